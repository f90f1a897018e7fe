// M3: how long one bulk copy takes from issue to completion, alone and behind queued copies,
// which sizes the rings (Little's law: stages >= latency / period) and tells whether a load
// waits behind the stores of the same SM. One thread issues every copy.
//   - kLoad: issue -> the mbarrier phase completes (the bytes are in shared memory);
//   - kStore: issue -> wait_group.read 0 (shared memory read) -> wait_group 0 (writes done).
// Queued: `queued` copies of the same size issued just before the measured one (loads on a
// barrier of their own, or stores committed as one group), drained after it. A cold source
// is a row never read since the host flushed L2; a hot one is row 0 again and again.
#pragma once
#include <cstdint>

#include "microbench/probe.cuh"

namespace hybrid_ep::micro {

enum class CopyKind : int { kLoad = 0, kStore = 1 };
enum class Queue : int { kNone = 0, kLoads = 1, kStores = 2 };

constexpr int kLatencyMaxQueued = 8;

struct LatencyArgs {
  Common c;
  int kind;    // CopyKind
  int queue;   // Queue
  int queued;  // 0 .. kLatencyMaxQueued
  int cold;
  int samples;
  uint32_t copy_bytes;
  const uint8_t* src;  // src_rows rows of copy_bytes; a cold run needs samples * (queued + 1) + 1 of them
  uint64_t src_rows;
  uint8_t* dst;  // dst_rows rows, as many as src
  uint64_t dst_rows;
  uint64_t* out;  // per sample: [2s] cycles to completion (a load) or to read done (a store), [2s+1] to write done
};

// A point of the measurement; the buffers have `rows` rows of copy_bytes each (a cold run
// needs samples * (kLatencyMaxQueued + 1) + 1 of them).
struct LatencyCase {
  CopyKind kind;
  uint32_t copy_bytes;
  bool cold;
  Queue queue;
};

inline LatencyArgs latency_args(const Common& c, const LatencyCase& lc, int samples, const uint8_t* src, uint8_t* dst,
                                uint64_t rows, uint64_t* out) {
  LatencyArgs a{};
  a.c = c;
  a.kind = static_cast<int>(lc.kind);
  a.queue = static_cast<int>(lc.queue);
  a.queued = lc.queue == Queue::kNone ? 0 : kLatencyMaxQueued;
  a.cold = lc.cold;
  a.samples = samples;
  a.copy_bytes = lc.copy_bytes;
  a.src = src;
  a.src_rows = rows;
  a.dst = dst;
  a.dst_rows = rows;
  a.out = out;
  return a;
}

// Shared memory of a launch: the measured copy's stage and the queue's.
inline size_t latency_smem(const LatencyArgs& a) { return static_cast<size_t>(1 + a.queued) * a.copy_bytes; }

struct LatencyShared {
  uint64_t bar, queue_bar;
};

__global__ void __launch_bounds__(32, 1) latency_kernel(const __grid_constant__ LatencyArgs a) {
  LatencyShared& sh = dev::block_shared<LatencyShared>();
  uint8_t* smem = dev::dynamic_smem<uint8_t>();  // stage 0: the measured copy; 1 .. queued: the queue
  if (threadIdx.x != 0) return;
  dev::mbar_init(&sh.bar, 1);
  dev::mbar_init(&sh.queue_bar, 1);
  dev::mbar_fence_init();
  const SpanClock clock = SpanClock::start();
  const uint32_t bytes = a.copy_bytes;
  for (int s = 0; s < a.samples; ++s) {
    const uint32_t parity = static_cast<uint32_t>(s) & 1u;
    // a cold sample's rows were never touched; a hot one reuses rows 0 .. queued
    const uint64_t first = a.cold ? 1 + static_cast<uint64_t>(s) * (a.queued + 1) : 0;
    if (a.queue == static_cast<int>(Queue::kLoads)) {
      dev::mbar_arrive_expect_tx(&sh.queue_bar, bytes * a.queued);
      for (int q = 1; q <= a.queued; ++q)
        dev::bulk_g2s(smem + static_cast<size_t>(q) * bytes, a.src + ((first + q) % a.src_rows) * bytes, bytes,
                      &sh.queue_bar);
    } else if (a.queue == static_cast<int>(Queue::kStores)) {
      for (int q = 1; q <= a.queued; ++q)
        dev::bulk_s2g(a.dst + ((first + q) % a.dst_rows) * bytes, smem + static_cast<size_t>(q) * bytes, bytes);
      dev::bulk_commit();
    }
    const uint8_t* src = a.src + (first % a.src_rows) * bytes;
    uint8_t* dst = a.dst + (first % a.dst_rows) * bytes;
    const uint64_t t0 = cycles();
    uint64_t read = 0, done = 0;
    if (a.kind == static_cast<int>(CopyKind::kLoad)) {
      dev::mbar_arrive_expect_tx(&sh.bar, bytes);
      dev::bulk_g2s(smem, src, bytes, &sh.bar);
      spin_until(a.c, [&] { return dev::mbar_try_wait(&sh.bar, parity); });
      read = cycles() - t0;
    } else {
      dev::bulk_s2g(dst, smem, bytes);
      dev::bulk_commit();
      dev::bulk_wait_read_all();
      read = cycles() - t0;
      dev::bulk_wait_all();
      done = cycles() - t0;
    }
    a.out[2 * s] = read;
    a.out[2 * s + 1] = done;
    if (a.queue == static_cast<int>(Queue::kLoads))
      spin_until(a.c, [&] { return dev::mbar_try_wait(&sh.queue_bar, parity); });
    if (a.queue == static_cast<int>(Queue::kStores)) dev::bulk_wait_all();
  }
  clock.stop(a.c);
}

}  // namespace hybrid_ep::micro
