// Dispatch kernel (a template over the inter-node transport): persistent, one block per SM, warp-specialised. Every
// block sends its share of this rank's tokens and, at the same time, expands its share of the rows this rank receives,
// chunk by chunk as they arrive.
//
// Send (this rank's chunks of kChunkTokens tokens, strided over the blocks):
//   warp 0      bulk-loads the chunk's rows into the send FIFO (small rows batched per stage);
//   warps 2-3   write each row's routing entries and fp8 scales into the destinations' receive
//               rings;
//   warp 1      builds the chunk's destination table (one lane per token), bulk-stores each
//               stage once per destination rank through its peer pointer into the rank's
//               receive ring (store_groups groups
//               in flight, the oldest stage released first), and signals the chunk to every
//               destination once its stores completed and its entries are written: checked at
//               the next group's commit, so the next chunk is not drained.
// Expand (every (source, chunk) this rank receives, strided over the blocks):
//   warps 6-7   wait for the chunk's signal, load its routing entries at once, compute each
//               entry's expert-major output row, write probs, scales and row_pos, and publish
//               the chunk's position table;
//   warp 4      bulk-loads the chunk's rows (contiguous in its ring slot) into the expand FIFO;
//   warp 5      bulk-stores each row to its output rows (several groups in flight) and, once
//               the chunk's loads completed, frees its ring slot (a credit to its writer).
// Warps 8-15 write the zero padding rows. The last block to finish publishes done_dispatch,
// which lets peers reuse every ring slot in the next call.
//
// The rings between ranks (kernels/peer_ring.cuh: their invariant, and why no wait closes a
// cycle). The receive ring: chunk c of source s lands in its slot of the destination's ring for
// s (rows, entries, scales), row q of the slot for the chunk's q-th row to that destination; the
// chunk signal says which receive slots [first, first + rows) those rows are (the handle's
// tables stay indexed by receive slot). Its writer is s, or for a source on another node its
// rail peer on the destination's node (the forwarder); its reader's expand store warp releases
// the slot once the chunk's loads completed. The writer acquires the slot from every rank of its
// node (also one the chunk sends no rows: then the destination's credits stay in chunk order):
// the store warp before its stores, the entry warps before their entries (they run up to
// kMetaSlots chunks ahead). A call that sends a rank more than a ring holds costs time (the
// writer waits for the reader), never memory. With several nodes the staging in the RDMA
// region is a ring per node too (RdmaLayout): own chunk c staged for node n takes its slot of
// the source's staging ring for n (rows by the store warp, routing by the RDMA warps) and is put
// into the same slot of the rail peer's ring for the source's node; the forwarder releases it
// once it read the chunk whole (its store warp signalled it: loads completed, routing read). The
// store warp and the RDMA warps acquire it from every other node, whether or not the chunk sends
// it rows (every chunk's routing is put). The send units come in key order (SendUnits: own chunk
// c, then forwarded chunk c - fwd_lag()), and the store warp signals its pending unit before any
// wait that may block (the pending signal would otherwise wait for the next unit's first
// stores), so no reader waits for a chunk whose writer holds its signal while it waits.
//
// With several nodes (kernels/hierarchy.cuh) the send warps serve only this node's ranks:
//   warp 1      also bulk-stores each row of an own chunk into the staging area of every
//               other node that hosts one of its routes (one more store target of the stage
//               already in shared memory) and, once those stores completed, hands the chunk
//               to the RDMA warps through the staged fifo;
//   warps 8-11  (RDMA) write each chunk's routing once per remote node that hosts one of its
//               routes and put the staged rows and the routing to the rail peer there
//               (transport `Rdma`);
//   warps 0-3   also forward the chunks that arrived from the rail peers on other nodes:
//               the same FIFO, destination tables, entries and chunk signals, with rows and
//               routing read from the RDMA region, as if the source had sent them itself;
// and warps 12-15 write the padding. The destinations' expansion does not change.
//
// A wait that gives up raises the launch's abort flag; every role then leaves its loop
// (decisions that lead to a warp collective are taken from lane 0's answer), producers wait
// for the loads they issued and stores for their bulk groups, so no block exits with a copy
// touching its shared memory.
#include "common/state.cuh"
#include "kernels/chunks.cuh"
#include "kernels/hierarchy.cuh"
#include "kernels/index_math.cuh"
#include "kernels/launch.h"
#include "kernels/padding.cuh"
#include "kernels/peer_ring.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/skeleton.cuh"

