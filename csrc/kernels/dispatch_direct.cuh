// Dispatch kernel of the direct path (one node whose ranks address each other's output
// tensors): persistent, one block per SM. Every block sends its share of this rank's chunks
// of kChunkTokens tokens straight into their final expert-major rows on each route's rank:
// one bulk load of a token's row, one bulk store per route, so a row moves once per route
// instead of once into a receive buffer and again into its expert's rows. A rank's work as a
// destination is its zero padding; the kernel returns once every source has written its rows.
//
//   warp 0      bulk-loads the chunk's rows into the FIFO (small rows batched per stage, rows
//               larger than a stage in segments);
//   warp 1      builds the chunk's route table, a lane per token: each route's output row at
//               its expert's rank (the first row of this source's rows of that expert, from the
//               destination's layout kernel, plus the route's ordinal; -1 where num_out_tokens
//               clipped it), kept in the handle for combine, and writes each route's routing
//               weight and fp8 scales into the destination's tensors: the scales by one bulk
//               store per route from the chunk's scales, bulk-loaded into a tile at the end of
//               the FIFO's memory (ScaleTiles), where a row's scales are whole 16-byte units;
//   warps 2-3   bulk-store each stage once per route, the two warps taking alternate stages,
//               store_groups groups in flight each, then release the stage (1 arrival);
//   warps 4-5   write this rank's zero padding rows (kernels/padding.cuh).
// At the start block 0 publishes this rank's output tensors and every block reads every
// destination's (kernels/direct.cuh, bounded waits); at the end the last block of this rank
// tells every destination that its rows have landed, and block 0 waits until every source
// said so, then publishes done_dispatch.
#include "common/state.cuh"
#include "kernels/direct.cuh"
#include "kernels/launch.h"
#include "kernels/padding.cuh"
#include "kernels/pipeline.cuh"
#include "kernels/skeleton.cuh"

namespace hybrid_ep {
namespace dispatch_direct_impl {

// Warp roles (kDirectThreads = 192: 6 warps).
enum class DirectRole { kLoad, kTable, kStore, kPad };
constexpr int kStoreWarps = 2, kPadWarps = 2;
constexpr int kDirectThreads = 6 * 32;
__host__ __device__ constexpr RoleTable<DirectRole, 4> direct_warps() {
  return {{{DirectRole::kLoad, 0, 1},
           {DirectRole::kTable, 1, 1},
           {DirectRole::kStore, 2, kStoreWarps},
           {DirectRole::kPad, 2 + kStoreWarps, kPadWarps}}};
}
static_assert(direct_warps().tiles(kDirectThreads / 32), "the direct dispatch's roles tile its block");
constexpr int kTableSlots = 2;  // chunks whose route tables are ready ahead of the stores

// A chunk's routes: output row at the route's rank (-1: none, or clipped) and that rank.
struct RouteTable {
  int32_t row[kChunkTokens][kMaxTopK];
  uint8_t dest[kChunkTokens][kMaxTopK];
};

struct DirectDispatchShared {
  uint64_t full[kMaxStages], empty[kMaxStages];
  uint64_t table_full[kTableSlots], table_empty[kTableSlots];
  uint64_t scales_full[kTableSlots];  // a table slot's tile of fp8 scales has landed (ScaleTiles)
  RouteTable tables[kTableSlots];
  uint64_t rows[kMaxRanks], probs[kMaxRanks], scales[kMaxRanks];  // each destination's, this process's addresses
  int64_t num_rows[kMaxRanks];
  int32_t first_row[kMaxExperts];  // [destination][its local expert]: this source's first output row there
  BlockControl ctl;
};

// The fp8 scales of a table slot's chunk in shared memory, for the route table's lanes to
// bulk-store each route's scales (scale_cols floats, contiguous at its output row) instead of
// one 4-byte store per scale and route: a write request carries a 32-byte sector on the SM's
// path to the crossbar, which the rows' bulk stores take as well (at H = 7168, 56 requests of
// 4 bytes per route become 7 whole sectors). The tiles take the last FIFO stages of the
// dynamic shared memory. None (slot_bytes 0) without scales, where a row's scales are not
// whole 16-byte units or the input's scales not 16-byte aligned (bulk copies need both), or
// where the FIFO would keep fewer than 3 stages: then each scale is stored by its lane.
struct ScaleTiles {
  uint32_t slot_bytes = 0;  // a chunk's scales: chunk x scale_cols x 4
  int stages = 0;           // FIFO stages they take

