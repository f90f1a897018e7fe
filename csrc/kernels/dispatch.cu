// Dispatch kernel: persistent, one block per SM, warp-specialised. Every block sends its
// share of this rank's tokens and, at the same time, expands its share of the rows this rank
// receives, chunk by chunk as they arrive.
//
// Send (this rank's chunks of kChunkTokens tokens, strided over the blocks):
//   warp 0      bulk-loads the chunk's rows into the send FIFO (small rows batched per stage);
//   warps 2-3   write each row's routing entries and fp8 scales into the destinations' buffers;
//   warp 1      builds the chunk's destination table (one lane per token), bulk-stores each
//               stage once per destination rank through its peer pointer (several groups in
//               flight, the oldest stage released first), and signals the chunk to every
//               destination once its stores completed and its entries are written: checked at
//               the next group's commit, so the next chunk is not drained.
// Expand (every (source, chunk) this rank receives, strided over the blocks):
//   warps 6-7   wait for the chunk's signal, load its routing entries at once, compute each
//               entry's expert-major output row, write probs, scales and row_pos, and publish
//               the chunk's position table;
//   warp 4      bulk-loads the chunk's rows (contiguous receive slots) into the expand FIFO;
//   warp 5      bulk-stores each row to its output rows (several groups in flight).
// Warps 8-15 write the zero padding rows. The last block to finish publishes done_dispatch,
// which lets peers reuse the receive buffers.
//
// Where the inter-node path enters (docs/traffic.md): an RDMA warp group, taken from
// the padding warps, puts each chunk once per remote node to its rail peer; there the
// send-load warp gets a second source of chunks, rows that arrived by RDMA, and warp 1
// forwards them over NVLink through the same FIFO and destination tables.
//
// A wait that gives up raises the launch's abort flag; every role then leaves its loop
// (decisions that lead to a warp collective are taken from lane 0's answer), producers wait
// for the loads they issued and stores for their bulk groups, so no block exits with a copy
// touching its shared memory.
#include "common/state.cuh"
#include "kernels/chunks.cuh"
#include "kernels/launch.h"
#include "kernels/pipeline.cuh"

namespace hybrid_ep {
namespace {

constexpr int kStoreGroupsInFlight = 4;      // bulk-store groups still reading a FIFO at once
constexpr int kMetaSlots = 4;                // send chunks whose entries may be written ahead
constexpr int kTableSlots = 4;               // expand chunks whose position tables are ready ahead

// Warp roles (kThreads = 512: 16 warps).
constexpr int kSendLoadWarp = 0, kSendStoreWarp = 1, kSendMetaWarp = 2;      // 2 and 3
constexpr int kExpandLoadWarp = 4, kExpandStoreWarp = 5, kExpandMetaWarp = 6;  // 6 and 7
constexpr int kMetaWarps = 2, kPaddingWarp = 8;                              // 8 .. 15

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

// A send chunk's destinations, built once by warp 1's lanes (one token each): the (rank,
// slot) of each of its rows, and per destination the chunk's slots [first, first + rows).
struct SendTable {
  int32_t ndest[kChunkTokens];
  uint8_t dest_rank[kChunkTokens][kMaxTopK];
  int32_t dest_slot[kChunkTokens][kMaxTopK];
  int32_t span_first[2][kMaxRanks];  // two chunks: the one being sent, the one awaiting its signal
  int32_t span_rows[2][kMaxRanks];
};

// An expand chunk's output rows, built by warps 6-7 for warps 4-5.
struct ExpandTable {
  int32_t first;  // receive slots [first, first + rows) of the source
  int32_t rows;
  int32_t pos[kChunkTokens][kMaxTopK];  // output row of each entry of each row, -1 if none
};

struct DispatchShared {
  uint64_t send_full[kMaxStages], send_empty[kMaxStages];
  uint64_t expand_full[kMaxStages], expand_empty[kMaxStages];
  uint64_t meta_full[kMetaSlots], meta_empty[kMetaSlots];
  uint64_t table_full[kTableSlots], table_empty[kTableSlots];
  SendTable send;
  ExpandTable tables[kTableSlots];
  volatile int abort;
};

// What every role of a block needs to know about the call.
struct Dispatch {
  const LaunchArgs& args;
  const RankArgs& a;
  const Geometry& geo;
  const RegLayout& reg;
  const InfoLayout& il;
  RankView view;
  int b, nb, W, L, Tmax, T, K, kd, meta_entries, scale_cols, chunk, stages;
  uint32_t row_bytes;
  RowBatches batches;
  const int64_t* info;
  uint64_t epoch;
  DispatchShared& sh;
  StageRing send_fifo, expand_fifo;
  Ring meta_ring, table_ring;

