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
//
// Aborts (a wait that gave up) are decided per warp from lane 0's answer, so every lane of
// a warp leaves a loop together; the producer lane waits for every bulk load it issued
// before the block exits, and the consumer lane for every bulk store.
#include "common/state.cuh"
#include "kernels/fifo.cuh"
#include "kernels/launch.h"

namespace hybrid_ep {
namespace {

__device__ __forceinline__ int elem_bytes(int dtype) {
  return dtype == kFloat32 ? 4 : dtype == kFloat8 ? 1 : 2;
}

__device__ __forceinline__ MetaEntry load_entry(const MetaEntry* p) {
  const int4 v = dev::ld_volatile_v4(p);
  return MetaEntry{v.x, v.y, __int_as_float(v.z), v.w};
}

__device__ __forceinline__ void store_entry(MetaEntry* p, int j, int ordinal, float prob) {
  *reinterpret_cast<int4*>(p) = make_int4(j, ordinal, __float_as_int(prob), 0);
}

__device__ __forceinline__ bool has_destination(const int32_t* send_slot, int t, int W) {
  for (int d = 0; d < W; ++d)
    if (send_slot[static_cast<int64_t>(t) * W + d] >= 0) return true;
  return false;
}

struct DispatchShared {
  uint64_t full[kMaxStages];
  uint64_t empty[kMaxStages];
  uint32_t chunk_rows[kMaxRanks];
  int32_t positions[kMaxTopK];
  volatile int abort;
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

  DispatchShared& sh = dev::block_shared<DispatchShared>();
  const uint64_t epoch = view.state()->dispatch_epoch;
  const Fifo fifo{dev::dynamic_smem<uint8_t>(), sh.full, sh.empty, args.fifo_stages, args.stage_bytes, a.rank, epoch};

  if (tid == 0) {
    for (int s = 0; s < args.fifo_stages; ++s) {
      dev::mbar_init(&sh.full[s], 1);
      dev::mbar_init(&sh.empty[s], 1);
    }
    dev::mbar_fence_init();
    sh.abort = aborted(args) ? 1 : 0;
  }
  for (int d = tid; d < kMaxRanks; d += blockDim.x) sh.chunk_rows[d] = 0;
  __syncthreads();
  if (sh.abort) return;

  uint32_t item = 0;     // FIFO position; advanced identically by the producer and the consumer lane
  uint32_t drained = 0;  // producer: loads up to here are known to have landed

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
    __syncthreads();  // entries written by every thread before warp 1 signals them (its release is cumulative)

