// What every microbenchmark kernel needs beside the device layer: the SM's cycle counter and
// index, the record of a block's span (cycles and nanoseconds, from which the host computes
// the SM clock the measurement ran at), and a bounded spin, so that no measurement hangs.
// Compiled by nvcc for the GPU, and by the host compiler against the CPU model for the tests
// (virtual time stands in for cycles there).
#pragma once
#include <cstdint>

#include "device/device.cuh"

namespace hybrid_ep::micro {

#if defined(__CUDACC__)
__device__ __forceinline__ uint64_t cycles() { return clock64(); }
__device__ __forceinline__ uint32_t sm_id() {
  uint32_t id;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(id));
  return id;
}
#else
inline uint64_t cycles() { return dev::global_timer_ns(); }
inline uint32_t sm_id() { return blockIdx.x; }
#endif

// One block's measured interval: SM cycles and %globaltimer nanoseconds, read back to back at
// both ends, and the SM it ran on.
struct Span {
  uint64_t cycles0, ns0, cycles1, ns1;
  uint32_t sm;
  uint32_t pad;
};

// Shared by every measurement kernel.
struct Common {
  uint64_t timeout_ns;  // bound of every wait
  int* abort;           // set by the first wait that runs out; every other wait then gives up
  Span* spans;          // one per block
};

constexpr int kTimedOut = 1;  // *Common::abort after a wait of the microbenchmark ran out

struct SpanClock {
  uint64_t cycles0, ns0;

  __device__ __forceinline__ static SpanClock start() {
    SpanClock s;
    s.ns0 = dev::global_timer_ns();
    s.cycles0 = cycles();
    return s;
  }
  // Records the span of this block (one thread calls it).
  __device__ __forceinline__ void stop(const Common& c) const {
    Span s;
    s.cycles1 = cycles();
    s.ns1 = dev::global_timer_ns();
    s.cycles0 = cycles0;
    s.ns0 = ns0;
    s.sm = sm_id();
    s.pad = 0;
    c.spans[blockIdx.x] = s;
  }
};

// Spins until probe() is true. The abort flag and the timer are read every 1024 turns only, so
// the bound adds a counter and a compare to a turn. False when this wait ran out (it raises the
// abort flag) or another one did: every wait after the first failure gives up within 1024
// turns, so a broken measurement ends in about one timeout.
template <typename Probe>
__device__ __forceinline__ bool spin_until(const Common& c, Probe&& probe) {
  uint64_t start = 0;
  for (uint32_t turn = 1;; ++turn) {
    if (probe()) return true;
    if ((turn & 1023u) == 0) {
      if (dev::ld_volatile(c.abort) != 0) return false;
      const uint64_t now = dev::global_timer_ns();
      if (start == 0) {
        start = now;
      } else if (now - start > c.timeout_ns) {
        atomicCAS(c.abort, 0, kTimedOut);
        return false;
      }
    }
  }
}

}  // namespace hybrid_ep::micro