  // Received rows are packed at the call's row size: consecutive slots of a source are
  // contiguous, so a batch of them is one bulk copy.
  __device__ uint8_t* recv_row(int r, int source, int64_t slot) const {
    return view.base(r) + reg.recv_rows + (static_cast<int64_t>(source) * Tmax + slot) * row_bytes;
  }
  // Chunk c of `source`, as signalled to rank d.
  __device__ ChunkSignal* chunk_signal(int d, int source, int c) const {
    return reinterpret_cast<ChunkSignal*>(view.base(d) + reg.chunk_signal) +
           static_cast<int64_t>(source) * static_cast<int64_t>(reg.max_chunks) + c;
  }
  __device__ int send_chunks() const { return (T + chunk - 1) / chunk; }
  __device__ int source_chunks(int s) const { return static_cast<int>((info[il.src_tokens + s] + chunk - 1) / chunk); }
  __device__ void stop() const { sh.abort = 1; }
  __device__ bool stopped() const { return sh.abort != 0; }
};

using ExpandChunks = ReceivedChunks<Dispatch>;  // the (source, chunk) pairs this block expands

// ---- send -----------------------------------------------------------------------------------

__device__ void send_load(const Dispatch& d) {
  const auto* x = reinterpret_cast<const uint8_t*>(d.a.x);
  PipeState produced;
  for (int c = d.b; c < d.send_chunks() && !d.stopped(); c += d.nb) {
    const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk);
    for (int k = 0; k < d.batches.items(t0, t1) && !d.stopped(); ++k, produced.advance(d.stages)) {
      const RowBatches::Item it = d.batches.item(t0, t1, k);
      if (!d.send_fifo.ring.producer_acquire(d.args, produced)) {
        d.stop();
        break;
      }
      d.send_fifo.load(produced, x + static_cast<int64_t>(it.first) * d.row_bytes + it.offset, it.rows * it.bytes);
    }
  }
  d.send_fifo.drain(d.args, PipeState{}, produced);
}

// Warps 2-3: the chunk's routing entries (and fp8 scales) into every destination's buffer.
__device__ void send_meta(const Dispatch& d, int tw, int lane) {
  const auto* send_slot = reinterpret_cast<const int32_t*>(d.a.send_slot);
  const auto* idx = reinterpret_cast<const int64_t*>(d.a.topk_idx);
  const auto* weights = reinterpret_cast<const float*>(d.a.topk_weights);
  const auto* ords = reinterpret_cast<const int32_t*>(d.a.entry_ord);
  const auto* x_scales = reinterpret_cast<const float*>(d.a.x_scales);
  const int W = d.W, K = d.K;
  PipeState slot;
  for (int c = d.b; c < d.send_chunks(); c += d.nb, slot.advance(kMetaSlots)) {
    bool ok = true;
    if (lane == 0) ok = !d.stopped() && d.meta_ring.producer_acquire(d.args, slot);
    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
    const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk);
    for (int u = tw; u < (t1 - t0) * W; u += kMetaWarps * 32) {
      const int t = t0 + u / W, dst = u % W;
      const int s = send_slot[static_cast<int64_t>(t) * W + dst];
      if (s < 0) continue;
      const int64_t row = static_cast<int64_t>(d.a.rank) * d.Tmax + s;
      auto* meta = reinterpret_cast<MetaEntry*>(d.view.base(dst) + d.reg.recv_meta) + row * d.meta_entries;
      int q = 0;
      for (int k = 0; k < K; ++k) {
        const int64_t e = idx[static_cast<int64_t>(t) * K + k];
        if (e < 0 || e / d.L != dst) continue;
        store_entry(meta + q, static_cast<int>(e % d.L), ords[static_cast<int64_t>(t) * K + k],
                    weights[static_cast<int64_t>(t) * K + k]);
        ++q;
      }
      for (; q < d.kd; ++q) store_entry(meta + q, -1, 0, 0.f);
      if (d.scale_cols > 0) {
        auto* out = reinterpret_cast<float*>(d.view.base(dst) + d.reg.recv_scales + row * d.reg.scale_stride);
        for (int i = 0; i < d.scale_cols; ++i) out[i] = x_scales[static_cast<int64_t>(t) * d.scale_cols + i];
      }
    }
    __syncwarp();
    if (lane == 0) d.meta_ring.producer_commit(slot);  // one of the two warps' arrivals
  }
}

