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
#include "kernels/pipeline.cuh"
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

constexpr int kMaxBatchRows = kChunkTokens;  // rows one stage may carry (a chunk's worth)
constexpr int kStoreGroupsInFlight = 4;      // bulk-store groups still reading the FIFO at once

// A chunk's destinations, built once by warp 1's lanes (one token each): the (rank, slot)
// of each of its rows, and per destination the chunk's slots [first, first + rows).
struct SendTable {
  int32_t ndest[kChunkTokens];
  uint8_t dest_rank[kChunkTokens][kMaxTopK];
  int32_t dest_slot[kChunkTokens][kMaxTopK];
  int32_t span_first[2][kMaxRanks];  // two chunks: the one being sent, the one awaiting its signal
  int32_t span_rows[2][kMaxRanks];
};

struct DispatchShared {
  uint64_t full[kMaxStages];
  uint64_t empty[kMaxStages];
  SendTable send;
  int32_t positions[kMaxBatchRows][kMaxTopK];  // output row of each entry of the stage's rows
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
  const RowBatches batches{row_bytes, static_cast<uint32_t>(args.stage_bytes), args.rows_per_stage,
                           static_cast<int>((row_bytes + args.stage_bytes - 1) / args.stage_bytes)};
  const auto* info = reinterpret_cast<const int64_t*>(a.info);
  const auto* send_slot = reinterpret_cast<const int32_t*>(a.send_slot);
  const auto* idx = reinterpret_cast<const int64_t*>(a.topk_idx);
  const auto* weights = reinterpret_cast<const float*>(a.topk_weights);
  const auto* ords = reinterpret_cast<const int32_t*>(a.entry_ord);
  const auto* x = reinterpret_cast<const uint8_t*>(a.x);
  const auto* x_scales = reinterpret_cast<const float*>(a.x_scales);
  // Received rows are packed at the call's row size: consecutive slots of a source are
  // contiguous, so a batch of them is one bulk copy.
  auto recv_row = [&](int r, int source, int64_t slot) {
    return view.base(r) + reg.recv_rows + (static_cast<int64_t>(source) * Tmax + slot) * row_bytes;
  };

  DispatchShared& sh = dev::block_shared<DispatchShared>();
  const uint64_t epoch = view.state()->dispatch_epoch;
  const StageRing fifo{{sh.full, sh.empty, args.fifo_stages, a.rank, epoch}, dev::dynamic_smem<uint8_t>(),
                       args.stage_bytes};
  const int stages = args.fifo_stages;

  if (tid == 0) {
    fifo.ring.init(1, 1);
    dev::mbar_fence_init();
    sh.abort = aborted(args) ? 1 : 0;
  }
  __syncthreads();
  if (sh.abort) return;

  PipeState produced, consumed, drained;  // the producer lane's, the consumer lane's

  // ---- phase 1: one row per (token, destination rank) -----------------------------------
  // Chunk c of this rank is signalled to every destination d in d's chunk_signal[rank][c].
  auto chunk_signal = [&](int d, int source, int c) {
    return reinterpret_cast<ChunkSignal*>(view.base(d) + reg.chunk_signal) +
           static_cast<int64_t>(source) * static_cast<int64_t>(reg.max_chunks) + c;
  };
  // Send-store lane: chunk signals wait until the chunk's bulk stores completed; that is
  // checked at the next group's commit (or at the end), so the next chunk is not drained.
  int pending_chunk = -1, pending_span = 0;
  uint32_t groups = 0, pending_group = 0;
  PipeState released;  // send-store lane: stages handed back to the producer
  auto signal_pending = [&](int writes_in_flight) {
    if (pending_chunk < 0) return;
    bulk_wait_write_except(writes_in_flight);
    dev::fence_proxy_async();  // the bulk writes, before the generic release below
    __threadfence_system();
    for (int d = 0; d < W; ++d) {
      ChunkSignal* sig = chunk_signal(d, a.rank, pending_chunk);
      const int rows = sh.send.span_rows[pending_span][d];
      sig->first = rows > 0 ? sh.send.span_first[pending_span][d] : 0;
      sig->rows = rows;
      dev::st_release_sys(&sig->epoch, epoch);
    }
    pending_chunk = -1;
  };

