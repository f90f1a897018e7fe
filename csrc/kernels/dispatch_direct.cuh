// Dispatch kernel of the direct path (the ranks of a node address each other's output
// tensors), a template over the inter-node transport: persistent, one block per SM. Every block
// sends its share of this rank's chunks of kChunkTokens tokens straight into their final
// expert-major rows on each route's rank of its node: one bulk load of a token's row, one bulk
// store per route, so a row moves once per route instead of once into a receive buffer and
// again into its expert's rows. A rank's work as a destination is its zero padding; the kernel
// returns once every source of its node has written its rows.
//
//   warp 0      bulk-loads the unit's rows into the FIFO (small rows batched per stage, rows
//               larger than a stage in segments);
//   warp 1      builds the unit's route table, a lane per token: each route's output row at
//               its expert's rank (the first row of the source's rows of that expert, from the
//               destination's count kernel, plus the route's ordinal; -1 where num_out_tokens
//               clipped it), kept in the handle for combine, and writes each route's routing
//               weight and fp8 scales into the destination's tensors;
//   warps 2-3   bulk-store each stage once per target of its rows, the two warps taking
//               alternate stages (of an even number: the launcher refuses another), store_groups groups
//               in flight each, then release the stage (1 arrival);
//   warps 4-5   write this rank's zero padding rows (kernels/padding.cuh); with several nodes
//               warp 4 is the RDMA warp (below) and warp 5 writes the padding.
// At the start block 0 publishes this rank's output tensors and every block reads those of every
// rank of its node (kernels/direct.cuh, bounded waits); at the end the last block of this rank
// tells every rank of its node that its rows have landed, and block 0 waits until every rank of
// the node said so, then publishes done_dispatch.
//
// With several nodes (kernels/hierarchy.cuh) a block's units are its own chunks and the chunks
// that arrive from the rail peers on other nodes (DirectUnits, merged by key):
//   own chunk c     routes to this node's ranks as above; for each other node n the chunk's
//                   token reaches, one more target: row q of the chunk's slot of
//                   the staging ring for n in this rank's RDMA region (staged_rows_out), q the
//                   token's ordinal among the chunk's tokens for n. Once both store warps'
//                   stores of the chunk completed (the done ring: one arrival each), the RDMA
//                   warp writes each token's routing for n (TokenMeta: every route's expert,
//                   ordinal and weight, then its fp8 scales) and puts the rows and the routing,
//                   with the chunk's signal, into the same slot of the rail peer on n;
//   forwarded chunk c of the rail peer on node m: the load warp and the table warp wait for
//                   its signal (kPhaseRdmaRows); the rows are loaded from staged_rows_in into the
//                   FIFO as an own chunk's are, and the table warp computes each route to a rank
//                   of this node from the published layout (that rank's first row of the
//                   source's rows of the expert, + the route's ordinal), writes its weight and
//                   scales there and keeps the routes in the handle (fwd_routes, fwd_rows) for
//                   combine. Once both store warps waited for the chunk's loads (the table
//                   warp read its routing before; a chunk without rows takes one stage without
//                   bytes, which says the load warp read its header), the RDMA warp releases
//                   the chunk's staging slot to the source: both ends of the slot are free.
// The staging rings are rings between ranks (kernels/peer_ring.cuh: their invariant, and why no
// wait closes a cycle, with the units' keys of DirectUnits): before a store warp stores own chunk
// c into the staging, it acquires the chunk's slot from every other node (the RDMA warp writes
// the routing into it for every node, rows or none). A store warp holds at most one unit whose
// done arrival is pending (its stores in flight) and makes it before any wait that may block,
// and the RDMA warp waits only for the store warps, so no unit is held back by a later one.
//
// A wait that gives up raises the launch's abort flag; every role then leaves its loop, producers
// wait for the loads they issued and stores for their bulk groups, so no block exits with a copy
// touching its shared memory.
#include "common/state.cuh"
#include "kernels/direct.cuh"
#include "kernels/hierarchy.cuh"
#include "kernels/index_math.cuh"
#include "kernels/launch.h"
#include "kernels/padding.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/skeleton.cuh"

