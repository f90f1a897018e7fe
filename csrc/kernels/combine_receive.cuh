// Combine kernel (a template over the inter-node transport): persistent, one block per SM,
// warp-specialised. Every block reduces its share of the rows this rank received (as their
// expert host) and, at the same time, sums its share of this rank's own tokens (as their
// source), chunk by chunk as partials arrive.
//
// Each side is a load thread feeding a ring of shared-memory stages that hold one row
// segment each (one route's expert output, or one partial), and a reducer group of
// kGroupWarps warps that adds the segments of a row in fp32 registers: thread i of the group
// holds columns of quads i, i + kGroupThreads, ... of the whole segment, so a row is cut into
// segments only beyond kMaxSegCols columns. The group's warps take every stage in turn
// without agreeing with each other: each waits for the stage itself and releases it with one
// arrival (the empty barrier counts kGroupWarps).
//
// Expert host (every (source, chunk) this rank received in the dispatch, strided over the
// blocks as in dispatch; the chunk spans come from the handle):
//   warp 0      reads a chunk's output rows and weights into a table (a lane per row), then
//               bulk-loads each route of each row into the input ring, one stage per route
//               and segment (a row without routes left, clipped by num_out_tokens, gets one
//               stage without bytes: its partial is zero);
//   warps 1-4   add a row's routes (times the routing weight with apply_probs) and write the
//               partial, rounded once to the wire dtype, into the output ring;
//   warp 5      bulk-stores each partial into the source's buffer (every output stage but the
//               one being written may be in flight) and signals each chunk to its source once
//               the chunk's stores completed.
// Source (this rank's chunks of kChunkTokens tokens, strided over the blocks):
//   warp 6      waits until every rank signalled the chunk, reads the chunk's partial list
//               into a table (a lane per token), then bulk-loads each token's partials (one
//               per expert host of this node, one per other node the token reached);
//   warps 7-10  add a token's partials and write its output row, rounded once, from registers.
// With several nodes (kernels/hierarchy.cuh) an expert host stores the partial of a source on
// another node into that source's rail peer on this node instead. The rail peer's source side
// forwards them: between its own chunks (SourceSideChunks: an own chunk after the forwarded
// chunks one block step ahead of it), warp 6 waits for every rank of this node's partials of
// a chunk it forwarded in the dispatch and bulk-loads each token's (one per rank of this node
// that hosts its routes), warps 7-10 sum them (fp32) and write the node partial, rounded once
// to the wire dtype, into the staging area, and
//   warp 11     (several nodes) puts each forwarded chunk's node partials back to the source on
//               the other node, one put with signal per chunk, once the reducers wrote them;
// the source's warp 6 then also waits for each other node's chunk and loads its node partials.
// Partials travel in the wire dtype (default the dtype of expert_out, fp32 on request), so
// a bf16 combine rounds once per hop. The last block to finish publishes done_combine, which
// lets peers write the next combine's partials.
//
// Rings between ranks (kernels/peer_ring.cuh: their invariant, and why no wait closes a
// cycle). Partials go through bounded rings whatever max_tokens and the routing: an expert
// host's partials of chunk c of source s to its slot of the ring it fills for s (row q: the q-th
// of the chunk's receive slots at the host), in s's partial_rows (partial) or, for a source on
// another node, in s's rail peer's forward_rows (forward); the forwarder's node partials of
// chunk c to its slot of its node_part_rows_out, and by the put to the same slot of the source's
// node_part_rows_in (node_part). The reader of a ring (a source's or forwarder's load warp)
// releases a chunk once its bulk loads landed in shared memory; the host store warp acquires a
// slot before the chunk's stores, and the forwarder's load warp before the chunk whose node
// partials its reducers will write. Every chunk takes its slot, rows or none. The host store warp signals
// every chunk it stored before it waits for a credit, the source load warp sends the credits of
// the chunks it loaded (after they landed, which needs no peer) before it waits for a peer, and
// the reducers and the put warp wait only inside the block.
#include "common/state.cuh"
#include "kernels/chunks.cuh"
#include "kernels/hierarchy.cuh"
#include "kernels/index_math.cuh"
#include "kernels/launch.h"
#include "kernels/peer_ring.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/segments.cuh"
#include "kernels/skeleton.cuh"

