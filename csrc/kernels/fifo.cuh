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
  int rank;        // for the timeout record
  uint64_t epoch;  // the call, for the timeout record

  __device__ uint8_t* slot(uint32_t item) const { return data + static_cast<size_t>(item % stages) * stage_bytes; }

  // Producer: wait until the slot is free, then load `bytes` from global memory into it.
  // False (nothing issued) when a wait gave up.
  __device__ bool produce(const LaunchArgs& args, uint32_t item, const void* src, uint32_t bytes) const {
    const uint32_t s = item % stages, round = item / stages;
    if (round > 0 && !mbar_wait(args, &empty[s], (round - 1) & 1, rank, epoch)) return false;
    dev::mbar_arrive_expect_tx(&full[s], bytes);
    dev::bulk_g2s(slot(item), src, bytes, &full[s]);
    return true;
  }

  // Consumer: wait until the slot holds the item.
  __device__ bool wait_full(const LaunchArgs& args, uint32_t item) const {
    return mbar_wait(args, &full[item % stages], (item / stages) & 1, rank, epoch);
  }

  // Consumer: the stores issued from the slot have read it; hand it back to the producer.
  __device__ void release(uint32_t item) const {
    dev::bulk_commit();
    dev::bulk_wait_read_all();
    dev::mbar_arrive(&empty[item % stages]);
  }

  // Producer: wait until every load issued in [from, to) has landed, consumed or not (after
  // an abort the consumer stops early; the block may not exit with loads in flight). Only
  // the last load of each slot can be pending; earlier ones were waited for by the consumer.
  __device__ void drain(const LaunchArgs& args, uint32_t from, uint32_t to) const {
    const uint32_t first = to - from > static_cast<uint32_t>(stages) ? to - stages : from;
    for (uint32_t item = first; item < to; ++item)
      mbar_drain(args, &full[item % stages], (item / stages) & 1, rank, epoch);
  }
};

}  // namespace hybrid_ep
