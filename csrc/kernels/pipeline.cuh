// Pipelines between the warps of a block: a ring of `stages` slots, each guarded by a "full"
// mbarrier (the producer's data is there) and an "empty" mbarrier (the consumer is done with
// it). Producer and consumer each walk the same sequence of items with their own PipeState.
//
// A StageRing adds shared-memory data to each slot, filled by bulk loads that complete their
// bytes on the full barrier (TMA), and emptied by bulk stores (the consumer releases a slot
// once the stores that read it have read it). A plain Ring carries no data: its slots hold
// whatever the two sides agree on (a chunk's table), the producer arrives on full itself.
//
// DeferredReleases holds what a role releases to others (a ring slot's credit, a chunk's signal)
// until the bulk copies that read or wrote the chunk landed (StoresLanded, LoadsLanded).
#pragma once
#include "common/state.cuh"

namespace hybrid_ep {

// Where a walker is in a ring: the slot, the parity of the slot's current round, and how
// many items it has passed (for drains and for the bulk-group arithmetic).
struct PipeState {
  int stage = 0;
  uint32_t phase = 0;
  uint32_t count = 0;

  // The walker that has passed `count` items of a ring of `stages` slots.
  __device__ static PipeState at(uint32_t count, int stages) {
    return {static_cast<int>(count % stages), (count / stages) & 1u, count};
  }

  __device__ void advance(int stages) {
    ++count;
    if (++stage == stages) {
      stage = 0;
      phase ^= 1u;
    }
  }
};

// The barriers of a ring and the bounded waits on them.
struct Ring {
  uint64_t* full;
  uint64_t* empty;
  int stages;
  int rank;       // for the timeout record
  uint64_t call;  // the call, for the timeout record
  int site;       // PipeSite: which ring, for the timeout record

  // One thread initialises; `arrivals` are the full barrier's arrivals per round (1 for TMA).
  __device__ void init(uint32_t full_arrivals, uint32_t empty_arrivals) const {
    for (int s = 0; s < stages; ++s) {
      dev::mbar_init(&full[s], full_arrivals);
      dev::mbar_init(&empty[s], empty_arrivals);
    }
  }

  // Producer: wait until the slot is free. The first round passes at once (a fresh barrier
  // has completed the phase before its first).
  __device__ bool producer_acquire(const LaunchArgs& args, const PipeState& p) const {
    return mbar_wait(args, &empty[p.stage], p.phase ^ 1u, rank, call, site, kWaitedForFreeSlot);
  }
  // Producer of a data-less ring: the slot's content is written; one of `full_arrivals`.
  __device__ void producer_commit(const PipeState& p) const { dev::mbar_arrive(&full[p.stage]); }

  // Consumer: wait until the slot holds the item.
  __device__ bool consumer_wait(const LaunchArgs& args, const PipeState& p) const {
    return mbar_wait(args, &full[p.stage], p.phase, rank, call, site, kWaitedForData);
  }
  // After lane 0 of a warp waited (bounded) and the warp agreed it succeeded: every other
  // lane observes the completed phase itself, its own acquire of the slot (the producer's
  // writes and the bytes its bulk copies completed on the barrier; the consumer's reads
  // before a release). The phase is complete, so each test passes at once.
  __device__ void observe_full(const PipeState& p, int lane) const {
    while (lane != 0 && !dev::mbar_try_wait(&full[p.stage], p.phase)) {}
  }
  __device__ void observe_empty(const PipeState& p, int lane) const {
    while (lane != 0 && !dev::mbar_try_wait(&empty[p.stage], p.phase ^ 1u)) {}
  }

  // Consumer: done with the slot (one of `empty_arrivals`).
  __device__ void consumer_release(const PipeState& p) const { dev::mbar_arrive(&empty[p.stage]); }
};

// A ring whose slots hold `stage_bytes` of shared memory filled by bulk loads.
struct StageRing {
  Ring ring;
  uint8_t* data;
  int stage_bytes;

  __device__ uint8_t* slot(const PipeState& p) const { return data + static_cast<size_t>(p.stage) * stage_bytes; }

