// The inter-node side of one rank, shared by the three kernels: its place in the hierarchy
// and the areas of its RDMA region (common/params.h RdmaLayout).
//
// Rank r = (node n, local g). A source sends each token once per remote node n' that hosts
// one of its routes, to its rail peer (n', g): chunk c of the source (kChunkTokens tokens)
// becomes staged slots c * kChunkTokens + q there, q the token's ordinal among the chunk's
// tokens for n', one put for the rows and one put with signal for the chunk's routing. The
// rail peer forwards the rows over NVLink into the receive slots the source computed, so
// the destinations' receive layout is the single-node one. Combine comes back the same way:
// one node partial per staged slot, put to the source.
#pragma once
#include "common/state.cuh"
#include "kernels/index_math.cuh"
#include "kernels/peer_ring.cuh"
#include "transport/select.cuh"

namespace hybrid_ep {

template <typename Rdma>
struct Hierarchy {
  Rdma rdma;
  const RdmaLayout& R;
  Topology topo;
  int rank, node;
  int64_t max_chunks, staged;  // chunks per source, staged slots per source node
  PeerRing staging;            // the staging rings (a ring per node: kernels/peer_ring.cuh)

  __device__ bool multi() const { return topo.N > 1; }
  __device__ int first_local() const { return node * topo.G; }  // ranks of this node: first_local() + g
  __device__ int rail_peer(int n) const { return topo.rail_peer(rank, n); }
  // This call's done flag (`done_off`: done_dispatch or done_combine of the RDMA region) to
  // the rail peer on every other node, quieted before the kernel ends: a late one would land
  // over the next call's (kernels/peer_ring.cuh's invariant). One thread.
  __device__ void signal_done_to_rail_peers(uint64_t done_off, uint64_t call) const {
    if (!multi()) return;
    for (int n = 0; n < topo.N; ++n)
      if (n != node) rdma.signal(rail_peer(n), done_off + 8 * node, call);
    rdma.quiet();
  }
  __device__ uint64_t* flag(uint64_t offset, int64_t index) const {
    return reinterpret_cast<uint64_t*>(rdma.local(offset)) + index;
  }
  // Until a signal word that puts deliver is >= target (wait_at_least), then the transport's
  // consistency step: the data those puts wrote is visible to this thread's later reads also
  // through a proxy transport (rdma.cuh, delivered). False when this or another wait gave up.
  __device__ bool wait_delivered(const LaunchArgs& args, const uint64_t* word, uint64_t target, int phase, int peer,
                                 uint64_t call, uint64_t since = 0) const {
    if (!wait_at_least(args, word, target, phase, rank, peer, call, 1, since)) return false;
    rdma.delivered(word, target);
    return true;
  }
  // Byte offsets of (source node n, chunk c) in the per-chunk areas.
  __device__ uint64_t chunk_flag_off(uint64_t area, int n, int c) const {
    return area + static_cast<uint64_t>(n * max_chunks + c) * 8;
  }
  __device__ uint64_t chunk_meta_off(uint64_t area, int n, int c) const {
    return area + static_cast<uint64_t>(n * max_chunks + c) * R.chunk_meta_bytes;
  }
  // The staging rings in the RDMA region (both dispatch kernels): chunk c staged for (or from)
  // node n takes its slot of node n's ring; byte offsets of its row q, of its routing, and of
  // the slot's credit (the rail peer on node n forwarded chunk c from it).
  __device__ uint64_t staged_off(uint64_t area, int n, int c, int q, uint32_t row_bytes) const {
    return area + static_cast<uint64_t>(staging.row(n, c, q)) * row_bytes;
  }
  __device__ uint64_t staged_meta_off(uint64_t area, int n, int c) const {
    return area + static_cast<uint64_t>(staging.word(n, c)) * R.chunk_meta_bytes;
  }
  __device__ uint64_t staged_credit_off(int n, int c) const {
    return R.staged_credit + static_cast<uint64_t>(staging.word(n, c)) * 8;
  }
  // One staged token's record in a chunk's routing: TokenMeta, G receive slots, scales.
  __device__ static TokenMeta* token_meta(uint8_t* chunk_meta, int q, uint64_t token_bytes) {
    return reinterpret_cast<TokenMeta*>(chunk_meta + kChunkMetaHeader + q * token_bytes);
  }
  __device__ int32_t* token_slots(TokenMeta* m) const { return reinterpret_cast<int32_t*>(m + 1); }
  __device__ float* token_scales(TokenMeta* m) const { return reinterpret_cast<float*>(token_slots(m) + topo.G); }