namespace hybrid_ep {
namespace dispatch_receive_impl {  // kernels/dispatch_receive.cu and kernels_nvshmem.cu instantiate it

constexpr int kMetaSlots = 4;   // send chunks whose entries may be written ahead
constexpr int kTableSlots = 4;  // expand chunks whose position tables are ready ahead
// Own chunks whose staged rows the RDMA warps may take ahead. More than the RDMA warps: a warp
// is at most kRdmaWarps chunks ahead of the slowest, so a parity wait never sees a round
// from two rounds back.
constexpr int kStagedSlots = 8;

// Warp roles (kThreads = 512: 16 warps); with several nodes warps 8-11 are the RDMA warps.
enum class DispatchRole { kSendLoad, kSendStore, kSendMeta, kExpandLoad, kExpandStore, kExpandMeta, kRdma, kPadding };
constexpr int kMetaWarps = 2, kRdmaWarps = 4;
__host__ __device__ constexpr RoleTable<DispatchRole, 8> dispatch_warps(bool multi) {
  const int rdma = multi ? kRdmaWarps : 0;
  return {{{DispatchRole::kSendLoad, 0, 1},
           {DispatchRole::kSendStore, 1, 1},
           {DispatchRole::kSendMeta, 2, kMetaWarps},
           {DispatchRole::kExpandLoad, 4, 1},
           {DispatchRole::kExpandStore, 5, 1},
           {DispatchRole::kExpandMeta, 6, kMetaWarps},
           {DispatchRole::kRdma, 8, rdma},
           {DispatchRole::kPadding, 8 + rdma, 8 - rdma}}};
}
static_assert(dispatch_warps(false).tiles(kThreads / 32) && dispatch_warps(true).tiles(kThreads / 32),
              "the dispatch's roles tile its block");
static_assert(kStagedSlots > kRdmaWarps, "an RDMA warp may run kRdmaWarps chunks ahead of another");
// A send table's destination at or above this is node (value - kStagedTarget)'s staging area.
constexpr int kStagedTarget = 128;
static_assert(kMaxDomainRanks <= kStagedTarget && kStagedTarget + kMaxNodes <= 256,
              "destinations are uint8_t: a rank's local index on this node, or kStagedTarget + a node");

__device__ __forceinline__ MetaEntry load_entry(const MetaEntry* p) {
  const int4 v = dev::ld_volatile_v4(p);
  return MetaEntry{v.x, v.y, __int_as_float(v.z), v.w};
}

__device__ __forceinline__ void store_entry(MetaEntry* p, int j, int ordinal, float prob) {
  *reinterpret_cast<int4*>(p) = make_int4(j, ordinal, __float_as_int(prob), 0);
}

// A send chunk's destinations, built once by warp 1's lanes (one token each): the (rank's local
// index on this node, slot) of each of its rows (with several nodes also (kStagedTarget + node, staged slot)
// of each other node it reaches: a token reaches at most K ranks, so at most K targets),
// and per destination the chunk's slots [first, first + rows).
struct ChunkDestinations {
  int32_t ndest[kChunkTokens];
  uint8_t dest_rank[kChunkTokens][kMaxTopK];
  int32_t dest_slot[kChunkTokens][kMaxTopK];
  int32_t span_first[2][kMaxDomainRanks];  // two chunks: the one being sent, the one awaiting its signal
  int32_t span_rows[2][kMaxDomainRanks];   // (indexed by the destination's local index on this node)
};

// An expand chunk's output rows, built by warps 6-7 for warps 4-5.
struct ExpandTable {
  int32_t rows;                         // the chunk's rows: rows [0, rows) of its slot in the receive ring
  int32_t pos[kChunkTokens][kMaxTopK];  // output row of each entry of each row, -1 if none
};

struct DispatchShared {
  uint64_t send_full[kMaxStages], send_empty[kMaxStages];
  uint64_t expand_full[kMaxStages], expand_empty[kMaxStages];
  uint64_t meta_full[kMetaSlots], meta_empty[kMetaSlots];
  uint64_t table_full[kTableSlots], table_empty[kTableSlots];
  uint64_t staged_full[kStagedSlots], staged_empty[kStagedSlots];  // several nodes: warp 1 -> warps 8-11
  ChunkDestinations send;
  ExpandTable tables[kTableSlots];
  BlockControl ctl;
};
static_assert(sizeof(DispatchShared) <= kStaticSmemReserve,
              "the dispatch kernel's static shared memory outgrew the launch plans' reserve");

// One unit of the send warps: a chunk of this rank's tokens, or a chunk of a source on
// another node that arrived by RDMA and is forwarded to the ranks of this node.
struct SendUnit {
  int source;  // the rank whose receive slots the rows take (this rank for its own chunks)
  int node;    // the source's node for a forwarded chunk, -1 for an own chunk
  int chunk;
  int u0, u1;  // rows: tokens [u0, u1) of x, or staged rows [0, rows) of the forwarded chunk
};

// What every role of a block needs to know about the call.
template <typename Rdma>
struct Dispatch : KernelCall {
  const RegLayout& reg;
  const InfoLayout& il;
  int W, G, L, Tmax, T, K, kd, meta_entries, scale_cols, chunk, stages;
  PeerRing recv;  // the receive rings it writes and reads (the staging rings: h.staging)
  uint32_t row_bytes;
  RowBatches batches;
  const int64_t* info;
  DispatchShared& sh;
  StageRing send_fifo, expand_fifo;
  Ring meta_ring, table_ring, staged_fifo;
  Hierarchy<Rdma> h;

  // smem: the two FIFOs' stages, the send FIFO's first.
  __device__ Dispatch(const KernelCall& k, DispatchShared& shared, uint8_t* smem)
      : KernelCall(k), reg(k.geo.reg), il(k.geo.info), W(k.geo.world_size), G(k.geo.ranks_per_node),
        L(k.geo.local_experts), Tmax(k.geo.max_tokens), T(k.a.num_tokens), K(k.a.topk), kd(k.args.kd),
        meta_entries(static_cast<int>(k.geo.reg.meta_entries)), scale_cols(k.args.scale_cols),
        chunk(k.args.chunk_tokens), stages(k.args.fifo_stages), recv(peer_rings::recv(k.geo)),
        row_bytes(static_cast<uint32_t>(k.args.row_elems) * elem_bytes(k.args.dtype)),
        batches(RowBatches::of(row_bytes, k.args)), info(reinterpret_cast<const int64_t*>(k.a.info)), sh(shared),
        send_fifo{k.ring(shared.send_full, shared.send_empty, stages, kSiteSendFifo), smem, k.args.stage_bytes},
        expand_fifo{k.ring(shared.expand_full, shared.expand_empty, stages, kSiteExpandFifo),
                    smem + static_cast<size_t>(stages) * k.args.stage_bytes, k.args.stage_bytes},
        meta_ring(k.ring(shared.meta_full, shared.meta_empty, kMetaSlots, kSiteSendEntries)),
        table_ring(k.ring(shared.table_full, shared.table_empty, kTableSlots, kSiteExpandTables)),
        staged_fifo(k.ring(shared.staged_full, shared.staged_empty, kStagedSlots, kSiteStagedRows)),
        h(make_hierarchy<Rdma>(k.geo, k.a)) {}

