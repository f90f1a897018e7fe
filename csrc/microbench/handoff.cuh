// M1: handing a pipeline stage from one warp to another of the same SM through an mbarrier,
// the step every kernel pipeline repeats per item. Warp A arrives on `ping` and waits on
// `pong`; warp B waits on `ping` and arrives on `pong`. A times the round trips, B the
// one-way time from A's arrive to the moment its whole warp may use the stage (both read
// the same SM's clock).
//
// Variants: how the waiting lane waits (Wait), how the rest of its warp learns it (Agree),
// and `spinners` more warps that wait, the same way, on a barrier that completes only at the
// end (the idle roles of a kernel). A bar.sync kernel measures a named barrier among 2-4 warps.
// With kNamed the receiving side is a group of kNamedGroupWarps warps (B and the warps after it),
// as the direct combine's reducer group: an elected lane of B waits, then the group's bar.sync.
#pragma once
#include <cstdint>

#include "common/state.cuh"
#include "kernels/pipeline.cuh"
#include "microbench/probe.cuh"

namespace hybrid_ep::micro {

enum class Wait : int {
  kBare = 0,     // mbar_try_wait in a loop (the bound: one compare per turn)
  kHint = 1,     // mbar_try_wait_hint with HandoffArgs::hint_ns
  kProject = 2,  // common/state.cuh's mbar_wait, as the kernels wait today
};

enum class Agree : int {
  kLane = 0,         // lane 0 alone waits and arrives; the other lanes take no part
  kWarpUniform = 1,  // lane 0 waits, warp_uniform, the other 31 lanes observe the phase
                     // (Ring::observe_full); the sender's warp __syncwarp's, lane 0 arrives
  kElect = 2,        // an elected lane waits, then __syncwarp; the sender's elected lane arrives
  kConverged = 3,    // every lane waits itself, the warp converged, then a vote of lanes that
                     // arrive together (the direct combine's kReducerWaitConverged); the
                     // sender's warp __syncwarp's, lane 0 arrives
  kNamed = 4,        // B's group: an elected lane of B waits, then bar.sync among the group's
                     // warps (the direct combine's kReducerWaitNamed); A waits and both send as
                     // kElect does
};

constexpr int kNamedGroupWarps = 4;         // a reducer group of the direct combine
constexpr uint32_t kNamedGroupBarrier = 2;  // the group's bar.sync (1 is bar.sync's own kernel's)

constexpr int kHandoffMaxSpinners = 8;

struct HandoffArgs {
  LaunchArgs la;  // what the project's mbar_wait reads: abort flag, bound, error record
  Common c;
  uint32_t hint_ns;
  int iterations;
  int spinners;
  // [0] one-way cycles summed over the iterations, [1] the smallest one-way, [2] cycles and
  // [3] nanoseconds of all round trips, [4] round trips done
  uint64_t* out;
};

struct HandoffShared {
  uint64_t ping, pong, stop;
  uint64_t sent_at;  // A's clock when it arrived on ping
};

template <Wait W>
__device__ __forceinline__ bool wait_phase(const HandoffArgs& a, uint64_t* bar, uint32_t parity) {
  if constexpr (W == Wait::kBare) {
    return spin_until(a.c, [&] { return dev::mbar_try_wait(bar, parity); });
  } else if constexpr (W == Wait::kHint) {
    return spin_until(a.c, [&] { return dev::mbar_try_wait_hint(bar, parity, a.hint_ns); });
  } else {
    return mbar_wait(a.la, bar, parity, 0, 0, kSiteNone, kWaitedForData);
  }
}

// The receiving warp (or its lane 0 alone, kLane) learns that the phase completed. After a
// failed wait it returns false without observing, and the loops go on: every later wait gives
// up at once, so control flow stays warp-uniform and the kernel ends.
template <Wait W, Agree G>
__device__ __forceinline__ bool receive(const HandoffArgs& a, uint64_t* bar, uint32_t parity, int lane,
                                        bool lead = true) {
  if constexpr (G == Agree::kLane) {
    return wait_phase<W>(a, bar, parity);
  } else if constexpr (G == Agree::kWarpUniform) {
    bool ok = true;
    if (lane == 0) ok = wait_phase<W>(a, bar, parity);
    if (!warp_uniform(ok)) return false;
    while (lane != 0 && !dev::mbar_try_wait(bar, parity)) {}
    return true;
  } else if constexpr (G == Agree::kConverged) {
    const bool ok = wait_phase<W>(a, bar, parity);
    return __ballot_sync(0xffffffffu, !ok) == 0;
  } else if constexpr (G == Agree::kNamed) {  // a warp of B's group: B's elected lane waits, all meet
    bool ok = true;
    if (lead && dev::elect_one()) ok = wait_phase<W>(a, bar, parity);
    dev::named_barrier_sync(kNamedGroupBarrier, 32 * kNamedGroupWarps);
    return ok;
  } else {
    bool ok = true;
    if (dev::elect_one()) ok = wait_phase<W>(a, bar, parity);
    __syncwarp();
    return ok;
  }
}

// The sending warp (or lane 0 alone) marks the time and arrives.
template <Agree G>
__device__ __forceinline__ void send(HandoffShared& sh, uint64_t* bar, int lane, bool stamp) {
  bool sender = lane == 0;
  if constexpr (G == Agree::kWarpUniform || G == Agree::kConverged) __syncwarp();
  if constexpr (G == Agree::kElect || G == Agree::kNamed) sender = dev::elect_one();
  if (sender) {
    if (stamp) sh.sent_at = cycles();
    dev::mbar_arrive(bar);
  }
}

template <Wait W, Agree G>
__global__ void __launch_bounds__(32 * (1 + kNamedGroupWarps + kHandoffMaxSpinners), 1)
    handoff_kernel(const __grid_constant__ HandoffArgs a) {
  HandoffShared& sh = dev::block_shared<HandoffShared>();
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  if (threadIdx.x == 0) {
    dev::mbar_init(&sh.ping, 1);
    dev::mbar_init(&sh.pong, 1);
    dev::mbar_init(&sh.stop, 1);
    dev::mbar_fence_init();
  }
  __syncthreads();
  const bool takes_part = G != Agree::kLane || lane == 0;
  constexpr Agree kA = G == Agree::kNamed ? Agree::kElect : G;       // A is one warp
  constexpr int kGroup = G == Agree::kNamed ? kNamedGroupWarps : 1;  // B's warps
  if (warp == 0 && takes_part) {
    const SpanClock clock = SpanClock::start();
    const uint64_t c0 = cycles(), t0 = dev::global_timer_ns();
    for (int i = 0; i < a.iterations; ++i) {
      send<kA>(sh, &sh.ping, lane, true);
      receive<W, kA>(a, &sh.pong, static_cast<uint32_t>(i) & 1u, lane);
    }
    const uint64_t c1 = cycles(), t1 = dev::global_timer_ns();
    if (lane == 0) {
      a.out[2] = c1 - c0;
      a.out[3] = t1 - t0;
      a.out[4] = static_cast<uint64_t>(a.iterations);
      dev::mbar_arrive(&sh.stop);
      clock.stop(a.c);
    }
  } else if (warp == 1 && takes_part) {
    uint64_t sum = 0, least = ~0ull;
    for (int i = 0; i < a.iterations; ++i) {
      receive<W, G>(a, &sh.ping, static_cast<uint32_t>(i) & 1u, lane);
      const uint64_t one_way = cycles() - sh.sent_at;
      sum += one_way;
      least = one_way < least ? one_way : least;
      send<G>(sh, &sh.pong, lane, false);
    }
    if (lane == 0) {
      a.out[0] = sum;
      a.out[1] = least;
    }
  } else if (warp > 1 && warp < 1 + kGroup) {  // the rest of B's group meets it at each bar.sync
    for (int i = 0; i < a.iterations; ++i) receive<W, G>(a, &sh.ping, static_cast<uint32_t>(i) & 1u, lane, false);
  } else if (warp >= 1 + kGroup && warp < 1 + kGroup + a.spinners && lane == 0) {
    wait_phase<W>(a, &sh.stop, 0);
  }
  __syncthreads();
}

// bar.sync among all `32 * warps` threads of the block, `iterations` times; thread 0 times it.
struct BarrierArgs {
  Common c;
  int iterations;
  uint64_t* out;  // [0] cycles, [1] nanoseconds of all iterations
};

constexpr uint32_t kMicroBarrierId = 1;

__global__ void __launch_bounds__(128, 1) named_barrier_kernel(const __grid_constant__ BarrierArgs a) {
  const uint32_t threads = blockDim.x;
  dev::named_barrier_sync(kMicroBarrierId, threads);
  const SpanClock clock = SpanClock::start();
  const uint64_t c0 = cycles(), t0 = dev::global_timer_ns();
  for (int i = 0; i < a.iterations; ++i) dev::named_barrier_sync(kMicroBarrierId, threads);
  const uint64_t c1 = cycles(), t1 = dev::global_timer_ns();
  if (threadIdx.x == 0) {
    a.out[0] = c1 - c0;
    a.out[1] = t1 - t0;
    clock.stop(a.c);
  }
}

}  // namespace hybrid_ep::micro
