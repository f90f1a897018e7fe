// Per-rank device state kept in the registered buffer, and bounded waits.
//
// Flags are monotonic: call numbers and row counters only grow, so consecutive calls need no
// reset and no extra barrier. Every wait reads the launch's abort flag and the global timer;
// the first wait that runs out of time records rank, peer, phase and call in the
// host-visible ErrorRecord and raises the abort flag so every other wait of every rank
// returns too.
#pragma once
#include "common/params.h"
#include "device/device.cuh"

namespace hybrid_ep {

constexpr int kNoPeer = -1;  // ErrorRecord.peer of a wait that depends on no other rank

struct RankView {
  const Geometry& geo;
  uint8_t* const* peers;  // registered-buffer bases, indexed by rank
  int rank;

  __device__ uint8_t* base(int r) const { return peers[r]; }
  __device__ uint8_t* own() const { return peers[rank]; }
  __device__ LocalState* state() const { return reinterpret_cast<LocalState*>(own() + geo.reg.state); }
  __device__ uint64_t* flag(int r, uint64_t offset, int index) const {
    return reinterpret_cast<uint64_t*>(base(r) + offset) + index;
  }
};

// The rank of the launch a block serves and the block's index among that rank's blocks.
struct BlockPlace {
  const RankArgs& rank;
  int block;
  int blocks;
};

// Rank i of the launch: in the parameters, or past kInlineLaunchRanks in device memory.
__device__ __forceinline__ const RankArgs& launch_rank(const LaunchArgs& args, int i) {
  return i < kInlineLaunchRanks ? args.ranks[i]
                                : reinterpret_cast<const RankArgs*>(args.more_ranks)[i - kInlineLaunchRanks];
}

__device__ __forceinline__ BlockPlace block_place(const LaunchArgs& args) {
  return {launch_rank(args, blockIdx.x / args.num_sms), static_cast<int>(blockIdx.x % args.num_sms), args.num_sms};
}

__device__ __forceinline__ RankView rank_view(const Geometry& geo, const RankArgs& a) {
  return RankView{geo, reinterpret_cast<uint8_t* const*>(a.peers), a.rank};
}

__device__ __forceinline__ bool aborted(const LaunchArgs& args) {
  return dev::ld_volatile(reinterpret_cast<const int*>(args.abort_flag)) != 0;
}

// The same answer in every lane of the warp: lane 0's. Decisions that lead to a warp
// collective or a barrier must be warp-uniform. The __syncwarp orders what lane 0 acquired
// before the answer (a peer's flag, say) before the other lanes' accesses after it: a shuffle
// alone carries the value, not memory order.
__device__ __forceinline__ bool warp_uniform(bool value) {
  __syncwarp();
  return __shfl_sync(0xffffffffu, static_cast<int>(value), 0) != 0;
}

__device__ inline void record_error(const LaunchArgs& args, int phase, int rank, int peer, uint64_t call,
                                    uint64_t expected, uint64_t observed, int site = kSiteNone) {
  int* flag = reinterpret_cast<int*>(args.abort_flag);
  if (atomicCAS(flag, 0, phase) == 0) {
    auto* rec = reinterpret_cast<volatile ErrorRecord*>(args.error);
    rec->rank = rank;
    rec->peer = peer;
    rec->call = call;
    rec->expected = expected;
    rec->observed = observed;
    rec->site = site;
    __threadfence_system();
    rec->phase = phase;
    __threadfence_system();
  }
}

// A bad route of a call that moved no rows, where no host read the counts before the dispatch
// kernel (a static size): a report for the host's next call, not a failure (no abort flag, so
// the buffer stays usable). Every rank writes the same route. The call is zeroed before the
// fields and written after them, so a host that reads the same non-zero call before and
// after the fields read one call's route.
__device__ inline void record_bad_route(const LaunchArgs& args, int rank, int token, uint64_t call, int num_experts,
                                        int64_t id) {
  auto* rec = reinterpret_cast<volatile ErrorRecord*>(args.bad_route);
  rec->call = 0;
  __threadfence_system();
  rec->phase = kPhaseBadRouting;
  rec->rank = rank;
  rec->peer = token;
  rec->site = kSiteNone;
  rec->expected = static_cast<uint64_t>(num_experts);
  rec->observed = static_cast<uint64_t>(id);
  __threadfence_system();
  rec->call = call;
  __threadfence_system();
}

// The waits are cheap while they wait (a waiting thread takes issue slots from the warps
// doing the work, and an acquire poll invalidates the SM's L1): an mbarrier probe may suspend
// the thread until its phase completes or kSuspendHintNs pass; a flag is polled relaxed with
// a short sleep between polls and acquired once, by a fence, when its value is seen. The
// clock is read only when a probe or a batch of polls came back empty, the abort flag after
// a batch of polls or once per kSuspendHintNs of probes.
constexpr uint32_t kSuspendHintNs = 1000;  // how late a suspended waiter may notice an abort
constexpr uint32_t kPollSleepNs = 64;      // between two polls of a flag another rank raises
constexpr uint32_t kPollsPerCheck = 16;    // polls between two reads of the abort flag and clock

// Until *flag >= target (then this thread has acquired what the writer released). Returns
// false when this or another wait gave up. A flag this rank itself raises (a chunk it signals
// to itself) gets `bounds` = 2 bounds, like a wait inside a block: the wait that stalls its
// writer on another rank reports first. since: where the wait's clock starts (0: at its first
// poll); the count kernel passes its own start, so its waits in a row draw on one bound, as the
// host that reads its counts does.
__device__ inline bool wait_at_least(const LaunchArgs& args, const uint64_t* flag, uint64_t target, int phase, int rank,
                                     int peer, uint64_t call, uint32_t bounds = 1, uint64_t since = 0) {
  uint64_t start = since;
  for (uint32_t poll = 0;; ++poll) {
    const uint64_t v = dev::ld_relaxed_sys(flag);
    if (v >= target) {
      dev::fence_acq_rel_sys();
      return true;
    }
    if (poll % kPollsPerCheck == 0) {
      if (aborted(args)) return false;
      const uint64_t now = dev::global_timer_ns();
      if (start == 0) start = now;
      if (now - start > bounds * args.timeout_ns) {
        record_error(args, phase, rank, peer, call, target, v);
        return false;
      }
    }
    dev::sleep_ns(kPollSleepNs);
  }
}

// Until an mbarrier phase between the warps of a block completes. A stage usually stalls
// because a wait on a peer stalls elsewhere in the block, so it is given twice the bound: the
// peer's wait reports first and names the peer. A stage that still never completes depends on
// no peer (a bulk copy of this rank's own memory), so its record names none.
// The abort flag is read once the hint's time has passed since the last reading, not after
// every probe: the hardware may end a suspension early, and each reading is a load from
// global memory (ld.volatile: ncu put 5.2 % of the direct dispatch's warp samples there on
// 2026-11-26) during which the thread does not see the phase complete.
__device__ inline bool mbar_wait(const LaunchArgs& args, uint64_t* bar, uint32_t parity, int rank, uint64_t call,
                                 int site, int side) {
  if (dev::mbar_try_wait(bar, parity)) return true;
  const uint64_t start = dev::global_timer_ns();
  uint64_t checked = start;
  for (;;) {
    if (dev::mbar_try_wait_hint(bar, parity, kSuspendHintNs)) return true;
    const uint64_t now = dev::global_timer_ns();
    if (now - checked < kSuspendHintNs) continue;
    checked = now;
    if (aborted(args)) return false;
    if (now - start > 2 * args.timeout_ns) {
      record_error(args, kPhasePipeline, rank, kNoPeer, call, parity, side, site);
      return false;
    }
  }
}

// Wait for a phase even after an abort: bulk loads that were issued still land in this
// block's shared memory, so the block may not exit before they did. Bounded by the timeout
// all the same (a load that never completes is a hardware fault, not a peer's).
__device__ inline void mbar_drain(const LaunchArgs& args, uint64_t* bar, uint32_t parity, int rank, uint64_t call,
                                  int site) {
  if (dev::mbar_try_wait(bar, parity)) return;
  const uint64_t start = dev::global_timer_ns();
  while (!dev::mbar_try_wait_hint(bar, parity, kSuspendHintNs)) {
    if (dev::global_timer_ns() - start > args.timeout_ns) {
      record_error(args, kPhasePipeline, rank, kNoPeer, call, parity, kWaitedForData, site);
      return;
    }
  }
}

__host__ __device__ inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace hybrid_ep
