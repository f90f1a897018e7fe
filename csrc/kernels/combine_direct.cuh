// Combine kernel of the direct path (the ranks of a node address each other's expert outputs),
// a template over the inter-node transport: persistent, one block per SM. Every block sums its
// share of this rank's tokens straight from the expert output rows of each route on its node,
// wherever they live, and writes the tokens' rows: a row moves once per route, with no partial
// sums between the ranks of a node. A rank's work as an expert host is to publish its expert_out
// and wait until every rank of its node has read it.
//
// Two pipelines per block (kernels/segments.cuh), taking units of the block's share in turn
// (UnitPipelines: with several nodes, each kind of unit in turn), each of a load warp and R
// reducer warps (LaunchArgs::reducer_warps, 4 or 8: DirectCombineBlock):
//   warps 0 and R + 1 read a unit's parts into a table, a lane per token (each route's row at
//                     its expert's rank, which the dispatch kept in the handle, and with
//                     apply_probs its routing weight there), then bulk-load every part's
//                     segment into the pipeline's ring;
//   the others        add a token's parts in fp32 registers and write its row, rounded once.
// A stage holds one route's row segment (kCombineStageRoute: a hand-off per route row, the group
// keeping the segment's sum in registers across the stages), or every part of one token's column
// segment (kCombineStageToken, LaunchArgs::combine_stage: the load warp's lanes issue the parts
// under one expected-bytes arrival; the reducers wait once, sum the parts, write the segment and
// release the stage once). The reducers learn a stage is full as LaunchArgs::reducer_wait says
// (kernels/segments.cuh): each warp on its own, or the group through one waiter and a named barrier.
// At the start block 0 publishes this rank's expert_out and probs and every block reads those of
// every rank of its node (bounded waits); at the end the last block of this rank tells every
// rank of its node that its reads ended, and block 0 waits until every one said so (only then
// may expert_out be freed), then publishes done_combine.
//
// With several nodes (kernels/hierarchy.cuh) a block's units are its own chunks and the chunks it
// forwarded in the dispatch (SourceSideChunks: an own chunk after the forwarded chunks up to a
// block step ahead of it):
//   own chunk c       a token's parts are its routes on this node and one node partial per other
//                     node it reaches, at row q of the chunk's slot of that node's ring in this
//                     rank's RDMA region (node_part_rows_in; q its ordinal among the chunk's
//                     tokens for that node), once the rail peer there put the chunk
//                     (kPhaseRdmaPartials);
//                     the reducers add them (node partials in the wire dtype) and, after the
//                     chunk's last segment, give its slots' credits back to those rail peers
//                     (every load of the chunk landed: the reducers waited for each);
//   forwarded chunk c of the rail peer on node n: a token's parts are its routes on this node (the
//                     dispatch kept them, fwd_routes); the reducers write its node partial, rounded
//                     once to the wire dtype, into row q of the chunk's slot of the node-partial
//                     ring for n (node_part_rows_out), and once the chunk's last one is written,
//   warp 2 R + 2      puts the chunk's node partials, with its signal, into the same slot of the
//                     source (one put per chunk, also for no rows).
// The node-partial rings are rings between ranks (kernels/peer_ring.cuh: their invariant, and
// why no wait closes a cycle): before a forwarded chunk takes its slot, the load warp acquires it
// from the source (kPhaseNodePartRing); each block's units come in SourceSideChunks' order, and
// the reducers and the put warp wait only inside the block.
#include "common/state.cuh"
#include "kernels/direct.cuh"
#include "kernels/hierarchy.cuh"
#include "kernels/index_math.cuh"
#include "kernels/launch.h"
#include "kernels/peer_ring.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/segments.cuh"
#include "kernels/skeleton.cuh"