__device__ void send_store(const Dispatch& d, int lane) {
  const auto* send_slot = reinterpret_cast<const int32_t*>(d.a.send_slot);
  SendTable& tab = d.sh.send;
  const int W = d.W;
  const int in_flight = min(kStoreGroupsInFlight, d.stages - 1);
  PipeState consumed, released, meta;  // lane 0's
  uint32_t groups = 0, pending_group = 0;
  int pending_chunk = -1, pending_span = 0;

  // Lane 0: once chunk pending_chunk's stores completed (all but the newest `writes_in_flight`
  // groups) and its entries are written, tell every destination where its rows are.
  auto signal_pending = [&](int writes_in_flight) -> bool {
    if (pending_chunk < 0) return true;
    bulk_wait_write_except(writes_in_flight);
    if (!d.meta_ring.consumer_wait(d.args, meta)) return false;
    d.meta_ring.consumer_release(meta);
    meta.advance(kMetaSlots);
    dev::fence_proxy_async();  // the bulk writes, before the generic release below
    __threadfence_system();    // the entries other warps wrote (their arrival ordered them before)
    for (int dst = 0; dst < W; ++dst) {
      ChunkSignal* sig = d.chunk_signal(dst, d.a.rank, pending_chunk);
      const int rows = tab.span_rows[pending_span][dst];
      sig->first = rows > 0 ? tab.span_first[pending_span][dst] : 0;
      sig->rows = rows;
      dev::st_release_sys(&sig->epoch, d.epoch);
    }
    pending_chunk = -1;
    return true;
  };

  int local = 0;
  for (int c = d.b; c < d.send_chunks(); c += d.nb, ++local) {
    const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk);
    // The chunk's destination table, once: lane i takes token t0 + i.
    const int span = local & 1;
    for (int dst = lane; dst < W; dst += 32) {
      tab.span_first[span][dst] = 0x7fffffff;
      tab.span_rows[span][dst] = 0;
    }
    __syncwarp();
    if (lane < t1 - t0) {
      const int t = t0 + lane;
      int n = 0;
      for (int dst = 0; dst < W; ++dst) {
        const int slot = send_slot[static_cast<int64_t>(t) * W + dst];
        if (slot < 0) continue;
        tab.dest_rank[lane][n] = static_cast<uint8_t>(dst);
        tab.dest_slot[lane][n] = slot;
        ++n;
        atomicMin(&tab.span_first[span][dst], slot);
        atomicAdd(&tab.span_rows[span][dst], 1);
      }
      tab.ndest[lane] = n;
    }
    __syncwarp();
    bool ok = true;
    if (lane == 0) {
      for (int k = 0; k < d.batches.items(t0, t1) && ok; ++k, consumed.advance(d.stages)) {
        const RowBatches::Item it = d.batches.item(t0, t1, k);
        if (d.stopped() || !d.send_fifo.ring.consumer_wait(d.args, consumed)) {
          ok = false;
          break;
        }
        for (int r = 0; r < it.rows; ++r) {
          const int i = it.first + r - t0;
          for (int q = 0; q < tab.ndest[i]; ++q)
            dev::bulk_s2g(d.recv_row(tab.dest_rank[i][q], d.a.rank, tab.dest_slot[i][q]) + it.offset,
                          d.send_fifo.slot(consumed) + r * it.bytes, it.bytes);
        }
        dev::bulk_commit();
        ++groups;
        if (pending_chunk >= 0 && pending_group < groups)
          ok = signal_pending(static_cast<int>(groups - pending_group));
        bulk_wait_read_except(in_flight);  // release the oldest stages only
        for (; released.count + in_flight <= consumed.count; released.advance(d.stages))
          d.send_fifo.ring.consumer_release(released);
      }
      if (ok) {
        pending_chunk = c;
        pending_span = span;
        pending_group = groups;
      }
    }
    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
  }
  if (lane == 0) {
    if (!d.stopped() && !signal_pending(0)) d.stop();
    dev::bulk_wait_all();
    for (; released.count < consumed.count; released.advance(d.stages)) d.send_fifo.ring.consumer_release(released);
  }
}

