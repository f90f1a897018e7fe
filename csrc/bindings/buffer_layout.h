// The byte layouts of one rank's registered buffer (RegLayout) and RDMA region (RdmaLayout),
// built here from the list of rings between ranks (kernels/peer_ring.cuh) and bound to Python
// with a table of their regions (name, offset, bytes, purpose): hybrid_ep/backends/cuda/layout.py
// reads them, and memory_plan() reports the registered table's lines as they are.
//
// Each ring family holds a ring per (writer, source) pair it serves, and its slots are the
// writer's: a writer holds its depth in chunk slots in a reader's buffer, shared among the
// sources it writes for. A rank writes a node peer's receive rings for its own chunks and, as
// their forwarder, for its rail peers on the N - 1 other nodes: N sources, depth / N slots each;
// an expert host writes the forward rings of a forwarder for the N - 1 source nodes. A writer's
// depth is ring_chunks (BufferConfig.ring_chunks) while a reader has at most kFullDepthWriters
// writers in the family (a host of 8 GPUs: the depth the kernels run at there); past that, each
// writer gets its share of ring_chunks x kFullDepthWriters (writer_depth), so the bytes a reader
// holds stop growing with the NVLink domain (36 or 72 ranks of a GB200 domain) until the floors
// bind. Never fewer than kMinRingSlots slots a ring, the least a ring between ranks turns over
// with (kernels/peer_ring.cuh: a forwarded chunk comes half a ring after its index), and no more
// than the chunks of the largest source where a combine ring holds a chunk's partials. So the
// memory a rank holds grows with the peers that write into it (G node peers over NVLink, N rail
// peers over RDMA) up to kFullDepthWriters of them, not with the EP size.
//
// Host code only (the bindings); the kernels receive the offsets in Geometry. Beside them, the
// layout of a call's workspace (WorkspaceLayout): where one rank's per-call tensors lie in its part.
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/params.h"

namespace hybrid_ep {

constexpr uint64_t kRegionAlign = 128;  // every region starts on its own 128-byte line
constexpr uint64_t kMinRingSlots = 2;
constexpr uint64_t kFullDepthWriters = 8;  // writers of a reader's ring family that each get ring_chunks slots
constexpr uint64_t kMaxRowElemBytes = 4;   // the widest value rows between ranks carry (fp32)

// What a buffer's layout depends on (BufferConfig; scale_cols: the fp32 scales of an fp8 row of
// `hidden` columns, 0 where fp8 rows cannot have that width).
struct BufferShape {
  int64_t world_size = 0, ranks_per_node = 0, local_experts = 0, max_tokens = 0, hidden = 0, ring_chunks = 0;
  int64_t scale_cols = 0;
  int64_t ring_elem_bytes = kMaxRowElemBytes;  // bytes of a value in the rings' rows (BufferConfig.ring_dtype)
};

// One region of a layout: [offset, offset + bytes), and what it holds (memory_plan()'s line).
struct Region {
  std::string name;
  uint64_t offset = 0, bytes = 0;
  std::string purpose;
};

struct BufferLayouts {
  RegLayout reg{};
  RdmaLayout rdma{};
  std::vector<Region> registered, rdma_regions;
};

namespace layout_detail {

inline uint64_t round_up(uint64_t v, uint64_t m) { return (v + m - 1) / m * m; }

// Consecutive fields of a buffer, each on its own kRegionAlign line, grouped into regions.
class Planner {
 public:
  explicit Planner(std::vector<Region>& regions) : regions_(regions) {}
  // A field of `bytes`: its offset.
  uint64_t take(uint64_t bytes) {
    const uint64_t start = at_;
    at_ = round_up(at_ + bytes, kRegionAlign);
    return start;
  }
  // The fields taken since the last region make up region `name`.
  void region(const char* name, const std::string& purpose) {
    regions_.push_back(Region{name, start_, at_ - start_, purpose});
    start_ = at_;
  }
  uint64_t total() const { return at_; }

