// M2: how many bytes per second one SM's bulk copies (TMA) move, for the patterns the
// kernels use, with the project's own pipeline (kernels/pipeline.cuh: Ring, StageRing, the
// store-group release of the send and expand stores).
//
// A block runs `pipelines` independent pipelines, each on `stages` stages of `copy_bytes`:
//   - kLoad: one thread issues bulk loads, reusing a stage once its previous load landed; with
//     `parts` > 1 (the direct combine's token stage) a stage of copy_bytes takes `parts` copies
//     of copy_bytes / parts, each from a row of its own, under one expected-bytes arrival, issued
//     by lane 0 alone or by `part_lanes` lanes (lane l: parts l, l + part_lanes, ...); every lane
//     of the pipeline's warp waits for the stage's previous round itself, as the kernel's load warp;
//   - kStore: one thread issues bulk stores (one group each) from its stages, letting `depth`
//     groups still read (wait_group.read depth), then waits for every write;
//   - kMix: dispatch's send: a load thread fills the stages, a store thread stores each stage
//     to `fanout` destinations (one group), keeps `depth` groups reading and releases the
//     older stages to the loads (depth <= stages - 1), then waits for every write. As the
//     direct dispatch's store warps: `store_threads` = 2 store threads take alternate stages,
//     each keeping `depth` of its own groups reading (depth <= (stages - 1) / 2); with `table`
//     each store's destination is read from a route table in shared memory (the row, then the
//     destination, then that destination's base: three dependent loads before the store).
// Copy i of a pipeline reads row i (sequential) or a hashed row (random: a new page nearly
// every copy) of the block's source region, and writes the same row of each destination's
// region. The host times the launch and reads each block's span.
#pragma once
#include <cstdint>

#include "common/state.cuh"
#include "kernels/pipeline.cuh"
#include "microbench/probe.cuh"