    if (warp == 0 && lane == 0) {
      for (int t = t0; t < t1 && !sh.abort; ++t) {
        if (!has_destination(send_slot, t, W)) continue;
        for (uint32_t sg = 0; sg < nseg; ++sg, ++item) {
          const uint32_t bytes = min(seg_bytes, row_bytes - sg * seg_bytes);
          if (!fifo.produce(args, item, x + static_cast<int64_t>(t) * row_bytes + sg * seg_bytes, bytes)) {
            sh.abort = 1;
            break;
          }
        }
      }
      fifo.drain(args, drained, item);
      drained = item;
    } else if (warp == 1 && lane == 0) {
      for (int t = t0; t < t1 && !sh.abort; ++t) {
        if (!has_destination(send_slot, t, W)) continue;
        for (uint32_t sg = 0; sg < nseg; ++sg, ++item) {
          const uint32_t bytes = min(seg_bytes, row_bytes - sg * seg_bytes);
          if (!fifo.wait_full(args, item)) {
            sh.abort = 1;
            break;
          }
          for (int d = 0; d < W; ++d) {
            const int slot = send_slot[static_cast<int64_t>(t) * W + d];
            if (slot < 0) continue;
            uint8_t* dst = view.base(d) + reg.recv_rows +
                           (static_cast<int64_t>(a.rank) * Tmax + slot) * reg.row_stride + sg * seg_bytes;
            dev::bulk_s2g(dst, fifo.slot(item), bytes);
          }
          fifo.release(item);
        }
      }
      dev::bulk_wait_all();
      if (!sh.abort) {
        dev::fence_proxy_async();  // the bulk writes above, before the generic release below
        __threadfence_system();
        for (int d = 0; d < W; ++d)
          if (sh.chunk_rows[d] > 0) dev::red_add_release_sys(view.flag(d, reg.dispatch_signal, a.rank), sh.chunk_rows[d]);
      }
      for (int d = 0; d < W; ++d) sh.chunk_rows[d] = 0;
    }
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
    for (int64_t v = b; v < num_recv; v += nb) {
      bool ok = true;
      while (v >= s_end && s + 1 < W) {  // next source with rows; wait until all arrived
        ++s;
        s_end = info[il.recv_offset + s] + info[il.recv_count + s];
        if (v < s_end && lane == 0) {
          const uint64_t target = st->rx_dispatch[s] + static_cast<uint64_t>(info[il.recv_count + s]);
          ok = wait_at_least(args, view.flag(a.rank, reg.dispatch_signal, s), target, kPhaseDispatchRows, a.rank, s,
                             epoch);
          if (ok) dev::fence_proxy_async();  // the peer's rows are read by bulk loads below
        }
      }
      if (!warp_uniform(ok)) {
        sh.abort = 1;
        break;
      }
      const int64_t i = v - info[il.recv_offset + s];
      const int64_t row = static_cast<int64_t>(s) * Tmax + i;
      bool stop = false;
      if (warp == 0) {
        if (lane == 0) {
          for (uint32_t sg = 0; sg < nseg; ++sg, ++item) {
            const uint32_t bytes = min(seg_bytes, row_bytes - sg * seg_bytes);
            const uint8_t* src = view.own() + reg.recv_rows + row * reg.row_stride + sg * seg_bytes;
            if (!fifo.produce(args, item, src, bytes)) {
              stop = true;
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
            if (!fifo.wait_full(args, item)) {
              stop = true;
              break;
            }
            for (int q = 0; q < kd; ++q) {
              const int p = sh.positions[q];
              if (p >= 0) dev::bulk_s2g(out + static_cast<int64_t>(p) * row_bytes + sg * seg_bytes, fifo.slot(item), bytes);
            }
            fifo.release(item);
          }
        }
      }
      // Also the warp's barrier before sh.positions is rewritten for the next row.
      if (warp_uniform(stop)) {
        sh.abort = 1;
        break;
      }
    }
    if (warp == 0 && lane == 0) fifo.drain(args, drained, item);
    if (warp == 1 && lane == 0) dev::bulk_wait_all();
  }
  __syncthreads();
  if (sh.abort) return;

  if (tid == 0 && !aborted(args)) {
    __threadfence();
    const uint32_t prev = atomicAdd(&st->blocks_done_dispatch, 1u);
    if (prev == static_cast<uint32_t>(nb - 1)) {
      st->blocks_done_dispatch = 0;
      for (int s = 0; s < W; ++s) st->rx_dispatch[s] += static_cast<uint64_t>(info[il.recv_count + s]);
      __threadfence_system();
      dev::st_release_sys(view.flag(a.rank, reg.done_dispatch, 0), epoch);
    }
  }
}

}  // namespace

size_t dispatch_smem_bytes(const LaunchArgs& args) {
  return static_cast<size_t>(args.fifo_stages) * static_cast<size_t>(args.stage_bytes);
}

LaunchStatus launch_dispatch(const LaunchArgs& args, uint64_t stream) {
  return dev::launch_cooperative(dispatch_kernel, args.num_ranks * args.blocks_per_rank, kThreads,
                                 dispatch_smem_bytes(args), stream, args);
}

int dispatch_max_blocks_per_sm(size_t smem) { return dev::max_active_blocks(dispatch_kernel, kThreads, smem); }

}  // namespace hybrid_ep