  const int chunk = args.chunk_tokens;
  const int nchunks = (T + chunk - 1) / chunk;
  int local_chunk = 0;
  for (int c = b; c < nchunks; c += nb, ++local_chunk) {
    const int t0 = c * chunk, t1 = min(T, t0 + chunk);
    for (int u = tid; u < (t1 - t0) * W; u += blockDim.x) {
      const int t = t0 + u / W, d = u % W;
      const int slot = send_slot[static_cast<int64_t>(t) * W + d];
      if (slot < 0) continue;
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

    const int nitems = batches.items(t0, t1);
    if (warp == 0 && lane == 0) {
      for (int k = 0; k < nitems && !sh.abort; ++k, produced.advance(stages)) {
        const RowBatches::Item it = batches.item(t0, t1, k);
        if (!fifo.ring.producer_acquire(args, produced)) {
          sh.abort = 1;
          break;
        }
        fifo.load(produced, x + static_cast<int64_t>(it.first) * row_bytes + it.offset, it.rows * it.bytes);
      }
      fifo.drain(args, drained, produced);
      drained = produced;
    } else if (warp == 1) {
      // The chunk's destination table, once: lane i takes token t0 + i.
      const int span = local_chunk & 1;
      for (int d = lane; d < W; d += 32) {
        sh.send.span_first[span][d] = 0x7fffffff;
        sh.send.span_rows[span][d] = 0;
      }
      __syncwarp();
      if (lane < t1 - t0) {
        const int t = t0 + lane;
        int n = 0;
        for (int d = 0; d < W; ++d) {
          const int slot = send_slot[static_cast<int64_t>(t) * W + d];
          if (slot < 0) continue;
          sh.send.dest_rank[lane][n] = static_cast<uint8_t>(d);
          sh.send.dest_slot[lane][n] = slot;
          ++n;
          atomicMin(&sh.send.span_first[span][d], slot);
          atomicAdd(&sh.send.span_rows[span][d], 1);
        }
        sh.send.ndest[lane] = n;
      }
      __syncwarp();
      if (lane == 0) {
        const int in_flight = min(kStoreGroupsInFlight, stages - 1);
        for (int k = 0; k < nitems && !sh.abort; ++k, consumed.advance(stages)) {
          const RowBatches::Item it = batches.item(t0, t1, k);
          if (!fifo.ring.consumer_wait(args, consumed)) {
            sh.abort = 1;
            break;
          }
          for (int r = 0; r < it.rows; ++r) {
            const int i = it.first + r - t0;
            for (int q = 0; q < sh.send.ndest[i]; ++q)
              dev::bulk_s2g(recv_row(sh.send.dest_rank[i][q], a.rank, sh.send.dest_slot[i][q]) + it.offset,
                            fifo.slot(consumed) + r * it.bytes, it.bytes);
          }
          dev::bulk_commit();
          ++groups;
          // The previous chunk is signalled once its stores completed; this group stays in flight.
          if (pending_chunk >= 0 && pending_group < groups) signal_pending(static_cast<int>(groups - pending_group));
          // Release the oldest stages: at most `in_flight` groups may still read theirs.
          bulk_wait_read_except(in_flight);
          for (; released.count + in_flight <= consumed.count; released.advance(stages))
            fifo.ring.consumer_release(released);
        }
        if (!sh.abort) {
          pending_chunk = c;
          pending_span = span;
          pending_group = groups;
        }
      }
    }
    __syncthreads();
    if (sh.abort) break;
  }
  if (warp == 1 && lane == 0) {
    if (!sh.abort) signal_pending(0);
    dev::bulk_wait_all();
    for (; released.count < consumed.count; released.advance(stages)) fifo.ring.consumer_release(released);
  }
  __syncthreads();
  if (sh.abort) return;

  // ---- phase 2: expand received rows into the expert-major output -----------------------
  const int64_t R = a.num_out_rows;
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
    // The units of every source's rows (a batch, or a row in segments), in source order,
    // strided over the blocks.
    int64_t first_unit = 0;  // of source s in that enumeration
    bool stop = false;
    const int per_unit = batches.items_per_unit();
    for (int s = 0; s < W && !stop; ++s) {
      const int n = static_cast<int>(info[il.recv_count + s]);
      const int nunits = batches.units(0, n);
      const int u0 = static_cast<int>(((b - first_unit) % nb + nb) % nb);
      first_unit += nunits;
      if (u0 >= nunits) continue;
      bool ok = true;
      if (lane == 0) {  // every chunk of this source has arrived
        const int src_chunks = static_cast<int>((info[il.src_tokens + s] + chunk - 1) / chunk);
        for (int c = 0; c < src_chunks && ok; ++c)
          ok = wait_at_least(args, &chunk_signal(a.rank, s, c)->epoch, epoch, kPhaseDispatchRows, a.rank, s, epoch);
        if (ok) dev::fence_proxy_async();  // the peer's rows are read by bulk loads below
      }
      if (!warp_uniform(ok)) {
        stop = true;
        break;
      }
      for (int u = u0; u < nunits && !stop; u += nb) {
        for (int k = u * per_unit; k < (u + 1) * per_unit; ++k) {
          const RowBatches::Item it = batches.item(0, n, k);
          bool failed = false;
          if (warp == 0) {
            if (lane == 0) {
              if (fifo.ring.producer_acquire(args, produced)) {
                fifo.load(produced, recv_row(a.rank, s, it.first) + it.offset, it.rows * it.bytes);
                produced.advance(stages);
              } else {
                failed = true;
              }
            }
          } else {
            // warp 1: entries -> output rows (probs, scales, row_pos) of every row of the
            // stage, once per row (its first segment), then the rows by bulk stores.
            if (it.offset == 0) {
              for (int v = lane; v < it.rows * kd; v += 32) {
                const int r = v / kd, q = v % kd;
                const int64_t row = static_cast<int64_t>(s) * Tmax + it.first + r;
                int pos = -1;
                const MetaEntry en = load_entry(reinterpret_cast<const MetaEntry*>(view.own() + reg.recv_meta) +
                                                row * meta_entries + q);
                if (en.local_expert >= 0) {
                  const int j = en.local_expert;
                  const int64_t p = info[il.expert_start + j] + info[il.src_prefix + s * L + j] + en.ordinal;
                  if (p < R) {
                    pos = static_cast<int>(p);
                    out_probs[p] = en.prob;
                  }
                }
                row_pos[row * kd + q] = pos;
                sh.positions[r][q] = pos;
              }
              __syncwarp();
              if (scale_cols > 0) {
                for (int r = 0; r < it.rows; ++r) {
                  const int64_t row = static_cast<int64_t>(s) * Tmax + it.first + r;
                  const auto* src =
                      reinterpret_cast<const volatile float*>(view.own() + reg.recv_scales + row * reg.scale_stride);
                  for (int q = 0; q < kd; ++q) {
                    const int p = sh.positions[r][q];
                    if (p < 0) continue;
                    for (int c2 = lane; c2 < scale_cols; c2 += 32)
                      out_scales[static_cast<int64_t>(p) * scale_cols + c2] = src[c2];
                  }
                }
              }
            }
            if (lane == 0) {
              if (fifo.ring.consumer_wait(args, consumed)) {
                for (int r = 0; r < it.rows; ++r)
                  for (int q = 0; q < kd; ++q) {
                    const int p = sh.positions[r][q];
                    if (p >= 0)
                      dev::bulk_s2g(out + static_cast<int64_t>(p) * row_bytes + it.offset,
                                    fifo.slot(consumed) + r * it.bytes, it.bytes);
                  }
                dev::bulk_commit();
                dev::bulk_wait_read_all();
                fifo.ring.consumer_release(consumed);
                consumed.advance(stages);
              } else {
                failed = true;
              }
            }
          }
          // Also the warp's barrier before sh.positions is rewritten for the next unit.
          if (warp_uniform(failed)) {
            stop = true;
            break;
          }
        }
      }
    }
    if (stop) sh.abort = 1;
    if (warp == 0 && lane == 0) fifo.drain(args, drained, produced);
    if (warp == 1 && lane == 0) dev::bulk_wait_all();
  }
  __syncthreads();
  if (sh.abort) return;

  if (tid == 0 && !aborted(args)) {
    __threadfence();
    const uint32_t prev = atomicAdd(&st->blocks_done_dispatch, 1u);
    if (prev == static_cast<uint32_t>(nb - 1)) {
      st->blocks_done_dispatch = 0;
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