  // Row q of chunk c of `source` in rank r's receive ring (q counts the chunk's rows for r).
  // Rows are packed at the call's row size, so a batch of a chunk's rows is one bulk copy.
  __device__ int64_t ring_row(int source, int c, int q) const { return recv.row(source, c, q); }
  __device__ uint8_t* recv_row(int r, int source, int c, int q) const {
    return view.base(r) + reg.recv_rows + ring_row(source, c, q) * row_bytes;
  }
  __device__ MetaEntry* recv_entries(int r, int source, int c, int q) const {
    return reinterpret_cast<MetaEntry*>(view.base(r) + reg.recv_meta) + ring_row(source, c, q) * meta_entries;
  }
  __device__ float* recv_scales(int r, int source, int c, int q) const {
    return reinterpret_cast<float*>(view.base(r) + reg.recv_scales + ring_row(source, c, q) * reg.scale_stride);
  }
  // The credit of rank g of this node for the chunk slot of chunk c of the source on node sn,
  // in the buffer of the rank that writes that ring (w: the source, or its rail peer here).
  __device__ uint64_t* recv_credit(int w, int sn, int g, int c) const {
    return view.flag(w, reg.recv_credit, recv.word(sn * G + g, c));
  }
  // The rank that writes this rank's ring for `source` (and signals its chunks here): the source,
  // or for a source on another node its rail peer on this node, which forwards its chunks.
  __device__ int ring_writer(int source) const {
    return h.topo.same_node(source, a.rank) ? source : h.first_local() + h.topo.local(source);
  }
  // The node of a unit's source (this rank's for an own chunk).
  __device__ int unit_node(const SendUnit& su) const { return su.node < 0 ? h.node : su.node; }
  // The ring slots a unit writes: chunk su.chunk's slot in the receive ring of each rank g of
  // this node (item g) and, with `staged`, for an own chunk with several nodes, its slot in
  // the staging ring for each other node n (item G + n). Item i's credit word, in this rank's
  // memory.
  __device__ int slot_items(const SendUnit& su, bool with_staged) const {
    return G + (with_staged && su.node < 0 && h.multi() ? h.topo.N : 0);
  }
  __device__ bool slot_item(const SendUnit& su, int i) const { return i < G || i - G != h.node; }
  __device__ const uint64_t* slot_credit(const SendUnit& su, int i) const {
    return i < G ? recv_credit(a.rank, unit_node(su), i, su.chunk) : h.flag(h.staged_credit_off(i - G, su.chunk), 0);
  }
  __device__ const PeerRing& slot_ring(int i) const { return i < G ? recv : h.staging; }
  // Whether the unit's slots are free (slot_items), without waiting: each lane polls its items
  // once. Warp-collective, the same answer in every lane.
  __device__ bool slots_ready(const SendUnit& su, int lane, bool with_staged) const {
    bool ready = true;
    for (int i = lane; i < slot_items(su, with_staged); i += 32)
      ready &= !slot_item(su, i) || slot_ring(i).is_free(slot_credit(su, i), call, su.chunk);
    return __ballot_sync(0xffffffffu, !ready) == 0u;
  }
  // Until every reader of the unit's slots freed them (PeerRing::wait_free: the rank of this
  // node, or the rail peer on the other node). Each lane waits for its items; warp-collective,
  // true in every lane when all did. The store warp's lane 0 fences before its bulk stores.
  __device__ bool slots_free(const SendUnit& su, int lane, bool with_staged) const {
    bool ok = !stopped();
    for (int i = lane; i < slot_items(su, with_staged) && ok; i += 32) {
      if (!slot_item(su, i)) continue;
      const int reader = i < G ? h.first_local() + i : h.rail_peer(i - G);
      ok = slot_ring(i).wait_free(args, slot_credit(su, i), call, su.chunk, a.rank, reader);
    }
    __syncwarp();  // every lane's acquire, before any lane's writes into the slots
    return __ballot_sync(0xffffffffu, !ok) == 0u;
  }
  // Chunk c of `source`, as signalled to rank d.
  __device__ ChunkSignal* recv_signal(int d, int source, int c) const {
    return reinterpret_cast<ChunkSignal*>(view.base(d) + reg.recv_signal) +
           static_cast<int64_t>(source) * static_cast<int64_t>(reg.max_chunks) + c;
  }
  // Staged row q of own chunk c for node n, in this rank's RDMA region.
  __device__ uint8_t* staged_row(int n, int c, int q) const {
    return h.rdma.local(h.staged_off(h.R.staged_rows_out, n, c, q, row_bytes));
  }
  // The lanes (tokens t0 + lane < t1) of an own chunk that go to node n: a token's staged slot
  // there is its ordinal among them. Every lane calls it.
  __device__ unsigned staged_mask(int t0, int t1, int n, int lane) const {
    const auto* send_ord = reinterpret_cast<const int32_t*>(a.send_ord);
    const int t = t0 + lane;
    bool goes = false;
    if (t < t1)
      for (int g = 0; g < h.topo.G; ++g) goes |= send_ord[static_cast<int64_t>(t) * W + n * h.topo.G + g] >= 0;
    return __ballot_sync(0xffffffffu, goes);
  }
  __device__ int send_chunks() const { return (T + chunk - 1) / chunk; }
  // How many chunk indices a forwarded chunk comes after the own chunk of its index (SendUnits;
  // below the slots of every ring it writes: kernels/peer_ring.cuh).
  __device__ int fwd_lag() const { return min(recv.slots, h.staging.slots) / 2; }
  // Own chunk c of this rank.
  __device__ SendUnit own_unit(int c) const { return SendUnit{a.rank, -1, c, c * chunk, min(T, c * chunk + chunk)}; }
  // The FIFO items of a unit: its stages, or one stage without bytes for a forwarded chunk
  // without rows, so the store warp frees the chunk's staging only after the load warp read it.
  __device__ int unit_items(const SendUnit& su) const { return max(1, batches.items(su.u0, su.u1)); }
  // A forwarded chunk's routing, in this rank's RDMA region.
  __device__ uint8_t* fwd_meta(const SendUnit& su) const {
    return h.rdma.local(h.staged_meta_off(h.R.staged_meta_in, su.node, su.chunk));
  }
  // A forwarded chunk's signal word (the staging ring's), in this rank's RDMA region.
  __device__ const uint64_t* arrival(const SendUnit& su) const {
    return h.flag(h.chunk_flag_off(h.R.staged_signal, su.node, su.chunk), 0);
  }
  // Lane 0: whether a forwarded chunk arrived, without waiting. Own chunks are there.
  __device__ bool arrived(const SendUnit& su) const {
    return su.node < 0 || PeerRing::is_published(arrival(su), call, su.chunk);
  }
  // Lane 0: wait until a forwarded chunk arrived, then read its row count. Own chunks are ready.
  __device__ bool arrive(SendUnit& su) const {
    if (su.node < 0) return true;
    if (!h.staging.reader_wait_delivered(h.rdma, args, arrival(su), call, su.chunk, a.rank, su.source)) return false;
    su.u1 = *reinterpret_cast<const volatile int32_t*>(fwd_meta(su));
    return true;
  }
  // The same, for a whole warp: lane 0 waits, every lane gets the rows.
  __device__ bool arrive_warp(SendUnit& su, int lane) const {
    bool ok = true;
    if (lane == 0) ok = !stopped() && arrive(su);
    su.u1 = __shfl_sync(0xffffffffu, su.u1, 0);
    return warp_uniform(ok);
  }
  // Row i of a unit (u0 <= i < u1).
  __device__ const uint8_t* unit_row(const SendUnit& su, int i) const {
    if (su.node < 0) return reinterpret_cast<const uint8_t*>(a.x) + static_cast<int64_t>(i) * row_bytes;
    return h.rdma.local(h.staged_off(h.R.staged_rows_in, su.node, su.chunk, i, row_bytes));
  }
  __device__ int source_chunks(int s) const { return chunks_of(info[il.src_tokens + s], chunk); }
};

template <typename Rdma>
using ExpandChunks = ReceivedChunks<Dispatch<Rdma>>;  // the (source, chunk) pairs this block expands

// The units a block's send warps take, in order: its own chunks (b, b + nb, ...) and, with
// several nodes, its forwarded chunks (every chunk of the rail peer on each other node,
// numbered chunk by chunk: chunk 0 of each node in node order, then chunk 1, ...; units b,
// b + nb, ...), merged by a key: an own chunk c has key c, a forwarded chunk c key
// c + fwd_lag() and comes after the own chunk of that key. The lag (half a ring) lets a
// source's chunk c arrive while the forwarder sends its own chunks up to c + lag, and is below
// the slots of its rings, which keeps every wait pointing at a lower key (kernels/peer_ring.cuh:
// why that keeps the rings free of deadlock). Every send role walks it alike, and the RDMA warps
// take the block's own chunks in the same order.
template <typename Rdma>
struct SendUnits {
  const Dispatch<Rdma>& d;
  int key = 0;            // the key looked at
  int node = -1;          // the node looked at next at that key (-1: the own chunk first)
  int64_t forwarded = 0;  // forwarded chunks numbered so far
  int last;               // the last key with a unit

