// Combine kernel of the direct path (one node whose ranks address each other's expert
// outputs): persistent, one block per SM. Every block sums its share of this rank's tokens
// straight from the expert output rows of each route, wherever they live, and writes the
// tokens' rows: a row moves once per route, with no partial sums between ranks. A rank's work
// as an expert host is to publish its expert_out and wait until every source has read it.
//
// Two pipelines per block (kernels/segments.cuh), taking alternate chunks of the block's
// share of kChunkTokens tokens:
//   warps 0 and 5     read a chunk's routes into a table, a lane per token (each route's row
//                     at its expert's rank, which the dispatch kept in the handle, and with
//                     apply_probs its routing weight there), then bulk-load every route's
//                     segment into the pipeline's ring;
//   warps 1-4, 6-9    add a token's routes in fp32 registers and write its row, rounded once.
// At the start block 0 publishes this rank's expert_out and probs and every block reads every
// expert host's (bounded waits); at the end the last block of this rank tells every host that
// its reads ended, and block 0 waits until every source said so (only then may expert_out be
// freed), then publishes done_combine.
#include "common/state.cuh"
#include "kernels/direct.cuh"
#include "kernels/launch.h"
#include "kernels/pipeline.cuh"
#include "kernels/segments.cuh"
#include "kernels/skeleton.cuh"

namespace hybrid_ep {
namespace combine_pull_impl {

constexpr int kPipelines = kPullPipelines, kPipelineWarps = 1 + kGroupWarps;
constexpr int kPullThreads = kPipelines * kPipelineWarps * 32;

// Warp roles, per pipeline (its warps p * kPipelineWarps + ...).
enum class PullRole { kLoad, kReduce };
__host__ __device__ constexpr RoleTable<PullRole, 2> pull_warps() {
  return {{{PullRole::kLoad, 0, 1}, {PullRole::kReduce, 1, kGroupWarps}}};
}
static_assert(pull_warps().tiles(kPipelineWarps), "a pull pipeline's roles tile its warps");

// A chunk's routes, per token: the expert host and row of each, and its weight.
struct PullTable {
  int32_t parts[kChunkTokens];
  int32_t row[kChunkTokens][kMaxTopK];
  uint8_t host[kChunkTokens][kMaxTopK];
  float weight[kChunkTokens][kMaxTopK];
};

struct PullShared {
  uint64_t full[kPipelines][kMaxStages], empty[kPipelines][kMaxStages];
  PartItem items[kPipelines][kMaxStages];
  PullTable tables[kPipelines];
  uint64_t rows[kMaxRanks], probs[kMaxRanks];  // each expert host's expert_out and probs, this process's addresses
  BlockControl ctl;
};

// What every role of a block needs to know about the call.
struct CombinePull : KernelCall {
  int L, T, K, C, seg_cols, segments, chunk, stages;
  uint32_t in_bytes;
  PullShared& sh;
  uint8_t* data;  // [kPipelines][stages][seg_cols] expert output segments

  __device__ CombinePull(const KernelCall& k, PullShared& shared, uint8_t* smem, uint32_t elem_size)
      : KernelCall(k), L(k.geo.local_experts), T(k.a.num_tokens), K(k.a.topk), C(k.args.row_elems),
        seg_cols(k.args.seg_cols), segments((C + seg_cols - 1) / seg_cols), chunk(k.args.chunk_tokens),
        stages(k.args.src_stages), in_bytes(elem_size), sh(shared), data(smem) {}