namespace hybrid_ep {
namespace dispatch_direct_impl {  // kernels/direct.cu and kernels_nvshmem.cu instantiate it

// Warp roles (kDirectThreads = 192: 6 warps); with several nodes warp 4 is the RDMA warp.
enum class DirectRole { kLoad, kTable, kStore, kRdma, kPad };
constexpr int kStoreWarps = kDirectStoreWarps, kPadWarps = 2;
constexpr int kDirectThreads = 6 * 32;
__host__ __device__ constexpr RoleTable<DirectRole, 5> direct_warps(bool multi) {
  const int rdma = multi ? 1 : 0;
  return {{{DirectRole::kLoad, 0, 1},
           {DirectRole::kTable, 1, 1},
           {DirectRole::kStore, 2, kStoreWarps},
           {DirectRole::kRdma, 2 + kStoreWarps, rdma},
           {DirectRole::kPad, 2 + kStoreWarps + rdma, kPadWarps - rdma}}};
}
static_assert(direct_warps(false).tiles(kDirectThreads / 32) && direct_warps(true).tiles(kDirectThreads / 32),
              "the direct dispatch's roles tile its block");
constexpr int kTableSlots = 2;  // units whose route tables are ready ahead of the stores
constexpr int kDoneSlots = 4;   // several nodes: units the store warps finished, for the RDMA warp
// A route table's destination at or above this is node (value - kStagedTarget)'s staging ring.
constexpr int kStagedTarget = 128;
static_assert(kMaxDomainRanks <= kStagedTarget && kStagedTarget + kMaxNodes <= 256, "destinations are uint8_t");

// A unit's targets, per row (at most K: a route to this node's ranks, or one per other node the
// row reaches, which takes at least one of its routes): the output row at the target's rank (or
// the row of the staging slot) and that rank's local index on this node (or kStagedTarget + node).
struct RouteTable {
  int32_t u0, u1;  // the unit's rows: tokens [u0, u1) of x, or staged rows [0, u1) of a forwarded chunk
  int32_t targets[kChunkTokens];
  int32_t row[kChunkTokens][kMaxTopK];
  uint8_t dest[kChunkTokens][kMaxTopK];
};

// Whether row i of a unit has a route to row p of destination dst (a chunk's consecutive tokens
// of one expert take consecutive rows there: their ordinals follow each other).
__device__ __forceinline__ bool routes_to(const RouteTable& tab, int i, int dst, int p) {
  for (int q = 0; q < tab.targets[i]; ++q)
    if (tab.dest[i][q] == dst && tab.row[i][q] == p) return true;
  return false;
}

struct DirectDispatchShared {
  uint64_t full[kMaxStages], empty[kMaxStages];
  uint64_t table_full[kTableSlots], table_empty[kTableSlots];
  uint64_t done_full[kDoneSlots], done_empty[kDoneSlots];  // several nodes: store warps -> RDMA warp
  RouteTable tables[kTableSlots];
  // each destination's on this node (by local index), this process's addresses
  uint64_t rows[kMaxDomainRanks], probs[kMaxDomainRanks], scales[kMaxDomainRanks];
  int64_t num_rows[kMaxDomainRanks];
  // [source node m][rank g of this node][its local expert j]: the first output row there of the
  // rows of the source on node m that this rank serves (itself, or its rail peer on m)
  int32_t first_row[kMaxExperts];
  BlockControl ctl;
};
static_assert(sizeof(DirectDispatchShared) <= kStaticSmemReserve,
              "the dispatch_direct kernel's static shared memory outgrew the launch plans' reserve");

// What every role of a block needs to know about the call.
template <typename Rdma>
struct DirectDispatch : KernelCall {
  const InfoLayout& il;
  int W, G, L, T, K, scale_cols, chunk, stages;
  uint32_t row_bytes;
  RowBatches batches;
  const int64_t* info;
  DirectDispatchShared& sh;
  StageRing fifo;
  Ring table_ring, done_ring;
  Hierarchy<Rdma> h;

  __device__ DirectDispatch(const KernelCall& k, DirectDispatchShared& shared, uint8_t* smem)
      : KernelCall(k), il(k.geo.info), W(k.geo.world_size), G(k.geo.ranks_per_node), L(k.geo.local_experts),
        T(k.a.num_tokens), K(k.a.topk), scale_cols(k.args.scale_cols), chunk(k.args.chunk_tokens),
        stages(k.args.fifo_stages), row_bytes(static_cast<uint32_t>(k.args.row_elems) * elem_bytes(k.args.dtype)),
        batches(RowBatches::of(row_bytes, k.args)), info(reinterpret_cast<const int64_t*>(k.a.info)), sh(shared),
        fifo{k.ring(shared.full, shared.empty, stages, kSiteDirectRows), smem, k.args.stage_bytes},
        table_ring(k.ring(shared.table_full, shared.table_empty, kTableSlots, kSiteDirectTables)),
        done_ring(k.ring(shared.done_full, shared.done_empty, kDoneSlots, kSiteDirectDone)),
        h(make_hierarchy<Rdma>(k.geo, k.a)) {}