  __device__ static ScaleTiles of(const LaunchArgs& args, const RankArgs& a) {
    ScaleTiles t;
    const uint32_t row = static_cast<uint32_t>(args.scale_cols) * 4u;
    if (row == 0 || row % 16 != 0 || a.x_scales % 16 != 0) return t;
    const uint32_t slot = static_cast<uint32_t>(args.chunk_tokens) * row;
    const uint32_t stage = static_cast<uint32_t>(args.stage_bytes);
    const int stages = static_cast<int>((kTableSlots * slot + stage - 1) / stage);
    if (args.fifo_stages - stages < 3) return t;
    t.slot_bytes = slot;
    t.stages = stages;
    return t;
  }
};

// What every role of a block needs to know about the call.
struct DirectDispatch : KernelCall {
  const InfoLayout& il;
  int W, L, T, K, scale_cols, chunk, stages;
  uint32_t row_bytes;
  RowBatches batches;
  const int64_t* info;
  DirectDispatchShared& sh;
  ScaleTiles tiles;
  StageRing fifo;
  Ring table_ring;
  StageRing scale_tiles;  // the tiles' ring: table slot s's tile, its full barrier

  __device__ DirectDispatch(const KernelCall& k, DirectDispatchShared& shared, uint8_t* smem)
      : KernelCall(k), il(k.geo.info), W(k.geo.world_size), L(k.geo.local_experts), T(k.a.num_tokens), K(k.a.topk),
        scale_cols(k.args.scale_cols), chunk(k.args.chunk_tokens),
        stages(k.args.fifo_stages - ScaleTiles::of(k.args, k.a).stages),
        row_bytes(static_cast<uint32_t>(k.args.row_elems) * elem_bytes(k.args.dtype)),
        batches(RowBatches::of(row_bytes, k.args)), info(reinterpret_cast<const int64_t*>(k.a.info)), sh(shared),
        tiles(ScaleTiles::of(k.args, k.a)),
        fifo{k.ring(shared.full, shared.empty, stages, kSiteDirectRows), smem, k.args.stage_bytes},
        table_ring(k.ring(shared.table_full, shared.table_empty, kTableSlots, kSiteDirectTables)),
        scale_tiles{k.ring(shared.scales_full, shared.scales_full, kTableSlots, kSiteDirectTables),
                    smem + static_cast<size_t>(stages) * k.args.stage_bytes, static_cast<int>(tiles.slot_bytes)} {}