namespace hybrid_ep::micro {

enum class TmaMode : int { kLoad = 0, kStore = 1, kMix = 2 };

constexpr int kTmaMaxPipelines = 4;
constexpr int kTmaMaxStoreThreads = 2;
constexpr int kTmaThreads = 32 * (1 + kTmaMaxStoreThreads) * kTmaMaxPipelines;  // kMix: a load warp, store warps
constexpr int kTmaTableRows = 32;  // the route table's rows (a chunk's tokens in the direct dispatch)
constexpr int kTmaMaxFanout = 8;   // destinations a route table holds

struct TmaArgs {
  LaunchArgs la;  // the project's bounded waits read its abort flag, bound and error record
  Common c;
  int mode;           // TmaMode
  int fanout;         // kMix: destinations per stage
  int pipelines;      // 1 .. kTmaMaxPipelines
  int stages;         // per pipeline, 2 .. kMaxStages
  int depth;          // store groups left reading: 0 .. 7
  int store_threads;  // kMix: 1, or 2 taking alternate stages
  int table;          // kMix: destinations read from a route table in shared memory (fanout <= 8)
  int parts;          // kLoad: copies per stage under one arrival (1: one copy of copy_bytes)
  int part_lanes;     // kLoad with parts > 1: the lanes that issue them (1 .. 32)
  int random_rows;
  uint32_t copy_bytes;  // a multiple of 16
  uint32_t copies;      // per pipeline: loads (kLoad, kMix) or stores (kStore)
  // Row counts are powers of two (a mask, not a 64-bit division, on the issuing thread's path).
  const uint8_t* src;  // block b reads rows [b * src_rows, (b + 1) * src_rows)
  uint64_t src_rows;
  uint8_t* dst;  // destination j of block b: rows [(b * fanout + j) * dst_rows, ... + dst_rows)
  uint64_t dst_rows;
};

struct TmaShared {
  uint64_t full[kTmaMaxPipelines][kMaxStages];
  uint64_t empty[kTmaMaxPipelines][kMaxStages];
  // The route table (table): a copy's row modulo kTmaTableRows -> per route its row there and its
  // destination, and each destination's region.
  int32_t row[kTmaTableRows][kTmaMaxFanout];
  uint8_t dest[kTmaTableRows][kTmaMaxFanout];
  uint8_t* base[kTmaMaxFanout];
};

// The row copy i of pipeline `pipe` touches, among `rows` (a power of two).
__device__ __forceinline__ uint64_t tma_row(const TmaArgs& a, int pipe, uint32_t i, uint64_t rows) {
  uint64_t n = static_cast<uint64_t>(pipe) * a.copies + i;
  if (a.random_rows) {  // splitmix64's finaliser of (block, copy)
    n += (static_cast<uint64_t>(blockIdx.x) + 1) * 0x9e3779b97f4a7c15ull;
    n = (n ^ (n >> 30)) * 0xbf58476d1ce4e5b9ull;
    n = (n ^ (n >> 27)) * 0x94d049bb133111ebull;
    n ^= n >> 31;
  }
  return n & (rows - 1);
}

__device__ __forceinline__ const uint8_t* tma_src(const TmaArgs& a, int pipe, uint32_t i) {
  return a.src + (blockIdx.x * a.src_rows + tma_row(a, pipe, i, a.src_rows)) * a.copy_bytes;
}

__device__ __forceinline__ uint8_t* tma_dst(const TmaArgs& a, int pipe, uint32_t i, int j) {
  const uint64_t region = static_cast<uint64_t>(blockIdx.x) * a.fanout + j;
  return a.dst + (region * a.dst_rows + tma_row(a, pipe, i, a.dst_rows)) * a.copy_bytes;
}

__device__ __forceinline__ void tma_load_only(const TmaArgs& a, const StageRing& ring, int pipe) {
  PipeState p;
  for (uint32_t i = 0; i < a.copies; ++i, p.advance(a.stages)) {
    // the slot's previous load (one round back) must have landed before it is refilled
    if (p.count >= static_cast<uint32_t>(a.stages) &&
        !mbar_wait(a.la, &ring.ring.full[p.stage], p.phase ^ 1u, 0, 0, kSiteNone, kWaitedForData))
      break;
    ring.load(p, tma_src(a, pipe, i), a.copy_bytes);
  }
  ring.drain(a.la, PipeState{}, p);
}

__device__ __forceinline__ void tma_load_gather(const TmaArgs& a, const StageRing& ring, int pipe, int lane) {
  const uint32_t part = a.copy_bytes / static_cast<uint32_t>(a.parts);
  const uint64_t rows = a.src_rows * static_cast<uint64_t>(a.parts);  // of `part` bytes each
  PipeState p;
  for (uint32_t i = 0; i < a.copies; ++i, p.advance(a.stages)) {
    const bool ok = p.count < static_cast<uint32_t>(a.stages) ||
                    mbar_wait(a.la, &ring.ring.full[p.stage], p.phase ^ 1u, 0, 0, kSiteNone, kWaitedForData);
    if (__ballot_sync(0xffffffffu, !ok) != 0) break;
    if (lane == 0) dev::mbar_arrive_expect_tx(&ring.ring.full[p.stage], a.copy_bytes);
    __syncwarp();  // the expected bytes before any part lands
    for (int k = lane; lane < a.part_lanes && k < a.parts; k += a.part_lanes) {
      const uint64_t row = tma_row(a, pipe, i * static_cast<uint32_t>(a.parts) + k, rows);
      dev::bulk_g2s(ring.slot(p) + static_cast<size_t>(k) * part, a.src + (blockIdx.x * rows + row) * part, part,
                    &ring.ring.full[p.stage]);
    }
  }
  if (lane == 0) ring.drain(a.la, PipeState{}, p);
}

__device__ __forceinline__ void tma_store_only(const TmaArgs& a, const StageRing& ring, int pipe) {
  for (uint32_t i = 0; i < a.copies; ++i) {
    dev::bulk_s2g(tma_dst(a, pipe, i, 0), ring.data + static_cast<size_t>(i % a.stages) * a.copy_bytes, a.copy_bytes);
    dev::bulk_commit();
    bulk_wait_read_except(a.depth);
  }
  dev::bulk_wait_all();
}

__device__ __forceinline__ void tma_mix_load(const TmaArgs& a, const StageRing& ring, int pipe) {
  PipeState p;
  for (uint32_t i = 0; i < a.copies; ++i, p.advance(a.stages)) {
    if (!ring.ring.producer_acquire(a.la, p)) break;
    ring.load(p, tma_src(a, pipe, i), a.copy_bytes);
  }
  ring.drain(a.la, PipeState{}, p);
}

__device__ __forceinline__ int tma_store_threads(const TmaArgs& a) {
  return a.store_threads == kTmaMaxStoreThreads ? kTmaMaxStoreThreads : 1;
}

// Route j of copy i through the route table, as the direct dispatch finds a route's output row.
__device__ __forceinline__ uint8_t* tma_table_dst(const TmaArgs& a, const TmaShared& sh, int pipe, uint32_t i, int j) {
  const uint64_t r = tma_row(a, pipe, i, a.dst_rows);
  const int k = static_cast<int>(r % kTmaTableRows);
  return sh.base[sh.dest[k][j]] + (r - k + static_cast<uint64_t>(sh.row[k][j])) * a.copy_bytes;
}

// Store thread `which` of a.store_threads: copies which, which + store_threads, ...
__device__ __forceinline__ void tma_mix_store(const TmaArgs& a, const TmaShared& sh, const StageRing& ring, int pipe,
                                              int which) {
  const int every = tma_store_threads(a);
  PipeState p, released;
  for (int s = 0; s < which; ++s) {
    p.advance(a.stages);
    released.advance(a.stages);
  }
  for (uint32_t i = which; i < a.copies; i += every) {
    if (!ring.ring.consumer_wait(a.la, p)) break;
    for (int j = 0; j < a.fanout; ++j)
      dev::bulk_s2g(a.table ? tma_table_dst(a, sh, pipe, i, j) : tma_dst(a, pipe, i, j), ring.slot(p), a.copy_bytes);
    dev::bulk_commit();
    bulk_wait_read_except(a.depth);
    // every own group but the newest `depth` has read its stage: hand those stages to the loads
    while (released.count + a.depth * every <= p.count) {
      ring.ring.consumer_release(released);
      for (int s = 0; s < every; ++s) released.advance(a.stages);
    }
    for (int s = 0; s < every; ++s) p.advance(a.stages);
  }
  dev::bulk_wait_all();
}

__global__ void __launch_bounds__(kTmaThreads, 1) tma_kernel(const __grid_constant__ TmaArgs a) {
  TmaShared& sh = dev::block_shared<TmaShared>();
  uint8_t* smem = dev::dynamic_smem<uint8_t>();
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  if (threadIdx.x == 0) {
    for (int q = 0; q < a.pipelines; ++q)
      for (int s = 0; s < a.stages; ++s) {
        dev::mbar_init(&sh.full[q][s], 1);
        dev::mbar_init(&sh.empty[q][s], 1);
      }
    dev::mbar_fence_init();
  }
  if (a.table && threadIdx.x == 0) {  // routes of row k: row k of each destination's region, as tma_dst
    for (int k = 0; k < kTmaTableRows; ++k)
      for (int j = 0; j < kTmaMaxFanout; ++j) {
        sh.row[k][j] = k;
        sh.dest[k][j] = static_cast<uint8_t>(j);
      }
    for (int j = 0; j < a.fanout && j < kTmaMaxFanout; ++j)
      sh.base[j] = a.dst + (static_cast<uint64_t>(blockIdx.x) * a.fanout + j) * a.dst_rows * a.copy_bytes;
  }
  if (a.mode == static_cast<int>(TmaMode::kStore)) {  // what the stores carry: each word its offset + 1
    const uint32_t words = static_cast<uint32_t>(a.pipelines * a.stages) * (a.copy_bytes / 4);
    for (uint32_t w = threadIdx.x; w < words; w += blockDim.x) reinterpret_cast<uint32_t*>(smem)[w] = w + 1;
    dev::fence_proxy_async();
  }
  __syncthreads();
  const SpanClock clock = SpanClock::start();
  const bool mix = a.mode == static_cast<int>(TmaMode::kMix);
  const int per_pipe = mix ? 1 + tma_store_threads(a) : 1;  // kMix: the load warp, then the store warps
  const int pipe = warp / per_pipe;
  const bool gather = a.mode == static_cast<int>(TmaMode::kLoad) && a.parts > 1;
  if (gather && pipe < a.pipelines) {  // every lane of the pipeline's warp
    const StageRing ring{Ring{sh.full[pipe], sh.empty[pipe], a.stages, 0, 0, kSiteNone},
                         smem + static_cast<size_t>(pipe) * a.stages * a.copy_bytes, static_cast<int>(a.copy_bytes)};
    tma_load_gather(a, ring, pipe, lane);
  } else if (lane == 0 && pipe < a.pipelines) {
    const StageRing ring{Ring{sh.full[pipe], sh.empty[pipe], a.stages, 0, 0, kSiteNone},
                         smem + static_cast<size_t>(pipe) * a.stages * a.copy_bytes, static_cast<int>(a.copy_bytes)};
    if (a.mode == static_cast<int>(TmaMode::kLoad)) {
      tma_load_only(a, ring, pipe);
    } else if (!mix) {
      tma_store_only(a, ring, pipe);
    } else if (warp % per_pipe == 0) {
      tma_mix_load(a, ring, pipe);
    } else {
      tma_mix_store(a, sh, ring, pipe, warp % per_pipe - 1);
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) clock.stop(a.c);
}

}  // namespace hybrid_ep::micro