// ---- expand ---------------------------------------------------------------------------------

// Warps 6-7: a chunk's entries -> output rows, probs, scales, row_pos and the position table.
__device__ void expand_meta(const Dispatch& d, int tw, int lane) {
  const int64_t R = d.a.num_out_rows;
  auto* out_scales = reinterpret_cast<float*>(d.a.out_scales);
  auto* out_probs = reinterpret_cast<float*>(d.a.out_probs);
  auto* row_pos = reinterpret_cast<int32_t*>(d.a.row_pos);
  const auto* recv_meta = reinterpret_cast<const MetaEntry*>(d.view.own() + d.reg.recv_meta);
  const int64_t* info = d.info;
  ExpandChunks chunks(d);
  PipeState slot;
  int s, c;
  while (chunks.next(s, c)) {
    const ChunkSignal* sig = d.chunk_signal(d.a.rank, s, c);
    bool ok = true;
    if (lane == 0)
      ok = !d.stopped() &&
           wait_at_least(d.args, &sig->epoch, d.epoch, kPhaseDispatchRows, d.a.rank, s, d.epoch) &&
           d.table_ring.producer_acquire(d.args, slot);
    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
    const int first = *reinterpret_cast<const volatile int32_t*>(&sig->first);
    const int rows = *reinterpret_cast<const volatile int32_t*>(&sig->rows);
    ExpandTable& tab = d.sh.tables[slot.stage];
    if (tw == 0) {
      tab.first = first;
      tab.rows = rows;
      // The handle keeps the span: combine reduces the same chunks after later dispatches.
      auto* spans = reinterpret_cast<int32_t*>(d.a.recv_spans);
      const int64_t i = (static_cast<int64_t>(s) * static_cast<int64_t>(d.reg.max_chunks) + c) * 2;
      spans[i] = first;
      spans[i + 1] = rows;
    }
    for (int v = tw; v < rows * d.kd; v += kMetaWarps * 32) {
      const int r = v / d.kd, q = v % d.kd;
      const int64_t row = static_cast<int64_t>(s) * d.Tmax + first + r;
      int pos = -1;
      const MetaEntry en = load_entry(recv_meta + row * d.meta_entries + q);
      if (en.local_expert >= 0) {
        const int j = en.local_expert;
        const int64_t p = info[d.il.expert_start + j] + info[d.il.src_prefix + s * d.L + j] + en.ordinal;
        if (p < R) {
          pos = static_cast<int>(p);
          out_probs[p] = en.prob;
          if (d.scale_cols > 0) {
            const auto* src =
                reinterpret_cast<const volatile float*>(d.view.own() + d.reg.recv_scales + row * d.reg.scale_stride);
            for (int i = 0; i < d.scale_cols; ++i) out_scales[p * d.scale_cols + i] = src[i];
          }
        }
      }
      row_pos[row * d.kd + q] = pos;
      tab.pos[r][q] = pos;
    }
    __syncwarp();
    if (lane == 0) d.table_ring.producer_commit(slot);  // one of the two warps' arrivals
    slot.advance(kTableSlots);
  }
}