  // The staging ring's writer (both dispatches; its slot acquired by the caller). One warp, lane i
  // with token t of this rank's chunk c, `mask` the lanes whose token goes to node n: each such
  // token's routing at its ordinal among them in the chunk's slot of node n's ring (with
  // `send_ord`, [T, W], also its receive slot at each rank there; the direct path has none),
  // and the chunk's row count in the header. Returns the chunk's routing.
  __device__ uint8_t* stage_routing(const RankArgs& a, int K, int scale_cols, int n, int c, unsigned mask, int lane,
                                    int64_t t, const int32_t* send_ord) const {
    const auto* idx = reinterpret_cast<const int64_t*>(a.topk_idx);
    const auto* weights = reinterpret_cast<const float*>(a.topk_weights);
    const auto* ords = reinterpret_cast<const int32_t*>(a.entry_ord);
    const auto* x_scales = reinterpret_cast<const float*>(a.x_scales);
    uint8_t* meta = rdma.local(staged_meta_off(R.staged_meta_out, n, c));
    if ((mask >> lane) & 1u) {
      TokenMeta* tm = token_meta(meta, __popc(mask & ((1u << lane) - 1u)), R.token_meta_bytes);
      for (int k = 0; k < kMaxTopK; ++k) {
        const bool real = k < K;
        tm->expert[k] = real ? static_cast<int32_t>(idx[t * K + k]) : -1;
        tm->ordinal[k] = real ? ords[t * K + k] : 0;
        tm->weight[k] = real ? weights[t * K + k] : 0.f;
      }
      if (send_ord != nullptr) {
        int32_t* slots = token_slots(tm);
        for (int g = 0; g < topo.G; ++g) slots[g] = send_ord[t * topo.W + n * topo.G + g];
      }
      float* scales = token_scales(tm);
      for (int i = 0; i < scale_cols; ++i) scales[i] = x_scales[t * scale_cols + i];
    }
    if (lane == 0) *reinterpret_cast<int32_t*>(meta) = __popc(mask);
    return meta;
  }
  // Then, once the chunk's rows are staged and the warp fenced them and the routing: its rows,
  // and its routing with the chunk's signal (the tag: kernels/peer_ring.cuh), put into the same
  // slot of the ring for this node at the rail peer on node n. Every lane calls it.
  __device__ void put_staged(int lane, int n, int c, int rows, uint32_t row_bytes, uint64_t call) const {
    const int peer = rail_peer(n);
    if (rows > 0) {
      rdma.put(lane, peer, staged_off(R.staged_rows_in, node, c, 0, row_bytes),
               rdma.local(staged_off(R.staged_rows_out, n, c, 0, row_bytes)), static_cast<uint64_t>(rows) * row_bytes);
      if (lane == 0) rdma.fence();  // the rows are delivered before the routing's signal
      __syncwarp();
    }
    rdma.put_signal(lane, peer, staged_meta_off(R.staged_meta_in, node, c),
                    rdma.local(staged_meta_off(R.staged_meta_out, n, c)),
                    kChunkMetaHeader + static_cast<uint64_t>(rows) * R.token_meta_bytes,
                    chunk_flag_off(R.staged_signal, node, c), PeerRing::tag(call, c));
  }
};

template <typename Rdma>
__device__ Hierarchy<Rdma> make_hierarchy(const Geometry& geo, const RankArgs& a) {
  const Topology topo{geo.world_size, geo.ranks_per_node, geo.num_nodes};
  const int64_t max_chunks = static_cast<int64_t>(geo.reg.max_chunks);
  return Hierarchy<Rdma>{
      make_transport<Rdma>(a), geo.rdma, topo, a.rank, topo.node(a.rank), max_chunks, max_chunks * kChunkTokens,
      peer_rings::staged(geo)};
}

// Forwarded chunks a rank handles: every chunk of the rail peer on every other node, in node
// order, then chunk order. Dispatch forwards them and combine sends their node partials back,
// both strided over the rank's blocks the same way. Call: h (a Hierarchy) and source_chunks(s).
template <typename Call>
__device__ int64_t forwarded_chunks(const Call& call) {
  int64_t total = 0;
  for (int n = 0; n < call.h.topo.N; ++n)
    if (n != call.h.node) total += call.source_chunks(call.h.rail_peer(n));
  return total;
}

// Forwarded chunk k -> (source node n, chunk c).
template <typename Call>
__device__ void forwarded_chunk(const Call& call, int64_t k, int& n, int& c) {
  for (n = 0; n < call.h.topo.N; ++n) {
    if (n == call.h.node) continue;
    const int chunks = call.source_chunks(call.h.rail_peer(n));
    if (k < chunks) break;
    k -= chunks;
  }
  c = static_cast<int>(k);
}

// The units one block of the direct path's dispatch takes, in order (kernels/dispatch_direct.cuh):
// its own chunks (b, b + nb, ... of send_chunks()) and, with several nodes, the chunks that
// arrive from the rail peer on every other node (every chunk of each, numbered chunk by chunk:
// chunk 0 of each node in node order, then chunk 1, ...; units b, b + nb, ...), merged by a
// key: an own chunk c has key c, a forwarded chunk c key c + fwd_lag() and comes after the
// own chunk of that key. The lag (half a ring) lets a source's chunk c arrive while the
// rail peer stores its own chunks up to c + lag, and is below the ring's slots, which keeps every
// wait pointing at a lower key (kernels/peer_ring.cuh: why the rings cannot deadlock).
// Every role of the block walks it alike. Call: h, b, nb, send_chunks(), source_chunks(s),
// fwd_lag().
template <typename Call>
struct DirectUnits {
  const Call& call;
  int key = 0;            // the key looked at
  int node = -1;          // the node looked at next at that key (-1: the own chunk first)
  int64_t forwarded = 0;  // forwarded chunks numbered so far
  int last;               // the last key with a unit