  __device__ int chunks() const { return (T + chunk - 1) / chunk; }
};

// Warp 0 (lane 0): the block's chunks' rows into the FIFO.
__device__ inline void load_rows(const DirectDispatch& d) {
  const auto* x = reinterpret_cast<const uint8_t*>(d.a.x);
  PipeState produced;
  for (int c = d.b; c < d.chunks() && !d.stopped(); c += d.nb) {
    const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk);
    for (int k = 0; k < d.batches.items(t0, t1) && !d.stopped(); ++k, produced.advance(d.stages)) {
      const RowBatches::Item it = d.batches.item(t0, t1, k);
      if (!d.fifo.ring.producer_acquire(d.args, produced)) {
        d.stop();
        break;
      }
      d.fifo.load(produced, x + static_cast<int64_t>(it.first) * d.row_bytes + it.offset, it.rows * it.bytes);
    }
  }
  d.fifo.drain(d.args, PipeState{}, produced);
}

// Warp 1: each chunk's route table (lane i: token t0 + i), the handle's route rows, and the
// routing weights and fp8 scales at each route's output row. With scale tiles, each lane
// commits one bulk group of scale stores per chunk, so the chunk before last's (the slot's
// previous tile) has been read once all but its newest group have.
__device__ inline void route_table(const DirectDispatch& d, int lane) {
  const auto* idx = reinterpret_cast<const int64_t*>(d.a.topk_idx);
  const auto* weights = reinterpret_cast<const float*>(d.a.topk_weights);
  const auto* ords = reinterpret_cast<const int32_t*>(d.a.entry_ord);
  const auto* x_scales = reinterpret_cast<const float*>(d.a.x_scales);
  auto* route_rows = reinterpret_cast<int32_t*>(d.a.route_rows);
  PipeState slot;
  for (int c = d.b; c < d.chunks(); c += d.nb, slot.advance(kTableSlots)) {
    bool ok = true;
    if (lane == 0) ok = !d.stopped() && d.table_ring.producer_acquire(d.args, slot);
    if (!warp_uniform(ok)) {
      d.stop();
      break;
    }
    d.table_ring.observe_empty(slot, lane);  // every lane writes after both store warps released the slot
    RouteTable& tab = d.sh.tables[slot.stage];
    const int64_t t = static_cast<int64_t>(c) * d.chunk + lane;
    const uint8_t* tile = d.scale_tiles.slot(slot);
    if (d.tiles.slot_bytes > 0) {  // this chunk's scales into the slot's tile, once its last stores read it
      dev::bulk_wait_read<1>();
      __syncwarp();
      if (lane == 0) {
        const int64_t t0 = static_cast<int64_t>(c) * d.chunk, n = min(static_cast<int64_t>(d.chunk), d.T - t0);
        d.scale_tiles.load(slot, x_scales + t0 * d.scale_cols, static_cast<uint32_t>(n * d.scale_cols * 4));
        ok = d.scale_tiles.ring.consumer_wait(d.args, slot);
        if (!ok) mbar_drain(d.args, &d.sh.scales_full[slot.stage], slot.phase, d.a.rank, d.epoch, kSiteDirectTables);
      }
      if (!warp_uniform(ok)) {
        d.stop();
        break;
      }
      d.scale_tiles.ring.observe_full(slot, lane);
    }
    if (lane < d.chunk && t < d.T) {
      for (int k = 0; k < d.K; ++k) {
        const int64_t e = idx[t * d.K + k];  // checked by the layout kernel: -1 or a valid expert
        int32_t row = -1;
        int dst = 0;
        if (e >= 0) {
          dst = static_cast<int>(e / d.L);
          const int64_t p = static_cast<int64_t>(d.sh.first_row[e]) + ords[t * d.K + k];
          if (p < d.sh.num_rows[dst]) {
            row = static_cast<int32_t>(p);
            dev::st(reinterpret_cast<float*>(d.sh.probs[dst]) + p, weights[t * d.K + k]);
            auto* out_scales = reinterpret_cast<float*>(d.sh.scales[dst]) + p * d.scale_cols;
            if (d.tiles.slot_bytes > 0)
              dev::bulk_s2g(out_scales, tile + static_cast<size_t>(lane) * d.scale_cols * 4, d.scale_cols * 4);
            else
              for (int i = 0; i < d.scale_cols; ++i) dev::st(out_scales + i, x_scales[t * d.scale_cols + i]);
          }
        }
        tab.row[lane][k] = row;
        tab.dest[lane][k] = static_cast<uint8_t>(dst);
        dev::st(route_rows + t * d.K + k, row);
      }
    }
    if (d.tiles.slot_bytes > 0) dev::bulk_commit();
    __syncwarp();
    if (lane == 0) d.table_ring.producer_commit(slot);
  }
  if (d.tiles.slot_bytes > 0) {  // the scales landed before the rank's done signal (after the block barrier)
    dev::bulk_wait_all();
    dev::fence_proxy_async();
  }
}

// The store groups a store thread lets still read their stages. The two threads' newest
// groups hold kStoreWarps x that many stages of the one ring; with the stage being stored they
// leave the loads at least one, or a load would wait for a release that waits for a later load.
__device__ __forceinline__ int direct_store_groups_in_flight(const LaunchArgs& args, int stages) {
  return min(store_groups_in_flight(args, stages), (stages - 1) / kStoreWarps);
}

// Warps 2-3 (lane 0): every other stage each (the FIFO's items which, which + kStoreWarps,
// ...), stored once per route of its rows, then released once its stores have read it. A
// thread stores all of a stage's routes, as the microbenchmarks' 1 load + 8 stores per stage
// does, so a stage waits for one thread's stores, and each thread wakes once per kStoreWarps
// stages.
__device__ inline void store_routes(const DirectDispatch& d, int which) {
  StoreQueue queue(d.fifo.ring, direct_store_groups_in_flight(d.args, d.stages), which, kStoreWarps);
  PipeState item, table;  // item: every item of the FIFO
  bool ok = true;
  for (int c = d.b; c < d.chunks() && ok; c += d.nb, table.advance(kTableSlots)) {
    if (d.stopped() || !d.table_ring.consumer_wait(d.args, table)) {
      ok = false;
      break;
    }
    const RouteTable& tab = d.sh.tables[table.stage];
    const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk);
    for (int k = 0; k < d.batches.items(t0, t1); ++k, item.advance(d.stages)) {
      if (item.count % kStoreWarps != static_cast<uint32_t>(which)) continue;  // the other thread's
      const RowBatches::Item it = d.batches.item(t0, t1, k);
      if (d.stopped() || !d.fifo.ring.consumer_wait(d.args, item)) {
        ok = false;
        break;
      }
      for (int r = 0; r < it.rows; ++r) {
        const int i = it.first + r - t0;
        for (int q = 0; q < d.K; ++q) {
          const int p = tab.row[i][q];
          if (p >= 0)
            dev::bulk_s2g(reinterpret_cast<uint8_t*>(d.sh.rows[tab.dest[i][q]]) +
                              static_cast<int64_t>(p) * d.row_bytes + it.offset,
                          d.fifo.slot(item) + r * it.bytes, it.bytes);
        }
      }
      queue.commit();
      queue.release_read();
    }
    if (ok) d.table_ring.consumer_release(table);  // the rows were read when the stores were issued
  }
  if (!ok) d.stop();
  queue.finish();  // the rows landed before the last block's release (after the block barrier)
}