  __device__ int send_chunks() const { return (T + chunk - 1) / chunk; }
  __device__ int chunks() const { return send_chunks(); }
  __device__ int source_chunks(int s) const { return chunks_of(info[il.src_tokens + s], chunk); }
  __device__ int fwd_lag() const { return h.staging.slots / 2; }  // DirectUnits (kernels/peer_ring.cuh)
  // The FIFO items of a unit (m: its source node, -1 for an own chunk): its stages, or one stage
  // without bytes for a forwarded chunk without rows, so the store warps' done arrival, and
  // with it the chunk's staging credit, comes after the load warp read the chunk's header.
  __device__ int unit_items(int m, int u0, int u1) const {
    return m >= 0 ? max(1, batches.items(u0, u1)) : batches.items(u0, u1);
  }
  __device__ const uint64_t* arrival(int m, int c) const {
    return h.flag(h.chunk_flag_off(h.R.staged_signal, m, c), 0);
  }
  // A forwarded chunk's routing (its header holds its rows), in this rank's RDMA region.
  __device__ uint8_t* fwd_meta(int m, int c) const { return h.rdma.local(h.staged_meta_off(h.R.staged_meta_in, m, c)); }
  // Lane 0: until forwarded chunk c of the rail peer on node m arrived (bounded); its rows.
  __device__ bool arrive(int m, int c, int& rows) const {
    if (!h.staging.reader_wait_delivered(h.rdma, args, arrival(m, c), call, c, a.rank, h.rail_peer(m))) return false;
    rows = *reinterpret_cast<const volatile int32_t*>(fwd_meta(m, c));
    return true;
  }
  // Whether token t (t0 <= t < t1) of this rank has a route to node n. Every lane calls it.
  __device__ bool reaches(int t, int t1, int n) const {
    const auto* idx = reinterpret_cast<const int64_t*>(a.topk_idx);
    bool goes = false;
    for (int k = 0; t < t1 && k < K; ++k) {
      const int64_t e = idx[static_cast<int64_t>(t) * K + k];
      goes |= e >= 0 && h.topo.node(expert_rank(e, L)) == n;
    }
    return goes;
  }
};

// Warp 0 (lane 0): the block's units' rows into the FIFO.
template <typename Rdma>
__device__ void load_rows(const DirectDispatch<Rdma>& d) {
  const auto* x = reinterpret_cast<const uint8_t*>(d.a.x);
  PipeState produced;
  DirectUnits<DirectDispatch<Rdma>> units(d);
  int m, c;
  while (!d.stopped() && units.next(m, c)) {
    int u0 = c * d.chunk, u1 = min(d.T, u0 + d.chunk);
    const uint8_t* rows = x;
    if (m >= 0) {  // rows that arrived by RDMA, read by bulk loads
      u0 = 0;
      if (!d.arrive(m, c, u1)) {
        d.stop();
        break;
      }
      dev::fence_proxy_async();
      rows = d.h.rdma.local(d.h.staged_off(d.h.R.staged_rows_in, m, c, 0, d.row_bytes));
    }
    for (int k = 0; k < d.unit_items(m, u0, u1) && !d.stopped(); ++k, produced.advance(d.stages)) {
      if (!d.fifo.ring.producer_acquire(d.args, produced)) {
        d.stop();
        break;
      }
      if (u1 == u0) {  // a forwarded chunk without rows: the stage says its header was read
        d.fifo.ring.producer_commit(produced);
        continue;
      }
      const RowBatches::Item it = d.batches.item(u0, u1, k);
      d.fifo.load(produced, rows + static_cast<int64_t>(it.first) * d.row_bytes + it.offset, it.rows * it.bytes);
    }
  }
  d.fifo.drain(d.args, PipeState{}, produced);
}

// Tokens whose fp8 scales route_scales loads before storing any of them: their loads are in
// flight together, so a chunk pays kScaleBatch-fold fewer load latencies (a token at a time, each
// token's stores waited for its own load: 32 device-memory latencies per chunk on the table warp,
// which the store warps wait for once the rows are half as wide as bf16's).
constexpr int kScaleBatch = 8;

// Warp 1, once a unit's table is written: each of its tokens' fp8 scales (scales(j): token j's)
// to each of its routes' rows on this node (another node's targets get theirs from the RDMA warp).
// The whole warp copies kScaleBatch tokens at a time: lane l holds each token's scales 4 l .. 4 l + 3
// of each pass of 128 (one 16-byte load where the input's row allows it), all the batch's loaded
// before any is stored, then stored to every route's row (16 bytes where the row is aligned, else 4
// at a time), so a route's scales go as whole sectors (8 at H = 8192, 7 at 7168). A lane per token
// storing each scale alone took a sector, and a load, per scale and route (ncu on the H200: about
// 2.9 ns each, 64 per route at H = 8192, which left the fp8 dispatch slower than bf16's).
template <typename Rdma, typename Scales>
__device__ void route_scales(const DirectDispatch<Rdma>& d, const RouteTable& tab, int tokens, int lane,
                             Scales scales) {
  const int S = d.scale_cols;
  if (S == 0) return;
  __syncwarp();  // every lane's routes in the table
  const auto aligned = [](const float* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; };
  for (int j0 = 0; j0 < tokens; j0 += kScaleBatch) {
    for (int base = 0; base < S; base += 4 * 32) {
      const int c = base + 4 * lane, mine = max(0, min(4, S - c));  // this lane's scales of the pass
      float v[kScaleBatch][4];
#pragma unroll
      for (int b = 0; b < kScaleBatch; ++b) {
        v[b][0] = v[b][1] = v[b][2] = v[b][3] = 0.f;
        if (j0 + b >= tokens || mine == 0) continue;
        const float* src = scales(j0 + b);
        if (mine == 4 && aligned(src + c)) {
          const float4 q = dev::ld(reinterpret_cast<const float4*>(src + c));
          v[b][0] = q.x, v[b][1] = q.y, v[b][2] = q.z, v[b][3] = q.w;
        } else {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (e < mine) v[b][e] = dev::ld(src + c + e);
        }
      }
#pragma unroll
      for (int b = 0; b < kScaleBatch; ++b) {
        const int j = j0 + b;
        for (int r = 0; j < tokens && r < tab.targets[j] && mine > 0; ++r) {
          const int dst = tab.dest[j][r];
          if (dst >= kStagedTarget) continue;
          float* to = reinterpret_cast<float*>(d.sh.scales[dst]) + static_cast<int64_t>(tab.row[j][r]) * S + c;
          if (mine == 4 && aligned(to)) {
            dev::st(reinterpret_cast<float4*>(to), make_float4(v[b][0], v[b][1], v[b][2], v[b][3]));
          } else {
#pragma unroll
            for (int e = 0; e < 4; ++e)
              if (e < mine) dev::st(to + e, v[b][e]);
          }
        }
      }
    }
  }
}

// Warp 1, an own chunk (lane i: token t0 + i): each route to a rank of this node, the handle's
// route rows, the routing weights and (route_scales) fp8 scales at each route's output row, and with several
// nodes one target per other node the token reaches (its row in that node's staging slot).
template <typename Rdma>
__device__ void own_table(const DirectDispatch<Rdma>& d, RouteTable& tab, int c, int lane) {
  const auto* idx = reinterpret_cast<const int64_t*>(d.a.topk_idx);
  const auto* weights = reinterpret_cast<const float*>(d.a.topk_weights);
  const auto* ords = reinterpret_cast<const int32_t*>(d.a.entry_ord);
  const auto* x_scales = reinterpret_cast<const float*>(d.a.x_scales);
  auto* route_rows = reinterpret_cast<int32_t*>(d.a.route_rows);
  const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk);
  const int64_t t = static_cast<int64_t>(t0) + lane;
  int n = 0;
  if (lane < d.chunk && t < t1) {
    // Every route's expert, ordinal and weight loaded before the first store, so their loads are
    // in flight together (a store between them would order each route's loads after the last
    // route's stores: a device-memory latency per route on the table warp).
    int32_t expert[kMaxTopK], ord[kMaxTopK];
    float weight[kMaxTopK];
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      if (k >= d.K) continue;
      expert[k] = static_cast<int32_t>(dev::ld(&idx[t * d.K + k]));  // checked by the count kernel: -1 or valid
      ord[k] = dev::ld(&ords[t * d.K + k]);
      weight[k] = dev::ld(&weights[t * d.K + k]);
    }
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      if (k >= d.K) continue;
      const int e = expert[k];
      int32_t row = -1;
      const int dst = e >= 0 ? expert_rank(e, d.L) : 0;
      if (e >= 0 && d.h.topo.same_node(dst, d.a.rank)) {  // another node's routes: its rail peer's
        const int64_t p = static_cast<int64_t>(d.sh.first_row[e]) + ord[k];
        const int g = d.h.topo.local(dst);
        if (p < d.sh.num_rows[g]) {
          row = static_cast<int32_t>(p);
          dev::st(reinterpret_cast<float*>(d.sh.probs[g]) + p, weight[k]);
          tab.row[lane][n] = row;
          tab.dest[lane][n] = static_cast<uint8_t>(g);
          ++n;
        }
      }
      dev::st(route_rows + t * d.K + k, row);
    }
  }
  for (int m = 0; d.h.multi() && m < d.h.topo.N; ++m) {
    if (m == d.h.node) continue;
    const bool goes = d.reaches(static_cast<int>(t), t1, m);
    const unsigned mask = __ballot_sync(0xffffffffu, goes);
    if (goes) {
      tab.row[lane][n] = __popc(mask & ((1u << lane) - 1u));
      tab.dest[lane][n] = static_cast<uint8_t>(kStagedTarget + m);
      ++n;
    }
  }
  if (lane < d.chunk && t < t1) tab.targets[lane] = n;
  if (lane == 0) tab.u0 = t0, tab.u1 = t1;
  route_scales(d, tab, t1 - t0, lane, [&](int j) { return x_scales + static_cast<int64_t>(t0 + j) * d.scale_cols; });
}