  __device__ explicit SendUnits(const Dispatch<Rdma>& call) : d(call), last(call.send_chunks() - 1) {
    for (int n = 0; d.h.multi() && n < d.h.topo.N; ++n)
      if (n != d.h.node) last = max(last, d.source_chunks(d.h.rail_peer(n)) - 1 + d.fwd_lag());
  }

  __device__ bool next(SendUnit& su) {
    for (; key <= last; ++key, node = -1) {
      if (node < 0) {
        node = 0;
        if (key < d.send_chunks() && key % d.nb == d.b) {
          su = d.own_unit(key);
          return true;
        }
      }
      const int c = key - d.fwd_lag();  // the forwarded chunks of this key
      while (d.h.multi() && c >= 0 && node < d.h.topo.N) {
        const int m = node++;
        if (m == d.h.node || c >= d.source_chunks(d.h.rail_peer(m))) continue;
        if (block_takes(forwarded++, d.nb, d.b)) {
          su = SendUnit{d.h.rail_peer(m), m, c, 0, 0};
          return true;
        }
      }
    }
    return false;
  }
};

// ---- send -----------------------------------------------------------------------------------

template <typename Rdma>
__device__ void send_load(const Dispatch<Rdma>& d) {
  PipeState produced;
  SendUnits<Rdma> units(d);
  SendUnit su;
  while (!d.stopped() && units.next(su)) {
    if (!d.arrive(su)) {
      d.stop();
      break;
    }
    if (su.node >= 0) dev::fence_proxy_async();  // rows that arrived by RDMA, read by bulk loads
    for (int k = 0; k < d.unit_items(su) && !d.stopped(); ++k, produced.advance(d.stages)) {
      if (!d.send_fifo.ring.producer_acquire(d.args, produced)) {
        d.stop();
        break;
      }
      if (su.u1 == su.u0) {  // a forwarded chunk without rows: the stage says its routing was read
        d.send_fifo.ring.producer_commit(produced);
        continue;
      }
      const RowBatches::Item it = d.batches.item(su.u0, su.u1, k);
      d.send_fifo.load(produced, d.unit_row(su, it.first) + it.offset, it.rows * it.bytes);
    }
  }
  d.send_fifo.drain(d.args, PipeState{}, produced);
}

// One row's routing entries for rank dst (its routes to dst's experts, then unused entries up
// to kd) and its fp8 scales, into dst's receive ring: row `row` of chunk c of the source.
template <typename Rdma, typename Expert>
__device__ void write_entries(const Dispatch<Rdma>& d, int dst, int source, int c, int row, const Expert* expert,
                              const int32_t* ordinal, const float* weight, int routes, const float* scales) {
  MetaEntry* meta = d.recv_entries(dst, source, c, row);
  int q = 0;
  for (int k = 0; k < routes; ++k) {
    const int64_t e = expert[k];
    if (e < 0 || expert_rank(e, d.L) != dst) continue;
    store_entry(meta + q, local_expert(e, d.L), ordinal[k], weight[k]);
    ++q;
  }
  for (; q < d.kd; ++q) store_entry(meta + q, -1, 0, 0.f);
  if (d.scale_cols > 0) {
    float* out = d.recv_scales(dst, source, c, row);
    for (int i = 0; i < d.scale_cols; ++i) out[i] = scales[i];
  }
}

// Warps 2-3: each unit's routing entries (and fp8 scales) into the receive rings of this
// node's destinations: from the routing tensors for own chunks, from the staged records for
// forwarded ones. Warp i takes destinations i, i + 2, ..., a lane per row of the unit: a row's
// place in the chunk's slot is its ordinal among the unit's rows for that destination. Each
// warp waits for the slot itself (the entries are written up to kMetaSlots units ahead of the
// store warp).
template <typename Rdma>
__device__ void send_meta(const Dispatch<Rdma>& d, int tw, int lane) {
  const auto* send_ord = reinterpret_cast<const int32_t*>(d.a.send_ord);
  const auto* idx = reinterpret_cast<const int64_t*>(d.a.topk_idx);
  const auto* weights = reinterpret_cast<const float*>(d.a.topk_weights);
  const auto* ords = reinterpret_cast<const int32_t*>(d.a.entry_ord);
  const auto* x_scales = reinterpret_cast<const float*>(d.a.x_scales);
  const int W = d.W, K = d.K, G = d.G, first = d.h.first_local();
  const unsigned below = (1u << lane) - 1u;
  PipeState slot;
  SendUnits<Rdma> units(d);
  SendUnit su;
  for (; units.next(su); slot.advance(kMetaSlots)) {
    bool ok = true;
    if (lane == 0) ok = !d.stopped() && d.meta_ring.producer_acquire(d.args, slot);
    if (!warp_uniform(ok) || !d.arrive_warp(su, lane) || !d.slots_free(su, lane, false)) {
      d.stop();
      break;
    }
    d.meta_ring.observe_empty(slot, lane);  // every lane writes after the consumer released the slot
    const int rows = su.u1 - su.u0, t = su.u0 + lane;
    uint8_t* meta = su.node < 0 ? nullptr : d.fwd_meta(su);
    for (int g = tw / 32; g < G; g += kMetaWarps) {
      int s = -1;
      TokenMeta* tm = nullptr;
      if (lane < rows) {
        if (su.node < 0) {
          s = send_ord[static_cast<int64_t>(t) * W + first + g];
        } else {
          tm = d.h.token_meta(meta, lane, d.h.R.token_meta_bytes);
          s = d.h.token_slots(tm)[g];
        }
      }
      const unsigned goes = __ballot_sync(0xffffffffu, s >= 0);
      if (s < 0) continue;
      const int row = __popc(goes & below);
      if (su.node < 0)
        write_entries(d, first + g, d.a.rank, su.chunk, row, idx + static_cast<int64_t>(t) * K,
                      ords + static_cast<int64_t>(t) * K, weights + static_cast<int64_t>(t) * K, K,
                      x_scales + static_cast<int64_t>(t) * d.scale_cols);
      else
        write_entries(d, first + g, su.source, su.chunk, row, tm->expert, tm->ordinal, tm->weight, kMaxTopK,
                      d.h.token_scales(tm));
    }
    __syncwarp();
    if (lane == 0) d.meta_ring.producer_commit(slot);  // one of the two warps' arrivals
  }
}

template <typename Rdma>
__device__ void send_store(const Dispatch<Rdma>& d, int lane) {
  const auto* send_ord = reinterpret_cast<const int32_t*>(d.a.send_ord);
  auto* fwd_slots = reinterpret_cast<int32_t*>(d.a.fwd_slots);
  auto* fwd_rows = reinterpret_cast<int32_t*>(d.a.fwd_rows);
  ChunkDestinations& tab = d.sh.send;
  const int W = d.W, G = d.G, first = d.h.first_local();
  const bool multi = d.h.multi();
  const unsigned below = (1u << lane) - 1u;
  StoreQueue queue(d.send_fifo.ring, store_groups_in_flight(d.args, d.stages));  // lane 0's
  PipeState consumed, meta, staged;                                              // lane 0's
  RingReleases<Rdma> releases(d.h.rdma);  // lane 0's credits of forwarded chunks' staging slots
  struct Stored {
    int chunk, source, span;
    int node;     // a forwarded chunk: its source's node (its staging slot here is read), else -1
    bool staged;  // an own chunk with several nodes: its staged rows go to the RDMA warps
  };
  // The unit stored last, until its stores landed (DeferredReleases): the next unit's first
  // commit flushes it (every unit commits a group), or before that a wait that may block.
  DeferredReleases<Stored, 1> pending;

  // Lane 0: once the pending unit's stores landed (all but the newest `in_flight` groups) and
  // its entries are written, tell every destination of this node where its rows are, and the
  // RDMA warps that the unit's staged rows are there. A forwarded unit was read whole by then
  // (its rows' loads completed, the entry warps read its routing; a chunk without rows had its
  // empty stage): its slot in the staging ring is free, on this rank and, since its put
  // arrived, on the source, which the credit tells.
  auto signal_pending = [&](int in_flight) -> bool {
    StoresLanded stores(queue, in_flight);
    auto landed = [&](uint32_t mark) {
      const Landing l = stores(mark);
      if (l != Landing::kLanded) return l;
      if (!d.meta_ring.consumer_wait(d.args, meta)) return Landing::kStopped;
      d.meta_ring.consumer_release(meta);
      meta.advance(kMetaSlots);
      __threadfence_system();  // the entries other warps wrote (their arrival ordered them before)
      return Landing::kLanded;
    };
    return pending.flush(landed, [&](const Stored& u) {
      for (int g = 0; g < G; ++g) {
        ChunkSignal* sig = d.recv_signal(first + g, u.source, u.chunk);
        const int rows = tab.span_rows[u.span][g];
        sig->first = rows > 0 ? tab.span_first[u.span][g] : 0;
        sig->rows = rows;
        PeerRing::publish(&sig->tag, d.call, u.chunk);
      }
      if (u.node >= 0) releases.reader_release(u.source, d.h.staged_credit_off(d.h.node, u.chunk), d.call, u.chunk);
      if (u.staged) {
        if (!d.staged_fifo.producer_acquire(d.args, staged)) return false;
        d.staged_fifo.producer_commit(staged);
        staged.advance(kStagedSlots);
      }
      return true;
    });
  };

  int local = 0;
  SendUnits<Rdma> units(d);
  SendUnit su;
  for (; units.next(su); ++local) {
    // A wait that may block (the unit's arrival from another node, a free slot in the receive
    // rings) first signals the pending unit: the ranks that would end the wait may need it. A
    // pending own chunk's staged rows go to the RDMA warps before any forwarded unit: the other
    // nodes' forwarders wait for them.
    bool ok = true;
    const bool staged_pending = pending.full() && pending.item[0].staged;  // lane 0's
    if (lane == 0 && su.node >= 0 && (staged_pending || !d.arrived(su))) ok = signal_pending(0);
    if (!warp_uniform(ok) || !d.arrive_warp(su, lane)) {
      d.stop();
      break;
    }
    if (!d.slots_ready(su, lane, true) && lane == 0) ok = signal_pending(0);
    if (!warp_uniform(ok) || !d.slots_free(su, lane, true)) {
      d.stop();
      break;
    }
    // The unit's destination table, once: lane i takes row u0 + i; its place in the chunk's
    // slot of a destination's ring is its ordinal among the unit's rows for that destination.
    const int span = local & 1, rows = su.u1 - su.u0;
    const int32_t* slots = nullptr;
    if (lane < rows) {
      if (su.node < 0) {
        slots = send_ord + static_cast<int64_t>(su.u0 + lane) * W + first;
      } else {
        slots = d.h.token_slots(d.h.token_meta(d.fwd_meta(su), lane, d.h.R.token_meta_bytes));
        // The handle keeps where each forwarded row went: combine sums their partials here.
        int32_t* kept =
            fwd_slots +
            (static_cast<int64_t>(su.node) * d.h.staged + static_cast<int64_t>(su.chunk) * d.chunk + lane) * G;
        for (int g = 0; g < G; ++g) kept[g] = slots[g];
      }
    }
    int n = 0;
    for (int g = 0; g < G; ++g) {
      const int slot = lane < rows ? slots[g] : -1;
      const unsigned goes = __ballot_sync(0xffffffffu, slot >= 0);
      const int first_slot = __shfl_sync(0xffffffffu, slot, goes ? __ffs(goes) - 1 : 0);
      if (slot >= 0) {
        tab.dest_rank[lane][n] = static_cast<uint8_t>(g);
        tab.dest_slot[lane][n] = __popc(goes & below);
        ++n;
      }
      if (lane == 0) {
        tab.span_first[span][g] = first_slot;  // receive slots [first_slot, first_slot + rows) of the source
        tab.span_rows[span][g] = __popc(goes);
      }
    }
    if (lane < rows) tab.ndest[lane] = n;
    // Several nodes: each other node an own token reaches is one more target, its staged slot.
    if (multi && su.node < 0) {
      for (int node = 0; node < d.h.topo.N; ++node) {
        if (node == d.h.node) continue;
        const unsigned mask = d.staged_mask(su.u0, su.u1, node, lane);
        if ((mask >> lane) & 1u) {
          tab.dest_rank[lane][n] = static_cast<uint8_t>(kStagedTarget + node);
          tab.dest_slot[lane][n] = __popc(mask & ((1u << lane) - 1u));
          ++n;
        }
      }
      if (lane < rows) tab.ndest[lane] = n;
    }
    if (su.node >= 0 && lane == 0) fwd_rows[static_cast<int64_t>(su.node) * d.h.max_chunks + su.chunk] = su.u1;
    __syncwarp();
    if (lane == 0) {
      PeerRing::acquired();  // the slots' credits (slots_free), before the bulk stores into them
      for (int k = 0; k < d.unit_items(su) && ok; ++k, consumed.advance(d.stages)) {
        if (d.stopped() || !d.send_fifo.ring.consumer_wait(d.args, consumed)) {
          ok = false;
          break;
        }
        const RowBatches::Item it = rows > 0 ? d.batches.item(su.u0, su.u1, k) : RowBatches::Item{0, 0, 0u, 0u};
        for (int r = 0; r < it.rows; ++r) {
          const int i = it.first + r - su.u0;
          for (int q = 0; q < tab.ndest[i]; ++q) {
            const int dst = tab.dest_rank[i][q], row = tab.dest_slot[i][q];
            uint8_t* to = dst >= kStagedTarget ? d.staged_row(dst - kStagedTarget, su.chunk, row)
                                               : d.recv_row(first + dst, su.source, su.chunk, row);
            dev::bulk_s2g(to + it.offset, d.send_fifo.slot(consumed) + r * it.bytes, it.bytes);
          }
        }
        queue.commit();
        ok = signal_pending(1);  // the pending unit's groups (older than this one) landed
        queue.release_read();
      }
      if (ok) pending.note(Stored{su.chunk, su.source, span, su.node, multi && su.node < 0}, queue.groups());
    }
    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
  }
  if (lane == 0) {
    if (!d.stopped() && !signal_pending(0)) d.stop();
    queue.finish();
    releases.quiet();  // the staging credits, before the rank's done signal to the rail peers
  }
}

// ---- expand ---------------------------------------------------------------------------------

// Warps 6-7: a chunk's entries -> output rows, probs, scales, row_pos and the position table.
template <typename Rdma>
__device__ void expand_meta(const Dispatch<Rdma>& d, int tw, int lane) {
  const int64_t R = d.a.num_out_rows;
  auto* out_scales = reinterpret_cast<float*>(d.a.out_scales);
  auto* out_probs = reinterpret_cast<float*>(d.a.out_probs);
  auto* row_pos = reinterpret_cast<int32_t*>(d.a.row_pos);
  const int64_t* info = d.info;
  ExpandChunks<Rdma> chunks(d);
  PipeState slot;
  int s, c;
  while (chunks.next(s, c)) {
    const ChunkSignal* sig = d.recv_signal(d.a.rank, s, c);
    // This rank signals its own chunks and those it forwards: a wait on its own progress.
    const uint32_t bounds = d.ring_writer(s) == d.a.rank ? 2 : 1;
    bool ok = true;
    if (lane == 0)
      ok = !d.stopped() && d.recv.reader_wait(d.args, &sig->tag, d.call, c, d.a.rank, s, bounds) &&
           d.table_ring.producer_acquire(d.args, slot);
    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
    d.table_ring.observe_empty(slot, lane);  // every lane writes the table after both expand warps read it
    const int first = *reinterpret_cast<const volatile int32_t*>(&sig->first);
    const int rows = *reinterpret_cast<const volatile int32_t*>(&sig->rows);
    ExpandTable& tab = d.sh.tables[slot.stage];
    if (tw == 0) {
      tab.rows = rows;
      // The handle keeps the span: combine reduces the same chunks after later dispatches.
      auto* spans = reinterpret_cast<int32_t*>(d.a.recv_spans);
      const int64_t i = (static_cast<int64_t>(s) * static_cast<int64_t>(d.reg.max_chunks) + c) * 2;
      spans[i] = first;
      spans[i + 1] = rows;
    }
    for (int v = tw; v < rows * d.kd; v += kMetaWarps * 32) {
      const int r = v / d.kd, q = v % d.kd;
      const int64_t row = static_cast<int64_t>(s) * d.Tmax + first + r;  // the handle's tables: by receive slot
      int pos = -1;
      const MetaEntry en = load_entry(d.recv_entries(d.a.rank, s, c, r) + q);
      if (en.local_expert >= 0) {
        const int j = en.local_expert;
        const int64_t p = info[d.il.expert_start + j] + info[d.il.src_prefix + s * d.L + j] + en.ordinal;
        if (p < R) {
          pos = static_cast<int>(p);
          out_probs[p] = en.prob;
          if (d.scale_cols > 0) {
            const volatile float* src = d.recv_scales(d.a.rank, s, c, r);
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

// The expand warps' walk over this block's received chunks, in the order the table warps
// fill the table ring: next() waits for the next chunk's table; null at the end or on a stop.
template <typename Rdma>
struct ExpandTables {
  const Dispatch<Rdma>& d;
  ExpandChunks<Rdma> chunks;
  PipeState table;
  __device__ explicit ExpandTables(const Dispatch<Rdma>& call) : d(call), chunks(call) {}
  __device__ const ExpandTable* next(int& s, int& c) {
    if (!chunks.next(s, c) || d.stopped()) return nullptr;
    if (!d.table_ring.consumer_wait(d.args, table)) {
      d.stop();
      return nullptr;
    }
    return &d.sh.tables[table.stage];
  }
};

template <typename Rdma>
__device__ void expand_load(const Dispatch<Rdma>& d) {
  ExpandTables<Rdma> tables(d);
  PipeState produced;
  int s, c;
  while (const ExpandTable* tab = tables.next(s, c)) {
    const int rows = tab->rows;
    d.table_ring.consumer_release(tables.table);  // one of two releases: the store warp still reads it
    if (rows > 0) {
      PeerRing::reader_acquire(&d.recv_signal(d.a.rank, s, c)->tag);  // set: this thread's acquire of the rows
      dev::fence_proxy_async();                                       // read by bulk loads below
    }
    for (int k = 0; k < d.batches.items(0, rows) && !d.stopped(); ++k, produced.advance(d.stages)) {
      const RowBatches::Item it = d.batches.item(0, rows, k);  // rows of the chunk's slot in the ring
      if (!d.expand_fifo.ring.producer_acquire(d.args, produced)) {
        d.stop();
        break;
      }
      d.expand_fifo.load(produced, d.recv_row(d.a.rank, s, c, it.first) + it.offset, it.rows * it.bytes);
    }
    tables.table.advance(kTableSlots);
  }
  d.expand_fifo.drain(d.args, PipeState{}, produced);
}

// Warp 5: a received chunk's rows from the expand FIFO to their output rows. Once every bulk
// load of the chunk's rows completed (and the table warps read its entries and scales: its
// table came after), the chunk's slot in the receive ring is free: its credit goes to the
// ring's writer, the source, or for a source on another node its rail peer on this node.
template <typename Rdma>
__device__ void expand_store(const Dispatch<Rdma>& d) {
  auto* out = reinterpret_cast<uint8_t*>(d.a.out);
  StoreQueue queue(d.expand_fifo.ring, store_groups_in_flight(d.args, d.stages));
  ExpandTables<Rdma> tables(d);
  const Topology& topo = d.h.topo;
  PipeState consumed;
  int s, c;
  while (const ExpandTable* next = tables.next(s, c)) {
    const ExpandTable& tab = *next;
    const int rows = tab.rows;
    bool ok = true;
    for (int k = 0; k < d.batches.items(0, rows); ++k, consumed.advance(d.stages)) {
      const RowBatches::Item it = d.batches.item(0, rows, k);
      if (d.stopped() || !d.expand_fifo.ring.consumer_wait(d.args, consumed)) {
        ok = false;
        break;
      }
      for (int r = 0; r < it.rows; ++r) {
        const int i = it.first + r;
        for (int q = 0; q < d.kd; ++q) {
          const int p = tab.pos[i][q];
          if (p >= 0)
            dev::bulk_s2g(out + static_cast<int64_t>(p) * d.row_bytes + it.offset,
                          d.expand_fifo.slot(consumed) + r * it.bytes, it.bytes);
        }
      }
      queue.commit();
      queue.release_read();
    }
    if (!ok) {
      d.stop();
      break;
    }
    d.recv.reader_release(d.recv_credit(d.ring_writer(s), topo.node(s), topo.local(d.a.rank), c), d.call, c);
    d.table_ring.consumer_release(tables.table);  // positions were read when the stores were issued
    tables.table.advance(kTableSlots);
  }
  queue.finish();
}

// Warps 8-11 with several nodes: for each of this block's own chunks and each other node
// (also one no route of the chunk reaches: every chunk is signalled), write the routing of the
// chunk's tokens for that node into the chunk's slot of the staging ring in this rank's RDMA
// region and, once warp 1 says the chunk's rows are staged there (the staged fifo: its bulk
// stores completed), put them to the rail peer there, into the same slot of its ring for this
// node: the rows, then the routing with the chunk's signal. Lane i takes token t0 + i. A slot
// is free, at both ends, once the rail peer's credit says it forwarded the slot's previous
// chunk (its put had arrived, so its source bytes were read; kernels/peer_ring.cuh); the first
// turn's slots are free at the call's start (the count kernel waited until each rail peer had
// forwarded the previous call's rows).
template <typename Rdma>
__device__ void rdma_send(const Dispatch<Rdma>& d, int w, int lane) {
  const Hierarchy<Rdma>& h = d.h;
  const auto* send_ord = reinterpret_cast<const int32_t*>(d.a.send_ord);
  const int N = h.topo.N;
  const int own = (d.send_chunks() - d.b + d.nb - 1) / d.nb;  // this block's own chunks
  // the block's abort word read once per warp (warp_uniform): the body's ballots and puts are warp-wide
  for (int p = w; p < own * (N - 1) && !warp_uniform(d.stopped()); p += kRdmaWarps) {
    const int j = p / (N - 1), c = d.b + j * d.nb;  // the block's j-th own chunk
    const int n = p % (N - 1) < h.node ? p % (N - 1) : p % (N - 1) + 1;
    const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk);
    const unsigned mask = d.staged_mask(t0, t1, n, lane);
    // The chunk's slot of the staging ring for node n (here and at the rail peer there) is free
    // once the rail peer forwarded the slot's previous chunk from it.
    bool ok = true;
    if (lane == 0)
      ok = !d.stopped() &&
           h.staging.wait_free(d.args, h.flag(d.h.staged_credit_off(n, c), 0), d.call, c, d.a.rank, h.rail_peer(n));
    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
    h.stage_routing(d.a, d.K, d.scale_cols, n, c, mask, lane, static_cast<int64_t>(t0) + lane, send_ord);
    // The chunk's rows are staged for every node once warp 1 committed it: round j / slots.
    const PipeState st{j % kStagedSlots, static_cast<uint32_t>(j / kStagedSlots) & 1u, static_cast<uint32_t>(j)};
    if (lane == 0) ok = !d.stopped() && d.staged_fifo.consumer_wait(d.args, st);
    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
    d.staged_fifo.observe_full(st, lane);  // every lane's transport copy reads the staged rows
    __threadfence();                       // the routing and the staged bytes, before the transport reads them
    __syncwarp();
    if (lane == 0) d.staged_fifo.consumer_release(st);  // one of the chunk's N - 1 nodes
    h.put_staged(lane, n, c, __popc(mask), d.row_bytes, d.call);
  }
  if (lane == 0) h.rdma.quiet();
}

template <typename Rdma>
__global__ void __launch_bounds__(kThreads, 1) dispatch_receive_kernel(const __grid_constant__ LaunchArgs args) {
  const BlockPlace place = block_place(args);
  if (place.rank.absent || call_refused(args.geo, place.rank)) return;
  DispatchShared& sh = dev::block_shared<DispatchShared>();
  const Dispatch<Rdma> d(kernel_call(args, place, kDispatchCall, sh.ctl), sh, dev::dynamic_smem<uint8_t>());
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool multi = d.h.multi();

  init_block(d, [&] {
    d.send_fifo.ring.init(1, 1);
    d.expand_fifo.ring.init(1, 1);
    d.meta_ring.init(kMetaWarps, 1);
    d.table_ring.init(kMetaWarps, 2);                  // both expand warps read each table
    if (multi) d.staged_fifo.init(1, d.h.topo.N - 1);  // each of the chunk's other nodes releases it
  });
  if (!block_ready(d)) return;

  const RoleSpan<DispatchRole> role = dispatch_warps(multi).of(warp);
  switch (role.role) {
    case DispatchRole::kSendLoad:
      if (lane == 0) send_load(d);
      break;
    case DispatchRole::kSendStore: send_store(d, lane); break;
    case DispatchRole::kSendMeta: send_meta(d, role.thread_index(tid), lane); break;
    case DispatchRole::kExpandLoad:
      if (lane == 0) expand_load(d);
      break;
    case DispatchRole::kExpandStore:
      if (lane == 0) expand_store(d);
      break;
    case DispatchRole::kExpandMeta: expand_meta(d, role.thread_index(tid), lane); break;
    case DispatchRole::kRdma: rdma_send(d, role.warp_index(warp), lane); break;
    case DispatchRole::kPadding: zero_padding(d, role.warp_index(warp), role.warps, lane); break;
  }
  if (!roles_done(d)) return;

  if (tid == 0 && last_block(d, &d.view.state()->blocks_done_dispatch)) {
    publish_done(d, d.geo.reg.done_dispatch);
    // The rows the rail peers on other nodes staged here are forwarded: they may send the next.
    d.h.signal_done_to_rail_peers(d.geo.rdma.done_dispatch, d.call);
  }
}

template <typename Rdma>
LaunchStatus launch_dispatch_receive_with(const LaunchArgs& args, uint64_t stream) {
  return dev::launch_cooperative(dispatch_receive_kernel<Rdma>, args.num_ranks * args.num_sms, kThreads,
                                 2 * static_cast<size_t>(args.fifo_stages) * static_cast<size_t>(args.stage_bytes),
                                 stream, args, "dispatch_receive");
}

}  // namespace dispatch_receive_impl

}  // namespace hybrid_ep
