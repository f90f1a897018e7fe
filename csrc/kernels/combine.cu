// Combine kernel: persistent, one block per SM; each warp owns one row at a time.
//
// Phase 1 (on the expert host): for every received row, the warp sums the rows its local
// experts produced (optionally times the routing weight) in fp32 and pushes the partial sum
// into the source rank's registered buffer with 16-byte stores through the peer pointer.
// One partial per (token, destination rank) crosses NVLink, as in dispatch.
// Phase 2 (on the source): once every expert host has signalled its rows, each token's
// partials are summed in fp32 and cast once to the output dtype.
#include "common/state.cuh"
#include "kernels/launch.h"

namespace hybrid_ep {
namespace {

template <typename T>
struct Vec;  // 16 bytes of T <-> fp32

template <>
struct Vec<float> {
  static constexpr int kN = 4;
  __device__ static void load(const void* p, float* out) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  }
  __device__ static void store(void* p, const float* in) {
    *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
  }
};

template <typename H2, typename Conv>
struct Vec16Half {
  static constexpr int kN = 8;
  __device__ static void load(const void* p, float* out) {
    const int4 raw = *reinterpret_cast<const int4*>(p);
    const H2* h = reinterpret_cast<const H2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 f = Conv::to_float2(h[i]);
      out[2 * i] = f.x, out[2 * i + 1] = f.y;
    }
  }
  __device__ static void store(void* p, const float* in) {
    int4 raw;
    H2* h = reinterpret_cast<H2*>(&raw);
#pragma unroll
    for (int i = 0; i < 4; ++i) h[i] = Conv::from_float2(make_float2(in[2 * i], in[2 * i + 1]));
    *reinterpret_cast<int4*>(p) = raw;
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
struct Vec<__nv_bfloat16> : Vec16Half<__nv_bfloat162, BF16Conv> {};
template <>
struct Vec<__half> : Vec16Half<__half2, HalfConv> {};

// A partial written by a peer in this call: read around L1.
__device__ __forceinline__ float4 ld_partial(const float* p) { return __ldcv(reinterpret_cast<const float4*>(p)); }

struct CombineShared {
  uint32_t rows_for[kMaxRanks];  // partial rows this block pushed to each source
  int abort;
};

template <typename Elem>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(const __grid_constant__ LaunchArgs args) {
  using V = Vec<Elem>;
  constexpr int kN = V::kN;
  const BlockPlace place = block_place(args);
  const RankArgs& a = place.rank;
  if (a.absent) return;
  const int b = place.block, nb = place.blocks;
  const Geometry& geo = args.geo;
  const RegLayout& reg = geo.reg;
  const InfoLayout& il = geo.info;
  const RankView view = rank_view(geo, a);
  const int W = geo.world_size, Tmax = geo.max_tokens, T = a.num_tokens, kd = args.kd, C = args.row_elems;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarps = blockDim.x >> 5;
  const int64_t gw = static_cast<int64_t>(b) * nwarps + warp, nw = static_cast<int64_t>(nb) * nwarps;
  const int nvec = C / kN;
  const auto* info = reinterpret_cast<const int64_t*>(a.info);
  const auto* row_pos = reinterpret_cast<const int32_t*>(a.row_pos);
  const auto* expert_out = reinterpret_cast<const uint8_t*>(a.expert_out);
  const auto* probs = reinterpret_cast<const float*>(a.probs);
  const auto* send_slot = reinterpret_cast<const int32_t*>(a.send_slot);
  auto* y = reinterpret_cast<uint8_t*>(a.y);
  LocalState* st = view.state();

  CombineShared& sh = dev::block_shared<CombineShared>();
  uint32_t* rows_for = sh.rows_for;
  const uint64_t epoch = st->combine_epoch + 1;
  if (tid == 0) sh.abort = 0;
  for (int s = tid; s < kMaxRanks; s += blockDim.x) rows_for[s] = 0;
  __syncthreads();

  // Flow control: the source must have read the partials of the previous combine.
  if (tid < W && !wait_at_least(args, view.flag(tid, reg.done_combine, 0), epoch - 1, kPhaseCombineFlow, a.rank,
                                tid, epoch))
    sh.abort = 1;
  __syncthreads();
  if (sh.abort) return;

  // ---- phase 1: reduce local expert rows, push one fp32 partial per received row --------
  const int64_t num_recv = info[il.num_recv];
  int s = 0;
  for (int64_t v = gw; v < num_recv; v += nw) {
    while (s + 1 < W && v >= info[il.recv_offset + s + 1]) ++s;
    const int64_t i = v - info[il.recv_offset + s];
    const int64_t row = static_cast<int64_t>(s) * Tmax + i;
    int pos[kMaxTopK];
    float w[kMaxTopK];
#pragma unroll
    for (int q = 0; q < kMaxTopK; ++q) {
      pos[q] = q < kd ? row_pos[row * kd + q] : -1;
      w[q] = (pos[q] >= 0 && args.apply_probs) ? probs[pos[q]] : 1.f;
    }
    float* dst = reinterpret_cast<float*>(view.base(s) + reg.comb_rows +
                                          (static_cast<int64_t>(a.rank) * Tmax + i) * reg.comb_stride);
    for (int cv = lane; cv < nvec; cv += 32) {
      float acc[kN];
#pragma unroll
      for (int n = 0; n < kN; ++n) acc[n] = 0.f;
#pragma unroll
      for (int q = 0; q < kMaxTopK; ++q) {
        if (pos[q] < 0) continue;
        float val[kN];
        V::load(expert_out + (static_cast<int64_t>(pos[q]) * C + cv * kN) * sizeof(Elem), val);
#pragma unroll
        for (int n = 0; n < kN; ++n) acc[n] += w[q] * val[n];
      }
#pragma unroll
      for (int n = 0; n < kN; n += 4)
        *reinterpret_cast<float4*>(dst + cv * kN + n) = make_float4(acc[n], acc[n + 1], acc[n + 2], acc[n + 3]);
    }
    if (lane == 0) atomicAdd(&rows_for[s], 1u);
  }
  __syncthreads();  // every partial written before the releases below (they are cumulative)
  for (int d = tid; d < W; d += blockDim.x)
    if (rows_for[d] > 0) {
      __threadfence_system();
      dev::red_add_release_sys(view.flag(d, reg.combine_signal, a.rank), rows_for[d]);
    }

  // ---- phase 2: sum the partials of each of this rank's tokens ---------------------------
  if (tid < W) {
    const uint64_t target = st->rx_combine[tid] + static_cast<uint64_t>(info[il.send_count + tid]);
    if (!wait_at_least(args, view.flag(a.rank, reg.combine_signal, tid), target, kPhaseCombineRows, a.rank, tid,
                       epoch))
      sh.abort = 1;
  }
  __syncthreads();
  if (sh.abort) return;

  const auto* partials = reinterpret_cast<const float*>(view.own() + reg.comb_rows);
  const int64_t comb_floats = static_cast<int64_t>(reg.comb_stride / sizeof(float));
  for (int64_t t = gw; t < T; t += nw) {
    for (int cv = lane; cv < nvec; cv += 32) {
      float acc[kN];
#pragma unroll
      for (int n = 0; n < kN; ++n) acc[n] = 0.f;
      for (int d = 0; d < W; ++d) {
        const int slot = send_slot[t * W + d];
        if (slot < 0) continue;
        const float* src = partials + (static_cast<int64_t>(d) * Tmax + slot) * comb_floats + cv * kN;
#pragma unroll
        for (int n = 0; n < kN; n += 4) {
          const float4 p = ld_partial(src + n);
          acc[n] += p.x, acc[n + 1] += p.y, acc[n + 2] += p.z, acc[n + 3] += p.w;
        }
      }
      V::store(y + (t * C + cv * kN) * sizeof(Elem), acc);
    }
  }
  __syncthreads();

  if (tid == 0 && !aborted(args)) {
    __threadfence();
    const uint32_t prev = atomicAdd(&st->blocks_done_combine, 1u);
    if (prev == static_cast<uint32_t>(nb - 1)) {
      st->blocks_done_combine = 0;
      for (int d = 0; d < W; ++d) st->rx_combine[d] += static_cast<uint64_t>(info[il.send_count + d]);
      st->combine_epoch = epoch;
      __threadfence_system();
      dev::st_release_sys(view.flag(a.rank, reg.done_combine, 0), epoch);
    }
  }
}

template <typename T>
LaunchStatus launch_combine_typed(const LaunchArgs& args, uint64_t stream) {
  return dev::launch_cooperative(combine_kernel<T>, args.num_ranks * args.blocks_per_rank, kThreads, 0, stream, args);
}

}  // namespace

LaunchStatus launch_combine(const LaunchArgs& args, uint64_t stream) {
  switch (args.dtype) {
    case kFloat32: return launch_combine_typed<float>(args, stream);
    case kBFloat16: return launch_combine_typed<__nv_bfloat16>(args, stream);
    case kFloat16: return launch_combine_typed<__half>(args, stream);
    default: return "combine: unsupported dtype code";
  }
}

int combine_max_blocks_per_sm() { return dev::max_active_blocks(combine_kernel<__nv_bfloat16>, kThreads, 0); }

}  // namespace hybrid_ep