namespace hybrid_ep {
namespace combine_receive_impl {  // kernels/combine_receive.cu and kernels_nvshmem.cu instantiate it

// Warp roles (kCombineThreads = 384: 12 warps); the put warp works with several nodes only.
enum class CombineRole { kHostLoad, kHostReduce, kHostStore, kSourceLoad, kSourceReduce, kForwardPut };
constexpr int kCombineThreads = 12 * 32;
__host__ __device__ constexpr RoleTable<CombineRole, 6> combine_warps() {
  return {{{CombineRole::kHostLoad, 0, 1},
           {CombineRole::kHostReduce, 1, kGroupWarps},
           {CombineRole::kHostStore, 1 + kGroupWarps, 1},
           {CombineRole::kSourceLoad, 2 + kGroupWarps, 1},
           {CombineRole::kSourceReduce, 3 + kGroupWarps, kGroupWarps},
           {CombineRole::kForwardPut, 3 + 2 * kGroupWarps, 1}}};
}
static_assert(combine_warps().tiles(kCombineThreads / 32), "the combine's roles tile its block");
constexpr int kMaxPendingChunks = 8;  // chunks held for their releases (stored, not signalled; loaded, not credited)
constexpr int kPutStages = 4;         // forwarded chunks written by the reducers, not yet put

// ---- stages and tables ----------------------------------------------------------------------

// One output stage of the expert host: a partial, to be stored for `source` as row
// chunk_row % kChunkTokens of chunk chunk_row / kChunkTokens.
struct OutItem {
  int32_t source, chunk_row, col0, cols;
};

// A received chunk's routes, read by the host load warp (a lane per row).
struct HostTable {
  int32_t routes[kChunkTokens];
  int32_t pos[kChunkTokens][kMaxTopK];
  float weight[kChunkTokens][kMaxTopK];
};

// A source chunk's partials, read by the source load warp (a lane per token): the expert host
// on this node (local index g) or the node (kNodePart + n) of each, and its slot there.
constexpr int kNodePart = kMaxDomainRanks;
static_assert(kNodePart + kMaxNodes <= 256, "SrcTable::from is uint8_t");
struct SrcTable {
  int32_t parts[kChunkTokens];
  uint8_t from[kChunkTokens][kMaxTopK];
  int32_t slot[kChunkTokens][kMaxTopK];
};

// A source-ring item of a forwarded chunk (several nodes): PartItem.row holds the chunk, and
// PartItem.slot (0 for the source's own tokens) this tag: the source node, the row's ordinal
// in the chunk and the chunk's rows (a chunk without rows passes as one stage without bytes).
struct FwdTag {
  static constexpr int32_t kTag = 1 << 30;
  int32_t node, q, rows;

  __device__ static bool is(int32_t slot) { return (slot & kTag) != 0; }
  __device__ int32_t pack() const { return kTag | (node << 16) | (q << 8) | rows; }
  __device__ static FwdTag of(int32_t slot) { return {(slot >> 16) & 0x3fff, (slot >> 8) & 0xff, slot & 0xff}; }
  // The chunk's node partials are all written once this row's segment ending at column `end` is.
  __device__ bool completes(int end, int C) const { return rows == 0 || (q == rows - 1 && end == C); }
};
static_assert(kChunkTokens < 256, "a forwarded row's ordinal and its chunk's rows fit FwdTag's bytes");

// A forwarded chunk whose node partials the reducers wrote: for the put warp.
struct FwdPut {
  int32_t node, chunk, rows;
};

struct CombineShared {
  uint64_t host_full[kMaxStages], host_empty[kMaxStages];
  uint64_t out_full[kMaxStages], out_empty[kMaxStages];
  uint64_t src_full[kMaxStages], src_empty[kMaxStages];
  uint64_t put_full[kPutStages], put_empty[kPutStages];
  PartItem host_items[kMaxStages];
  OutItem out_items[kMaxStages];
  PartItem src_items[kMaxStages];
  FwdPut put_items[kPutStages];
  HostTable host_table;
  SrcTable src_table;
  BlockControl ctl;
};
static_assert(sizeof(CombineShared) <= kStaticSmemReserve,
              "the combine kernel's static shared memory outgrew the launch plans' reserve");

// What every role of a block needs to know about the call.
template <typename Rdma>
struct Combine : KernelCall {
  const RegLayout& reg;
  const InfoLayout& il;
  int W, Tmax, T, kd, C, seg_cols, segments, chunk;
  PeerRing partial, forward, node_part;  // the rings of partial sums it writes and reads (kernels/peer_ring.cuh)
  uint32_t in_bytes, wire_bytes;         // element sizes
  const int64_t* info;
  CombineShared& sh;
  uint8_t* host_in;   // [host_stages][seg_cols] expert output segments
  uint8_t* host_out;  // [host_out_stages][seg_cols] partials in the wire dtype
  uint8_t* src_in;    // [src_stages][seg_cols] partials in the wire dtype
  Hierarchy<Rdma> h;

  // smem: the three rings' stages (combine_receive_stage_bytes), in the order above.
  __device__ Combine(const KernelCall& k, CombineShared& shared, uint8_t* smem, uint32_t elem_size, uint32_t wire_size)
      : KernelCall(k), reg(k.geo.reg), il(k.geo.info), W(k.geo.world_size), Tmax(k.geo.max_tokens), T(k.a.num_tokens),
        kd(k.args.kd), C(k.args.row_elems), seg_cols(k.args.seg_cols), segments((C + seg_cols - 1) / seg_cols),
        chunk(k.args.chunk_tokens), partial(peer_rings::partial(k.geo)), forward(peer_rings::forward(k.geo)),
        node_part(peer_rings::node_part(k.geo)), in_bytes(elem_size), wire_bytes(wire_size),
        info(reinterpret_cast<const int64_t*>(k.a.info)), sh(shared), host_in(smem),
        host_out(host_in + static_cast<size_t>(k.args.host_stages) * k.args.host_stage_bytes),
        src_in(host_out + static_cast<size_t>(k.args.host_out_stages) * k.args.src_stage_bytes),
        h(make_hierarchy<Rdma>(k.geo, k.a)) {}

