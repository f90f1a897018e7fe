// Row segments through a shared-memory ring into a reducer group's registers: the skeleton
// both sides of combine (kernels/combine_receive.cuh) and the direct path's combine (kernels/combine_direct.cuh)
// share. A load thread puts the parts of one row segment (a route's expert output, a partial)
// into stages of their own; a group of kGroupWarps warps holds the segment in fp32 registers
// (thread i of the group: 16-byte vectors i, i + kGroupThreads, ...), adds each part as it arrives and
// hands the finished segment to the caller. Each warp of the group waits for a stage and
// releases it itself, the ring's empty barrier counting kGroupWarps arrivals; with the named
// hand-off (kReducerWaitNamed) group thread 0 waits for the whole group and a bar.sync passes it on.
//
// Call: anything with args (LaunchArgs), seg_cols, stop() and stopped().
#pragma once
#include <cstring>
#include <type_traits>

#include "common/state.cuh"
#include "kernels/pipeline.cuh"

namespace hybrid_ep {

constexpr int kGroupWarps = 4, kGroupThreads = kGroupWarps * 32;  // a reducer group

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

// A pair's 32 bits (element 0 in the low half) <-> fp32. bf16 is the top half of an fp32, so the
// device layer widens it with a shift and a mask (dev::bf16x2_to_float2), exactly as
// __bfloat1622float2 does, in 2 instructions where the cvt of each half takes 3.
struct BF16Conv {
  using H2 = __nv_bfloat162;
  __device__ static float2 to_float2(__nv_bfloat162 v) { return __bfloat1622float2(v); }
  __device__ static float2 bits_to_float2(uint32_t bits) { return dev::bf16x2_to_float2(bits); }
  __device__ static __nv_bfloat162 from_float2(float2 v) { return __float22bfloat162_rn(v); }
};
struct HalfConv {
  using H2 = __half2;
  __device__ static float2 to_float2(__half2 v) { return __half22float2(v); }
  __device__ static float2 bits_to_float2(uint32_t bits) {
    __half2 v;
    memcpy(&v, &bits, 4);
    return __half22float2(v);
  }
  __device__ static __half2 from_float2(float2 v) { return __float22half2_rn(v); }
};
template <>
struct Quad<__nv_bfloat16> : QuadHalf<__nv_bfloat162, BF16Conv> {};
template <>
struct Quad<__half> : QuadHalf<__half2, HalfConv> {};

// ---- sixteen bytes of a dtype <-> fp32: a reducer thread's vector ---------------------------

// One 16-byte access: kCols columns (8 of a 16-bit dtype, 4 of fp32), the unit a reducer
// thread loads from a stage and holds in registers.
template <typename T>
struct Vec16;
template <>
struct Vec16<float> {
  static constexpr int kCols = 4;
  __device__ static void load(const uint8_t* p, float* out) { Quad<float>::load(p, out); }
  __device__ static void store(uint8_t* p, const float* in) { Quad<float>::store(p, in); }
};

template <typename Conv>
struct Vec16Half {
  static constexpr int kCols = 8;
  __device__ static void load(const uint8_t* p, float* out) {
    const int4 v = dev::ld(reinterpret_cast<const int4*>(p));
    const int bits[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const float2 f = Conv::bits_to_float2(static_cast<uint32_t>(bits[k]));
      out[2 * k] = f.x, out[2 * k + 1] = f.y;
    }
  }
  __device__ static void store(uint8_t* p, const float* in) {
    int bits[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const typename Conv::H2 h = Conv::from_float2(make_float2(in[2 * k], in[2 * k + 1]));
      memcpy(&bits[k], &h, 4);
    }
    dev::st(reinterpret_cast<int4*>(p), make_int4(bits[0], bits[1], bits[2], bits[3]));
  }
};
template <>
struct Vec16<__nv_bfloat16> : Vec16Half<BF16Conv> {};
template <>
struct Vec16<__half> : Vec16Half<HalfConv> {};

// The columns of one vector of a combine dtype code (fp32, bf16, fp16): a segment and a row
// must hold whole vectors (the launchers check; rows are whole 16-byte multiples anyway).
__host__ __device__ constexpr int vector_cols(int32_t dtype) { return dtype == kFloat32 ? 4 : 8; }

// Both combine launchers' check of the segment width the host chose: nullptr if it holds, else
// the error's text.
inline const char* check_segment_cols(const LaunchArgs& args) {
  if (args.seg_cols <= 0 || args.seg_cols > kCombineMaxSegCols || args.seg_cols % 4 != 0)
    return "combine: seg_cols must be a positive multiple of 4 up to 8192 (kCombineMaxSegCols)";
  if (args.seg_cols % vector_cols(args.dtype) != 0 || args.row_elems % vector_cols(args.dtype) != 0)
    return "combine: seg_cols and the row's columns must be whole 16-byte vectors (multiples of 8 for bf16 / fp16, "
           "4 for fp32)";
  return nullptr;
}

// kCols columns of fp32 rounded once to Out at p: one 16-byte store where they fill one, else
// a store per quad (a 16-bit segment written as fp32, or the reverse).
template <typename Out, int kCols>
__device__ __forceinline__ void store_cols(uint8_t* p, const float* in) {
  if constexpr (kCols * sizeof(Out) == 16) {
    Vec16<Out>::store(p, in);
  } else {
#pragma unroll
    for (int q = 0; q < kCols / 4; ++q) Quad<Out>::store(p + q * 4 * sizeof(Out), in + 4 * q);
  }
}

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

// A reducer warp learns that a stage is full, in one of the ways of LaunchArgs::reducer_wait
// (common/params.h). kReducerWaitObserve: lane 0 waits (bounded), the warp agrees on the answer,
// and every other lane observes the completed phase itself (its own acquire of the stage's bytes
// and header); kReducerWaitElect: the agreement's __syncwarp alone orders lane 0's acquire before
// the other lanes' reads; kReducerWaitConverged: every lane waits (bounded) itself, the warp
// converged, and a ballot of lanes that arrive together gives the verdict, so no lane runs a wait
// loop while the others stand at a collective (micro M1's hand-offs on the H200, half a round
// trip: 341 ns with lane 0 waiting and the others at its vote, 238 with an elected lane and a
// __syncwarp, 93 for a lane alone).
template <typename Call>
__device__ __forceinline__ bool warp_consumer_wait(const Call& d, const Ring& ring, const PipeState& p, int lane,
                                                   int wait = kReducerWaitObserve) {
  if (wait == kReducerWaitConverged) {
    const bool ok = !d.stopped() && ring.consumer_wait(d.args, p);
    if (__ballot_sync(0xffffffffu, !ok) == 0) return true;
    d.stop();
    return false;
  }
  bool ok = true;
  if (lane == 0) ok = !d.stopped() && ring.consumer_wait(d.args, p);
  if (!warp_uniform(ok)) {
    d.stop();
    return false;
  }
  if (wait == kReducerWaitObserve) ring.observe_full(p, lane);
  return true;
}

// A reducer group learns that a stage is full with one waiter and a named barrier
// (kReducerWaitNamed, Hybrid-EP's hand-off): group thread 0 waits (bounded) and writes the
// verdict into `verdict` (the word of this item's parity: the next item's verdict is written
// only after every thread passed this item's barrier and read this one's), then the group's
// `threads` threads meet at named barrier `id`, whose bar.sync orders the waiter's acquire of the
// stage and its verdict before every thread's reads. Every thread of the group calls it; all
// return the same answer, so no thread leaves a loop another still runs (bar.sync is not bounded).
template <typename Call>
__device__ __forceinline__ bool group_consumer_wait(const Call& d, const Ring& ring, const PipeState& p, int gt,
                                                    uint32_t id, uint32_t threads, volatile int* verdict) {
  volatile int* word = verdict + (p.count & 1u);
  if (gt == 0) *word = !d.stopped() && ring.consumer_wait(d.args, p) && !d.stopped();
  dev::named_barrier_sync(id, threads);
  if (*word != 0) return true;
  d.stop();
  return false;
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

// One row segment in fp32, spread over a reducer group of kWarps warps (kGroupWarps, or the
// direct combine's LaunchArgs::reducer_warps): thread gt holds the 16-byte vectors (of In, the
// parts' dtype) gt, gt + kThreads, ... (consecutive threads touch consecutive bytes, in shared and
// in global memory). The loops are unrolled, so the accumulator stays in registers. Each part is
// added element by element in fp32 in the order the parts come, the product with the weight
// rounded before the sum (no fused multiply-add), as the oracle sums.
//
// A part of the widest segments (every vector of a thread but its last whole: 7168 to 8192 bf16
// columns at 4 warps, 6144 to 8192 at 8) is added in one straight block, kVecs vectors a thread
// with the last one clamped; narrower ones take a bounded loop with a branch around each vector's
// load, about 1.5 times the instructions per vector (SASS of combine_direct_kernel<bf16> at 4
// warps: 26 against 17.25 per plain vector), which made the H = 7168 combine 1.36 times slower
// per row than H = 8192's on the H200. A loop for every vector count (one instantiation each) took
// registers the kernel does not have (at 4 warps it runs at its cap of 168 and spilled).
template <typename In, int kWarps = kGroupWarps>
struct SegmentAcc {
  static constexpr int kThreads = kWarps * 32;
  using V = Vec16<In>;
  static constexpr int kCols = V::kCols;                                 // per vector
  static constexpr int kVecs = kCombineMaxSegCols / (kCols * kThreads);  // per thread
  static_assert(kVecs * kCols * kThreads == kCombineMaxSegCols, "a segment spreads evenly over a group");
  static_assert(kCols == vector_cols(std::is_same<In, float>::value ? kFloat32 : kBFloat16), "vector_cols");

  float v[kVecs][kCols];
  bool blank = false;  // no part: the segment is zero whatever v holds (v keeps its registers, no
                       // constant written into all of them on every item's path)

  // v = w * part (the first part), else v += part (w == 1: w * x is x) or v += w * part, for the
  // `cols` columns (whole vectors: launchers check vector_cols) of In at `in`. The part's kind is one branch per part,
  // not a select per element.
  __device__ __forceinline__ void add(const uint8_t* in, int cols, int gt, float w, bool first) {
    blank = false;
    if (first) {
      add_as<kFirst>(in, cols, gt, w);
    } else if (w == 1.f) {
      add_as<kPlain>(in, cols, gt, w);
    } else {
      add_as<kWeighted>(in, cols, gt, w);
    }
  }
  // The same for a part of another dtype (an fp32 node partial added into a 16-bit row's
  // accumulator): the thread's columns read as From, a quad at a time.
  template <typename From>
  __device__ __forceinline__ void add_from(const uint8_t* in, int cols, int gt, float w, bool first) {
    if constexpr (std::is_same<From, In>::value) {
      add(in, cols, gt, w, first);
    } else {
      blank = false;
      const int whole = cols / kCols, rounds = (whole + kThreads - 1) / kThreads;
#pragma unroll
      for (int i = 0; i < kVecs; ++i) {
        if (i >= rounds) continue;
        float x[kCols];
        const uint8_t* p = in + static_cast<size_t>(min(gt + i * kThreads, whole - 1)) * kCols * sizeof(From);
#pragma unroll
        for (int q = 0; q < kCols / 4; ++q) Quad<From>::load(p + q * 4 * sizeof(From), x + 4 * q);
        if (first) {
          add_to<kFirst>(v[i], x, w);
        } else if (w == 1.f) {
          add_to<kPlain>(v[i], x, w);
        } else {
          add_to<kWeighted>(v[i], x, w);
        }
      }
    }
  }
  // A segment without parts (a row with nothing to add): zero.
  __device__ __forceinline__ void set_blank() { blank = true; }
  // The segment's `cols` columns rounded once to Out, at `out` (shared or global memory).
  template <typename Out>
  __device__ __forceinline__ void store(uint8_t* out, int cols, int gt) const {
    if (blank) {
      store_as<Out, true>(out, cols, gt);
    } else {
      store_as<Out, false>(out, cols, gt);
    }
  }

 private:
  enum Kind { kFirst, kPlain, kWeighted };

  template <typename Out, bool kBlank>
  __device__ __forceinline__ void store_as(uint8_t* out, int cols, int gt) const {
    const float zeros[kCols] = {};
    const int whole = cols / kCols;
#pragma unroll
    for (int i = 0; i < kVecs; ++i) {
      const int j = gt + i * kThreads;
      if (cols == kCombineMaxSegCols || j < whole)
        store_cols<Out, kCols>(out + static_cast<size_t>(j) * kCols * sizeof(Out), kBlank ? zeros : v[i]);
    }
  }

  template <Kind kKind>
  __device__ __forceinline__ static void add_to(float* acc, const float* x, float w) {
#pragma unroll
    for (int e = 0; e < kCols; ++e) {
      if (kKind == kFirst) acc[e] = w * x[e];
      if (kKind == kPlain) acc[e] += x[e];
      if (kKind == kWeighted) acc[e] = __fadd_rn(acc[e], __fmul_rn(w, x[e]));
    }
  }

  template <Kind kKind>
  __device__ __forceinline__ void add_as(const uint8_t* in, int cols, int gt, float w) {
    float x[kVecs][kCols];
    const int whole = cols / kCols;
    if (whole >= (kVecs - 1) * kThreads) {  // the widest segments: one straight block
      // every thread's vectors but the last are whole; the last is clamped to the segment's last
      // vector (a copy added to columns never stored) where the segment ends before it
      const int last = min(gt + (kVecs - 1) * kThreads, whole - 1);
#pragma unroll
      for (int i = 0; i < kVecs; ++i)
        V::load(in + static_cast<size_t>(i + 1 < kVecs ? gt + i * kThreads : last) * 16, x[i]);
#pragma unroll
      for (int i = 0; i < kVecs; ++i) add_to<kKind>(v[i], x[i], w);
      return;
    }
    // `rounds` vectors per thread (the same in every thread: uniform branches); a vector past the
    // end adds a copy of the last one to columns that are never stored (store() bounds them), so
    // no divergent branch per vector
    const int rounds = (whole + kThreads - 1) / kThreads;
#pragma unroll
    for (int i = 0; i < kVecs; ++i)
      if (i < rounds) V::load(in + static_cast<size_t>(min(gt + i * kThreads, whole - 1)) * 16, x[i]);
#pragma unroll
    for (int i = 0; i < kVecs; ++i)
      if (i < rounds) add_to<kKind>(v[i], x[i], w);
  }
};

// ---- a token's parts in one stage ------------------------------------------------------------

// Every part of one row segment, in one stage (the direct combine's token stage): part k's
// `cols` columns at in + k * part_bytes, in In, or in Wire where bit k of `wire` is set (a node
// partial), weighted by weight[k]. Thread gt of a group of kThreads adds the 16-byte vectors gt,
// gt + kThreads, ... of the segment (whole vectors: the launchers check vector_cols): for each,
// the parts in their order, element by element in fp32, the product with the weight rounded
// before the sum (no fused multiply-add), as the oracle and SegmentAcc sum, then writes it to
// out rounded once to Out. No part: zeros. The accumulator is one vector, not the segment's
// (SegmentAcc holds a whole segment across stages), and the loop runs to each thread's own last
// vector: no vector is clamped at any width. The parts' loads go kPartBatch at a time, so their
// latencies overlap.
template <typename In, typename Wire, typename Out, int kThreads>
__device__ __forceinline__ void sum_parts(const uint8_t* in, uint32_t part_bytes, int n, uint32_t wire,
                                          const float* weight, int cols, uint8_t* out, int gt) {
  using V = Vec16<In>;
  constexpr int kCols = V::kCols;
  constexpr int kPartBatch = 4;
  const int vectors = cols / kCols;
  for (int j = gt; j < vectors; j += kThreads) {
    float acc[kCols] = {};
    for (int k0 = 0; k0 < n; k0 += kPartBatch) {
      float x[kPartBatch][kCols];
#pragma unroll
      for (int b = 0; b < kPartBatch; ++b) {
        const int k = k0 + b;
        if (k >= n) continue;
        const uint8_t* part = in + static_cast<size_t>(k) * part_bytes;
        if (std::is_same<Wire, In>::value || !((wire >> k) & 1u)) {
          V::load(part + static_cast<size_t>(j) * 16, x[b]);
        } else {
#pragma unroll
          for (int q = 0; q < kCols / 4; ++q)
            Quad<Wire>::load(part + (static_cast<size_t>(j) * kCols + 4 * q) * sizeof(Wire), x[b] + 4 * q);
        }
      }
#pragma unroll
      for (int b = 0; b < kPartBatch; ++b) {
        const int k = k0 + b;
        if (k >= n) continue;
        const float w = weight[k];
        if (k == 0) {
#pragma unroll
          for (int e = 0; e < kCols; ++e) acc[e] = w * x[b][e];
        } else if (w == 1.f) {
#pragma unroll
          for (int e = 0; e < kCols; ++e) acc[e] += x[b][e];
        } else {
#pragma unroll
          for (int e = 0; e < kCols; ++e) acc[e] = __fadd_rn(acc[e], __fmul_rn(w, x[b][e]));
        }
      }
    }
    store_cols<Out, kCols>(out + static_cast<size_t>(j) * kCols * sizeof(Out), acc);
  }
}

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
// issued load waited for, consumed or not, so the block never exits with one in flight. Loads
// before item `observed` are those this lane already saw land (each phase is waited for once).
template <typename Call>
__device__ void finish_loads(const Call& d, const Ring& ring, PartItem* items, uint8_t* data, uint32_t elem_bytes,
                             PipeState produced, bool ok, uint32_t observed = 0) {
  if (!ok) {
    d.stop();
  } else if (ring.producer_acquire(d.args, produced)) {
    items[produced.stage].flags = kEndOfWork;
    ring.producer_commit(produced);
    produced.advance(ring.stages);
  }
  StageRing{ring, data, static_cast<int>(d.seg_cols * elem_bytes)}.drain(d.args, PipeState::at(observed, ring.stages),
                                                                         produced);
}

// A reducer warp of a group: the parts of each row segment added as they arrive; emit(acc,
// item) takes the segment (SegmentAcc<In>) after its last part (false: stop). Returns at the
// end of work or on a stop.
template <typename In, typename Call, typename Emit>
__device__ void reduce_parts(const Call& d, const Ring& ring, const PartItem* items, const uint8_t* data, int gt,
                             int lane, Emit emit) {
  SegmentAcc<In> acc;
  dev::assume_shared(data);  // the stages (a pointer of a struct the compiler may keep in local memory)
  for (PipeState p;; p.advance(ring.stages)) {
    if (!warp_consumer_wait(d, ring, p, lane)) return;
    const PartItem it = items[p.stage];
    if (it.flags & kEndOfWork) return;
    if (it.flags & kNoBytes) {
      acc.set_blank();
    } else {
      acc.add(data + static_cast<size_t>(p.stage) * d.seg_cols * sizeof(In), it.cols, gt, it.weight,
              (it.flags & kFirstPart) != 0);
    }
    __syncwarp();
    if (lane == 0) ring.consumer_release(p);  // one of the group's kGroupWarps arrivals
    if ((it.flags & kLastPart) && !emit(acc, it)) return;
  }
}

}  // namespace hybrid_ep
