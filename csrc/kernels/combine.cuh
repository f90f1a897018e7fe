// Combine kernel (a template over the inter-node transport): persistent, one block per SM, warp-specialised. Every block reduces its
// share of the rows this rank received (as their expert host) and, at the same time, sums
// its share of this rank's own tokens (as their source), chunk by chunk as partials arrive.
//
// Expert host (every (source, chunk) this rank received in the dispatch, strided over the
// blocks as in dispatch; the chunk spans come from the handle):
//   warp 0      for each received row and column segment, bulk-loads the row's expert outputs
//               (one per valid output row of the row's entries) into a stage;
//   warps 2-5   take the stages in turn: fp32 sum (times the routing weight with
//               apply_probs), rounded once to the wire dtype into the stage's output area;
//   warp 1      bulk-stores each partial into the source's buffer (store_groups groups in flight)
//               and signals each chunk to its source once the chunk's stores completed.
// Source (this rank's chunks of kChunkTokens tokens, strided over the blocks):
//   warp 6      waits until every rank signalled the chunk, then bulk-loads each token's
//               partials (one per destination rank) for each column segment into a stage;
//   warps 7-14  take the stages in turn: fp32 sum of the partials, rounded once to the
//               output dtype and written to the token's row.
// With several nodes (kernels/hierarchy.cuh) an expert host stores the partial of a source on
// another node into that source's rail peer on this node instead, and
//   warp 15     (forwarder) sums the partials of this node's ranks for each token it forwarded
//               in the dispatch (fp32, rounded once to the wire dtype) and puts one row per
//               token back to the source on the other node, one put with signal per chunk;
// the source's warp 6 then also waits for each other node's chunk and loads its node partials.
// Partials travel in the wire dtype (default the dtype of expert_out, fp32 on request), so
// a bf16 combine rounds once per hop. The last block to finish publishes done_combine, which
// lets peers write the next combine's partials.
#include "common/state.cuh"
#include "kernels/chunks.cuh"
#include "kernels/hierarchy.cuh"
#include "kernels/launch.h"
#include "kernels/pipeline.cuh"

namespace hybrid_ep {
namespace combine_impl {  // kernels/combine.cu and kernels_nvshmem.cu instantiate it

constexpr int kHostLoadWarp = 0, kHostStoreWarp = 1, kHostReduceWarp = 2, kHostReducers = 4;  // 2 .. 5
constexpr int kSrcLoadWarp = 6, kSrcReduceWarp = 7, kSrcReducers = 8;                         // 7 .. 14
constexpr int kForwardWarp = 15;                                                              // several nodes
constexpr int kMaxPendingChunks = 8;    // chunks whose partials are stored but not yet signalled

// ---- four values of a 16-bit or 32-bit dtype <-> fp32 -------------------------------------

template <typename T>
struct Quad;  // 4 elements of T

template <>
struct Quad<float> {
  __device__ static void load(const void* p, float* out) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  }
  __device__ static void store(void* p, const float* in) {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
  }
};

template <typename H2, typename Conv>
struct QuadHalf {
  __device__ static void load(const void* p, float* out) {
    const H2* h = reinterpret_cast<const H2*>(p);
    const float2 a = Conv::to_float2(h[0]), b = Conv::to_float2(h[1]);
    out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
  }
  __device__ static void store(void* p, const float* in) {
    H2* h = reinterpret_cast<H2*>(p);
    h[0] = Conv::from_float2(make_float2(in[0], in[1]));
    h[1] = Conv::from_float2(make_float2(in[2], in[3]));
  }
};

struct BF16Conv {
  __device__ static float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
  __device__ static __nv_bfloat162 from_float2(float2 v) { return __float22bfloat162_rn(v); }
};
struct HalfConv {
  __device__ static float2 to_float2(__half2 v) { return __half22float2(v); }
  __device__ static __half2 from_float2(float2 v) { return __float22half2_rn(v); }
};
template <>
struct Quad<__nv_bfloat16> : QuadHalf<__nv_bfloat162, BF16Conv> {};
template <>
struct Quad<__half> : QuadHalf<__half2, HalfConv> {};

// ---- stages ---------------------------------------------------------------------------------

// An expert-host stage: up to kd input segments (expert_out rows, seg_cols columns each) and
// the partial's output area (seg_cols columns of the wire dtype) after them.
struct HostItem {
  int32_t source, slot;  // the received row: source rank and its slot there
  int32_t col0, cols;    // column segment
  int32_t n;             // valid input segments
  float w[kMaxTopK];     // their weights (1 without apply_probs)
};

// A source stage: up to kMaxPartials partial segments of one token.
struct SrcItem {
  int32_t token, col0, cols, n;
};

struct CombineShared {
  uint64_t host_full[kMaxStages], host_reduced[kMaxStages], host_empty[kMaxStages];
  uint64_t src_full[kMaxStages], src_empty[kMaxStages];
  HostItem host_items[kMaxStages];
  SrcItem src_items[kMaxStages];
  int abort_flow;  // flow-control wait gave up
  volatile int abort;
};

// What every role of a block needs to know about the call.
template <typename Rdma>
struct Combine {
  const LaunchArgs& args;
  const RankArgs& a;
  const RegLayout& reg;
  const InfoLayout& il;
  RankView view;
  int b, nb, W, Tmax, T, kd, C, seg_cols, segments, chunk;
  uint32_t in_bytes, wire_bytes;  // element sizes
  const int64_t* info;
  uint64_t epoch;
  CombineShared& sh;
  uint8_t* host_data;
  uint8_t* src_data;
  Hierarchy<Rdma> h;