  // Producer: after producer_acquire, load `bytes` from global memory into the slot.
  __device__ void load(const PipeState& p, const void* src, uint32_t bytes) const {
    dev::mbar_arrive_expect_tx(&ring.full[p.stage], bytes);
    dev::bulk_g2s(slot(p), src, bytes, &ring.full[p.stage]);
  }

  // Producer: wait until every load it issued in [from.count, to.count) has landed, consumed
  // or not (after an abort the consumer stops early, and the block may not exit with loads
  // in flight). Only the last load of each slot can be pending; the consumer waited for the
  // earlier ones.
  __device__ void drain(const LaunchArgs& args, PipeState from, const PipeState& to) const {
    const int stages = ring.stages;
    while (to.count - from.count > static_cast<uint32_t>(stages)) from.advance(stages);
    for (; from.count < to.count; from.advance(stages))
      mbar_drain(args, &ring.full[from.stage], from.phase, ring.rank, ring.call, ring.site);
  }
};

// How many of a store ring's newest groups may still read their stages when the store thread
// releases the older ones. Each such group holds its stage away from the loads, so with a few
// large stages a deep store queue leaves the loads only a stage or two ahead of the stores;
// the host picks the number per launch (LaunchArgs::store_groups).
__device__ __forceinline__ int store_groups_in_flight(const LaunchArgs& args, int stages) {
  return max(0, min(min(args.store_groups, kMaxStoreGroups), stages - 1));
}

// Bulk-store groups of one thread: commit after each item's stores, then let at most
// `in_flight` groups still read their shared memory. wait_group takes an immediate, hence the
// switch.
__device__ __forceinline__ void bulk_wait_read_except(int in_flight) {
  switch (in_flight < 0 ? 0 : in_flight > 7 ? 7 : in_flight) {
    case 0: dev::bulk_wait_read<0>(); break;
    case 1: dev::bulk_wait_read<1>(); break;
    case 2: dev::bulk_wait_read<2>(); break;
    case 3: dev::bulk_wait_read<3>(); break;
    case 4: dev::bulk_wait_read<4>(); break;
    case 5: dev::bulk_wait_read<5>(); break;
    case 6: dev::bulk_wait_read<6>(); break;
    default: dev::bulk_wait_read<7>(); break;
  }
}

// The same for completed writes (a destination may read what the groups wrote).
__device__ __forceinline__ void bulk_wait_write_except(int in_flight) {
  switch (in_flight < 0 ? 0 : in_flight > 7 ? 7 : in_flight) {
    case 0: dev::bulk_wait<0>(); break;
    case 1: dev::bulk_wait<1>(); break;
    case 2: dev::bulk_wait<2>(); break;
    case 3: dev::bulk_wait<3>(); break;
    case 4: dev::bulk_wait<4>(); break;
    case 5: dev::bulk_wait<5>(); break;
    case 6: dev::bulk_wait<6>(); break;
    default: dev::bulk_wait<7>(); break;
  }
}

// One store thread's bulk-store groups over the stages of a ring it consumes. After a stage's
// stores, commit() closes them as a group; release_read() lets at most `in_flight` of the
// thread's newest groups still read their stages and releases its older stages, oldest first;
// finish() waits until every store landed (and orders them before the thread's later generic
// accesses) and releases the rest. A thread that takes every `stride`-th stage of the ring
// from `first` on (store threads alternating stages) releases only its own.
struct StoreQueue {
  const Ring& ring;
  int in_flight, stride;
  PipeState next;          // the thread's oldest stage not yet released
  uint32_t committed = 0;  // groups (one per stage stored)
  uint32_t released = 0;

  __device__ StoreQueue(const Ring& r, int in_flight_groups, int first = 0, int every = 1)
      : ring(r), in_flight(in_flight_groups), stride(every) {
    for (int s = 0; s < first; ++s) next.advance(ring.stages);
  }
  __device__ uint32_t groups() const { return committed; }
  __device__ void commit() {
    dev::bulk_commit();
    ++committed;
  }
  __device__ void release_read() {
    bulk_wait_read_except(in_flight);  // release the oldest stages only
    while (released + in_flight < committed) release_next();
  }
  __device__ void finish() {
    dev::bulk_wait_all();      // the stores landed (a signal or the block's end comes next)
    dev::fence_proxy_async();  // and are ordered before this thread's later generic accesses
    while (released < committed) release_next();
  }