  __device__ int chunks() const { return (T + chunk - 1) / chunk; }
  __device__ uint8_t* stage_data(int pipeline) const {
    return data + static_cast<size_t>(pipeline) * stages * seg_cols * in_bytes;
  }
  // Pipeline p's ring.
  __device__ Ring pipeline_ring(int p) const { return ring(sh.full[p], sh.empty[p], stages, kSitePullRoutes); }
};

// A pipeline's load warp: lane i lists token t0 + i's routes, lane 0 loads them.
__device__ inline void pull_load(const CombinePull& d, int pipeline, const Ring& ring, int lane) {
  const auto* route_rows = reinterpret_cast<const int32_t*>(d.a.route_rows);
  const auto* idx = reinterpret_cast<const int64_t*>(d.a.topk_idx);
  PullTable& tab = d.sh.tables[pipeline];
  PartItem* items = d.sh.items[pipeline];
  uint8_t* data = d.stage_data(pipeline);
  PipeState produced;
  bool ok = true;
  if (lane == 0) dev::fence_proxy_async();  // the hosts' rows (acquired at the setup) are read by bulk loads
  int i = 0;
  for (int c = d.b; c < d.chunks() && ok; c += d.nb, ++i) {
    if (i % kPipelines != pipeline) continue;
    const int t0 = c * d.chunk, t1 = min(d.T, t0 + d.chunk);
    const int64_t t = static_cast<int64_t>(t0) + lane;
    if (t < t1) {
      int n = 0;
      for (int k = 0; k < d.K; ++k) {
        const int row = route_rows[t * d.K + k];
        if (row < 0) continue;
        const int host = static_cast<int>(idx[t * d.K + k] / d.L);
        tab.row[lane][n] = row;
        tab.host[lane][n] = static_cast<uint8_t>(host);
        tab.weight[lane][n] = d.args.apply_probs ? reinterpret_cast<const float*>(d.sh.probs[host])[row] : 1.f;
        ++n;
      }
      tab.parts[lane] = n;
    }
    __syncwarp();
    for (int q = 0; q < t1 - t0 && ok && lane == 0; ++q) {
      for (int g = 0; g < d.segments && ok; ++g) {
        const int col0 = g * d.seg_cols;
        const PartItem head{t0 + q, 0, col0, min(d.seg_cols, d.C - col0), 0, 1.f};
        ok = load_parts(d, ring, items, data, d.in_bytes, produced, head, tab.parts[q], [&](int j, float& weight) {
          weight = tab.weight[q][j];
          return reinterpret_cast<const uint8_t*>(d.sh.rows[tab.host[q][j]]) +
                 static_cast<int64_t>(tab.row[q][j]) * d.C * d.in_bytes;
        });
      }
    }
    ok = warp_uniform(ok);  // the table is rewritten for the next chunk only after lane 0 read it
  }
  if (lane == 0) finish_loads(d, ring, items, data, d.in_bytes, produced, ok);
}

template <typename Elem>
__global__ void __launch_bounds__(kPullThreads, 1) combine_pull_kernel(const __grid_constant__ LaunchArgs args) {
  const BlockPlace place = block_place(args);
  if (place.rank.absent || call_refused(args.geo, place.rank)) return;
  PullShared& sh = dev::block_shared<PullShared>();
  const CombinePull d(kernel_call(args, place, kCombineCall, sh.ctl), sh, dev::dynamic_smem<uint8_t>(),
                      static_cast<uint32_t>(sizeof(Elem)));
  const RankArgs& a = d.a;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int pipeline = warp / kPipelineWarps;
  const Ring ring = d.pipeline_ring(pipeline);

  init_block(d, [&] {
    for (int p = 0; p < kPipelines; ++p) d.pipeline_ring(p).init(1, kGroupWarps);
  });
  if (d.b == 0 && tid == 32)
    publish_tensors(d.view, a, kDirectCombine, d.epoch, a.expert_out, a.probs, a.probs, a.num_out_rows);
  if (tid < d.geo.world_size) {  // every expert host's expert_out and probs
    PeerView pv;
    if (read_tensors(args, d.view, a, tid, kDirectCombine, d.epoch, pv)) {
      sh.rows[tid] = pv.rows;
      sh.probs[tid] = pv.probs;
    } else {
      sh.ctl.fail = 1;
    }
  }
  if (!block_ready(d)) return;

  const RoleSpan<PullRole> role = pull_warps().of(warp % kPipelineWarps);
  switch (role.role) {
    case PullRole::kLoad: pull_load(d, pipeline, ring, lane); break;
    case PullRole::kReduce: {
      auto* y = reinterpret_cast<uint8_t*>(a.y);
      const int gt = role.thread_index(tid - pipeline * kPipelineWarps * 32);
      reduce_parts<Elem>(d, ring, sh.items[pipeline], d.stage_data(pipeline), gt, lane,
                         [&](const SegmentAcc<Elem>& acc, const PartItem& it) {
                           acc.template store<Elem>(y + (static_cast<int64_t>(it.row) * d.C + it.col0) * sizeof(Elem),
                                                    it.cols, gt);
                           return true;
                         });
      break;
    }
  }
  if (!roles_done(d)) return;

  LocalState* st = d.view.state();
  if (finish_direct(d, kDirectCombine, &st->blocks_done_combine)) {
    st->combine_epoch = d.epoch;  // every block of this rank has read the epoch: all reported done
    publish_done(d, d.geo.reg.done_combine);
  }
}

}  // namespace combine_pull_impl

}  // namespace hybrid_ep