  __device__ int send_chunks() const { return (T + chunk - 1) / chunk; }
  __device__ int source_chunks(int s) const { return static_cast<int>((info[il.src_tokens + s] + chunk - 1) / chunk); }
  __device__ void span(int s, int c, int& first, int& rows) const {
    const auto* spans = reinterpret_cast<const int32_t*>(a.recv_spans);
    const int64_t i = (static_cast<int64_t>(s) * static_cast<int64_t>(reg.max_chunks) + c) * 2;
    first = spans[i];
    rows = spans[i + 1];
  }
  // The partial of (source s, slot) from expert host `host`, in s's buffer.
  __device__ uint8_t* partial(int s, int host, int64_t slot) const {
    return view.base(s) + reg.comb_rows + (static_cast<int64_t>(host) * Tmax + slot) * C * wire_bytes;
  }
  __device__ uint64_t* comb_signal(int s, int host, int c) const {
    return reinterpret_cast<uint64_t*>(view.base(s) + reg.combine_signal) +
           static_cast<int64_t>(host) * static_cast<int64_t>(reg.max_chunks) + c;
  }
  // Partials for a source on another node go to its rail peer f on this node: rows of writer
  // (source node, local index of the writer) in f's comb_fwd area, at the writer's slot.
  __device__ int64_t fwd_writer(int s, int writer) const {
    return static_cast<int64_t>(h.topo.node(s)) * h.topo.G + h.topo.local(writer);
  }
  __device__ uint8_t* fwd_partial(int f, int64_t writer_index, int64_t slot) const {
    return view.base(f) + reg.comb_fwd + (writer_index * Tmax + slot) * C * wire_bytes;
  }
  __device__ uint64_t* fwd_signal(int f, int64_t writer_index, int c) const {
    return reinterpret_cast<uint64_t*>(view.base(f) + reg.comb_fwd_signal) +
           writer_index * static_cast<int64_t>(reg.max_chunks) + c;
  }
  // Where this rank, as expert host, stores its partial of (source s, slot) and signals chunk c.
  __device__ uint8_t* host_target(int s, int64_t slot) const {
    if (h.topo.same_node(s, a.rank)) return partial(s, a.rank, slot);
    return fwd_partial(h.topo.rail_peer(s, h.node), fwd_writer(s, a.rank), slot);
  }
  __device__ uint64_t* host_signal(int s, int c) const {
    if (h.topo.same_node(s, a.rank)) return comb_signal(s, a.rank, c);
    return fwd_signal(h.topo.rail_peer(s, h.node), fwd_writer(s, a.rank), c);
  }
  __device__ uint8_t* host_stage(int stage) const {
    return host_data + static_cast<size_t>(stage) * args.host_stage_bytes;
  }
  __device__ uint8_t* host_out(int stage) const {  // after kd input segments
    return host_stage(stage) + static_cast<size_t>(kd) * seg_cols * in_bytes;
  }
  __device__ uint8_t* src_stage(int stage) const { return src_data + static_cast<size_t>(stage) * args.src_stage_bytes; }
  __device__ void stop() const { dev::st_relaxed(&sh.abort, 1); }
  __device__ bool stopped() const { return dev::ld_relaxed(&sh.abort) != 0; }
};

// Item k of a ring whose stages are shared out among several consumer warps.
__device__ __forceinline__ PipeState pipe_at(uint32_t k, int stages) {
  PipeState p;
  p.stage = static_cast<int>(k % stages);
  p.phase = (k / stages) & 1u;
  p.count = k;
  return p;
}

// A parity wait tells only "this phase or the one before": a consumer may never wait for a
// stage's round r before its round r - 1 completed. So each stage has one consumer warp, which
// takes that stage's rounds in order: stage s belongs to warp s % consumers.
__device__ __forceinline__ bool owns(uint32_t k, int stages, int which, int consumers) {
  return static_cast<int>(k % stages) % consumers == which;
}

template <typename Rdma>
using HostChunks = ReceivedChunks<Combine<Rdma>>;  // the (source, chunk) pairs this block reduces

// A reducer warp: lane 0 waits until its stage holds the item; every lane gets the answer.
template <typename Rdma>
__device__ __forceinline__ bool wait_stage(const Combine<Rdma>& d, const Ring& ring, const PipeState& p, int lane) {
  bool ok = true;
  if (lane == 0) ok = !d.stopped() && ring.consumer_wait(d.args, p);
  if (!warp_uniform(ok)) {
    d.stop();
    return false;
  }
  ring.observe_full(p, lane);  // every lane reads the stage's bytes and header
  return true;
}

// ---- expert host ----------------------------------------------------------------------------

template <typename Rdma>
__device__ void host_load(const Combine<Rdma>& d, const Ring& ring) {
  const auto* row_pos = reinterpret_cast<const int32_t*>(d.a.row_pos);
  const auto* probs = reinterpret_cast<const float*>(d.a.probs);
  const auto* expert_out = reinterpret_cast<const uint8_t*>(d.a.expert_out);
  HostChunks<Rdma> chunks(d);
  PipeState produced;
  int s, c;
  while (chunks.next(s, c) && !d.stopped()) {
    int first, rows;
    d.span(s, c, first, rows);
    for (int r = 0; r < rows && !d.stopped(); ++r) {
      const int64_t row = static_cast<int64_t>(s) * d.Tmax + first + r;
      // The row's output rows and weights, read once for all its segments: the loads are
      // independent and issue together here, where between the copies of a segment each
      // read waited for the one before.
      int pos[kMaxTopK];
      float w[kMaxTopK];
      int n = 0;
      for (int q = 0; q < d.kd; ++q) {
        const int p = row_pos[row * d.kd + q];
        if (p >= 0) pos[n++] = p;
      }
      for (int i = 0; i < n; ++i) w[i] = d.args.apply_probs ? probs[pos[i]] : 1.f;
      for (int g = 0; g < d.segments; ++g, produced.advance(ring.stages)) {
        if (!ring.producer_acquire(d.args, produced)) {
          d.stop();
          break;
        }
        HostItem& it = d.sh.host_items[produced.stage];
        it.source = s;
        it.slot = first + r;
        it.col0 = g * d.seg_cols;
        it.cols = min(d.seg_cols, d.C - it.col0);
        it.n = n;
        for (int i = 0; i < n; ++i) it.w[i] = w[i];
        // The bytes first (the arrival also publishes the header), then the copies.
        dev::mbar_arrive_expect_tx(&ring.full[produced.stage], static_cast<uint32_t>(n) * it.cols * d.in_bytes);
        for (int i = 0; i < n; ++i)
          dev::bulk_g2s(d.host_stage(produced.stage) + static_cast<size_t>(i) * d.seg_cols * d.in_bytes,
                        expert_out + (static_cast<int64_t>(pos[i]) * d.C + it.col0) * d.in_bytes,
                        it.cols * d.in_bytes, &ring.full[produced.stage]);
      }
    }
  }
  StageRing{ring, d.host_data, d.args.host_stage_bytes}.drain(d.args, PipeState{}, produced);
}

template <typename Rdma, typename In, typename Wire>
__device__ void host_reduce(const Combine<Rdma>& d, const Ring& ring, const uint64_t* reduced, int which, int lane) {
  // This warp takes the items of the stages it owns, in order.
  HostChunks<Rdma> chunks(d);
  uint32_t k = 0;  // items before the current chunk
  int s, c;
  while (chunks.next(s, c)) {
    int first, rows;
    d.span(s, c, first, rows);
    const uint32_t items = static_cast<uint32_t>(rows) * d.segments;
    for (uint32_t item = k; item < k + items; ++item) {
      if (!owns(item, ring.stages, which, kHostReducers)) continue;
      const PipeState p = pipe_at(item, ring.stages);
      if (!wait_stage(d, ring, p, lane)) return;
      const HostItem& it = d.sh.host_items[p.stage];
      const uint8_t* in = d.host_stage(p.stage);
      uint8_t* out = d.host_out(p.stage);
      for (int v = lane; v < it.cols / 4; v += 32) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int q = 0; q < it.n; ++q) {
          float val[4];
          Quad<In>::load(in + (static_cast<size_t>(q) * d.seg_cols + v * 4) * sizeof(In), val);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[e] += it.w[q] * val[e];
        }
        Quad<Wire>::store(out + static_cast<size_t>(v) * 4 * sizeof(Wire), acc);
      }
      dev::fence_proxy_async();  // this lane's output, read next by a bulk store
      __syncwarp();
      if (lane == 0) dev::mbar_arrive(const_cast<uint64_t*>(&reduced[p.stage]));
    }
    k += items;
  }
}