 private:
  __device__ void release_next() {
    ring.consumer_release(next);
    ++released;
    for (int s = 0; s < stride; ++s) next.advance(ring.stages);
  }
};

// Whether the copies of a noted item have landed (DeferredReleases): yes, not yet (the caller
// did not ask to wait for them), or a bounded wait for them gave up (a stop).
enum class Landing { kLanded, kInFlight, kStopped };

// The releases a role owes once the bulk copies that read or wrote a chunk have landed: a ring
// slot's credit once the reader's bulk loads of the chunk landed in shared memory, a chunk's
// signal (or its hand-off to another warp of the block) once the writer's bulk stores of it
// landed in the destination's memory.
//
// A bulk copy is asynchronous: issuing it does not complete it, and only the full barrier of
// its stage (loads, LoadsLanded) or the thread's bulk-group wait (stores, StoresLanded) says
// it completed. A slot released once its loads were issued could take the writer's next chunk
// while the loads still read the previous one; a chunk signalled once its stores were issued
// could be read before its rows are there. Waiting right after the copies would stall the
// role's pipeline, so the role notes the chunk with a mark (where its last copy stands in the
// role's sequence of copies), goes on with the next chunk's copies, and flushes: releases,
// oldest first, the chunks whose copies landed, without waiting while its copies go out, and
// waiting for them (bounded) where the list is full or before a wait that may block, since the
// peer may need a release first (kernels/peer_ring.cuh, "Why the waits end").
//
// The releases must land before the kernel ends. A role sends what it still holds once it
// waited for every copy (the stores finished, the loads drained): a signal or hand-off it kept
// would leave its reader waiting until the call times out. A release over the transport is also
// quieted before the role ends (RingReleases): one landing late, in the next call, would
// overwrite that call's in the same word, and its writer's wait would never see its own.
template <typename Item, int kMax>
struct DeferredReleases {
  Item item[kMax];
  uint32_t mark[kMax];
  int count = 0;

  __device__ bool empty() const { return count == 0; }
  __device__ bool full() const { return count == kMax; }
  // An item whose copies end at `mark`: the caller flushed a full list first.
  __device__ void note(const Item& it, uint32_t m) {
    item[count] = it;
    mark[count] = m;
    ++count;
  }
  // Releases the items, oldest first, for which landed(mark) says their copies landed (waiting
  // for them where it was built to), up to the first that has not. False where landed or
  // release(item) gave up (a stop).
  template <typename Landed, typename Release>
  __device__ bool flush(Landed&& landed, Release&& release) {
    int done = 0;
    bool ok = true;
    for (; done < count; ++done) {
      const Landing l = landed(mark[done]);
      if (l != Landing::kLanded) {
        ok = l == Landing::kInFlight;
        break;
      }
      if (!release(item[done])) {
        ok = false;
        break;
      }
    }
    for (int i = done; i < count; ++i) {
      item[i - done] = item[i];
      mark[i - done] = mark[i];
    }
    count -= done;
    return ok;
  }
  // Every item, once the role waited for all its copies (its end).
  template <typename Release>
  __device__ bool release_all(Release&& release) {
    return flush([](uint32_t) { return Landing::kLanded; }, release);
  }
};

// Whether a thread's bulk stores landed, by its groups (StoreQueue): an item's mark is the
// groups the thread had committed after the item's stores (StoreQueue::groups()). A flush that
// lets the newest `in_flight` groups still be in flight takes the items older than them: the
// first such item waits for their groups (all but the newest `in_flight`), then orders their
// writes before this thread's generic accesses that follow (its releases), and with
// `system_fence` also at system scope.
struct StoresLanded {
  uint32_t committed;
  int in_flight;
  bool system_fence;
  bool waited = false;

