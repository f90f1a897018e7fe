// Per-rank device state kept in the registered buffer, and bounded waits.
//
// Flags are monotonic: epochs and row counters only grow, so consecutive calls need no
// reset and no extra barrier. Every wait polls the launch's abort flag and the global timer;
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

__device__ __forceinline__ BlockPlace block_place(const LaunchArgs& args) {
  return {args.ranks[blockIdx.x / args.blocks_per_rank], static_cast<int>(blockIdx.x % args.blocks_per_rank),
          args.blocks_per_rank};
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

__device__ inline void record_error(const LaunchArgs& args, int phase, int rank, int peer, uint64_t epoch,
                                    uint64_t expected, uint64_t observed) {
  int* flag = reinterpret_cast<int*>(args.abort_flag);
  if (atomicCAS(flag, 0, phase) == 0) {
    auto* rec = reinterpret_cast<volatile ErrorRecord*>(args.error);
    rec->rank = rank;
    rec->peer = peer;
    rec->epoch = epoch;
    rec->expected = expected;
    rec->observed = observed;
    __threadfence_system();
    rec->phase = phase;
    __threadfence_system();
  }
}

// Spin until *flag >= target. Returns false when this or another wait gave up.
__device__ inline bool wait_at_least(const LaunchArgs& args, const uint64_t* flag, uint64_t target, int phase,
                                     int rank, int peer, uint64_t epoch) {
  uint64_t start = 0;
  for (uint32_t spin = 0;; ++spin) {
    uint64_t v = dev::ld_acquire_sys(flag);
    if (v >= target) return true;
    if ((spin & 63) == 0) {
      if (aborted(args)) return false;
      uint64_t now = dev::global_timer_ns();
      if (start == 0) start = now;
      if (now - start > args.timeout_ns) {
        record_error(args, phase, rank, peer, epoch, target, v);
        return false;
      }
    }
  }
}

// Spin on an mbarrier phase between the warps of a block. A stage usually stalls because a
// wait on a peer stalls elsewhere in the block, so it is given twice the bound: the peer's
// wait reports first and names the peer. A stage that still never completes depends on no
// peer (a bulk copy of this rank's own memory), so its record names none.
__device__ inline bool mbar_wait(const LaunchArgs& args, uint64_t* bar, uint32_t parity, int rank, uint64_t epoch) {
  uint64_t start = 0;
  for (uint32_t spin = 0;; ++spin) {
    if (dev::mbar_try_wait(bar, parity)) return true;
    if ((spin & 63) == 0) {
      if (aborted(args)) return false;
      uint64_t now = dev::global_timer_ns();
      if (start == 0) start = now;
      if (now - start > 2 * args.timeout_ns) {
        record_error(args, kPhasePipeline, rank, kNoPeer, epoch, parity, 0);
        return false;
      }
    }
  }
}

// Wait for a phase even after an abort: bulk loads that were issued still land in this
// block's shared memory, so the block may not exit before they did. Bounded by the timeout
// all the same (a load that never completes is a hardware fault, not a peer's).
__device__ inline void mbar_drain(const LaunchArgs& args, uint64_t* bar, uint32_t parity, int rank, uint64_t epoch) {
  uint64_t start = 0;
  for (uint32_t spin = 0;; ++spin) {
    if (dev::mbar_try_wait(bar, parity)) return;
    if ((spin & 63) == 0) {
      uint64_t now = dev::global_timer_ns();
      if (start == 0) start = now;
      if (now - start > args.timeout_ns) {
        record_error(args, kPhasePipeline, rank, kNoPeer, epoch, parity, 0);
        return;
      }
    }
  }
}

__host__ __device__ inline int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }

}  // namespace hybrid_ep