// Warp 1, chunk c of the rail peer on node m (several nodes; lane q: its staged row q): each
// route to a rank of this node from the routing the source put with the rows, its weight and
// scales at its output row there, and the routes in the handle (fwd_routes: output row x
// kMaxDomainRanks + local index, -1 for none; fwd_rows: the chunk's rows) for combine.
template <typename Rdma>
__device__ bool forwarded_table(const DirectDispatch<Rdma>& d, RouteTable& tab, int m, int c, int lane) {
  const Hierarchy<Rdma>& h = d.h;
  int rows = 0;
  bool ok = true;
  if (lane == 0) ok = !d.stopped() && d.arrive(m, c, rows);
  rows = __shfl_sync(0xffffffffu, rows, 0);
  if (!warp_uniform(ok)) return false;
  const int width = fwd_route_width(d.geo);
  auto* kept = reinterpret_cast<int32_t*>(d.a.fwd_routes) +
               (static_cast<int64_t>(m) * h.staged + static_cast<int64_t>(c) * d.chunk + lane) * width;
  int n = 0;
  if (lane < rows) {
    TokenMeta* tm = h.token_meta(d.fwd_meta(m, c), lane, h.R.token_meta_bytes);
    for (int k = 0; k < kMaxTopK; ++k) {
      const int e = dev::ld(&tm->expert[k]);
      const int dst = e >= 0 ? e / d.L : 0;
      if (e < 0 || !h.topo.same_node(dst, d.a.rank)) continue;
      const int g = h.topo.local(dst);
      const int64_t p = static_cast<int64_t>(d.sh.first_row[(m * d.G + g) * d.L + e % d.L]) + dev::ld(&tm->ordinal[k]);
      if (p >= d.sh.num_rows[g]) continue;  // clipped by num_out_tokens
      dev::st(reinterpret_cast<float*>(d.sh.probs[g]) + p, dev::ld(&tm->weight[k]));
      tab.row[lane][n] = static_cast<int32_t>(p);
      tab.dest[lane][n] = static_cast<uint8_t>(g);
      kept[n] = static_cast<int32_t>(p * kMaxDomainRanks + g);
      ++n;
    }
    for (int i = n; i < width; ++i) kept[i] = -1;
    tab.targets[lane] = n;
  }
  if (lane == 0) {
    tab.u0 = 0, tab.u1 = rows;
    reinterpret_cast<int32_t*>(d.a.fwd_rows)[static_cast<int64_t>(m) * h.max_chunks + c] = rows;
  }
  route_scales(d, tab, rows, lane, [&](int j) -> const float* {
    return h.token_scales(h.token_meta(d.fwd_meta(m, c), j, h.R.token_meta_bytes));
  });
  return true;
}