__device__ void expand_load(const Dispatch& d) {
  ExpandChunks chunks(d);
  PipeState table, produced;
  int s, c;
  while (chunks.next(s, c) && !d.stopped()) {
    if (!d.table_ring.consumer_wait(d.args, table)) {
      d.stop();
      break;
    }
    const ExpandTable& tab = d.sh.tables[table.stage];
    const int first = tab.first, rows = tab.rows;
    if (rows > 0) {
      dev::ld_acquire_sys(&d.chunk_signal(d.a.rank, s, c)->epoch);  // set: this thread's acquire of the rows
      dev::fence_proxy_async();                                      // read by bulk loads below
    }
    for (int k = 0; k < d.batches.items(first, first + rows) && !d.stopped(); ++k, produced.advance(d.stages)) {
      const RowBatches::Item it = d.batches.item(first, first + rows, k);
      if (!d.expand_fifo.ring.producer_acquire(d.args, produced)) {
        d.stop();
        break;
      }
      d.expand_fifo.load(produced, d.recv_row(d.a.rank, s, it.first) + it.offset, it.rows * it.bytes);
    }
    table.advance(kTableSlots);  // the store warp releases the table
  }
  d.expand_fifo.drain(d.args, PipeState{}, produced);
}

__device__ void expand_store(const Dispatch& d) {
  auto* out = reinterpret_cast<uint8_t*>(d.a.out);
  const int in_flight = min(kStoreGroupsInFlight, d.stages - 1);
  ExpandChunks chunks(d);
  PipeState table, consumed, released;
  int s, c;
  while (chunks.next(s, c) && !d.stopped()) {
    if (!d.table_ring.consumer_wait(d.args, table)) {
      d.stop();
      break;
    }
    const ExpandTable& tab = d.sh.tables[table.stage];
    const int first = tab.first, rows = tab.rows;
    bool ok = true;
    for (int k = 0; k < d.batches.items(first, first + rows); ++k, consumed.advance(d.stages)) {
      const RowBatches::Item it = d.batches.item(first, first + rows, k);
      if (d.stopped() || !d.expand_fifo.ring.consumer_wait(d.args, consumed)) {
        ok = false;
        break;
      }
      for (int r = 0; r < it.rows; ++r) {
        const int i = it.first + r - first;
        for (int q = 0; q < d.kd; ++q) {
          const int p = tab.pos[i][q];
          if (p >= 0)
            dev::bulk_s2g(out + static_cast<int64_t>(p) * d.row_bytes + it.offset,
                          d.expand_fifo.slot(consumed) + r * it.bytes, it.bytes);
        }
      }
      dev::bulk_commit();
      bulk_wait_read_except(in_flight);  // release the oldest stages only
      for (; released.count + in_flight <= consumed.count; released.advance(d.stages))
        d.expand_fifo.ring.consumer_release(released);
    }
    if (!ok) {
      d.stop();
      break;
    }
    d.table_ring.consumer_release(table);  // positions were read when the stores were issued
    table.advance(kTableSlots);
  }
  dev::bulk_wait_all();
  for (; released.count < consumed.count; released.advance(d.stages)) d.expand_fifo.ring.consumer_release(released);
}

// Warps 8-15: zero rows after each expert's real rows, and after the whole layout.
__device__ void zero_padding(const Dispatch& d, int pw, int npw, int lane) {
  const int64_t R = d.a.num_out_rows;
  auto* out = reinterpret_cast<uint8_t*>(d.a.out);
  auto* out_scales = reinterpret_cast<float*>(d.a.out_scales);
  auto* out_probs = reinterpret_cast<float*>(d.a.out_probs);
  const int64_t* info = d.info;
  const int64_t gw = static_cast<int64_t>(d.b) * npw + pw, nw = static_cast<int64_t>(d.nb) * npw;
  const int64_t needed = info[d.il.needed];
  for (int j = 0; j <= d.L; ++j) {
    int64_t lo, hi;
    if (j < d.L) {
      const int64_t start = info[d.il.expert_start + j];
      lo = start + info[d.il.expert_rows + j];
      hi = j + 1 < d.L ? info[d.il.expert_start + j + 1] : needed;
    } else {
      lo = needed;
      hi = R;
    }
    hi = min(hi, R);
    for (int64_t r = lo + gw; r < hi; r += nw) {
      int4* dst = reinterpret_cast<int4*>(out + r * d.row_bytes);
      for (uint32_t v = lane; v < d.row_bytes / 16; v += 32) dst[v] = make_int4(0, 0, 0, 0);
      for (int i = lane; i < d.scale_cols; i += 32) out_scales[r * d.scale_cols + i] = 0.f;
      if (lane == 0) out_probs[r] = 0.f;
    }
  }
}