template <typename Rdma>
__device__ void host_store(const Combine<Rdma>& d, const Ring& ring, uint64_t* reduced) {
  const int in_flight = store_groups_in_flight(d.args, ring.stages);
  HostChunks<Rdma> chunks(d);
  PipeState consumed, released;
  uint32_t groups = 0;
  // Chunks stored but not yet signalled: (source, chunk, the group that completes it).
  int pend_s[kMaxPendingChunks] = {}, pend_c[kMaxPendingChunks] = {};
  uint32_t pend_g[kMaxPendingChunks] = {};
  int npend = 0;
  auto signal_through = [&](uint32_t upto_group, int writes_in_flight) {
    if (npend == 0 || pend_g[0] > upto_group) return;
    bulk_wait_write_except(writes_in_flight);
    dev::fence_proxy_async();  // the bulk writes, before the generic releases below
    __threadfence_system();
    int kept = 0;
    for (int i = 0; i < npend; ++i) {
      if (pend_g[i] <= upto_group) {
        dev::st_release_sys(d.host_signal(pend_s[i], pend_c[i]), d.epoch);
      } else {
        pend_s[kept] = pend_s[i], pend_c[kept] = pend_c[i], pend_g[kept] = pend_g[i];
        ++kept;
      }
    }
    npend = kept;
  };

  int s, c;
  while (chunks.next(s, c) && !d.stopped()) {
    int first, rows;
    d.span(s, c, first, rows);
    bool ok = true;
    for (int k = 0; k < rows * d.segments; ++k, consumed.advance(ring.stages)) {
      if (d.stopped() || !mbar_wait(d.args, &reduced[consumed.stage], consumed.phase, d.a.rank, d.epoch)) {
        ok = false;
        break;
      }
      const HostItem& it = d.sh.host_items[consumed.stage];
      dev::bulk_s2g(d.host_target(it.source, it.slot) + static_cast<int64_t>(it.col0) * d.wire_bytes,
                    d.host_out(consumed.stage), it.cols * d.wire_bytes);
      dev::bulk_commit();
      ++groups;
      signal_through(groups - 1, 1);  // chunks complete with an older group; this one stays in flight
      bulk_wait_read_except(in_flight);
      for (; released.count + in_flight <= consumed.count; released.advance(ring.stages)) ring.consumer_release(released);
    }
    if (!ok) {
      d.stop();
      break;
    }
    if (npend == kMaxPendingChunks) signal_through(groups, 0);
    pend_s[npend] = s, pend_c[npend] = c, pend_g[npend] = groups;
    ++npend;
  }
  if (!d.stopped()) signal_through(groups, 0);
  dev::bulk_wait_all();
  for (; released.count < consumed.count; released.advance(ring.stages)) ring.consumer_release(released);
}