// Warp 1: each unit's route table (own_table, forwarded_table) into the table ring.
template <typename Rdma>
__device__ void route_table(const DirectDispatch<Rdma>& d, int lane) {
  PipeState slot;
  DirectUnits<DirectDispatch<Rdma>> units(d);
  int m, c;
  for (; units.next(m, c); slot.advance(kTableSlots)) {
    bool ok = true;
    if (lane == 0) ok = !d.stopped() && d.table_ring.producer_acquire(d.args, slot);
    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
    d.table_ring.observe_empty(slot, lane);  // every lane writes after both store warps released the slot
    RouteTable& tab = d.sh.tables[slot.stage];
    if (m < 0) {
      own_table(d, tab, c, lane);
    } else if (!forwarded_table(d, tab, m, c, lane)) {
      d.stop();
      break;
    }
    __syncwarp();
    if (lane == 0) d.table_ring.producer_commit(slot);
  }
}

// The store groups a store thread lets still read their stages. The two threads' newest
// groups hold kStoreWarps x that many stages of the one ring; with the stage being stored they
// leave the loads at least one, or a load would wait for a release that waits for a later load.
__device__ __forceinline__ int direct_store_groups_in_flight(const LaunchArgs& args, int stages) {
  return min(store_groups_in_flight(args, stages), (stages - 1) / kStoreWarps);
}