__global__ void __launch_bounds__(kDirectThreads, 1) dispatch_direct_kernel(const __grid_constant__ LaunchArgs args) {
  const BlockPlace place = block_place(args);
  if (place.rank.absent || call_refused(args.geo, place.rank)) return;
  DirectDispatchShared& sh = dev::block_shared<DirectDispatchShared>();
  const DirectDispatch d(kernel_call(args, place, kDispatchCall, sh.ctl), sh, dev::dynamic_smem<uint8_t>());
  const RankArgs& a = d.a;
  const int tid = threadIdx.x, lane = tid & 31;

  init_block(d, [&] {
    d.fifo.ring.init(1, 1);  // a stage's one store thread releases it
    d.table_ring.init(1, kStoreWarps);
    for (int s = 0; s < kTableSlots; ++s) dev::mbar_init(&sh.scales_full[s], 1);  // a tile's one bulk load
  });
  if (d.b == 0 && tid == 32)
    publish_tensors(d.view, a, kDirectDispatch, d.epoch, a.out, a.out_probs, a.out_scales, a.num_out_rows);
  if (tid < d.W) {  // every destination's tensors, and where this source's rows of its experts start
    PeerView pv;
    if (read_tensors(args, d.view, a, tid, kDirectDispatch, d.epoch, pv)) {
      sh.rows[tid] = pv.rows;
      sh.probs[tid] = pv.probs;
      sh.scales[tid] = pv.scales;
      sh.num_rows[tid] = pv.num_rows;
      const auto* first = reinterpret_cast<const volatile int32_t*>(d.view.base(tid) + d.geo.reg.direct_first);
      for (int j = 0; j < d.L; ++j) sh.first_row[tid * d.L + j] = first[a.rank * d.L + j];
    } else {
      sh.ctl.fail = 1;
    }
  }
  if (!block_ready(d)) return;

  const RoleSpan<DirectRole> role = direct_warps().of(tid >> 5);
  switch (role.role) {
    case DirectRole::kLoad:
      if (lane == 0) load_rows(d);
      break;
    case DirectRole::kTable: route_table(d, lane); break;
    case DirectRole::kStore:
      if (lane == 0) store_routes(d, role.warp_index(tid >> 5));
      break;
    case DirectRole::kPad: zero_padding(d, role.warp_index(tid >> 5), role.warps, lane); break;
  }
  if (!roles_done(d)) return;

  if (finish_direct(d, kDirectDispatch, &d.view.state()->blocks_done_dispatch))
    publish_done(d, d.geo.reg.done_dispatch);
}

}  // namespace dispatch_direct_impl

}  // namespace hybrid_ep