  __device__ StoresLanded(const StoreQueue& queue, int in_flight_groups, bool system = false)
      : committed(queue.groups()), in_flight(in_flight_groups), system_fence(system) {}
  __device__ Landing operator()(uint32_t mark) {
    if (mark + static_cast<uint32_t>(in_flight) > committed) return Landing::kInFlight;
    if (!waited) {
      bulk_wait_write_except(in_flight);
      dev::fence_proxy_async();  // the bulk writes, before the generic releases
      if (system_fence) __threadfence_system();
      waited = true;
    }
    return Landing::kLanded;
  }
};

// Whether a producer's bulk loads into a ring's stages landed, by the stages' full barriers: an
// item's mark is the items the producer had produced after the item's loads (PipeState::count).
// A load landed when its stage's full barrier completed that round. `observed` counts the
// items known to have landed (the producer's thread observes each round at most once); it
// first takes every item whose stage the producer has acquired again (its consumers released
// it, so it landed). Without `block` a round is tested without waiting; with it, waited for
// (bounded).
struct LoadsLanded {
  const LaunchArgs& args;
  const Ring& ring;
  uint32_t& observed;
  bool block;

  __device__ LoadsLanded(const LaunchArgs& launch, const Ring& r, const PipeState& produced, uint32_t& seen,
                         bool blocking)
      : args(launch), ring(r), observed(seen), block(blocking) {
    const uint32_t stages = static_cast<uint32_t>(ring.stages);
    if (produced.count > stages) observed = max(observed, produced.count - stages);  // acquired again
  }
  __device__ Landing operator()(uint32_t mark) const {
    const uint32_t stages = static_cast<uint32_t>(ring.stages);
    for (; observed < mark; ++observed) {
      uint64_t* full = &ring.full[observed % stages];
      const uint32_t parity = (observed / stages) & 1u;
      if (!block && !dev::mbar_try_wait(full, parity)) return Landing::kInFlight;
      if (block && !mbar_wait(args, full, parity, ring.rank, ring.call, ring.site, kWaitedForData))
        return Landing::kStopped;
    }
    return Landing::kLanded;
  }
};

// Rows moved through a StageRing: whole rows batched `rows_per_stage` to a stage (rows are
// contiguous in memory), or, for a row larger than a stage, `segments` stages per row.
struct RowBatches {
  uint32_t row_bytes;
  uint32_t stage_bytes;
  int rows_per_stage;
  int segments;

  // A launch's batching of rows of `row_bytes` (its stage size and rows per stage).
  __device__ static RowBatches of(uint32_t row_bytes, const LaunchArgs& args) {
    const uint32_t stage = static_cast<uint32_t>(args.stage_bytes);
    return {row_bytes, stage, args.rows_per_stage, static_cast<int>((row_bytes + stage - 1) / stage)};
  }

  // Units of work among rows [begin, end): a batch of rows, or one row cut in segments. A
  // unit is handled by one block (its rows' routing is computed with the first item).
  __device__ int units(int begin, int end) const {
    const int n = end - begin;
    return n <= 0 ? 0 : rows_per_stage > 1 ? (n + rows_per_stage - 1) / rows_per_stage : n;
  }
  __device__ int items_per_unit() const { return rows_per_stage > 1 ? 1 : segments; }
  // Items (stages) that carry rows [begin, end).
  __device__ int items(int begin, int end) const { return units(begin, end) * items_per_unit(); }

  struct Item {
    int first;        // first row
    int rows;         // rows in the stage
    uint32_t offset;  // byte offset within each row (segments)
    uint32_t bytes;   // bytes of each row in the stage
  };

  __device__ Item item(int begin, int end, int k) const {
    if (rows_per_stage > 1) {
      const int first = begin + k * rows_per_stage;
      return {first, min(rows_per_stage, end - first), 0u, row_bytes};
    }
    const uint32_t offset = static_cast<uint32_t>(k % segments) * stage_bytes;
    return {begin + k / segments, 1, offset, min(stage_bytes, row_bytes - offset)};
  }
};

}  // namespace hybrid_ep