// ---- source ---------------------------------------------------------------------------------

template <typename Rdma>
__device__ void src_load(const Combine<Rdma>& d, const Ring& ring) {
  const auto* send_slot = reinterpret_cast<const int32_t*>(d.a.send_slot);
  const Hierarchy<Rdma>& h = d.h;
  const int G = h.topo.G, N = h.topo.N, first = h.first_local();
  const uint32_t row_b = static_cast<uint32_t>(d.C) * d.wire_bytes;
  PipeState produced;
  for (int c = d.b; c < d.send_chunks() && !d.stopped(); c += d.nb) {
    bool ok = true;
    for (int g = 0; g < G && ok; ++g)  // every expert host of this node stored its partials of chunk c
      ok = wait_at_least(d.args, d.comb_signal(d.a.rank, first + g, c), d.epoch, kPhaseCombineRows, d.a.rank,
                         first + g, d.epoch);
    for (int n = 0; n < N && ok; ++n)  // and every other node's rail peer put its node partials
      if (n != h.node)
        ok = wait_at_least(d.args, h.flag(h.chunk_flag_off(h.R.comb_signal, n, c), 0), d.epoch, kPhaseRdmaPartials,
                           d.a.rank, h.rail_peer(n), d.epoch);
    if (!ok) {
      d.stop();
      break;
    }
    dev::fence_proxy_async();  // the partials are read by bulk loads below
    const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk);
    int staged[kMaxRanks];  // next staged slot of this chunk at each other node
    for (int n = 0; n < N; ++n) staged[n] = c * d.chunk;
    for (int t = t0; t < t1 && !d.stopped(); ++t) {
      const int32_t* slots = send_slot + static_cast<int64_t>(t) * d.W;
      // This token's partials: one per expert host of this node, one per other node it reached.
      int n_parts = 0;
      for (int g = 0; g < G; ++g) n_parts += slots[first + g] >= 0;
      uint64_t remote = 0;  // bit n: the token reached node n (another node)
      for (int n = 0; n < N; ++n) {
        if (n == h.node) continue;
        bool goes = false;
        for (int g = 0; g < G; ++g) goes |= slots[n * G + g] >= 0;
        if (goes) remote |= 1ull << n, ++n_parts;
      }
      for (int seg = 0; seg < d.segments; ++seg, produced.advance(ring.stages)) {
        if (!ring.producer_acquire(d.args, produced)) {
          d.stop();
          break;
        }
        SrcItem& it = d.sh.src_items[produced.stage];
        it.token = t;
        it.col0 = seg * d.seg_cols;
        it.cols = min(d.seg_cols, d.C - it.col0);
        it.n = n_parts;
        const uint32_t bytes = it.cols * d.wire_bytes;
        dev::mbar_arrive_expect_tx(&ring.full[produced.stage], static_cast<uint32_t>(n_parts) * bytes);
        int i = 0;
        auto load = [&](const uint8_t* row) {
          dev::bulk_g2s(d.src_stage(produced.stage) + static_cast<size_t>(i++) * d.seg_cols * d.wire_bytes,
                        row + static_cast<int64_t>(it.col0) * d.wire_bytes, bytes, &ring.full[produced.stage]);
        };
        for (int g = 0; g < G; ++g)
          if (slots[first + g] >= 0) load(d.partial(d.a.rank, first + g, slots[first + g]));
        for (int n = 0; n < N; ++n)
          if ((remote >> n) & 1) load(h.rdma.local(h.staged_off(h.R.comb_rows_in, n, staged[n], row_b)));
      }
      for (int n = 0; n < N; ++n) staged[n] += (remote >> n) & 1;
    }
  }
  StageRing{ring, d.src_data, d.args.src_stage_bytes}.drain(d.args, PipeState{}, produced);
}

