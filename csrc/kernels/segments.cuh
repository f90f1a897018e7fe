// Row segments through a shared-memory ring into a reducer group's registers: the skeleton
// both sides of combine (kernels/combine.cuh) and the pull combine (kernels/combine_pull.cuh)
// share. A load thread puts the parts of one row segment (a route's expert output, a partial)
// into stages of their own; a group of kGroupWarps warps holds the segment in fp32 registers
// (thread i of the group: quads i, i + kGroupThreads, ...), adds each part as it arrives and
// hands the finished segment to the caller. Each warp of the group waits for a stage and
// releases it itself: the ring's empty barrier counts kGroupWarps arrivals.
//
// Call: anything with args (LaunchArgs), seg_cols, stop() and stopped().
#pragma once
#include "common/state.cuh"
#include "kernels/pipeline.cuh"

namespace hybrid_ep {

constexpr int kGroupWarps = 4, kGroupThreads = kGroupWarps * 32;  // a reducer group

// The accumulator: quads (4 columns) per thread of a group, for the widest segment.
constexpr int kQuadsPerThread = kCombineMaxSegCols / (4 * kGroupThreads);
static_assert(kQuadsPerThread * 4 * kGroupThreads == kCombineMaxSegCols, "a segment spreads evenly over a group");

// ---- four values of a 16-bit or 32-bit dtype <-> fp32 -------------------------------------

template <typename T>
struct Quad;  // 4 elements of T

// The loads and stores go through the device layer's accessors (dev::ld, dev::st: plain
// accesses on the GPU), which the timing model counts: every reduction's memory traffic.
template <>
struct Quad<float> {
  __device__ static void load(const void* p, float* out) {
    const float4 v = dev::ld(reinterpret_cast<const float4*>(p));
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  }
  __device__ static void store(void* p, const float* in) {
    dev::st(reinterpret_cast<float4*>(p), make_float4(in[0], in[1], in[2], in[3]));
  }
};

template <typename H2, typename Conv>
struct QuadHalf {
  __device__ static void load(const void* p, float* out) {
    const H2* h = reinterpret_cast<const H2*>(p);
    const float2 a = Conv::to_float2(dev::ld(h)), b = Conv::to_float2(dev::ld(h + 1));
    out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
  }
  __device__ static void store(void* p, const float* in) {
    H2* h = reinterpret_cast<H2*>(p);
    dev::st(h, Conv::from_float2(make_float2(in[0], in[1])));
    dev::st(h + 1, Conv::from_float2(make_float2(in[2], in[3])));
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

// ---- stages ------------------------------------------------------------------------------------

enum ItemFlags : int32_t {
  kFirstPart = 1,  // the first segment added into the accumulator (the others add to it)
  kLastPart = 2,   // the accumulator holds the row's segment: write it
  kNoBytes = 4,    // a row with nothing to add: its segment is zero
  kEndOfWork = 8,  // the load thread's last item: the reducers leave
};

// One stage of a part ring: one part (a route's expert output, or a partial) of one row segment.
struct PartItem {
  int32_t row, slot;   // what the caller writes the segment to (expert host: source rank and slot; source: token)
  int32_t col0, cols;  // column segment
  int32_t flags;
  float weight;  // the part's factor in the sum (the routing weight with apply_probs, else 1)
};

// ---- reducer groups ---------------------------------------------------------------------------

// A reducer warp: lane 0 waits (bounded) until the stage is full, the warp agrees on the
// answer, and every other lane observes the completed phase itself (its own acquire of the
// stage's bytes and header).
template <typename Call>
__device__ __forceinline__ bool warp_consumer_wait(const Call& d, const Ring& ring, const PipeState& p, int lane) {
  bool ok = true;
  if (lane == 0) ok = !d.stopped() && ring.consumer_wait(d.args, p);
  if (!warp_uniform(ok)) {
    d.stop();
    return false;
  }
  ring.observe_full(p, lane);
  return true;
}

// The same for a stage the warp is about to write (a producer of a data-less ring).
template <typename Call>
__device__ __forceinline__ bool warp_producer_acquire(const Call& d, const Ring& ring, const PipeState& p, int lane) {
  bool ok = true;
  if (lane == 0) ok = !d.stopped() && ring.producer_acquire(d.args, p);
  if (!warp_uniform(ok)) {
    d.stop();
    return false;
  }
  ring.observe_empty(p, lane);
  return true;
}

// One row segment in fp32, spread over a reducer group: thread gt holds quads gt,
// gt + kGroupThreads, ... (consecutive threads touch consecutive bytes, in shared and in
// global memory). The loops are unrolled, so the accumulator stays in registers.
struct SegmentAcc {
  float v[kQuadsPerThread][4];

  // v = w * segment (first) or v += w * segment, for the segment's `quads` quads of In at `in`.
  template <typename In>
  __device__ __forceinline__ void add(const uint8_t* in, int quads, int gt, float w, bool first) {
#pragma unroll
    for (int i = 0; i < kQuadsPerThread; ++i) {
      const int q = gt + i * kGroupThreads;
      if (q < quads) {
        float val[4];
        Quad<In>::load(in + static_cast<size_t>(q) * 4 * sizeof(In), val);
#pragma unroll
        for (int e = 0; e < 4; ++e) v[i][e] = first ? w * val[e] : v[i][e] + w * val[e];
      }
    }
  }
  __device__ __forceinline__ void zero() {
#pragma unroll
    for (int i = 0; i < kQuadsPerThread; ++i)
#pragma unroll
      for (int e = 0; e < 4; ++e) v[i][e] = 0.f;
  }
  // The segment rounded once to Out, at `out` (shared or global memory).
  template <typename Out>
  __device__ __forceinline__ void store(uint8_t* out, int quads, int gt) const {
#pragma unroll
    for (int i = 0; i < kQuadsPerThread; ++i) {
      const int q = gt + i * kGroupThreads;
      if (q < quads) Quad<Out>::store(out + static_cast<size_t>(q) * 4 * sizeof(Out), v[i]);
    }
  }
};

// ---- load threads -----------------------------------------------------------------------------

// Lane 0 of a load warp: the n parts of one row segment, a stage each (`head` with the flags
// of each part added; part(i) gives its row in global memory and its weight). A row without
// parts gets one stage without bytes: the reducers write a zero segment. False on a stop.
template <typename Call, typename Part>
__device__ bool load_parts(const Call& d, const Ring& ring, PartItem* items, uint8_t* data, uint32_t elem_bytes,
                           PipeState& produced, PartItem head, int n, Part part) {
  const uint32_t bytes = static_cast<uint32_t>(head.cols) * elem_bytes;
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
    const uint8_t* row = part(i, weight);
    it.weight = weight;
    dev::mbar_arrive_expect_tx(&ring.full[produced.stage], bytes);
    dev::bulk_g2s(data + static_cast<size_t>(produced.stage) * d.seg_cols * elem_bytes,
                  row + static_cast<int64_t>(head.col0) * elem_bytes, bytes, &ring.full[produced.stage]);
  }
  return true;
}

// Lane 0 of a load warp, at the end: the reducers' end-of-work stage (or the stop), then every
// issued load waited for, consumed or not, so the block never exits with one in flight.
template <typename Call>
__device__ void finish_loads(const Call& d, const Ring& ring, PartItem* items, uint8_t* data, uint32_t elem_bytes,
                             PipeState produced, bool ok) {
  if (!ok) {
    d.stop();
  } else if (ring.producer_acquire(d.args, produced)) {
    items[produced.stage].flags = kEndOfWork;
    ring.producer_commit(produced);
    produced.advance(ring.stages);
  }
  StageRing{ring, data, static_cast<int>(d.seg_cols * elem_bytes)}.drain(d.args, PipeState{}, produced);
}

// A reducer warp of a group: the parts of each row segment added as they arrive; emit(acc,
// item, quads) takes the segment after its last part (false: stop). Returns at the end of work
// or on a stop.
template <typename In, typename Call, typename Emit>
__device__ void reduce_parts(const Call& d, const Ring& ring, const PartItem* items, const uint8_t* data, int gt,
                             int lane, Emit emit) {
  SegmentAcc acc;
  for (PipeState p;; p.advance(ring.stages)) {
    if (!warp_consumer_wait(d, ring, p, lane)) return;
    const PartItem it = items[p.stage];
    if (it.flags & kEndOfWork) return;
    const int quads = it.cols / 4;
    if (it.flags & kNoBytes) {
      acc.zero();
    } else {
      acc.add<In>(data + static_cast<size_t>(p.stage) * d.seg_cols * sizeof(In), quads, gt, it.weight,
                  (it.flags & kFirstPart) != 0);
    }
    __syncwarp();
    if (lane == 0) ring.consumer_release(p);  // one of the group's kGroupWarps arrivals
    if ((it.flags & kLastPart) && !emit(acc, it, quads)) return;
  }
}

}  // namespace hybrid_ep