// Warps 2-3 (lane 0): every other stage each (the FIFO's items which, which + kStoreWarps,
// ...), stored once per target of its rows, then released once its stores have read it. With
// LaunchArgs::store_runs, a stage's consecutive rows bound for consecutive rows of one rank of
// this node leave as one bulk store (fp8's 8 KiB rows, two to a stage: a store of 8 KiB or less
// took an H200's store thread 147.6 ns whatever its bytes). A
// thread stores all of a stage's targets, as the microbenchmarks' 1 load + 8 stores per stage
// does, so a stage waits for one thread's stores, and each thread wakes once per kStoreWarps
// stages. With several nodes each thread tells the RDMA warp when it is done with a unit (the
// done ring): an own chunk once its staged stores completed, a forwarded chunk once its loads
// were waited for. That arrival stays pending while the next unit's stores go out, and is made
// before any wait that may block.
template <typename Rdma>
__device__ void store_routes(const DirectDispatch<Rdma>& d, int which) {
  StoreQueue queue(d.fifo.ring, direct_store_groups_in_flight(d.args, d.stages), which, kStoreWarps);
  const bool multi = d.h.multi();
  const bool runs = d.args.store_runs != 0;  // whole rows only: a segment's stage holds one row
  PipeState item, table, done;               // item: every item of the FIFO
  struct Unit {};                            // the done ring's arrivals come in unit order
  DeferredReleases<Unit, 1> pending;         // a unit's done arrival, once its store groups landed
  // The arrival once the pending unit's groups landed, but for the newest `in_flight` (the
  // staged rows, before the RDMA warp's generic reads).
  auto arrive_pending = [&](int in_flight) -> bool {
    return pending.flush(StoresLanded(queue, in_flight), [&](Unit) {
      if (!d.done_ring.producer_acquire(d.args, done)) return false;
      d.done_ring.producer_commit(done);
      done.advance(kDoneSlots);
      return true;
    });
  };
  // A consumer wait on `ring` that may block: the pending arrival first, unless it passes at once.
  auto wait_for = [&](const Ring& ring, const PipeState& p) {
    if (d.stopped()) return false;
    if (!pending.empty() && dev::mbar_try_wait(&ring.full[p.stage], p.phase)) return true;
    return arrive_pending(0) && ring.consumer_wait(d.args, p);
  };
  DirectUnits<DirectDispatch<Rdma>> units(d);
  int m, c;
  bool ok = true;
  for (; ok && units.next(m, c); table.advance(kTableSlots)) {
    if (!wait_for(d.table_ring, table)) {
      ok = false;
      break;
    }
    const RouteTable& tab = d.sh.tables[table.stage];
    const int u0 = tab.u0, u1 = tab.u1;
    const bool staged = multi && m < 0;
    if (staged) {  // the chunk's slot of every other node's staging ring is free
      for (int n = 0; n < d.h.topo.N && ok; ++n)
        if (n != d.h.node)
          ok = d.h.staging.writer_acquire(d.args, d.h.flag(d.h.staged_credit_off(n, c), 0), d.call, c, d.a.rank,
                                          d.h.rail_peer(n), [&] { return arrive_pending(0); });
      if (!ok) break;
    }
    for (int k = 0; k < d.unit_items(m, u0, u1); ++k, item.advance(d.stages)) {
      if (item.count % kStoreWarps != static_cast<uint32_t>(which)) continue;  // the other thread's
      const RowBatches::Item it = u1 > u0 ? d.batches.item(u0, u1, k) : RowBatches::Item{0, 0, 0u, 0u};
      if (!wait_for(d.fifo.ring, item)) {
        ok = false;
        break;
      }
      for (int r = 0; r < it.rows; ++r) {
        const int i = it.first + r - u0;
        for (int q = 0; q < tab.targets[i]; ++q) {
          const int p = tab.row[i][q], dst = tab.dest[i][q];
          int run = 1;  // rows in this store
          if (runs && dst < kStagedTarget) {
            if (r > 0 && routes_to(tab, i - 1, dst, p - 1)) continue;  // the store of the row before holds it
            while (r + run < it.rows && routes_to(tab, i + run, dst, p + run)) ++run;
          }
          uint8_t* to =
              dst >= kStagedTarget
                  ? d.h.rdma.local(d.h.staged_off(d.h.R.staged_rows_out, dst - kStagedTarget, c, p, d.row_bytes))
                  : reinterpret_cast<uint8_t*>(d.sh.rows[dst]) + static_cast<int64_t>(p) * d.row_bytes;
          dev::bulk_s2g(to + it.offset, d.fifo.slot(item) + r * it.bytes, static_cast<uint32_t>(run) * it.bytes);
        }
      }
      queue.commit();
      // once the pending unit's groups are older than the newest in_flight (the next unit's)
      if (!arrive_pending(max(1, queue.in_flight))) ok = false;
      queue.release_read();
    }
    if (!ok) break;
    d.table_ring.consumer_release(table);  // the rows were read when the stores were issued
    if (multi) {
      if (!arrive_pending(0)) {
        ok = false;
        break;
      }
      pending.note(Unit{}, queue.groups());
    }
  }
  if (ok && !d.stopped() && !arrive_pending(0)) ok = false;
  if (!ok) d.stop();
  queue.finish();  // the rows landed before the last block's release (after the block barrier)
}