// Warp 15 with several nodes: for each chunk this rank forwarded in the dispatch (kept by the
// handle: fwd_rows, fwd_slots), wait for every rank of this node's partials of it, sum them
// per token in fp32, round once to the wire dtype into the staging area and put the chunk's
// node partials to the source, with its signal (also for no rows). The layout of the put is
// the dispatch's staging: slot c * kChunkTokens + q.
template <typename Rdma, typename Wire>
__device__ void forward_reduce(const Combine<Rdma>& d, int lane) {
  const Hierarchy<Rdma>& h = d.h;
  const auto* fwd_slots = reinterpret_cast<const int32_t*>(d.a.fwd_slots);
  const auto* fwd_rows = reinterpret_cast<const int32_t*>(d.a.fwd_rows);
  const int G = h.topo.G, first = h.first_local();
  const uint32_t row_b = static_cast<uint32_t>(d.C) * d.wire_bytes;
  const int64_t units = forwarded_chunks(d);
  for (int64_t u = d.b; u < units && !d.stopped(); u += d.nb) {
    int n, c;
    forwarded_chunk(d, u, n, c);
    bool ok = true;
    for (int g = 0; g < G && ok && lane == 0; ++g)
      ok = wait_at_least(d.args, d.fwd_signal(d.a.rank, static_cast<int64_t>(n) * G + g, c), d.epoch,
                         kPhaseNodePartials, d.a.rank, first + g, d.epoch);
    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
    const int rows = fwd_rows[static_cast<int64_t>(n) * h.max_chunks + c];
    const int64_t slot0 = static_cast<int64_t>(c) * d.chunk;
    for (int q = 0; q < rows; ++q) {
      const int32_t* slots = fwd_slots + (static_cast<int64_t>(n) * h.staged + slot0 + q) * G;
      uint8_t* out = h.rdma.local(h.staged_off(h.R.comb_rows_out, n, slot0 + q, row_b));
      for (int v = lane; v < d.C / 4; v += 32) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int g = 0; g < G; ++g) {
          if (slots[g] < 0) continue;
          float val[4];
          Quad<Wire>::load(d.fwd_partial(d.a.rank, static_cast<int64_t>(n) * G + g, slots[g]) +
                               static_cast<size_t>(v) * 4 * sizeof(Wire), val);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[e] += val[e];
        }
        Quad<Wire>::store(out + static_cast<size_t>(v) * 4 * sizeof(Wire), acc);
      }
    }
    __threadfence();  // the staged node partials, before the transport reads them
    __syncwarp();
    h.rdma.put_signal(lane, h.rail_peer(n), h.staged_off(h.R.comb_rows_in, h.node, slot0, row_b),
                      h.rdma.local(h.staged_off(h.R.comb_rows_out, n, slot0, row_b)),
                      static_cast<uint64_t>(rows) * row_b, h.chunk_flag_off(h.R.comb_signal, h.node, c), d.epoch);
  }
  if (lane == 0) h.rdma.quiet();
}