namespace hybrid_ep {
namespace combine_direct_impl {  // kernels/direct.cu and kernels_nvshmem.cu instantiate it

constexpr int kPipelines = kDirectCombinePipelines;
constexpr int kPutStages = 4;  // forwarded chunks written by a pipeline's reducers, not yet put

// Which pipeline takes each of a block's units, in SourceSideChunks' order: own and forwarded
// chunks each in turn between the pipelines. Their costs differ (an own chunk's tokens add their
// routes on this node and a node partial per other node; a forwarded chunk's tokens their routes
// here, rounded to the wire), and taken alternately regardless of kind the order gave one
// pipeline every forwarded chunk on 2 nodes at one block per rank, two of every 3 on 4 nodes:
// the timing model put that pipeline's reducers 1.16x (2 nodes) and 1.46x (4 nodes) the other's
// busy time, the kernel's end. One node: every unit is own, in turn as before. Every role that
// walks the units (the load warps, the put warp) asks in the same order, so they agree.
struct UnitPipelines {
  int turns[2] = {0, 0};  // units of each kind so far: [own, forwarded]
  __device__ int of(bool forwarded) { return turns[forwarded ? 1 : 0]++ % kPipelines; }
};

// Warp roles, per pipeline (its warps p * kPipelineWarps + ...).
enum class DirectCombineRole { kLoad, kReduce };

// A block's warps with R reducer warps per pipeline (LaunchArgs::reducer_warps: each segment's
// columns spread over R warps, kernels/segments.cuh): per pipeline a load warp and the reducers,
// then the put warp. The kernel is instantiated for each R the host may pick.
template <int R>
struct DirectCombineBlock {
  static constexpr int kPipelineWarps = 1 + R;
  static constexpr int kPutWarp = kPipelines * kPipelineWarps;
  static constexpr int kThreads = (kPutWarp + 1) * 32;
  static_assert(kThreads >= kMaxDomainRanks + kMaxNodes, "the setup's threads: a rank of the node, a node each");
  __host__ __device__ static constexpr RoleTable<DirectCombineRole, 2> roles() {
    return {{{DirectCombineRole::kLoad, 0, 1}, {DirectCombineRole::kReduce, 1, R}}};
  }
  static_assert(roles().tiles(kPipelineWarps), "a direct combine pipeline's roles tile its warps");
};

// A part of a token in the wire dtype (a node partial), not the dtype of expert_out.
constexpr int32_t kWirePart = 16;
static_assert((kWirePart & (kFirstPart | kLastPart | kNoBytes | kEndOfWork)) == 0, "a flag of its own");

// PartItem.slot of an own token: the last segment of its chunk's last token (its credits follow).
constexpr int32_t kChunkEnd = 1;
// PartItem.slot of a forwarded chunk's row (PartItem.row holds the chunk): the source node, the
// row's ordinal in the chunk and the chunk's rows (a chunk without rows passes as one stage
// without bytes).
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

// A unit's parts, per token: the expert host of each route (kNodePart + n: node n's partial) and
// its row there (for a node partial its row in the chunk's slot), and its weight.
constexpr int kNodePart = kMaxDomainRanks;
static_assert(kNodePart + kMaxNodes <= 256, "DirectCombineTable::host is uint8_t");
struct DirectCombineTable {
  int32_t parts[kChunkTokens];
  int32_t row[kChunkTokens][kMaxTopK];
  uint8_t host[kChunkTokens][kMaxTopK];
  float weight[kChunkTokens][kMaxTopK];
};

// A forwarded chunk whose node partials a pipeline's reducers wrote: for the put warp.
struct FwdPut {
  int32_t node, chunk, rows;
};

// A token stage's parts (kCombineStageToken), beside its PartItem (the segment: row, slot, col0,
// cols, flags): how many, which are node partials in the wire dtype (bit k), and their weights.
// Part k lies at k * DirectCombine::part_bytes of the stage.
struct TokenParts {
  int32_t n;
  uint32_t wire;
  float weight[kMaxTopK];
};

// The named barrier of pipeline p's reducer group (kReducerWaitNamed; 0 is __syncthreads').
__device__ __forceinline__ uint32_t reducer_barrier(int p) { return 1u + static_cast<uint32_t>(p); }

struct DirectCombineShared {
  uint64_t full[kPipelines][kMaxStages], empty[kPipelines][kMaxStages];
  uint64_t put_full[kPipelines][kPutStages], put_empty[kPipelines][kPutStages];
  PartItem items[kPipelines][kMaxStages];
  TokenParts token_parts[kPipelines][kMaxStages];
  int verdict[kPipelines][2];  // kReducerWaitNamed: the waiter's verdict on a stage, by the item's parity
  FwdPut puts[kPipelines][kPutStages];
  DirectCombineTable tables[kPipelines];
  // each expert host's expert_out and probs (by local index on this node), this process's addresses
  uint64_t rows[kMaxDomainRanks], probs[kMaxDomainRanks];
  BlockControl ctl;
};
static_assert(sizeof(DirectCombineShared) <= kStaticSmemReserve,
              "the combine_direct kernel's static shared memory outgrew the launch plans' reserve");

// The columns of a token stage's segment: K parts of it, each of the widest element, fill at most
// `stage_bytes`; a multiple of a round of the reducer group (a vector per thread) where one fits,
// so a row cut into segments leaves no thread idle but in its last segment (7168 bf16 columns at
// 4 warps, 32 KiB stages of 8 parts: 2048, 2048, 2048, 1024), else a multiple of 8 columns (whole
// 16-byte vectors of every dtype). The row's whole width where it fits.
__host__ __device__ inline int token_segment_cols(int C, int K, uint32_t elem, uint32_t stage_bytes, int reducer_warps,
                                                  int vector) {
  const int most = static_cast<int>(stage_bytes / (static_cast<uint32_t>(K > 0 ? K : 1) * elem)) / 8 * 8;
  const int round = reducer_warps * 32 * vector;
  const int seg = most >= round ? most / round * round : most;
  return C <= seg ? C : seg;
}

// What every role of a block needs to know about the call.
template <typename Rdma>
struct DirectCombine : KernelCall {
  int L, T, K, C;
  bool token_stage;  // kCombineStageToken: a stage holds every part of a token's segment
  int seg_cols, segments, chunk, stages;
  PeerRing node_part;             // the node-partial rings (kernels/peer_ring.cuh)
  uint32_t in_bytes, wire_bytes;  // element sizes
  uint32_t stage_bytes;           // a stage holds a segment of either (token stage: K parts of one)
  uint32_t part_bytes;            // token stage: where part k starts (k * part_bytes), a segment of the widest
  DirectCombineShared& sh;
  uint8_t* data;  // [kPipelines][stages][stage_bytes] segments
  Hierarchy<Rdma> h;