 private:
  std::vector<Region>& regions_;
  uint64_t at_ = 0, start_ = 0;
};

}  // namespace layout_detail

// The slots a writer holds in one reader's ring family of `writers` writers: ring_chunks up to
// kFullDepthWriters writers, then its share of ring_chunks x kFullDepthWriters, at least
// kMinRingSlots.
inline uint64_t writer_depth(uint64_t ring_chunks, uint64_t writers) {
  const uint64_t share = ring_chunks * kFullDepthWriters / (writers > 0 ? writers : 1);
  const uint64_t depth = share < ring_chunks ? share : ring_chunks;
  return depth > kMinRingSlots ? depth : kMinRingSlots;
}

// The slots of a ring whose writer holds `depth` slots in one reader's buffer, shared among the
// `sources` sources it writes for: its share, at least kMinRingSlots.
inline uint64_t shared_slots(uint64_t depth, uint64_t sources) {
  const uint64_t share = depth / (sources > 0 ? sources : 1);
  return share > kMinRingSlots ? share : kMinRingSlots;
}

inline BufferLayouts buffer_layouts(const BufferShape& s) {
  using layout_detail::Planner;
  using layout_detail::round_up;
  if (s.world_size < 1 || s.ranks_per_node < 1 || s.world_size % s.ranks_per_node != 0)
    throw std::invalid_argument("buffer_layouts: ranks_per_node must divide world_size");
  if (s.local_experts < 1 || s.max_tokens < 0 || s.hidden < 1 || s.scale_cols < 0)
    throw std::invalid_argument("buffer_layouts: local_experts and hidden must be >= 1, max_tokens, scale_cols >= 0");
  if (s.ring_chunks < static_cast<int64_t>(kMinRingSlots))
    throw std::invalid_argument("ring_chunks must be >= " + std::to_string(kMinRingSlots) + ", got " +
                                std::to_string(s.ring_chunks));
  const uint64_t W = s.world_size, G = s.ranks_per_node, N = W / G, L = s.local_experts, H = s.hidden;
  const uint64_t max_chunks = s.max_tokens > 0 ? (s.max_tokens + kChunkTokens - 1) / kChunkTokens : 1;
  if (max_chunks + 1 >= (uint64_t{1} << kRingTagChunkBits))
    throw std::invalid_argument("max_tokens_per_rank must be below " +
                                std::to_string(((uint64_t{1} << kRingTagChunkBits) - 2) * kChunkTokens) +
                                " (a ring slot's tag holds the chunk index in " + std::to_string(kRingTagChunkBits) +
                                " bits), got " + std::to_string(s.max_tokens));
  const uint64_t R = s.ring_chunks;
  const uint64_t node_depth = writer_depth(R, G);  // a writer's slots at a reader of its node (G writers, NVLink)
  const uint64_t rail_depth = writer_depth(R, N);  // a rail peer's at a rank of another node (RDMA)
  const auto comb_cap = [&](uint64_t slots) {      // no more than the largest source's chunks
    return slots < max_chunks ? slots : max_chunks;
  };

  BufferLayouts out;
  RegLayout& r = out.reg;
  r.max_chunks = max_chunks;
  // The rings of the registered buffer (NVLink): rings per reader, slots each.
  r.recv = RingLayout{W, shared_slots(node_depth, N)};  // a ring per source, its writer serving N sources
  r.partial = RingLayout{G, comb_cap(node_depth)};      // a ring per expert host of the source's node
  r.forward = RingLayout{N > 1 ? N * G : 0,             // per (source node, writer), writers serve N - 1
                         comb_cap(shared_slots(node_depth, N - 1))};
  r.meta_entries = L < static_cast<uint64_t>(kMaxTopK) ? L : kMaxTopK;
  r.count_row_ints = W + N + L + kCountRowTail + W;  // then W ints: the source's routes to each rank
  if (s.ring_elem_bytes != 2 && s.ring_elem_bytes != 4)
    throw std::invalid_argument("ring_dtype: rows between ranks of 2 or 4 bytes a value, got " +
                                std::to_string(s.ring_elem_bytes));
  const uint64_t elem = static_cast<uint64_t>(s.ring_elem_bytes);
  const std::string width = elem == 4 ? "fp32" : "16-bit";  // the widest rows the rings carry (memory_plan's lines)
  r.row_stride = round_up(H * elem, 16);
  r.scale_stride = s.scale_cols > 0 ? round_up(4 * s.scale_cols, 16) : 0;
  r.wire_stride = round_up(H * elem, 16);

  Planner reg(out.registered);
  r.count_call = reg.take(8 * W);
  r.recv_signal = reg.take(sizeof(ChunkSignal) * W * max_chunks);
  r.done_dispatch = reg.take(8);
  r.done_combine = reg.take(8);
  r.state = reg.take(sizeof(LocalState));
  r.count_in = reg.take(4 * W * r.count_row_ints);
  // each ring's words: the writer's signals in the reader's buffer, the readers' credits in the
  // writer's ([source node][reader g] for the receive rings a rank writes; a partial and a
  // forward ring's credits by their source)
  r.recv_credit = reg.take(8 * N * G * r.recv.slots);
  r.partial_signal = reg.take(8 * r.partial.rings * r.partial.slots);
  r.partial_credit = reg.take(8 * G * r.partial.slots);
  r.forward_signal = reg.take(8 * r.forward.rings * r.forward.slots);
  r.forward_credit = reg.take(8 * (N > 1 ? W : 0) * r.forward.slots);
  // the direct path: this rank's published tensors of a dispatch and a combine, the first output
  // row of each (source, local expert), and each source's completion per kernel
  r.direct_tensors = reg.take(2 * sizeof(PeerTensors));
  r.direct_first = reg.take(4 * W * L);
  r.direct_done = reg.take(8 * 2 * W);
  reg.region("flags+counts",
             "monotonic signals, per-rank state, exchanged counts, ring credits, the direct path's tables");
  const uint64_t recv_rows = r.recv.rings * r.recv.slots * kChunkTokens;
  r.recv_meta = reg.take(sizeof(MetaEntry) * recv_rows * r.meta_entries);
  reg.region("recv_meta", "routing entries of received rows, in the receive rings");
  r.recv_rows = reg.take(recv_rows * r.row_stride);
  reg.region("recv_rows",
             "received rows, sized for " + width +
                 ": a ring per source, each writer of this node's slots (ring_chunks, "
                 "scaled down past 8 writers) shared among the sources it writes for (its own chunks, and its rail "
                 "peers' on other nodes)");
  r.recv_scales = reg.take(recv_rows * r.scale_stride);
  reg.region("recv_scales", "fp8 scales of received rows, in the receive rings");
  r.partial_rows = reg.take(r.partial.rings * r.partial.slots * kChunkTokens * r.wire_stride);
  reg.region("partial_rows",
             "partial sums of this node's expert hosts, sized for an " + width + " wire: a ring per host");
  r.forward_rows = reg.take(r.forward.rings * r.forward.slots * kChunkTokens * r.wire_stride);
  reg.region("forward_rows",
             "several nodes: partials of this node's ranks for sources on other nodes whose rail peer "
             "this rank is, a ring per (source node, writer), its writer's slots shared among the nodes");
  r.total = reg.total();

  RdmaLayout& d = out.rdma;
  d.staged = RingLayout{N, rail_depth};               // a ring per node, written by this rank or its rail peer there
  d.node_part = RingLayout{N, comb_cap(rail_depth)};  // likewise, for the node partial sums
  if (N == 1) return out;                             // no RDMA region
  const uint64_t row_ints = round_up(r.count_row_ints, 4);
  d.token_meta_bytes = round_up(sizeof(TokenMeta) + 4 * G + 4 * static_cast<uint64_t>(s.scale_cols), 16);
  d.chunk_meta_bytes = kChunkMetaHeader + kChunkTokens * d.token_meta_bytes;
  Planner rd(out.rdma_regions);
  d.count_call = rd.take(8 * W);
  d.count_out = rd.take(4 * W * row_ints);
  d.count_in = rd.take(4 * 2 * W * row_ints);
  d.done_dispatch = rd.take(8 * N);
  d.done_combine = rd.take(8 * N);
  d.staged_signal = rd.take(8 * N * max_chunks);
  d.staged_credit = rd.take(8 * N * d.staged.slots);
  d.node_part_signal = rd.take(8 * N * d.node_part.slots);
  d.node_part_credit = rd.take(8 * N * d.node_part.slots);
  rd.region("rdma_flags+counts", "counts and flags of the inter-node path, the staging rings' signals and credits");
  const uint64_t staged_rows = N * d.staged.slots * kChunkTokens;
  d.staged_meta_out = rd.take(N * d.staged.slots * d.chunk_meta_bytes);
  d.staged_meta_in = rd.take(N * d.staged.slots * d.chunk_meta_bytes);
  rd.region("staged_meta", "a staged chunk's routing, out to the rail peer on each node and in from it");
  d.staged_rows_out = rd.take(staged_rows * r.row_stride);
  d.staged_rows_in = rd.take(staged_rows * r.row_stride);
  rd.region("staged_rows", "staged rows, sized for " + width + ": a ring per node, out and in");
  const uint64_t node_rows = N * d.node_part.slots * kChunkTokens;
  d.node_part_rows_out = rd.take(node_rows * r.wire_stride);
  d.node_part_rows_in = rd.take(node_rows * r.wire_stride);
  rd.region("node_part_rows", "node partial sums, sized for an " + width + " wire: a ring per node, out and in");
  d.total = rd.total();
  return out;
}

// Where one rank's per-call tensors of a dispatch lie in its part of the call's workspace
// (bytes from the part's start; -1 where the data path has none). The part is sized for
// max_tokens tokens and `topk` routes, so it depends only on the engine, K and the path:
// rank i's part of a call starts at i * bytes. The handle keeps the part for the combine.
struct WorkspaceLayout {
  int64_t info = -1;        // InfoLayout tensor (i64)
  int64_t send_ord = -1;    // [T, W] i32
  int64_t row_pos = -1;     // receive path: [W, max_tokens, kd] i32
  int64_t recv_spans = -1;  // receive path: [W, max_chunks, 2] i32
  int64_t fwd_slots = -1;   // several nodes: [N, max_chunks * kChunkTokens, G] i32
  int64_t fwd_rows = -1;    // several nodes: [N, max_chunks] i32
  int64_t fwd_routes = -1;  // direct path, several nodes: [N, max_chunks * kChunkTokens, fwd_route_width] i32
  int64_t entry_ord = -1;   // [T, K] i32
  int64_t route_rows = -1;  // direct path: [T, K] i32
  int64_t bytes = 0;        // the part, a multiple of kCallAlign
};

inline constexpr int64_t kCallAlign = 128;  // every tensor of a part starts on its own 128-byte line

// direct: the direct path's route rows; receive: the receive path's row positions and
// chunk spans. A layout with both serves a dispatch that chooses its path after the layout
// kernel (the engine's per-call fallback when the arena can not hold the output).
inline WorkspaceLayout workspace_layout(const Geometry& g, int32_t kd, int32_t topk, bool direct, bool receive) {
  if (topk < 0 || topk > kMaxTopK) throw std::invalid_argument("topk out of range for a call layout");
  WorkspaceLayout l;
  int64_t at = 0;
  auto place = [&at](int64_t& field, int64_t bytes) {
    field = at;
    at += (bytes + kCallAlign - 1) / kCallAlign * kCallAlign;
  };
  const int64_t W = g.world_size, T = g.max_tokens, N = g.num_nodes, G = g.ranks_per_node;
  const int64_t chunks = static_cast<int64_t>(g.reg.max_chunks);
  place(l.info, g.info.total * 8);
  place(l.send_ord, T * W * 4);
  if (receive) {
    place(l.row_pos, W * T * kd * 4);
    place(l.recv_spans, W * chunks * 2 * 4);
  }
  if (N > 1) {
    if (receive) place(l.fwd_slots, N * chunks * kChunkTokens * G * 4);
    if (direct) place(l.fwd_routes, N * chunks * kChunkTokens * fwd_route_width(g) * 4);
    place(l.fwd_rows, N * chunks * 4);
  }
  place(l.entry_ord, T * topk * 4);
  if (direct) place(l.route_rows, T * topk * 4);
  l.bytes = at < kCallAlign ? kCallAlign : at;
  return l;
}

// The address of a tensor at `offset` in a part at `part` (0 where the layout has none).
inline uint64_t at_offset(uint64_t part, int64_t offset) {
  return offset < 0 ? 0 : part + static_cast<uint64_t>(offset);
}

}  // namespace hybrid_ep