template <typename Rdma, typename Out, typename Wire>
__device__ void src_reduce(const Combine<Rdma>& d, const Ring& ring, int which, int lane) {
  auto* y = reinterpret_cast<uint8_t*>(d.a.y);
  uint32_t k = 0;  // items before the current chunk
  for (int c = d.b; c < d.send_chunks(); c += d.nb) {
    const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk);
    const uint32_t items = static_cast<uint32_t>(t1 - t0) * d.segments;
    for (uint32_t item = k; item < k + items; ++item) {
      if (!owns(item, ring.stages, which, kSrcReducers)) continue;
      const PipeState p = pipe_at(item, ring.stages);
      if (!wait_stage(d, ring, p, lane)) return;
      const SrcItem& it = d.sh.src_items[p.stage];
      const uint8_t* in = d.src_stage(p.stage);
      uint8_t* out = y + (static_cast<int64_t>(it.token) * d.C + it.col0) * sizeof(Out);
      for (int v = lane; v < it.cols / 4; v += 32) {
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        for (int q = 0; q < it.n; ++q) {
          float val[4];
          Quad<Wire>::load(in + (static_cast<size_t>(q) * d.seg_cols + v * 4) * sizeof(Wire), val);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[e] += val[e];
        }
        Quad<Out>::store(out + static_cast<size_t>(v) * 4 * sizeof(Out), acc);
      }
      __syncwarp();
      if (lane == 0) ring.consumer_release(p);
    }
    k += items;
  }
}

