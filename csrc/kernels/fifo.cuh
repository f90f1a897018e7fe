// The shared-memory FIFO of a dispatch block: `stages` slots of `stage_bytes`, each guarded
// by a "full" mbarrier (the producer's bulk load completes its bytes on it) and an "empty"
// mbarrier (the consumer arrives once its bulk stores have read the slot).
//
// Producer and consumer walk the same sequence of items and each keeps its own counter, so
// the slot of item n is n % stages and the parity of its round is (n / stages) & 1.
#pragma once
#include "common/state.cuh"

namespace hybrid_ep {

constexpr int kMaxStages = 16;

struct Fifo {
  uint8_t* data;
  uint64_t* full;
  uint64_t* empty;
  int stages;
  int stage_bytes;

  __device__ uint8_t* slot(uint32_t item) const { return data + static_cast<size_t>(item % stages) * stage_bytes; }

  // Producer: wait until the slot is free, then load `bytes` from global memory into it.
  __device__ bool produce(const LaunchArgs& args, int rank, uint32_t item, const void* src, uint32_t bytes) const {
    const uint32_t s = item % stages, round = item / stages;
    if (round > 0 && !mbar_wait(args, &empty[s], (round - 1) & 1, rank)) return false;
    ptx::mbar_arrive_expect_tx(&full[s], bytes);
    ptx::bulk_g2s(slot(item), src, bytes, &full[s]);
    return true;
  }

  // Consumer: wait until the slot holds the item.
  __device__ bool wait_full(const LaunchArgs& args, int rank, uint32_t item) const {
    return mbar_wait(args, &full[item % stages], (item / stages) & 1, rank);
  }

  // Consumer: the stores issued from the slot have read it; hand it back to the producer.
  __device__ void release(uint32_t item) const {
    ptx::bulk_commit();
    ptx::bulk_wait_read_all();
    ptx::mbar_arrive(&empty[item % stages]);
  }
};

}  // namespace hybrid_ep