  __device__ int send_chunks() const { return (T + chunk - 1) / chunk; }
  __device__ int source_chunks(int s) const { return chunks_of(info[il.src_tokens + s], chunk); }
  __device__ void span(int s, int c, int& first, int& rows) const {
    const auto* spans = reinterpret_cast<const int32_t*>(a.recv_spans);
    const int64_t i = (static_cast<int64_t>(s) * static_cast<int64_t>(reg.max_chunks) + c) * 2;
    first = spans[i];
    rows = spans[i + 1];
  }
  // A source-side chunk's place after the forwarded chunks (SourceSideChunks), below the slots
  // of the rings its waits point at (kernels/peer_ring.cuh).
  __device__ int own_lag() const { return min(nb, min(partial.slots, node_part.slots) - 1); }
  // The ring this rank, as expert host, fills for source s: its partial ring at s, or for a
  // source on another node its forward ring at s's rail peer on this node.
  __device__ const PeerRing& host_ring(int s) const { return h.topo.same_node(s, a.rank) ? partial : forward; }
  // The partial of source s at row q (the q-th of the chunk's rows at the host) of chunk c of
  // expert host `host`'s ring (a host of s's node), in s's buffer, and the slot's signal word.
  __device__ uint8_t* partial_row(int s, int host, int c, int q) const {
    return view.base(s) + reg.partial_rows + partial.row(h.topo.local(host), c, q) * C * wire_bytes;
  }
  __device__ uint64_t* partial_signal(int s, int host, int c) const {
    return reinterpret_cast<uint64_t*>(view.base(s) + reg.partial_signal) + partial.word(h.topo.local(host), c);
  }
  // Writer w's credit word (in w's buffer) of the slot of chunk c of its ring for source s.
  __device__ uint64_t* credit(int w, int s, int c) const {
    if (h.topo.same_node(s, w))
      return reinterpret_cast<uint64_t*>(view.base(w) + reg.partial_credit) + partial.word(h.topo.local(s), c);
    return reinterpret_cast<uint64_t*>(view.base(w) + reg.forward_credit) + forward.word(s, c);
  }
  // Partials for a source on another node go to its rail peer f on this node: the ring of writer
  // (source node, local index of the writer) in f's forward_rows area.
  __device__ int64_t fwd_writer(int s, int writer) const {
    return static_cast<int64_t>(h.topo.node(s)) * h.topo.G + h.topo.local(writer);
  }
  __device__ uint8_t* forward_row(int f, int64_t writer_index, int c, int q) const {
    return view.base(f) + reg.forward_rows + forward.row(writer_index, c, q) * C * wire_bytes;
  }
  __device__ uint64_t* forward_signal(int f, int64_t writer_index, int c) const {
    return reinterpret_cast<uint64_t*>(view.base(f) + reg.forward_signal) + forward.word(writer_index, c);
  }
  // Where this rank, as expert host, stores its partial of row q of chunk c of source s, and
  // signals chunk c.
  __device__ uint8_t* host_target(int s, int c, int q) const {
    if (h.topo.same_node(s, a.rank)) return partial_row(s, a.rank, c, q);
    return forward_row(h.topo.rail_peer(s, h.node), fwd_writer(s, a.rank), c, q);
  }
  __device__ uint64_t* host_signal(int s, int c) const {
    if (h.topo.same_node(s, a.rank)) return partial_signal(s, a.rank, c);
    return forward_signal(h.topo.rail_peer(s, h.node), fwd_writer(s, a.rank), c);
  }
  // The RDMA region's node-partial rings: the word of chunk c of node n's ring (signal, credit),
  // and the byte offset of its row q.
  __device__ uint64_t node_word_off(uint64_t area, int n, int c) const {
    return area + static_cast<uint64_t>(node_part.word(n, c)) * 8;
  }
  __device__ uint64_t node_row_off(uint64_t area, int n, int c, int q) const {
    return area + static_cast<uint64_t>(node_part.row(n, c, q)) * C * wire_bytes;
  }
  // The signal word of chunk c of node n's ring, in this rank's RDMA region.
  __device__ const uint64_t* node_part_signal(int n, int c) const {
    return h.flag(node_word_off(h.R.node_part_signal, n, c), 0);
  }
  __device__ uint8_t* host_in_stage(int stage) const {
    return host_in + static_cast<size_t>(stage) * seg_cols * in_bytes;
  }
  __device__ uint8_t* host_out_stage(int stage) const {
    return host_out + static_cast<size_t>(stage) * seg_cols * wire_bytes;
  }
  __device__ uint8_t* src_stage(int stage) const { return src_in + static_cast<size_t>(stage) * seg_cols * wire_bytes; }
};

template <typename Rdma>
using HostChunks = ReceivedChunks<Combine<Rdma>>;  // the (source, chunk) pairs this block reduces

// ---- expert host ----------------------------------------------------------------------------

// Warp 0: lane i reads row i of the chunk's output rows and weights into the table, then
// lane 0 loads every route of every row, segment by segment.
template <typename Rdma>
__device__ void host_load(const Combine<Rdma>& d, const Ring& ring, int lane) {
  const auto* row_pos = reinterpret_cast<const int32_t*>(d.a.row_pos);
  const auto* probs = reinterpret_cast<const float*>(d.a.probs);
  const auto* expert_out = reinterpret_cast<const uint8_t*>(d.a.expert_out);
  HostTable& tab = d.sh.host_table;
  HostChunks<Rdma> chunks(d);
  PipeState produced;
  int s, c;
  bool ok = true;
  while (ok && chunks.next(s, c)) {
    int first, rows;
    d.span(s, c, first, rows);
    if (lane < rows) {
      const int64_t row = static_cast<int64_t>(s) * d.Tmax + first + lane;
      int n = 0;
      for (int q = 0; q < d.kd; ++q) {
        const int p = dev::ld(&row_pos[row * d.kd + q]);
        if (p >= 0) tab.pos[lane][n++] = p;
      }
      dev::chain();  // the weights' addresses are the positions just read
      for (int i = 0; i < n; ++i) tab.weight[lane][i] = d.args.apply_probs ? dev::ld(&probs[tab.pos[lane][i]]) : 1.f;
      tab.routes[lane] = n;
    }
    __syncwarp();
    for (int r = 0; r < rows && ok && lane == 0; ++r) {
      const int n = tab.routes[r];
      const int32_t to = c * kChunkTokens + r;  // row r of chunk c (OutItem::chunk_row)
      for (int g = 0; g < d.segments && ok; ++g) {
        const int col0 = g * d.seg_cols;
        const PartItem head{s, to, col0, min(d.seg_cols, d.C - col0), 0, 1.f};
        ok = load_parts(d, ring, d.sh.host_items, d.host_in, d.in_bytes, produced, head, n, [&](int i, float& weight) {
          weight = tab.weight[r][i];
          return expert_out + static_cast<int64_t>(tab.pos[r][i]) * d.C * d.in_bytes;
        });
      }
    }
    ok = warp_uniform(ok);  // the table is rewritten for the next chunk only after lane 0 read it
  }
  if (lane == 0) finish_loads(d, ring, d.sh.host_items, d.host_in, d.in_bytes, produced, ok);
}

// Warps 1-4: each row's routes summed in registers, the partial written to the output ring.
template <typename Rdma, typename In, typename Wire>
__device__ void host_reduce(const Combine<Rdma>& d, const Ring& in, const Ring& out, int gt, int lane) {
  PipeState produced;
  reduce_parts<In>(d, in, d.sh.host_items, d.host_in, gt, lane, [&](const SegmentAcc<In>& acc, const PartItem& it) {
    if (!warp_producer_acquire(d, out, produced, lane)) return false;
    acc.template store<Wire>(d.host_out_stage(produced.stage), it.cols, gt);
    if (gt == 0) d.sh.out_items[produced.stage] = OutItem{it.row, it.slot, it.col0, it.cols};
    dev::fence_proxy_async();  // this thread's output, read next by a bulk store
    __syncwarp();
    if (lane == 0) out.producer_commit(produced);  // one of kGroupWarps arrivals
    produced.advance(out.stages);
    return true;
  });
}

// Warp 5 (lane 0): each partial stored to the source, chunks signalled once their stores
// landed (DeferredReleases: checked at each commit, so a chunk is not drained before the next
// is stored).
template <typename Rdma>
__device__ void host_store(const Combine<Rdma>& d, const Ring& out) {
  StoreQueue queue(out, store_groups_in_flight(d.args, out.stages));
  HostChunks<Rdma> chunks(d);
  PipeState consumed;
  struct Stored {
    int source, chunk;
  };
  DeferredReleases<Stored, kMaxPendingChunks> stored;  // chunks stored, not yet signalled
  // The chunks whose stores landed but for the newest `in_flight` groups: their signals.
  auto signal_landed = [&](int in_flight) {
    stored.flush(StoresLanded(queue, in_flight, true), [&](const Stored& k) {
      PeerRing::publish(d.host_signal(k.source, k.chunk), d.call, k.chunk);
      return true;
    });
  };

  int s, c;
  while (chunks.next(s, c) && !d.stopped()) {
    int first, rows;
    d.span(s, c, first, rows);
    // every chunk, rows or none, acquires its slot from the slot's reader (s, or its rail peer
    // on this node), first signalling the chunks already stored: the reader may need them
    const int reader = d.h.topo.same_node(s, d.a.rank) ? s : d.h.topo.rail_peer(s, d.h.node);
    if (!d.host_ring(s).writer_acquire(d.args, d.credit(d.a.rank, s, c), d.call, c, d.a.rank, reader, [&] {
          signal_landed(0);
          return true;
        })) {
      d.stop();
      break;
    }
    bool ok = true;
    for (int k = 0; k < rows * d.segments; ++k, consumed.advance(out.stages)) {
      if (d.stopped() || !out.consumer_wait(d.args, consumed)) {
        ok = false;
        break;
      }
      const OutItem& it = d.sh.out_items[consumed.stage];
      dev::bulk_s2g(d.host_target(it.source, it.chunk_row / kChunkTokens, it.chunk_row % kChunkTokens) +
                        static_cast<int64_t>(it.col0) * d.wire_bytes,
                    d.host_out_stage(consumed.stage), it.cols * d.wire_bytes);
      queue.commit();
      signal_landed(1);  // chunks complete with an older group; this one stays in flight
      queue.release_read();
    }
    if (!ok) {
      d.stop();
      break;
    }
    if (stored.full()) signal_landed(0);
    stored.note(Stored{s, c}, queue.groups());
  }
  if (!d.stopped()) signal_landed(0);
  queue.finish();
}

// ---- source ---------------------------------------------------------------------------------

// Lane 0 of the source load warp: the chunks whose partials it has loaded, each credited to its
// writers once every bulk load of it has landed in shared memory (DeferredReleases, marked by
// the items produced after the chunk's last load; LoadsLanded), then the writers may reuse the
// chunk's ring slots. The node-partial credits go over the transport (releases: quieted when
// the lane leaves its role).
template <typename Rdma>
struct SourceCredits {
  struct Chunk {
    int node;   // this rank's node for an own chunk, else the node of the source it forwarded
    int chunk;  //
  };
  DeferredReleases<Chunk, kMaxPendingChunks> pending;
  uint32_t landed = 0;  // the items whose loads are known to have landed (LoadsLanded)
  RingReleases<Rdma> releases;