// Warp 4 with several nodes: each unit once both store warps are done with it. An own chunk c:
// per other node n (also one no token reaches: every chunk is signalled), lane i writes token
// t0 + i's routing into the chunk's slot of the staging ring for n if it goes there (its place:
// its ordinal among the chunk's tokens for n, as the store warps staged its row), then the
// rows and the routing go to the rail peer on n, the routing with the chunk's signal. A
// forwarded chunk: the slot's credit back to its source.
template <typename Rdma>
__device__ void rdma_send(const DirectDispatch<Rdma>& d, int lane) {
  const Hierarchy<Rdma>& h = d.h;
  DirectUnits<DirectDispatch<Rdma>> units(d);
  RingReleases<Rdma> releases(h.rdma);  // lane 0's credits of forwarded chunks' staging slots
  PipeState done;
  int m, c;
  for (; units.next(m, c); done.advance(kDoneSlots)) {
    bool ok = true;
    if (lane == 0) ok = !d.stopped() && d.done_ring.consumer_wait(d.args, done);
    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
    d.done_ring.observe_full(done, lane);  // every lane's transport copy reads the staged rows
    __syncwarp();
    if (lane == 0) d.done_ring.consumer_release(done);
    if (m >= 0) {  // the forwarded chunk was read whole: its slot is free at both ends
      if (lane == 0) releases.reader_release(h.rail_peer(m), d.h.staged_credit_off(h.node, c), d.call, c);
      continue;
    }
    const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk), t = t0 + lane;
    for (int n = 0; n < h.topo.N; ++n) {
      if (n == h.node) continue;
      const unsigned mask = __ballot_sync(0xffffffffu, d.reaches(t, t1, n));
      h.stage_routing(d.a, d.K, d.scale_cols, n, c, mask, lane, t, nullptr);
      __threadfence();  // the routing and the staged rows, before the transport reads them
      __syncwarp();
      h.put_staged(lane, n, c, __popc(mask), d.row_bytes, d.call);
    }
  }
  if (lane == 0) releases.quiet(true);  // the staging puts and the credits, before the rank's done signals
}

