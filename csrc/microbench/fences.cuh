// M5: what the completion and chunk signals of a kernel cost, each timed around the one
// instruction, `reps` times:
//   - kSystem: __threadfence_system with `stores` plain global stores outstanding before it;
//   - kAcqRelSys: fence.acq_rel.sys (the acquire after a relaxed poll);
//   - kProxyAsync: every thread of the block writes shared memory, then fence.proxy.async
//     (as a reducer does before its stage is bulk-stored); warp 0's lane 0 times its fence;
//   - kBulkWait: eight bulk stores of copy_bytes (one group each), then wait_group 0.
#pragma once
#include <cstdint>

#include "microbench/probe.cuh"

namespace hybrid_ep::micro {

enum class Fence : int { kSystem = 0, kAcqRelSys = 1, kProxyAsync = 2, kBulkWait = 3 };

constexpr int kFenceBulkStores = 8;

struct FenceArgs {
  Common c;
  int kind;  // Fence
  int stores;
  int reps;
  uint64_t* scratch;  // kSystem: scratch_lines lines of 128 bytes (a power of two) the stores go to
  uint64_t scratch_lines;
  uint8_t* dst;  // kBulkWait: dst_rows rows of copy_bytes (a power of two)
  uint64_t dst_rows;
  uint32_t copy_bytes;  // dynamic shared memory: at least copy_bytes and 4 bytes per thread
  uint64_t* out;        // [0] cycles inside the timed instruction(s), [1] cycles issuing what came before
};

__global__ void __launch_bounds__(128, 1) fence_kernel(const __grid_constant__ FenceArgs a) {
  uint8_t* smem = dev::dynamic_smem<uint8_t>();
  const SpanClock clock = SpanClock::start();
  uint64_t timed = 0, before = 0;
  if (a.kind == static_cast<int>(Fence::kProxyAsync)) {
    volatile uint32_t* mine = reinterpret_cast<volatile uint32_t*>(smem) + threadIdx.x;
    for (int r = 0; r < a.reps; ++r) {
      *mine = static_cast<uint32_t>(r);
      const uint64_t t0 = cycles();
      dev::fence_proxy_async();
      timed += cycles() - t0;
    }
  } else if (threadIdx.x == 0) {
    for (int r = 0; r < a.reps; ++r) {
      const uint64_t t0 = cycles();
      if (a.kind == static_cast<int>(Fence::kBulkWait)) {
        for (int j = 0; j < kFenceBulkStores; ++j) {
          const uint64_t row = (static_cast<uint64_t>(r) * kFenceBulkStores + j) & (a.dst_rows - 1);
          dev::bulk_s2g(a.dst + row * a.copy_bytes, smem, a.copy_bytes);
          dev::bulk_commit();
        }
      } else {
        for (int j = 0; j < a.stores; ++j) {
          const uint64_t line = (static_cast<uint64_t>(r) * a.stores + j) & (a.scratch_lines - 1);
          reinterpret_cast<volatile uint64_t*>(a.scratch)[line * 16] = static_cast<uint64_t>(r);
        }
      }
      const uint64_t t1 = cycles();
      if (a.kind == static_cast<int>(Fence::kBulkWait)) {
        dev::bulk_wait_all();
      } else if (a.kind == static_cast<int>(Fence::kAcqRelSys)) {
        dev::fence_acq_rel_sys();
      } else {
        __threadfence_system();
      }
      const uint64_t t2 = cycles();
      before += t1 - t0;
      timed += t2 - t1;
    }
  }
  if (threadIdx.x == 0) {
    a.out[0] = timed;
    a.out[1] = before;
    clock.stop(a.c);
  }
}

}  // namespace hybrid_ep::micro