  __device__ DirectCombine(const KernelCall& k, DirectCombineShared& shared, uint8_t* smem, uint32_t elem_size,
                           uint32_t wire_size)
      : KernelCall(k), L(k.geo.local_experts), T(k.a.num_tokens), K(k.a.topk), C(k.args.row_elems),
        token_stage(k.args.combine_stage == kCombineStageToken),
        seg_cols(token_stage ? token_segment_cols(C, K, max(elem_size, wire_size),
                                                  static_cast<uint32_t>(k.args.src_stage_bytes), k.args.reducer_warps,
                                                  vector_cols(k.args.dtype))
                             : k.args.seg_cols),
        segments((C + seg_cols - 1) / seg_cols), chunk(k.args.chunk_tokens), stages(k.args.src_stages),
        node_part(peer_rings::node_part(k.geo)), in_bytes(elem_size), wire_bytes(wire_size),
        stage_bytes(token_stage ? static_cast<uint32_t>(k.args.src_stage_bytes)
                                : static_cast<uint32_t>(seg_cols) * max(elem_size, wire_size)),
        part_bytes(static_cast<uint32_t>(seg_cols) * max(elem_size, wire_size)), sh(shared), data(smem),
        h(make_hierarchy<Rdma>(k.geo, k.a)) {}