template <typename Rdma>
__global__ void __launch_bounds__(kDirectThreads, 1) dispatch_direct_kernel(const __grid_constant__ LaunchArgs args) {
  const BlockPlace place = block_place(args);
  if (place.rank.absent || call_refused(args.geo, place.rank)) return;
  DirectDispatchShared& sh = dev::block_shared<DirectDispatchShared>();
  const DirectDispatch<Rdma> d(kernel_call(args, place, kDispatchCall, sh.ctl), sh, dev::dynamic_smem<uint8_t>());
  const RankArgs& a = d.a;
  const int tid = threadIdx.x, lane = tid & 31;
  const bool multi = d.h.multi();

  init_block(d, [&] {
    d.fifo.ring.init(1, 1);  // a stage's one store thread releases it
    d.table_ring.init(1, kStoreWarps);
    if (multi) d.done_ring.init(kStoreWarps, 1);
  });
  // An aborted launch (a count kernel that gave up left dispatch_calls at the previous call) neither
  // publishes nor reads tensors: a peer's read would pass on that call's number and race with the
  // publish of this one.
  const bool setup = !d.stopped();
  if (setup && d.b == 0 && tid == 32)
    publish_tensors(d.view, a, kDirectDispatch, d.call, a.out, a.out_probs, a.out_scales, a.num_out_rows);
  if (setup && tid < d.G) {  // every destination's tensors, and where the rows this rank sends of its experts start
    const int dst = d.h.first_local() + tid;
    PeerView pv;
    if (read_tensors(args, d.view, a, dst, kDirectDispatch, d.call, pv)) {
      sh.rows[tid] = pv.rows;
      sh.probs[tid] = pv.probs;
      sh.scales[tid] = pv.scales;
      sh.num_rows[tid] = pv.num_rows;
      const auto* first = reinterpret_cast<const volatile int32_t*>(d.view.base(dst) + d.geo.reg.direct_first);
      for (int m = 0; m < d.h.topo.N; ++m)
        for (int j = 0; j < d.L; ++j) sh.first_row[(m * d.G + tid) * d.L + j] = first[d.h.rail_peer(m) * d.L + j];
    } else {
      sh.ctl.fail = 1;
    }
  }
  if (!block_ready(d)) return;

  const RoleSpan<DirectRole> role = direct_warps(multi).of(tid >> 5);
  switch (role.role) {
    case DirectRole::kLoad:
      if (lane == 0) load_rows(d);
      break;
    case DirectRole::kTable: route_table(d, lane); break;
    case DirectRole::kStore:
      if (lane == 0) store_routes(d, role.warp_index(tid >> 5));
      break;
    case DirectRole::kRdma: rdma_send(d, lane); break;
    case DirectRole::kPad: zero_padding(d, role.warp_index(tid >> 5), role.warps, lane); break;
  }
  if (!roles_done(d)) return;

  if (finish_direct(d, kDirectDispatch, &d.view.state()->blocks_done_dispatch)) {
    publish_done(d, d.geo.reg.done_dispatch);
    // The rows the rail peers on other nodes staged here are forwarded: they may send the next.
    d.h.signal_done_to_rail_peers(d.geo.rdma.done_dispatch, d.call);
  }
}

// The store threads take the FIFO's items in turn (item % kStoreWarps): with a stage count that
// is not a multiple of theirs, a thread takes a stage every other round, at the same parity, so
// its wait may pass on the phase it consumed two rounds before while the round in between is
// still loading, and it would store that stage's old rows. The launch's refusal, else nullptr.
inline LaunchStatus fifo_stages_refusal(const LaunchArgs& args) {
  if (args.fifo_stages % kStoreWarps == 0) return nullptr;
  return "dispatch_direct: fifo_stages must be a multiple of the block's store threads (DIRECT_STORE_THREADS): they "
         "take the FIFO's items in turn, and with another count a store thread's mbarrier wait may pass on a phase "
         "it already consumed";
}

}  // namespace dispatch_direct_impl

}  // namespace hybrid_ep