template <typename Rdma, typename Elem, typename Wire>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ LaunchArgs args) {
  const BlockPlace place = block_place(args);
  const RankArgs& a = place.rank;
  if (a.absent) return;
  const Geometry& geo = args.geo;
  const RankView view = rank_view(geo, a);
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  CombineShared& sh = dev::block_shared<CombineShared>();
  LocalState* st = view.state();
  const uint64_t epoch = st->combine_epoch + 1;
  uint8_t* smem = dev::dynamic_smem<uint8_t>();
  const int C = args.row_elems;
  const Combine<Rdma> d{args, a, geo.reg, geo.info, view, place.block, place.blocks, geo.world_size, geo.max_tokens,
                  a.num_tokens, args.kd, C, args.seg_cols, (C + args.seg_cols - 1) / args.seg_cols, args.chunk_tokens,
                  static_cast<uint32_t>(sizeof(Elem)), static_cast<uint32_t>(sizeof(Wire)),
                  reinterpret_cast<const int64_t*>(a.info), epoch, sh, smem,
                  smem + static_cast<size_t>(args.host_stages) * args.host_stage_bytes,
                  make_hierarchy<Rdma>(geo, a)};
  const bool multi = d.h.multi();
  const Ring host{sh.host_full, sh.host_empty, args.host_stages, a.rank, epoch};
  const Ring src{sh.src_full, sh.src_empty, args.src_stages, a.rank, epoch};

  if (tid == 0) {
    host.init(1, 1);
    src.init(1, 1);
    for (int s = 0; s < args.host_stages; ++s) dev::mbar_init(&sh.host_reduced[s], 1);
    dev::mbar_fence_init();
    sh.abort_flow = 0;
    sh.abort = aborted(args) ? 1 : 0;
  }
  __syncthreads();
  if (sh.abort) return;

  // Flow control: a source (or a rail peer, for sources on other nodes) must have read the
  // partials of the previous combine before this rank writes the next ones into its buffer;
  // so must every source on another node this rank forwards for, before the next node partials.
  if (tid < d.W) {
    bool ok = true;
    if (d.h.topo.same_node(tid, a.rank))
      ok = wait_at_least(args, view.flag(tid, geo.reg.done_combine, 0), epoch - 1, kPhaseCombineFlow, a.rank, tid,
                         epoch);
    else if (tid == d.h.rail_peer(d.h.topo.node(tid)))
      ok = wait_at_least(args, d.h.flag(geo.rdma.done_combine, d.h.topo.node(tid)), epoch - 1, kPhaseRdmaFlow,
                         a.rank, tid, epoch);
    if (!ok) sh.abort_flow = 1;
  }
  __syncthreads();
  if (sh.abort_flow) return;

  if (warp == kHostLoadWarp) {
    if (lane == 0) host_load(d, host);
  } else if (warp == kHostStoreWarp) {
    if (lane == 0) host_store(d, host, sh.host_reduced);
  } else if (warp < kHostReduceWarp + kHostReducers) {
    host_reduce<Rdma, Elem, Wire>(d, host, sh.host_reduced, warp - kHostReduceWarp, lane);
  } else if (warp == kSrcLoadWarp) {
    if (lane == 0) src_load(d, src);
  } else if (warp < kSrcReduceWarp + kSrcReducers) {
    src_reduce<Rdma, Elem, Wire>(d, src, warp - kSrcReduceWarp, lane);
  } else if (warp == kForwardWarp && multi) {
    forward_reduce<Rdma, Wire>(d, lane);
  }
  __syncthreads();

  if (tid == 0 && !sh.abort && !aborted(args)) {
    __threadfence();
    const uint32_t prev = atomicAdd(&st->blocks_done_combine, 1u);
    if (prev == static_cast<uint32_t>(d.nb - 1)) {
      st->blocks_done_combine = 0;
      st->combine_epoch = epoch;
      __threadfence_system();
      dev::st_release_sys(view.flag(a.rank, geo.reg.done_combine, 0), epoch);
      // The node partials the rail peers on other nodes put here are read: they may put the next.
      for (int n = 0; multi && n < d.h.topo.N; ++n)
        if (n != d.h.node) d.h.rdma.signal(d.h.rail_peer(n), geo.rdma.done_combine + 8 * d.h.node, epoch);
    }
  }
}

