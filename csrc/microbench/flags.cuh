// M4: a flag between blocks on two SMs, the signal every chunk of a kernel waits for. Block 0
// raises flag[0] to i and waits until flag[1] >= i; block 1 waits for flag[0] and raises
// flag[1]: a round trip is two one-way flag latencies. Variants: the poll (ld.acquire.sys per
// poll, as the kernels' wait_at_least today, or ld.relaxed.sys and one fence.acq_rel.sys once
// the value is seen), the signal (st.release.sys of the value, or red.release.sys.add of 1),
// and a __nanosleep back-off between polls. A second kernel times polls of a flag that does
// not change: the cost of one poll.
#pragma once
#include <cstdint>

#include "microbench/probe.cuh"

namespace hybrid_ep::micro {

constexpr int kFlagStride = 16;  // words between the two flags: separate 128-byte lines

struct FlagArgs {
  Common c;
  int iterations;
  uint32_t backoff_ns;  // 0: poll again at once
  int add;              // signal with red.release.sys.add of 1 instead of st.release.sys
  uint64_t* flags;      // [0] block 0 -> block 1, [kFlagStride] back; zero before the launch
  uint64_t* out;        // [0] cycles and [1] nanoseconds of the round trips (block 0), [2 + b] SM of block b
};

template <bool kAcquire>
__device__ __forceinline__ void wait_flag(const FlagArgs& a, const uint64_t* flag, uint64_t target) {
  spin_until(a.c, [&] {
    const uint64_t v = kAcquire ? dev::ld_acquire_sys(flag) : dev::ld_relaxed_sys(flag);
    if (v >= target) return true;
    if (a.backoff_ns != 0) dev::sleep_ns(a.backoff_ns);
    return false;
  });
  if (!kAcquire) dev::fence_acq_rel_sys();
}

__device__ __forceinline__ void raise_flag(const FlagArgs& a, uint64_t* flag, uint64_t value) {
  if (a.add) {
    dev::red_add_release_sys(flag, 1);
  } else {
    dev::st_release_sys(flag, value);
  }
}

// Two blocks; the launch gives each more than half an SM's shared memory, so they run on two SMs.
template <bool kAcquire>
__global__ void __launch_bounds__(32, 1) flag_kernel(const __grid_constant__ FlagArgs a) {
  if (threadIdx.x != 0) return;
  uint64_t* there = a.flags + (blockIdx.x == 0 ? 0 : kFlagStride);
  const uint64_t* back = a.flags + (blockIdx.x == 0 ? kFlagStride : 0);
  a.out[2 + blockIdx.x] = sm_id();
  if (blockIdx.x == 0) {
    const SpanClock clock = SpanClock::start();
    const uint64_t c0 = cycles(), t0 = dev::global_timer_ns();
    for (int i = 1; i <= a.iterations; ++i) {
      raise_flag(a, there, static_cast<uint64_t>(i));
      wait_flag<kAcquire>(a, back, static_cast<uint64_t>(i));
    }
    const uint64_t c1 = cycles(), t1 = dev::global_timer_ns();
    a.out[0] = c1 - c0;
    a.out[1] = t1 - t0;
    clock.stop(a.c);
  } else {
    for (int i = 1; i <= a.iterations; ++i) {
      wait_flag<kAcquire>(a, back, static_cast<uint64_t>(i));
      raise_flag(a, there, static_cast<uint64_t>(i));
    }
  }
}

struct PollArgs {
  Common c;
  int polls;
  const uint64_t* flag;  // stays 0
  uint64_t* out;         // [0] cycles of all polls, [1] the sum of the values read (0)
};

template <bool kAcquire>
__global__ void __launch_bounds__(32, 1) poll_kernel(const __grid_constant__ PollArgs a) {
  if (threadIdx.x != 0) return;
  const SpanClock clock = SpanClock::start();
  uint64_t sum = 0;
  const uint64_t c0 = cycles();
  for (int i = 0; i < a.polls; ++i) sum += kAcquire ? dev::ld_acquire_sys(a.flag) : dev::ld_relaxed_sys(a.flag);
  a.out[0] = cycles() - c0;
  a.out[1] = sum;
  clock.stop(a.c);
}

}  // namespace hybrid_ep::micro