  __device__ explicit DirectUnits(const Call& c) : call(c), last(c.send_chunks() - 1) {
    for (int n = 0; call.h.multi() && n < call.h.topo.N; ++n)
      if (n != call.h.node) last = max(last, call.source_chunks(call.h.rail_peer(n)) - 1 + call.fwd_lag());
  }

  // The next unit: chunk c of this rank (n = -1) or of the rail peer on node n; false at the end.
  __device__ bool next(int& n, int& c) {
    for (; key <= last; ++key, node = -1) {
      if (node < 0) {
        node = 0;
        if (key < call.send_chunks() && key % call.nb == call.b) {
          n = -1, c = key;
          return true;
        }
      }
      const int fc = key - call.fwd_lag();  // the forwarded chunks of this key
      while (call.h.multi() && fc >= 0 && node < call.h.topo.N) {
        const int m = node++;
        if (m == call.h.node || fc >= call.source_chunks(call.h.rail_peer(m))) continue;
        if (block_takes(forwarded++, call.nb, call.b)) {
          n = m, c = fc;
          return true;
        }
      }
    }
    return false;
  }
};

// The chunks one block's source side takes in combine, in order: its own chunks (b, b + nb, ...
// of send_chunks()) and, with several nodes, the forwarded chunks whose node partials it sends
// back (forwarded_chunks' units b, b + nb, ...), merged by chunk index, with an own chunk c
// after the forwarded chunks up to c + lag (own_lag(): a block step or two, so that the rail
// peers' forwarding of chunk c, at the same step of their own order, is likely done when c is
// waited for; less than a turn of the combine's rings, which kernels/peer_ring.cuh's argument
// needs). Call: h, b, nb, own_lag(), send_chunks() and source_chunks(s).
template <typename Call>
struct SourceSideChunks {
  const Call& call;
  int lag;            // an own chunk c comes after the forwarded chunks up to c + lag
  int key = 0;        // the forwarded chunk index looked at (the own chunk key - lag after it)
  int node = 0;       // the node looked at next at that index; N: the own chunk, N + 1: done
  int64_t unit0 = 0;  // forwarded units of the nodes before `node`
  int last;           // the last key with work

  __device__ explicit SourceSideChunks(const Call& c)
      : call(c), lag(c.own_lag()), last(c.send_chunks() - 1 + c.own_lag()) {
    for (int n = 0; n < call.h.topo.N; ++n)
      if (n != call.h.node) last = max(last, call.source_chunks(call.h.rail_peer(n)) - 1);
  }

  // The next chunk: forwarded from source node n, or own (n is this node); false when done.
  __device__ bool next(bool& forwarded, int& n, int& c) {
    const int N = call.h.topo.N;
    for (; key <= last; ++key, node = 0, unit0 = 0) {
      while (node < N) {
        const int m = node++;
        if (m == call.h.node) continue;
        const int chunks = call.source_chunks(call.h.rail_peer(m));
        const int64_t unit = unit0 + key;
        unit0 += chunks;
        if (key < chunks && block_takes(unit, call.nb, call.b)) {
          forwarded = true, n = m, c = key;
          return true;
        }
      }
      if (node == N) {
        node = N + 1;
        const int own = key - lag;
        if (own >= 0 && own < call.send_chunks() && own % call.nb == call.b) {
          forwarded = false, n = call.h.node, c = own;
          return true;
        }
      }
    }
    return false;
  }
};

}  // namespace hybrid_ep