__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(const __grid_constant__ LaunchArgs args) {
  const BlockPlace place = block_place(args);
  const RankArgs& a = place.rank;
  if (a.absent) return;
  const Geometry& geo = args.geo;
  const RankView view = rank_view(geo, a);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const uint32_t row_bytes = static_cast<uint32_t>(args.row_elems) * elem_bytes(args.dtype);
  DispatchShared& sh = dev::block_shared<DispatchShared>();
  const uint64_t epoch = view.state()->dispatch_epoch;
  const int stages = args.fifo_stages;
  uint8_t* smem = dev::dynamic_smem<uint8_t>();
  const Dispatch d{
      args, a, geo, geo.reg, geo.info, view, place.block, place.blocks, geo.world_size, geo.local_experts,
      geo.max_tokens, a.num_tokens, a.topk, args.kd, static_cast<int>(geo.reg.meta_entries), args.scale_cols,
      args.chunk_tokens, stages, row_bytes,
      RowBatches{row_bytes, static_cast<uint32_t>(args.stage_bytes), args.rows_per_stage,
                 static_cast<int>((row_bytes + args.stage_bytes - 1) / args.stage_bytes)},
      reinterpret_cast<const int64_t*>(a.info), epoch, sh,
      StageRing{{sh.send_full, sh.send_empty, stages, a.rank, epoch}, smem, args.stage_bytes},
      StageRing{{sh.expand_full, sh.expand_empty, stages, a.rank, epoch},
                smem + static_cast<size_t>(stages) * args.stage_bytes, args.stage_bytes},
      Ring{sh.meta_full, sh.meta_empty, kMetaSlots, a.rank, epoch},
      Ring{sh.table_full, sh.table_empty, kTableSlots, a.rank, epoch}};

  if (tid == 0) {
    d.send_fifo.ring.init(1, 1);
    d.expand_fifo.ring.init(1, 1);
    d.meta_ring.init(kMetaWarps, 1);
    d.table_ring.init(kMetaWarps, 1);
    dev::mbar_fence_init();
    sh.abort = aborted(args) ? 1 : 0;
  }
  __syncthreads();
  if (sh.abort) return;

  if (warp == kSendLoadWarp) {
    if (lane == 0) send_load(d);
  } else if (warp == kSendStoreWarp) {
    send_store(d, lane);
  } else if (warp < kSendMetaWarp + kMetaWarps) {
    send_meta(d, tid - kSendMetaWarp * 32, lane);
  } else if (warp == kExpandLoadWarp) {
    if (lane == 0) expand_load(d);
  } else if (warp == kExpandStoreWarp) {
    if (lane == 0) expand_store(d);
  } else if (warp < kExpandMetaWarp + kMetaWarps) {
    expand_meta(d, tid - kExpandMetaWarp * 32, lane);
  } else {
    zero_padding(d, warp - kPaddingWarp, (blockDim.x >> 5) - kPaddingWarp, lane);
  }
  __syncthreads();
  if (sh.abort) return;

  if (tid == 0 && !aborted(args)) {
    LocalState* st = view.state();
    __threadfence();
    const uint32_t prev = atomicAdd(&st->blocks_done_dispatch, 1u);
    if (prev == static_cast<uint32_t>(d.nb - 1)) {
      st->blocks_done_dispatch = 0;
      __threadfence_system();
      dev::st_release_sys(view.flag(a.rank, geo.reg.done_dispatch, 0), epoch);
    }
  }
}

}  // namespace

size_t dispatch_smem_bytes(const LaunchArgs& args) {
  return 2 * static_cast<size_t>(args.fifo_stages) * static_cast<size_t>(args.stage_bytes);  // send + expand FIFOs
}

LaunchStatus launch_dispatch(const LaunchArgs& args, uint64_t stream) {
  return dev::launch_cooperative(dispatch_kernel, args.num_ranks * args.blocks_per_rank, kThreads,
                                 dispatch_smem_bytes(args), stream, args);
}

int dispatch_max_blocks_per_sm(size_t smem) { return dev::max_active_blocks(dispatch_kernel, kThreads, smem); }

}  // namespace hybrid_ep