template <typename Rdma, typename Elem, typename Wire>
LaunchStatus launch_combine_typed(const LaunchArgs& args, uint64_t stream) {
  return dev::launch_cooperative(combine_kernel<Rdma, Elem, Wire>, args.num_ranks * args.blocks_per_rank, kThreads,
                                 static_cast<size_t>(args.host_stages) * args.host_stage_bytes +
                                     static_cast<size_t>(args.src_stages) * args.src_stage_bytes,
                                 stream, args);
}

template <typename Rdma>
LaunchStatus launch_combine_with(const LaunchArgs& args, uint64_t stream) {
  const bool fp32_wire = args.wire_dtype == kFloat32;
  switch (args.dtype) {
    case kFloat32: return launch_combine_typed<Rdma, float, float>(args, stream);
    case kBFloat16:
      return fp32_wire ? launch_combine_typed<Rdma, __nv_bfloat16, float>(args, stream)
                       : launch_combine_typed<Rdma, __nv_bfloat16, __nv_bfloat16>(args, stream);
    case kFloat16:
      return fp32_wire ? launch_combine_typed<Rdma, __half, float>(args, stream)
                       : launch_combine_typed<Rdma, __half, __half>(args, stream);
    default: return "combine: unsupported dtype code";
  }
}

}  // namespace combine_impl

}  // namespace hybrid_ep