  __device__ int send_chunks() const { return (T + chunk - 1) / chunk; }
  __device__ int source_chunks(int s) const {
    const auto* info = reinterpret_cast<const int64_t*>(a.info);
    return chunks_of(info[geo.info.src_tokens + s], chunk);
  }
  __device__ uint8_t* stage_data(int pipeline) const {
    return data + static_cast<size_t>(pipeline) * stages * stage_bytes;
  }
  // Pipeline p's ring, and its put ring (several nodes).
  __device__ Ring pipeline_ring(int p) const { return ring(sh.full[p], sh.empty[p], stages, kSiteDirectCombineRoutes); }
  __device__ Ring put_ring(int p) const {
    return ring(sh.put_full[p], sh.put_empty[p], kPutStages, kSiteDirectCombinePuts);
  }
  // A source-side chunk's place after the forwarded chunks (SourceSideChunks; kernels/peer_ring.cuh):
  // two block steps, less than a turn of the node-partial ring. With the kinds of unit dealt to
  // both pipelines (UnitPipelines) a forwarded chunk may wait behind an own chunk that waits for
  // the other node's partials; one step later those have more often come. The timing model, 2
  // nodes of 4, seed shape, 256 tokens per rank: 605.1 -> 463.9 us at 2 SMs per rank with the
  // emulation's put copies, 514.2 -> 469.9 (2 SMs) and 960.5 -> 886.1 (1 SM) with posted puts.
  __device__ int own_lag() const { return min(2 * nb, node_part.slots - 1); }
  // The node-partial rings: the byte offsets of row q of chunk c's slot of node n's ring, and of
  // the slot's word (signal, credit).
  __device__ uint64_t node_row_off(uint64_t area, int n, int c, int q) const {
    return area + static_cast<uint64_t>(node_part.row(n, c, q)) * C * wire_bytes;
  }
  __device__ uint64_t node_word_off(uint64_t area, int n, int c) const {
    return area + static_cast<uint64_t>(node_part.word(n, c)) * 8;
  }
  // The signal word of chunk c of node n's ring, in this rank's RDMA region.
  __device__ const uint64_t* node_part_signal(int n, int c) const {
    return h.flag(node_word_off(h.R.node_part_signal, n, c), 0);
  }
  // Whether token t (t < t1) of this rank has a route to node n. Every lane calls it.
  __device__ bool reaches(int64_t t, int t1, int n) const {
    const auto* idx = reinterpret_cast<const int64_t*>(a.topk_idx);
    bool goes = false;
    for (int k = 0; t < t1 && k < K; ++k) {
      const int64_t e = idx[t * K + k];
      goes |= e >= 0 && h.topo.node(expert_rank(e, L)) == n;
    }
    return goes;
  }
};

// Lane 0 of a load warp: the n parts of one row segment, a stage each (`head` with the flags of
// each part added; part(i, weight, wire) gives its row in global memory, its weight and whether
// it is in the wire dtype). A row without parts gets one stage without bytes: the reducers
// write a zero segment. False on a stop.
template <typename Rdma, typename Part>
__device__ bool direct_combine_parts(const DirectCombine<Rdma>& d, const Ring& ring, PartItem* items, uint8_t* data,
                                     PipeState& produced, PartItem head, int n, Part part) {
  for (int i = 0; i < max(n, 1); ++i, produced.advance(ring.stages)) {
    if (d.stopped() || !ring.producer_acquire(d.args, produced)) return false;
    PartItem& it = items[produced.stage];
    it = head;
    it.flags = (i == 0 ? kFirstPart : 0) | (i + 1 >= n ? kLastPart : 0) | (n == 0 ? kNoBytes : 0);
    if (n == 0) {  // the arrival publishes the header
      it.weight = 0.f;
      ring.producer_commit(produced);
      continue;
    }
    float weight = 1.f;
    bool wire = false;
    const uint8_t* row = part(i, weight, wire);
    const uint32_t elem = wire ? d.wire_bytes : d.in_bytes, bytes = static_cast<uint32_t>(head.cols) * elem;
    it.weight = weight;
    if (wire) it.flags |= kWirePart;
    dev::mbar_arrive_expect_tx(&ring.full[produced.stage], bytes);
    dev::bulk_g2s(data + static_cast<size_t>(produced.stage) * d.stage_bytes,
                  row + static_cast<int64_t>(head.col0) * elem, bytes, &ring.full[produced.stage]);
  }
  return true;
}

// The lanes of a load warp, a token stage: every part of one row segment in one stage (`head`
// the segment; part(k, weight, wire) gives part k's row in global memory, its weight and whether
// it is in the wire dtype). Every lane waits for the stage itself (the warp converged, a ballot
// gives the verdict: no lane in a wait loop while the others stand at a collective); lane k < n
// writes part k's weight, lane 0 the header and, once the warp's weights are written, arrives
// with the stage's expected bytes; then lane k issues part k's bulk load, so a token's parts go
// out from n threads side by side under one arrival. A segment without parts gets a stage
// without bytes: the reducers write zeros. False on a stop (every lane alike).
template <typename Rdma, typename Part>
__device__ bool direct_combine_token_stage(const DirectCombine<Rdma>& d, const Ring& ring, PartItem* items,
                                           TokenParts* token_parts, uint8_t* data, PipeState& produced,
                                           const PartItem& head, int n, int lane, Part part) {
  const bool acquired = !d.stopped() && ring.producer_acquire(d.args, produced);
  if (__ballot_sync(0xffffffffu, !acquired) != 0) return false;
  const int stage = produced.stage;
  TokenParts& tp = token_parts[stage];
  float weight = 1.f;
  bool wire = false;
  const uint8_t* row = lane < n ? part(lane, weight, wire) : nullptr;
  const uint32_t wires = __ballot_sync(0xffffffffu, lane < n && wire);
  if (lane < n) tp.weight[lane] = weight;
  if (lane == 0) {
    PartItem& it = items[stage];
    it = head;
    it.flags = kFirstPart | kLastPart | (n == 0 ? kNoBytes : 0);
    tp.n = n;
    tp.wire = wires;
  }
  __syncwarp();  // every lane's weight written before lane 0's arrival publishes the stage
  if (lane == 0) {
    if (n == 0) {
      ring.producer_commit(produced);
    } else {
      const uint32_t in_wire = static_cast<uint32_t>(__popc(wires));
      dev::mbar_arrive_expect_tx(&ring.full[stage],
                                 static_cast<uint32_t>(head.cols) *
                                     ((static_cast<uint32_t>(n) - in_wire) * d.in_bytes + in_wire * d.wire_bytes));
    }
  }
  __syncwarp();  // the stage's expected bytes before any of its parts lands
  if (lane < n) {
    const uint32_t elem = wire ? d.wire_bytes : d.in_bytes;
    dev::bulk_g2s(data + static_cast<size_t>(stage) * d.stage_bytes + static_cast<size_t>(lane) * d.part_bytes,
                  row + static_cast<int64_t>(head.col0) * elem, static_cast<uint32_t>(head.cols) * elem,
                  &ring.full[stage]);
  }
  produced.advance(ring.stages);
  return true;
}

// An own chunk c (lane i: token t0 + i): its routes on this node and, with several nodes, one
// node partial per other node it reaches, once each of those nodes' rail peers put the chunk.
template <typename Rdma>
__device__ bool own_parts(const DirectCombine<Rdma>& d, DirectCombineTable& tab, int c, int lane) {
  const auto* route_rows = reinterpret_cast<const int32_t*>(d.a.route_rows);
  const auto* idx = reinterpret_cast<const int64_t*>(d.a.topk_idx);
  const Hierarchy<Rdma>& h = d.h;
  const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk);
  const int64_t t = static_cast<int64_t>(t0) + lane;
  bool ok = true;
  for (int n = 0; h.multi() && n < h.topo.N && ok && lane == 0; ++n)  // every other node put its node partials
    if (n != h.node)
      ok = !d.stopped() && d.node_part.reader_wait_delivered(h.rdma, d.args, d.node_part_signal(n, c), d.call, c,
                                                             d.a.rank, h.rail_peer(n));
  if (!warp_uniform(ok)) return false;
  int n = 0;
  if (t < t1) {
    for (int k = 0; k < d.K; ++k) {
      const int row = route_rows[t * d.K + k];
      if (row < 0) continue;  // none, clipped, or on another node
      const int host = h.topo.local(expert_rank(idx[t * d.K + k], d.L));
      tab.row[lane][n] = row;
      tab.host[lane][n] = static_cast<uint8_t>(host);
      tab.weight[lane][n] = d.args.apply_probs ? reinterpret_cast<const float*>(d.sh.probs[host])[row] : 1.f;
      ++n;
    }
  }
  for (int m = 0; h.multi() && m < h.topo.N; ++m) {
    if (m == h.node) continue;
    const bool goes = d.reaches(t, t1, m);
    const unsigned mask = __ballot_sync(0xffffffffu, goes);
    if (goes) {
      tab.row[lane][n] = __popc(mask & ((1u << lane) - 1u));
      tab.host[lane][n] = static_cast<uint8_t>(kNodePart + m);
      tab.weight[lane][n] = 1.f;
      ++n;
    }
  }
  if (t < t1) tab.parts[lane] = n;
  return true;
}

// A chunk c this rank forwarded for the rail peer on node n (several nodes; lane q: its row q):
// its routes on this node, from the dispatch's handle, once the source freed the chunk's slot of
// the node-partial ring (from the ring's second turn on). Returns its rows.
template <typename Rdma>
__device__ bool forwarded_parts(const DirectCombine<Rdma>& d, DirectCombineTable& tab, int n, int c, int lane,
                                int& rows) {
  const Hierarchy<Rdma>& h = d.h;
  bool ok = true;
  if (lane == 0)
    ok = !d.stopped() && d.node_part.wait_free(d.args, h.flag(d.node_word_off(h.R.node_part_credit, n, c), 0), d.call,
                                               c, d.a.rank, h.rail_peer(n));
  if (!warp_uniform(ok)) return false;
  rows = reinterpret_cast<const int32_t*>(d.a.fwd_rows)[static_cast<int64_t>(n) * h.max_chunks + c];
  const int width = fwd_route_width(d.geo);
  const int32_t* kept = reinterpret_cast<const int32_t*>(d.a.fwd_routes) +
                        (static_cast<int64_t>(n) * h.staged + static_cast<int64_t>(c) * d.chunk + lane) * width;
  if (lane < rows) {
    int parts = 0;
    for (; parts < width && kept[parts] >= 0; ++parts) {
      const int row = kept[parts] / kMaxDomainRanks, host = kept[parts] % kMaxDomainRanks;
      tab.row[lane][parts] = row;
      tab.host[lane][parts] = static_cast<uint8_t>(host);
      tab.weight[lane][parts] = d.args.apply_probs ? reinterpret_cast<const float*>(d.sh.probs[host])[row] : 1.f;
    }
    tab.parts[lane] = parts;
  }
  return true;
}

// A pipeline's load warp: lane i lists token i's parts of each of the pipeline's units, and they
// are loaded token by token and segment by segment: by lane 0 into a stage per part (route
// stages), or by lane k for part k into one stage per token segment (token stages).
template <typename Rdma, int S>
__device__ void direct_combine_load(const DirectCombine<Rdma>& d, int pipeline, const Ring& ring, int lane) {
  constexpr bool kToken = S == kCombineStageToken;
  DirectCombineTable& tab = d.sh.tables[pipeline];
  PartItem* items = d.sh.items[pipeline];
  TokenParts* token_parts = d.sh.token_parts[pipeline];
  uint8_t* data = d.stage_data(pipeline);
  const Hierarchy<Rdma>& h = d.h;
  PipeState produced;
  SourceSideChunks<DirectCombine<Rdma>> work(d);
  UnitPipelines pipelines;
  bool ok = true, forwarded;
  int n, c;
  while (ok && work.next(forwarded, n, c)) {
    if (pipelines.of(forwarded) != pipeline) continue;
    int rows = 0;
    ok = forwarded ? forwarded_parts(d, tab, n, c, lane, rows) : own_parts(d, tab, c, lane);
    if (!ok) break;
    __syncwarp();
    // the parts (acquired above or at the setup) are read by bulk loads: every issuing lane's
    if (lane == 0 || kToken) dev::fence_proxy_async();
    const int t0 = c * d.chunk, tokens = forwarded ? max(rows, 1) : min(d.T, t0 + d.chunk) - t0;
    // Each lane that issues loads: lane 0 every part of a route stage, lane j part j of a token stage.
    for (int q = 0; q < tokens && ok && (lane == 0 || kToken); ++q) {
      const auto part = [&](int j, float& weight, bool& wire) -> const uint8_t* {
        weight = tab.weight[q][j];
        const int host = tab.host[q][j];
        if (host >= kNodePart) {
          wire = true;
          return h.rdma.local(d.node_row_off(h.R.node_part_rows_in, host - kNodePart, c, tab.row[q][j]));
        }
        return reinterpret_cast<const uint8_t*>(d.sh.rows[host]) +
               static_cast<int64_t>(tab.row[q][j]) * d.C * d.in_bytes;
      };
      const int parts = forwarded && rows == 0 ? 0 : tab.parts[q];
      for (int g = 0; g < (forwarded && rows == 0 ? 1 : d.segments) && ok; ++g) {
        const int col0 = g * d.seg_cols, cols = forwarded && rows == 0 ? 0 : min(d.seg_cols, d.C - col0);
        const bool end = q == tokens - 1 && g == d.segments - 1;
        const PartItem head = forwarded ? PartItem{c, FwdTag{n, q, rows}.pack(), col0, cols, 0, 1.f}
                                        : PartItem{t0 + q, end ? kChunkEnd : 0, col0, cols, 0, 1.f};
        if constexpr (kToken) {
          ok = direct_combine_token_stage(d, ring, items, token_parts, data, produced, head, parts, lane, part);
        } else {
          ok = direct_combine_parts(d, ring, items, data, produced, head, parts, part);
        }
      }
    }
    ok = warp_uniform(ok);  // the table is rewritten for the next unit only after lane 0 read it
  }
  if (lane == 0) finish_loads(d, ring, items, data, d.stage_bytes / d.seg_cols, produced, ok);
}

// How a reducer warp of pipeline `pipeline` learns that stage p is full: on its own (lane 0 and
// the warp's agreement, or every lane: warp_consumer_wait), or with its whole group through one
// waiter and the pipeline's named barrier (kReducerWaitNamed: group_consumer_wait). Every thread
// of the group calls it.
template <typename Rdma, int R>
__device__ __forceinline__ bool reducer_stage_wait(const DirectCombine<Rdma>& d, int pipeline, const Ring& ring,
                                                   const PipeState& p, int gt, int lane) {
  if (d.args.reducer_wait == kReducerWaitNamed)
    return group_consumer_wait(d, ring, p, gt, reducer_barrier(pipeline), R * 32, d.sh.verdict[pipeline]);
  return warp_consumer_wait(d, ring, p, lane, d.args.reducer_wait);
}

// After a segment's sum is written (y, or a node partial in the node-partial ring): after an own
// chunk's last segment one thread gives the chunk's node-partial slots back to the other nodes'
// rail peers (this warp waited for every load of the chunk on its stage's full barrier, so they
// landed and the release is due at once; the receive path's load warp, which does not wait for
// its loads, defers it: DeferredReleases, kernels/pipeline.cuh); after a forwarded chunk's last
// row each warp fences its stores and hands the chunk to the put warp (one of the put ring's R
// arrivals). False where the put ring's wait gave up (the block stopped).
template <typename Rdma>
__device__ bool segment_written(const DirectCombine<Rdma>& d, int pipeline, const PartItem& it, PipeState& produced,
                                RingReleases<Rdma>& releases, int gt, int lane) {
  const Hierarchy<Rdma>& h = d.h;
  if (!FwdTag::is(it.slot)) {
    if (h.multi() && it.slot == kChunkEnd && gt == 0) {
      const int c = it.row / d.chunk;
      for (int n = 0; n < h.topo.N; ++n)
        if (n != h.node)
          releases.reader_release(h.rail_peer(n), d.node_word_off(h.R.node_part_credit, h.node, c), d.call, c);
    }
    return true;
  }
  const FwdTag f = FwdTag::of(it.slot);
  if (!f.completes(it.col0 + it.cols, d.C)) return true;
  __threadfence();  // this thread's node partials, before the transport reads them
  const Ring put = d.put_ring(pipeline);
  if (!warp_producer_acquire(d, put, produced, lane)) return false;
  if (gt == 0) d.sh.puts[pipeline][produced.stage] = FwdPut{f.node, it.row, f.rows};
  __syncwarp();
  if (lane == 0) put.producer_commit(produced);
  produced.advance(put.stages);
  return true;
}

// Where a segment's sum goes: an own token's row of y (Elem), or a forwarded row's node partial,
// rounded once to the wire dtype, in the node-partial ring (nullptr for a chunk without rows).
template <typename Rdma, typename Out>
__device__ uint8_t* segment_out(const DirectCombine<Rdma>& d, const PartItem& it) {
  if (!FwdTag::is(it.slot))
    return reinterpret_cast<uint8_t*>(d.a.y) + (static_cast<int64_t>(it.row) * d.C + it.col0) * sizeof(Out);
  const FwdTag f = FwdTag::of(it.slot);
  if (f.rows == 0) return nullptr;
  return d.h.rdma.local(d.node_row_off(d.h.R.node_part_rows_out, f.node, it.row, f.q)) +
         static_cast<int64_t>(it.col0) * sizeof(Out);
}

// A pipeline's reducer warp, route stages: each row's parts summed in fp32 registers (node
// partials read in the wire dtype), a stage each. An own token's row is written to y, rounded
// once; a forwarded row's node partial, rounded once to the wire dtype, into the node-partial
// ring (segment_written: what follows each).
template <typename Rdma, typename Elem, typename Wire, int R>
__device__ void direct_combine_reduce(const DirectCombine<Rdma>& d, int pipeline, const Ring& ring, int gt, int lane) {
  const PartItem* items = d.sh.items[pipeline];
  const uint8_t* data = d.stage_data(pipeline);
  const bool named = d.args.reducer_wait == kReducerWaitNamed;
  PipeState produced;
  SegmentAcc<Elem, R> acc;
  RingReleases<Rdma> releases(d.h.rdma);  // this thread's node-partial credits (quieted as it goes)
  for (PipeState p;; p.advance(ring.stages)) {
    if (!reducer_stage_wait<Rdma, R>(d, pipeline, ring, p, gt, lane)) break;
    const PartItem it = items[p.stage];
    if (it.flags & kEndOfWork) break;
    const uint8_t* in = data + static_cast<size_t>(p.stage) * d.stage_bytes;
    if (it.flags & kNoBytes) {
      acc.set_blank();
    } else if (it.flags & kWirePart) {
      acc.template add_from<Wire>(in, it.cols, gt, it.weight, (it.flags & kFirstPart) != 0);
    } else {
      acc.add(in, it.cols, gt, it.weight, (it.flags & kFirstPart) != 0);
    }
    __syncwarp();
    if (lane == 0) ring.consumer_release(p);  // one of the group's R arrivals
    if (!(it.flags & kLastPart)) continue;
    if (!FwdTag::is(it.slot)) {
      acc.template store<Elem>(segment_out<Rdma, Elem>(d, it), it.cols, gt);
    } else if (uint8_t* out = segment_out<Rdma, Wire>(d, it)) {
      acc.template store<Wire>(out, it.cols, gt);
    }
    // A warp whose put-ring wait gave up goes on to the group's next wait, which says stop to
    // every warp at once (a group meeting at a named barrier leaves its loop together).
    if (!segment_written(d, pipeline, it, produced, releases, gt, lane) && !named) break;
  }
}

// A pipeline's reducer warp, token stages: each stage holds every part of one row segment
// (TokenParts), summed vector by vector straight from the stage into the segment's output
// (sum_parts, kernels/segments.cuh), then released once; segment_written says what follows.
template <typename Rdma, typename Elem, typename Wire, int R>
__device__ void direct_combine_reduce_tokens(const DirectCombine<Rdma>& d, int pipeline, const Ring& ring, int gt,
                                             int lane) {
  const PartItem* items = d.sh.items[pipeline];
  const TokenParts* token_parts = d.sh.token_parts[pipeline];
  const uint8_t* data = d.stage_data(pipeline);
  dev::assume_shared(data);
  const bool named = d.args.reducer_wait == kReducerWaitNamed;
  PipeState produced;
  RingReleases<Rdma> releases(d.h.rdma);  // this thread's node-partial credits (quieted as it goes)
  for (PipeState p;; p.advance(ring.stages)) {
    if (!reducer_stage_wait<Rdma, R>(d, pipeline, ring, p, gt, lane)) break;
    const PartItem it = items[p.stage];
    if (it.flags & kEndOfWork) break;
    const TokenParts& tp = token_parts[p.stage];
    const uint8_t* in = data + static_cast<size_t>(p.stage) * d.stage_bytes;
    const int n = (it.flags & kNoBytes) ? 0 : tp.n;
    if (!FwdTag::is(it.slot)) {
      sum_parts<Elem, Wire, Elem, R * 32>(in, d.part_bytes, n, tp.wire, tp.weight, it.cols,
                                          segment_out<Rdma, Elem>(d, it), gt);
    } else if (uint8_t* out = segment_out<Rdma, Wire>(d, it)) {
      sum_parts<Elem, Wire, Wire, R * 32>(in, d.part_bytes, n, tp.wire, tp.weight, it.cols, out, gt);
    }
    __syncwarp();
    if (lane == 0) ring.consumer_release(p);  // one of the group's R arrivals, after the warp's reads
    if (!segment_written(d, pipeline, it, produced, releases, gt, lane) && !named) break;
  }
}

// The put warp with several nodes: each chunk this block forwards, once a pipeline's reducers wrote
// its node partials into the chunk's slot of the node-partial ring (row q: the q-th of the
// chunk's tokens for this node), put to the same slot of the source on the other node with the
// chunk's signal (also for no rows). The block's units are the pipelines' (UnitPipelines).
template <typename Rdma>
__device__ void forward_put(const DirectCombine<Rdma>& d, int lane) {
  const Hierarchy<Rdma>& h = d.h;
  const uint64_t row_b = static_cast<uint64_t>(d.C) * d.wire_bytes;
  SourceSideChunks<DirectCombine<Rdma>> work(d);
  UnitPipelines pipelines;
  PipeState p[kPipelines];
  bool forwarded;
  int n, c;
  while (work.next(forwarded, n, c)) {
    const int pipeline = pipelines.of(forwarded);
    if (!forwarded) continue;
    const Ring put = d.put_ring(pipeline);
    if (!warp_consumer_wait(d, put, p[pipeline], lane)) break;
    const FwdPut it = d.sh.puts[pipeline][p[pipeline].stage];
    __syncwarp();
    if (lane == 0) put.consumer_release(p[pipeline]);
    p[pipeline].advance(put.stages);
    h.rdma.put_signal(lane, h.rail_peer(it.node), d.node_row_off(h.R.node_part_rows_in, h.node, it.chunk, 0),
                      h.rdma.local(d.node_row_off(h.R.node_part_rows_out, it.node, it.chunk, 0)), it.rows * row_b,
                      d.node_word_off(h.R.node_part_signal, h.node, it.chunk), PeerRing::tag(d.call, it.chunk));
  }
  if (lane == 0) h.rdma.quiet();
}

// S: the stage kind (kCombineStageRoute or kCombineStageToken), an instantiation each, so neither
// reducer's registers weigh on the other's.
template <typename Rdma, typename Elem, typename Wire, int R, int S>
__global__ void __launch_bounds__(DirectCombineBlock<R>::kThreads, 1)
    combine_direct_kernel(const __grid_constant__ LaunchArgs args) {
  using B = DirectCombineBlock<R>;
  const BlockPlace place = block_place(args);
  if (place.rank.absent || call_refused(args.geo, place.rank)) return;
  DirectCombineShared& sh = dev::block_shared<DirectCombineShared>();
  const DirectCombine<Rdma> d(kernel_call(args, place, kCombineCall, sh.ctl), sh, dev::dynamic_smem<uint8_t>(),
                              static_cast<uint32_t>(sizeof(Elem)), static_cast<uint32_t>(sizeof(Wire)));
  const RankArgs& a = d.a;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pipeline = warp / B::kPipelineWarps;
  const bool multi = d.h.multi();

  init_block(d, [&] {
    for (int p = 0; p < kPipelines; ++p) {
      d.pipeline_ring(p).init(1, R);
      if (multi) d.put_ring(p).init(R, 1);
    }
  });
  // An aborted launch neither publishes nor reads tensors (as the direct dispatch's setup).
  const bool setup = !d.stopped();
  if (setup && d.b == 0 && tid == 32)
    publish_tensors(d.view, a, kDirectCombine, d.call, a.expert_out, a.probs, a.probs, a.num_out_rows);
  const int G = d.geo.ranks_per_node;
  if (setup && tid < G) {  // every expert host's expert_out and probs on this node
    const int host = d.h.first_local() + tid;
    PeerView pv;
    if (read_tensors(args, d.view, a, host, kDirectCombine, d.call, pv)) {
      sh.rows[tid] = pv.rows;
      sh.probs[tid] = pv.probs;
    } else {
      sh.ctl.fail = 1;
    }
  } else if (setup && multi && tid >= kMaxDomainRanks && tid - kMaxDomainRanks < d.h.topo.N &&
             tid - kMaxDomainRanks != d.h.node) {
    // the source on node n has read the node partials of the previous combine this rank put it
    const int n = tid - kMaxDomainRanks;
    if (!wait_at_least(args, d.h.flag(d.geo.rdma.done_combine, n), d.call - 1, kPhaseRdmaFlow, a.rank, d.h.rail_peer(n),
                       d.call))
      sh.ctl.fail = 1;
  }
  if (!block_ready(d)) return;

  if (warp == B::kPutWarp) {
    if (multi) forward_put(d, lane);
  } else {
    const Ring ring = d.pipeline_ring(pipeline);
    const RoleSpan<DirectCombineRole> role = B::roles().of(warp % B::kPipelineWarps);
    switch (role.role) {
      case DirectCombineRole::kLoad: direct_combine_load<Rdma, S>(d, pipeline, ring, lane); break;
      case DirectCombineRole::kReduce: {
        const int gt = role.thread_index(tid - pipeline * B::kPipelineWarps * 32);
        if constexpr (S == kCombineStageToken) {
          direct_combine_reduce_tokens<Rdma, Elem, Wire, R>(d, pipeline, ring, gt, lane);
        } else {
          direct_combine_reduce<Rdma, Elem, Wire, R>(d, pipeline, ring, gt, lane);
        }
        break;
      }
    }
  }
  if (!roles_done(d)) return;

  LocalState* st = d.view.state();
  if (finish_direct(d, kDirectCombine, &st->blocks_done_combine)) {
    st->combine_calls = d.call;  // every block of this rank has read the call: all reported done
    publish_done(d, d.geo.reg.done_combine);
    // The node partials the rail peers on other nodes put here are read: they may put the next.
    d.h.signal_done_to_rail_peers(d.geo.rdma.done_combine, d.call);
  }
}

// Dynamic shared memory: each pipeline's stages, each a segment of expert_out or of the wire.
__host__ __device__ inline size_t combine_direct_stage_bytes(const LaunchArgs& args) {
  return static_cast<size_t>(kPipelines) * args.src_stages * args.src_stage_bytes;
}

template <typename Rdma, typename Elem, typename Wire, int R>
KernelChoice combine_direct_kernel_warps(const LaunchArgs& args) {
  const KernelFn kernel = args.combine_stage == kCombineStageToken
                              ? &combine_direct_kernel<Rdma, Elem, Wire, R, kCombineStageToken>
                              : &combine_direct_kernel<Rdma, Elem, Wire, R, kCombineStageRoute>;
  return {kernel, DirectCombineBlock<R>::kThreads, nullptr};
}

template <typename Rdma, typename Elem, typename Wire>
KernelChoice combine_direct_kernel_typed(const LaunchArgs& args) {
  return args.reducer_warps == kReducerWarpsWide
             ? combine_direct_kernel_warps<Rdma, Elem, Wire, kReducerWarpsWide>(args)
             : combine_direct_kernel_warps<Rdma, Elem, Wire, kReducerWarpsNarrow>(args);
}

// The launchers' check of the reducer warps the host chose: nullptr if they are an instantiated
// count, else the error's text.
inline const char* check_reducer_warps(const LaunchArgs& args) {
  if (args.reducer_warps != kReducerWarpsNarrow && args.reducer_warps != kReducerWarpsWide)
    return "combine: reducer_warps must be 4 or 8 (kReducerWarpsNarrow, kReducerWarpsWide)";
  return nullptr;
}

// The launchers' check of the stage kind and the hand-off the host chose: nullptr if the kernel
// has them, else the error's text. A token stage holds the parts of a segment of 8 columns or
// more for any top-k (kMaxTopK parts of the widest element, fp32).
inline const char* check_combine_stage(const LaunchArgs& args) {
  if (args.reducer_wait < kReducerWaitObserve || args.reducer_wait > kReducerWaitNamed)
    return "combine: reducer_wait must be one of kReducerWait{Observe,Elect,Converged,Named}";
  if (args.combine_stage != kCombineStageRoute && args.combine_stage != kCombineStageToken)
    return "combine: combine_stage must be kCombineStageRoute or kCombineStageToken";
  if (args.combine_stage == kCombineStageToken && args.src_stage_bytes < kMaxTopK * 8 * 4)
    return "combine: a token stage must hold kMaxTopK parts of 8 fp32 columns (src_stage_bytes >= 512)";
  if (args.combine_stage == kCombineStageToken && args.src_stage_bytes % 16 != 0)
    return "combine: a token stage's bytes must be a multiple of 16 (bulk copies into it start 16-byte aligned)";
  return nullptr;
}

// The kernel of the call's dtype, wire dtype, reducer warps and stage kind, and its block size
// (kernels/direct.cu launches it), or why the arguments have none.
template <typename Rdma>
KernelChoice combine_direct_kernel_for(const LaunchArgs& args) {
  for (const char* bad : {check_segment_cols(args), check_reducer_warps(args), check_combine_stage(args)})
    if (bad != nullptr) return {nullptr, 0, bad};
  // The node partials' dtype matters only with several nodes: one node instantiates the pair once.
  const bool fp32_wire = args.geo.num_nodes > 1 && args.wire_dtype == kFloat32;
  switch (args.dtype) {
    case kFloat32: return combine_direct_kernel_typed<Rdma, float, float>(args);
    case kBFloat16:
      return fp32_wire ? combine_direct_kernel_typed<Rdma, __nv_bfloat16, float>(args)
                       : combine_direct_kernel_typed<Rdma, __nv_bfloat16, __nv_bfloat16>(args);
    case kFloat16:
      return fp32_wire ? combine_direct_kernel_typed<Rdma, __half, float>(args)
                       : combine_direct_kernel_typed<Rdma, __half, __half>(args);
    default: return {nullptr, 0, "combine: unsupported dtype code"};
  }
}

}  // namespace combine_direct_impl

}  // namespace hybrid_ep