  __device__ explicit SourceCredits(const Rdma& rdma) : releases(rdma) {}
};

// The credits of a chunk whose loads landed: an own chunk's to every expert host of this node,
// a forwarded chunk's to every rank of this node that wrote partials of it (into its credit
// word for the forwarded chunk's source).
template <typename Rdma>
__device__ bool send_credits(const Combine<Rdma>& d, SourceCredits<Rdma>& cr,
                             const typename SourceCredits<Rdma>::Chunk& k) {
  const Hierarchy<Rdma>& h = d.h;
  const int first = h.first_local();
  const int source = k.node == h.node ? d.a.rank : h.rail_peer(k.node);
  const PeerRing& ring = d.host_ring(source);
  for (int g = 0; g < h.topo.G; ++g) ring.reader_release(d.credit(first + g, source, k.chunk), d.call, k.chunk);
  if (k.node != h.node) return true;
  // and an own chunk's node partials to the rail peer of every other node, whose staged slot is
  // free too (the put that delivered them has read them)
  for (int n = 0; n < h.topo.N; ++n)
    if (n != h.node)
      cr.releases.reader_release(h.rail_peer(n), d.node_word_off(h.R.node_part_credit, h.node, k.chunk), d.call,
                                 k.chunk);
  return true;
}

// Sends the credits of the pending chunks, oldest first, whose loads landed: those already seen
// to, or with `block`, after waiting (bounded) for each. False on a stop.
template <typename Rdma>
__device__ bool flush_credits(const Combine<Rdma>& d, const Ring& ring, SourceCredits<Rdma>& cr,
                              const PipeState& produced, bool block) {
  return cr.pending.flush(LoadsLanded(d.args, ring, produced, cr.landed, block),
                          [&](const typename SourceCredits<Rdma>::Chunk& k) { return send_credits(d, cr, k); });
}

// After the chunk's loads: its credits wait for them to land (a full list is flushed first).
template <typename Rdma>
__device__ bool note_credits(const Combine<Rdma>& d, const Ring& ring, SourceCredits<Rdma>& cr,
                             const PipeState& produced, int node, int c) {
  if (cr.pending.full() && !flush_credits(d, ring, cr, produced, true)) return false;
  cr.pending.note(typename SourceCredits<Rdma>::Chunk{node, c}, produced.count);
  return true;
}

// Lane 0 of the source load warp, before it waits for a peer: the credits of the chunks it
// loaded are sent first where `arrived` (the wait would pass at once) is false, after their
// loads landed (no peer is needed for that), since the peer may be waiting for them.
template <typename Rdma, typename Arrived>
__device__ bool credits_before_waiting(const Combine<Rdma>& d, const Ring& ring, SourceCredits<Rdma>& cr,
                                       const PipeState& produced, Arrived arrived) {
  if (!flush_credits(d, ring, cr, produced, false)) return false;
  return cr.pending.empty() || arrived() || flush_credits(d, ring, cr, produced, true);
}

// Warp 6, an own chunk c: lane 0 waits until every expert host of this node and every other
// node delivered the chunk's partials; lane i lists token i's partials in the table; lane 0
// loads them, token by token and segment by segment, and notes the chunk's credits. Warp-uniform;
// false on a stop.
template <typename Rdma>
__device__ bool src_load_own(const Combine<Rdma>& d, const Ring& ring, PipeState& produced,
                             SourceCredits<Rdma>& credits, int c, int lane) {
  const auto* send_ord = reinterpret_cast<const int32_t*>(d.a.send_ord);
  const Hierarchy<Rdma>& h = d.h;
  const int G = h.topo.G, N = h.topo.N, first = h.first_local();
  SrcTable& tab = d.sh.src_table;
  bool ok = true;
  if (lane == 0) {
    ok = !d.stopped() && credits_before_waiting(d, ring, credits, produced, [&] {
      for (int g = 0; g < G; ++g)
        if (!PeerRing::is_published(d.partial_signal(d.a.rank, first + g, c), d.call, c)) return false;
      for (int n = 0; n < N; ++n)
        if (n != h.node && !PeerRing::is_published(d.node_part_signal(n, c), d.call, c)) return false;
      return true;
    });
    for (int g = 0; g < G && ok; ++g)  // every expert host of this node stored its partials of chunk c
      ok = d.partial.reader_wait(d.args, d.partial_signal(d.a.rank, first + g, c), d.call, c, d.a.rank, first + g);
    for (int n = 0; n < N && ok; ++n)  // and every other node's rail peer put its node partials
      if (n != h.node)
        ok = d.node_part.reader_wait_delivered(h.rdma, d.args, d.node_part_signal(n, c), d.call, c, d.a.rank,
                                               h.rail_peer(n));
  }
  if (!warp_uniform(ok)) return false;
  const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk), t = t0 + lane;
  // Token t's partials: one per expert host of this node (at row q of the chunk's slot of that
  // host's ring, q its ordinal among the chunk's tokens for that host: the chunk's receive slots
  // there are consecutive), one per other node it reached (at row q of the chunk's slot of that
  // node's ring, q its ordinal among the chunk's tokens for that node). The table keeps q.
  int parts = 0;
  const bool mine = t < t1;
  const int32_t* slots = send_ord + static_cast<int64_t>(mine ? t : t0) * d.W;
  for (int g = 0; g < G; ++g) {
    const bool goes = mine && slots[first + g] >= 0;
    const unsigned mask = __ballot_sync(0xffffffffu, goes);
    if (goes) {
      tab.from[lane][parts] = static_cast<uint8_t>(g);
      tab.slot[lane][parts++] = __popc(mask & ((1u << lane) - 1u));
    }
  }
  for (int n = 0; n < N; ++n) {
    if (n == h.node) continue;
    bool goes = false;
    for (int g = 0; g < G && t < t1; ++g) goes |= slots[n * G + g] >= 0;
    const unsigned mask = __ballot_sync(0xffffffffu, goes);
    if (goes) {
      tab.from[lane][parts] = static_cast<uint8_t>(kNodePart + n);
      tab.slot[lane][parts++] = __popc(mask & ((1u << lane) - 1u));
    }
  }
  if (t < t1) tab.parts[lane] = parts;
  __syncwarp();
  if (lane == 0) dev::fence_proxy_async();  // the partials are read by bulk loads below
  for (int i = 0; i < t1 - t0 && ok && lane == 0; ++i) {
    for (int seg = 0; seg < d.segments && ok; ++seg) {
      ok = flush_credits(d, ring, credits, produced, false);  // those of earlier chunks that landed
      const int col0 = seg * d.seg_cols;
      const PartItem head{t0 + i, 0, col0, min(d.seg_cols, d.C - col0), 0, 1.f};
      ok = load_parts(d, ring, d.sh.src_items, d.src_in, d.wire_bytes, produced, head, tab.parts[i],
                      [&](int j, float&) -> const uint8_t* {
                        const int from = tab.from[i][j], q = tab.slot[i][j];
                        if (from < kNodePart) return d.partial_row(d.a.rank, first + from, c, q);
                        return h.rdma.local(d.node_row_off(h.R.node_part_rows_in, from - kNodePart, c, q));
                      });
    }
  }
  if (lane == 0 && ok) ok = note_credits(d, ring, credits, produced, h.node, c);
  return warp_uniform(ok);  // the table is rewritten for the next chunk only after lane 0 read it
}

// Warp 6, chunk c it forwarded from node n in the dispatch (several nodes; the handle keeps
// fwd_rows, fwd_slots): lane 0 waits until the source freed the chunk's node-partial slot (from
// the ring's second turn on) and every rank of this node stored its partials of it; lane q lists
// row q's partials (one per rank of this node that hosts the token's routes, in rank order: the
// order of the sum); lane 0 loads them, row by row and segment by segment, tagged (FwdTag) for
// the reducers, and notes the chunk's credits. A chunk without rows is one stage without bytes,
// so that its signal is put too. Warp-uniform; false on a stop.
template <typename Rdma>
__device__ bool src_load_forwarded(const Combine<Rdma>& d, const Ring& ring, PipeState& produced,
                                   SourceCredits<Rdma>& credits, int n, int c, int lane) {
  const Hierarchy<Rdma>& h = d.h;
  const int G = h.topo.G, first = h.first_local();
  SrcTable& tab = d.sh.src_table;
  // the chunk's node-partial slot: the source must have read its previous chunk (its credit),
  // before the reducers write this chunk's node partials there
  const uint64_t* credit = h.flag(d.node_word_off(h.R.node_part_credit, n, c), 0);
  bool ok = true;
  if (lane == 0) {
    ok = !d.stopped() && credits_before_waiting(d, ring, credits, produced, [&] {
      if (!d.node_part.is_free(credit, d.call, c)) return false;
      for (int g = 0; g < G; ++g)
        if (!PeerRing::is_published(d.forward_signal(d.a.rank, static_cast<int64_t>(n) * G + g, c), d.call, c))
          return false;
      return true;
    });
    if (ok) ok = d.node_part.wait_free(d.args, credit, d.call, c, d.a.rank, h.rail_peer(n));
    for (int g = 0; g < G && ok; ++g)
      ok = d.forward.reader_wait(d.args, d.forward_signal(d.a.rank, static_cast<int64_t>(n) * G + g, c), d.call, c,
                                 d.a.rank, first + g);
  }
  if (!warp_uniform(ok)) return false;
  const int rows = reinterpret_cast<const int32_t*>(d.a.fwd_rows)[static_cast<int64_t>(n) * h.max_chunks + c];
  const int64_t slot0 = static_cast<int64_t>(c) * d.chunk;
  // Row q's partials: one per rank g of this node that hosts the token's routes, at row p of the
  // chunk's slot of g's ring, p the row's ordinal among the chunk's rows for g (their receive
  // slots at g are consecutive).
  int parts = 0;
  const int32_t* slots =
      reinterpret_cast<const int32_t*>(d.a.fwd_slots) + (static_cast<int64_t>(n) * h.staged + slot0 + lane) * G;
  for (int g = 0; g < G; ++g) {
    const bool goes = lane < rows && slots[g] >= 0;
    const unsigned mask = __ballot_sync(0xffffffffu, goes);
    if (goes) {
      tab.from[lane][parts] = static_cast<uint8_t>(g);
      tab.slot[lane][parts++] = __popc(mask & ((1u << lane) - 1u));
    }
  }
  if (lane < rows) tab.parts[lane] = parts;
  __syncwarp();
  if (lane == 0) dev::fence_proxy_async();  // the partials are read by bulk loads below
  for (int q = 0; q < max(rows, 1) && ok && lane == 0; ++q) {
    for (int seg = 0; seg < (rows > 0 ? d.segments : 1) && ok; ++seg) {
      ok = flush_credits(d, ring, credits, produced, false);  // those of earlier chunks that landed
      const int col0 = seg * d.seg_cols, cols = rows > 0 ? min(d.seg_cols, d.C - col0) : 0;
      const PartItem head{c, FwdTag{n, q, rows}.pack(), col0, cols, 0, 1.f};
      ok = load_parts(d, ring, d.sh.src_items, d.src_in, d.wire_bytes, produced, head, rows > 0 ? tab.parts[q] : 0,
                      [&](int j, float&) -> const uint8_t* {
                        return d.forward_row(d.a.rank, static_cast<int64_t>(n) * G + tab.from[q][j], c, tab.slot[q][j]);
                      });
    }
  }
  if (lane == 0 && ok) ok = note_credits(d, ring, credits, produced, n, c);
  return warp_uniform(ok);  // the table is rewritten for the next chunk only after lane 0 read it
}

// Warp 6: the block's source-side chunks in SourceSideChunks' order, then the end of work.
template <typename Rdma>
__device__ void src_load(const Combine<Rdma>& d, const Ring& ring, int lane) {
  SourceSideChunks<Combine<Rdma>> work(d);
  PipeState produced;
  SourceCredits<Rdma> credits(d.h.rdma);  // lane 0's
  bool ok = true, forwarded;
  int n, c;
  while (ok && work.next(forwarded, n, c))
    ok = forwarded ? src_load_forwarded(d, ring, produced, credits, n, c, lane)
                   : src_load_own(d, ring, produced, credits, c, lane);
  if (lane != 0) return;
  finish_loads(d, ring, d.sh.src_items, d.src_in, d.wire_bytes, produced, ok, credits.landed);
  // every load landed (finish_loads waited for them): the last chunks' credits (the node-partial
  // ones quieted as `credits` goes)
  if (ok)
    credits.pending.release_all(
        [&](const typename SourceCredits<Rdma>::Chunk& k) { return send_credits(d, credits, k); });
}

// Warps 7-10: each row's partials summed in registers. An own token's output row is written
// from them, rounded once; a forwarded row's node partial is written, rounded once to the wire
// dtype, into the staging area, and after its chunk's last row each warp fences its stores and
// hands the chunk to the put warp (one of the put ring's kGroupWarps arrivals).
template <typename Rdma, typename Out, typename Wire>
__device__ void src_reduce(const Combine<Rdma>& d, const Ring& ring, const Ring& put, int gt, int lane) {
  auto* y = reinterpret_cast<uint8_t*>(d.a.y);
  const Hierarchy<Rdma>& h = d.h;
  PipeState produced;
  reduce_parts<Wire>(d, ring, d.sh.src_items, d.src_in, gt, lane, [&](const SegmentAcc<Wire>& acc, const PartItem& it) {
    if (!FwdTag::is(it.slot)) {
      acc.template store<Out>(y + (static_cast<int64_t>(it.row) * d.C + it.col0) * sizeof(Out), it.cols, gt);
      return true;
    }
    const FwdTag f = FwdTag::of(it.slot);
    if (f.rows > 0)
      acc.template store<Wire>(h.rdma.local(d.node_row_off(h.R.node_part_rows_out, f.node, it.row, f.q)) +
                                   static_cast<int64_t>(it.col0) * d.wire_bytes,
                               it.cols, gt);
    if (!f.completes(it.col0 + it.cols, d.C)) return true;
    __threadfence();  // this thread's node partials, before the transport reads them
    if (!warp_producer_acquire(d, put, produced, lane)) return false;
    if (gt == 0) d.sh.put_items[produced.stage] = FwdPut{f.node, it.row, f.rows};
    __syncwarp();
    if (lane == 0) put.producer_commit(produced);
    produced.advance(put.stages);
    return true;
  });
}

// Warp 11 with several nodes: each chunk this block forwards (as many as forwarded_chunks'
// units it takes), once the reducers wrote its node partials into the chunk's slot of the
// node-partial ring (row q: the q-th of the chunk's tokens for this node), put to the same slot
// of the source on the other node with the chunk's signal (also for no rows).
template <typename Rdma>
__device__ void forward_put(const Combine<Rdma>& d, const Ring& put, int lane) {
  const Hierarchy<Rdma>& h = d.h;
  const uint32_t row_b = static_cast<uint32_t>(d.C) * d.wire_bytes;
  const int64_t units = forwarded_chunks(d);
  PipeState p;
  for (int64_t u = d.b; u < units; u += d.nb, p.advance(put.stages)) {
    if (!warp_consumer_wait(d, put, p, lane)) break;
    const FwdPut it = d.sh.put_items[p.stage];
    __syncwarp();
    if (lane == 0) put.consumer_release(p);
    h.rdma.put_signal(lane, h.rail_peer(it.node), d.node_row_off(h.R.node_part_rows_in, h.node, it.chunk, 0),
                      h.rdma.local(d.node_row_off(h.R.node_part_rows_out, it.node, it.chunk, 0)),
                      static_cast<uint64_t>(it.rows) * row_b, d.node_word_off(h.R.node_part_signal, h.node, it.chunk),
                      PeerRing::tag(d.call, it.chunk));
  }
  if (lane == 0) h.rdma.quiet();
}

template <typename Rdma, typename Elem, typename Wire>
__global__ void __launch_bounds__(kCombineThreads, 1) combine_receive_kernel(const __grid_constant__ LaunchArgs args) {
  const BlockPlace place = block_place(args);
  if (place.rank.absent || call_refused(args.geo, place.rank)) return;
  CombineShared& sh = dev::block_shared<CombineShared>();
  const Combine<Rdma> d(kernel_call(args, place, kCombineCall, sh.ctl), sh, dev::dynamic_smem<uint8_t>(),
                        static_cast<uint32_t>(sizeof(Elem)), static_cast<uint32_t>(sizeof(Wire)));
  const RankArgs& a = d.a;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool multi = d.h.multi();
  const Ring host_in = d.ring(sh.host_full, sh.host_empty, args.host_stages, kSiteHostInputs);
  const Ring host_partials = d.ring(sh.out_full, sh.out_empty, args.host_out_stages, kSiteHostPartials);
  const Ring src = d.ring(sh.src_full, sh.src_empty, args.src_stages, kSiteSourceParts);
  const Ring put = d.ring(sh.put_full, sh.put_empty, kPutStages, kSiteForwardPuts);

  init_block(d, [&] {
    host_in.init(1, kGroupWarps);
    host_partials.init(kGroupWarps, 1);
    src.init(1, kGroupWarps);
    put.init(kGroupWarps, 1);
  });
  // Flow control: a source (or a rail peer, for sources on other nodes) must have read the
  // partials of the previous combine before this rank writes the next ones into its buffer;
  // so must every source on another node this rank forwards for, before the next node partials.
  if (tid < d.W) {
    bool ok = true;
    if (d.h.topo.same_node(tid, a.rank))
      ok = wait_at_least(args, d.view.flag(tid, d.reg.done_combine, 0), d.call - 1, kPhaseCombineFlow, a.rank, tid,
                         d.call);
    else if (tid == d.h.rail_peer(d.h.topo.node(tid)))
      ok = wait_at_least(args, d.h.flag(d.geo.rdma.done_combine, d.h.topo.node(tid)), d.call - 1, kPhaseRdmaFlow,
                         a.rank, tid, d.call);
    if (!ok) sh.ctl.fail = 1;
  }
  if (!block_ready(d)) return;

  const RoleSpan<CombineRole> role = combine_warps().of(warp);
  switch (role.role) {
    case CombineRole::kHostLoad: host_load(d, host_in, lane); break;
    case CombineRole::kHostReduce:
      host_reduce<Rdma, Elem, Wire>(d, host_in, host_partials, role.thread_index(tid), lane);
      break;
    case CombineRole::kHostStore:
      if (lane == 0) host_store(d, host_partials);
      break;
    case CombineRole::kSourceLoad: src_load(d, src, lane); break;
    case CombineRole::kSourceReduce: src_reduce<Rdma, Elem, Wire>(d, src, put, role.thread_index(tid), lane); break;
    case CombineRole::kForwardPut:
      if (multi) forward_put(d, put, lane);
      break;
  }
  if (!roles_done(d)) return;

  if (tid == 0 && last_block(d, &d.view.state()->blocks_done_combine)) {
    d.view.state()->combine_calls = d.call;
    publish_done(d, d.reg.done_combine);
    // The node partials the rail peers on other nodes put here are read: they may put the next.
    d.h.signal_done_to_rail_peers(d.geo.rdma.done_combine, d.call);
  }
}

// Dynamic shared memory: the three rings' stages.
__host__ __device__ inline size_t combine_receive_stage_bytes(const LaunchArgs& args) {
  return static_cast<size_t>(args.host_stages) * args.host_stage_bytes +
         static_cast<size_t>(args.host_out_stages + args.src_stages) * args.src_stage_bytes;
}

template <typename Rdma, typename Elem, typename Wire>
LaunchStatus launch_combine_receive_typed(const LaunchArgs& args, uint64_t stream) {
  return dev::launch_cooperative(combine_receive_kernel<Rdma, Elem, Wire>, args.num_ranks * args.num_sms,
                                 kCombineThreads, combine_receive_stage_bytes(args), stream, args, "combine_receive");
}

template <typename Rdma>
LaunchStatus launch_combine_receive_with(const LaunchArgs& args, uint64_t stream) {
  if (const char* bad = check_segment_cols(args)) return bad;
  const bool fp32_wire = args.wire_dtype == kFloat32;
  switch (args.dtype) {
    case kFloat32: return launch_combine_receive_typed<Rdma, float, float>(args, stream);
    case kBFloat16:
      return fp32_wire ? launch_combine_receive_typed<Rdma, __nv_bfloat16, float>(args, stream)
                       : launch_combine_receive_typed<Rdma, __nv_bfloat16, __nv_bfloat16>(args, stream);
    case kFloat16:
      return fp32_wire ? launch_combine_receive_typed<Rdma, __half, float>(args, stream)
                       : launch_combine_receive_typed<Rdma, __half, __half>(args, stream);
    default: return "combine: unsupported dtype code";
  }
}

}  // namespace combine_receive_impl

}  // namespace hybrid_ep
