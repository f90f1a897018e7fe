// Dispatch kernel: persistent, one block per SM, warp-specialised.
//
// Phase 1 (send): chunks of `chunk_tokens` tokens are strided over the blocks of a rank.
// For a chunk, all threads first write each row's routing entries (local expert, ordinal,
// weight) and fp8 scales into the destination ranks' receive buffers; then warp 0 (G2S)
// bulk-loads each token row, segment by segment, into the shared-memory FIFO and warp 1
// (S2G) bulk-stores each segment once per destination rank into that rank's registered
// buffer through its peer pointer. When the chunk's stores have completed, warp 1 adds the
// chunk's row count to each destination's signal with release semantics.
//
// Phase 2 (expand): the received rows are strided over the blocks. Warp 0 waits until a
// source's rows have all arrived and bulk-loads them into the FIFO; warp 1 reads each row's
// entries, computes its expert-major output rows and bulk-stores the row to each of them.
// The other warps write the zero padding rows meanwhile. The last block to finish records
// what was consumed and publishes done_dispatch, which lets peers reuse the buffers.
#include <cuda_runtime.h>

#include "common/state.cuh"
#include "kernels/fifo.cuh"
#include "kernels/launch.h"

namespace hybrid_ep {
namespace {

__device__ __forceinline__ int elem_bytes(int dtype) {
  return dtype == kFloat32 ? 4 : dtype == kFloat8 ? 1 : 2;
}

__device__ __forceinline__ MetaEntry load_entry(const MetaEntry* p) {
  // Written by a peer: bypass L1 so a previous call's entry is never seen.
  MetaEntry e;
  int prob_bits;
  asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(e.local_expert), "=r"(e.ordinal), "=r"(prob_bits), "=r"(e.pad)
               : "l"(p));
  e.prob = __int_as_float(prob_bits);
  return e;
}

__device__ __forceinline__ void store_entry(MetaEntry* p, int j, int ordinal, float prob) {
  *reinterpret_cast<int4*>(p) = make_int4(j, ordinal, __float_as_int(prob), 0);
}

__device__ __forceinline__ bool has_destination(const int32_t* send_slot, int t, int W) {
  for (int d = 0; d < W; ++d)
    if (send_slot[static_cast<int64_t>(t) * W + d] >= 0) return true;
  return false;
}

struct Shared {
  uint64_t full[kMaxStages];
  uint64_t empty[kMaxStages];
  uint32_t chunk_rows[kMaxRanks];
  int32_t positions[kMaxTopK];
  int abort;
};

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ LaunchArgs args) {
  const BlockPlace place = block_place(args);
  const RankArgs& a = place.rank;
  if (a.absent) return;
  const int b = place.block, nb = place.blocks;
  const Geometry& geo = args.geo;
  const RegLayout& reg = geo.reg;
  const InfoLayout& il = geo.info;
  const RankView view = rank_view(geo, a);
  const int W = geo.world_size, L = geo.local_experts, Tmax = geo.max_tokens, T = a.num_tokens, K = a.topk;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int kd = args.kd, meta_entries = static_cast<int>(reg.meta_entries), scale_cols = args.scale_cols;
  const uint32_t row_bytes = static_cast<uint32_t>(args.row_elems) * elem_bytes(args.dtype);
  const uint32_t seg_bytes = static_cast<uint32_t>(args.stage_bytes);
  const uint32_t nseg = (row_bytes + seg_bytes - 1) / seg_bytes;
  const auto* info = reinterpret_cast<const int64_t*>(a.info);
  const auto* send_slot = reinterpret_cast<const int32_t*>(a.send_slot);
  const auto* idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  const auto* weights = reinterpret_cast<const float*>(a.topk_weights);
  const auto* ords = reinterpret_cast<const int32_t*>(a.entry_ord);
  const auto* x = reinterpret_cast<const uint8_t*>(a.x);
  const auto* x_scales = reinterpret_cast<const float*>(a.x_scales);

  extern __shared__ __align__(128) uint8_t fifo_data[];
  __shared__ Shared sh;
  const Fifo fifo{fifo_data, sh.full, sh.empty, args.fifo_stages, args.stage_bytes};
  const uint64_t epoch = view.state()->dispatch_epoch;

  if (tid == 0) {
    for (int s = 0; s < args.fifo_stages; ++s) {
      ptx::mbar_init(&sh.full[s], 1);
      ptx::mbar_init(&sh.empty[s], 1);
    }
    ptx::mbar_fence_init();
    sh.abort = aborted(args) ? 1 : 0;
  }
  for (int d = tid; d < kMaxRanks; d += blockDim.x) sh.chunk_rows[d] = 0;
  __syncthreads();
  if (sh.abort) return;

  uint32_t item = 0;  // FIFO position; advanced identically by warp 0 lane 0 and warp 1

  // ---- phase 1: one row per (token, destination rank) -----------------------------------
  const int chunk = args.chunk_tokens;
  const int nchunks = (T + chunk - 1) / chunk;
  for (int c = b; c < nchunks; c += nb) {
    const int t0 = c * chunk, t1 = min(T, t0 + chunk);
    for (int u = tid; u < (t1 - t0) * W; u += blockDim.x) {
      const int t = t0 + u / W, d = u % W;
      const int slot = send_slot[static_cast<int64_t>(t) * W + d];
      if (slot < 0) continue;
      atomicAdd(&sh.chunk_rows[d], 1u);
      const int64_t row = static_cast<int64_t>(a.rank) * Tmax + slot;
      auto* meta = reinterpret_cast<MetaEntry*>(view.base(d) + reg.recv_meta) + row * meta_entries;
      int q = 0;
      for (int k = 0; k < K; ++k) {
        const int64_t e = idx[static_cast<int64_t>(t) * K + k];
        if (e < 0 || e / L != d) continue;
        store_entry(meta + q, static_cast<int>(e % L), ords[static_cast<int64_t>(t) * K + k],
                    weights[static_cast<int64_t>(t) * K + k]);
        ++q;
      }
      for (; q < kd; ++q) store_entry(meta + q, -1, 0, 0.f);
      if (scale_cols > 0) {
        auto* dst = reinterpret_cast<float*>(view.base(d) + reg.recv_scales + row * reg.scale_stride);
        for (int s = 0; s < scale_cols; ++s) dst[s] = x_scales[static_cast<int64_t>(t) * scale_cols + s];
      }
    }
    __threadfence_system();
    __syncthreads();

    if (warp == 0 && lane == 0) {
      for (int t = t0; t < t1 && !sh.abort; ++t) {
        if (!has_destination(send_slot, t, W)) continue;
        for (uint32_t sg = 0; sg < nseg; ++sg, ++item) {
          const uint32_t bytes = min(seg_bytes, row_bytes - sg * seg_bytes);
          if (!fifo.produce(args, a.rank, item, x + static_cast<int64_t>(t) * row_bytes + sg * seg_bytes, bytes)) {
            sh.abort = 1;
            break;
          }
        }
      }
    } else if (warp == 1 && lane == 0) {
      for (int t = t0; t < t1 && !sh.abort; ++t) {
        if (!has_destination(send_slot, t, W)) continue;
        for (uint32_t sg = 0; sg < nseg; ++sg, ++item) {
          const uint32_t bytes = min(seg_bytes, row_bytes - sg * seg_bytes);
          if (!fifo.wait_full(args, a.rank, item)) {
            sh.abort = 1;
            break;
          }
          for (int d = 0; d < W; ++d) {
            const int slot = send_slot[static_cast<int64_t>(t) * W + d];
            if (slot < 0) continue;
            uint8_t* dst = view.base(d) + reg.recv_rows +
                           (static_cast<int64_t>(a.rank) * Tmax + slot) * reg.row_stride + sg * seg_bytes;
            ptx::bulk_s2g(dst, fifo.slot(item), bytes);
          }
          fifo.release(item);
        }
      }
      ptx::bulk_wait_all();
      __threadfence_system();
      if (!sh.abort)
        for (int d = 0; d < W; ++d)
          if (sh.chunk_rows[d] > 0)
            ptx::red_add_release_sys(view.flag(d, reg.dispatch_signal, a.rank), sh.chunk_rows[d]);
    }
    __syncthreads();
    for (int d = tid; d < W; d += blockDim.x) sh.chunk_rows[d] = 0;
    __syncthreads();
    if (sh.abort) return;
  }

  // ---- phase 2: expand received rows into the expert-major output -----------------------
  const int64_t R = a.num_out_rows;
  const int64_t num_recv = info[il.num_recv];
  auto* out = reinterpret_cast<uint8_t*>(a.out);
  auto* out_scales = reinterpret_cast<float*>(a.out_scales);
  auto* out_probs = reinterpret_cast<float*>(a.out_probs);
  auto* row_pos = reinterpret_cast<int32_t*>(a.row_pos);
  LocalState* st = view.state();

  if (warp >= 2) {
    // Zero padding rows: after each expert's real rows, and after the whole layout.
    const int zwarps = (blockDim.x >> 5) - 2;
    const int64_t gw = static_cast<int64_t>(b) * zwarps + (warp - 2), nw = static_cast<int64_t>(nb) * zwarps;
    const int64_t needed = info[il.needed];
    for (int j = 0; j <= L; ++j) {
      int64_t lo, hi;
      if (j < L) {
        lo = info[il.expert_start + j] + info[il.expert_rows + j];
        hi = info[il.expert_start + j] + (j + 1 < L ? info[il.expert_start + j + 1] - info[il.expert_start + j]
                                                    : needed - info[il.expert_start + j]);
      } else {
        lo = needed;
        hi = R;
      }
      hi = min(hi, R);
      for (int64_t r = lo + gw; r < hi; r += nw) {
        int4* dst = reinterpret_cast<int4*>(out + r * row_bytes);
        for (uint32_t v = lane; v < row_bytes / 16; v += 32) dst[v] = make_int4(0, 0, 0, 0);
        for (int s = lane; s < scale_cols; s += 32) out_scales[r * scale_cols + s] = 0.f;
        if (lane == 0) out_probs[r] = 0.f;
      }
    }
  } else {
    int s = -1;
    int64_t s_end = 0;
    for (int64_t v = b; v < num_recv && !sh.abort; v += nb) {
      while (v >= s_end && s + 1 < W) {  // next source with rows; wait until all arrived
        ++s;
        s_end = info[il.recv_offset + s] + info[il.recv_count + s];
        if (v < s_end && lane == 0) {
          const uint64_t target = st->rx_dispatch[s] + static_cast<uint64_t>(info[il.recv_count + s]);
          if (!wait_at_least(args, view.flag(a.rank, reg.dispatch_signal, s), target, kPhaseDispatchRows, a.rank, s,
                             epoch))
            sh.abort = 1;
        }
      }
      if (warp == 1) __syncwarp();
      if (sh.abort) break;
      const int64_t i = v - info[il.recv_offset + s];
      const int64_t row = static_cast<int64_t>(s) * Tmax + i;
      if (warp == 0) {
        if (lane == 0) {
          for (uint32_t sg = 0; sg < nseg; ++sg, ++item) {
            const uint32_t bytes = min(seg_bytes, row_bytes - sg * seg_bytes);
            const uint8_t* src = view.own() + reg.recv_rows + row * reg.row_stride + sg * seg_bytes;
            if (!fifo.produce(args, a.rank, item, src, bytes)) {
              sh.abort = 1;
              break;
            }
          }
        }
      } else {
        // warp 1: entries -> output rows (probs, scales, row_pos), then the row by TMA.
        int pos = -1;
        if (lane < kd) {
          const MetaEntry en =
              load_entry(reinterpret_cast<const MetaEntry*>(view.own() + reg.recv_meta) + row * meta_entries + lane);
          if (en.local_expert >= 0) {
            const int j = en.local_expert;
            const int64_t p = info[il.expert_start + j] + info[il.src_prefix + s * L + j] + en.ordinal;
            if (p < R) {
              pos = static_cast<int>(p);
              out_probs[p] = en.prob;
            }
          }
          row_pos[row * kd + lane] = pos;
          sh.positions[lane] = pos;
        }
        __syncwarp();
        if (scale_cols > 0) {
          const auto* src = reinterpret_cast<const volatile float*>(view.own() + reg.recv_scales + row * reg.scale_stride);
          for (int q = 0; q < kd; ++q) {
            const int p = sh.positions[q];
            if (p < 0) continue;
            for (int c2 = lane; c2 < scale_cols; c2 += 32) out_scales[static_cast<int64_t>(p) * scale_cols + c2] = src[c2];
          }
        }
        if (lane == 0) {
          for (uint32_t sg = 0; sg < nseg; ++sg, ++item) {
            const uint32_t bytes = min(seg_bytes, row_bytes - sg * seg_bytes);
            if (!fifo.wait_full(args, a.rank, item)) {
              sh.abort = 1;
              break;
            }
            for (int q = 0; q < kd; ++q) {
              const int p = sh.positions[q];
              if (p >= 0) ptx::bulk_s2g(out + static_cast<int64_t>(p) * row_bytes + sg * seg_bytes, fifo.slot(item), bytes);
            }
            fifo.release(item);
          }
        }
        __syncwarp();
      }
    }
    if (warp == 1 && lane == 0) ptx::bulk_wait_all();
  }
  __syncthreads();
  if (sh.abort || aborted(args)) return;

  if (tid == 0) {
    __threadfence();
    const uint32_t prev = atomicAdd(&st->blocks_done_dispatch, 1u);
    if (prev == static_cast<uint32_t>(nb - 1)) {
      st->blocks_done_dispatch = 0;
      for (int s = 0; s < W; ++s) st->rx_dispatch[s] += static_cast<uint64_t>(info[il.recv_count + s]);
      __threadfence_system();
      ptx::st_release_sys(view.flag(a.rank, reg.done_dispatch, 0), epoch);
    }
  }
}

}  // namespace

size_t dispatch_smem_bytes(const LaunchArgs& args) {
  return static_cast<size_t>(args.fifo_stages) * static_cast<size_t>(args.stage_bytes);
}

cudaError_t launch_dispatch(const LaunchArgs& args, cudaStream_t stream) {
  const size_t smem = dispatch_smem_bytes(args);
  cudaError_t err = cudaFuncSetAttribute(dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                         static_cast<int>(smem));
  if (err != cudaSuccess) return err;
  void* params[] = {const_cast<LaunchArgs*>(&args)};
  return cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(dispatch_kernel),
                                     dim3(args.num_ranks * args.blocks_per_rank), dim3(kThreads), params, smem,
                                     stream);
}

int dispatch_max_blocks_per_sm(size_t smem) {
  int n = 0;
  cudaFuncSetAttribute(dispatch_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, dispatch_kernel, kThreads, smem);
  return n;
}

}  // namespace hybrid_ep
