// M6: how fast the warps of one SM sum K bf16 rows held in shared memory into fp32 and
// write the bf16 result back to shared memory, as combine's reducers do with a stage. The
// rows are filled with small integers ((q + e) % 8 for row q, element e), so every sum is
// exact and the host checks the result row. Each thread takes vectors of kVecBytes (4, 8 or
// 16-byte shared loads) strided over the block; the loop over the K rows is unrolled
// (kFixedK = K) or bounded at run time (kFixedK = 0, as combine's loop is today).
#pragma once
#include <cstdint>
#include <cstring>

#include "microbench/probe.cuh"

namespace hybrid_ep::micro {

constexpr int kReduceMaxRows = 8;

struct ReduceArgs {
  Common c;
  int rows;  // K (1 .. kReduceMaxRows); the kernel's kFixedK when that is not 0
  int reps;
  uint32_t row_bytes;  // a multiple of 16
  float weight[kReduceMaxRows];
  uint16_t* result;  // the bf16 bits of the summed row, copied out at the end
};

template <int kBytes>
struct alignas(kBytes) ReduceVec {
  uint32_t pair[kBytes / 4];  // each a bf16x2
};

__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t bits) {
  __nv_bfloat162 v;
  memcpy(&v, &bits, 4);
  return __bfloat1622float2(v);
}

__device__ __forceinline__ uint32_t float2_to_bf16x2(float x, float y) {
  const __nv_bfloat162 v = __float22bfloat162_rn(make_float2(x, y));
  uint32_t bits;
  memcpy(&bits, &v, 4);
  return bits;
}

template <int kVecBytes>
__device__ __forceinline__ void accumulate(const uint8_t* row, uint32_t v, float w, float* acc) {
  const ReduceVec<kVecBytes> x = reinterpret_cast<const ReduceVec<kVecBytes>*>(row)[v];
#pragma unroll
  for (int p = 0; p < kVecBytes / 4; ++p) {
    const float2 f = bf16x2_to_float2(x.pair[p]);
    acc[2 * p] += w * f.x;
    acc[2 * p + 1] += w * f.y;
  }
}

template <int kVecBytes, int kFixedK>
__global__ void __launch_bounds__(256, 1) reduce_kernel(const __grid_constant__ ReduceArgs a) {
  constexpr int kElems = kVecBytes / 2;
  uint8_t* smem = dev::dynamic_smem<uint8_t>();  // K input rows, the output row, K weights
  const int k = kFixedK > 0 ? kFixedK : a.rows;
  const uint32_t elems = a.row_bytes / 2;
  uint16_t* in = reinterpret_cast<uint16_t*>(smem);
  for (uint32_t i = threadIdx.x; i < elems * static_cast<uint32_t>(k); i += blockDim.x) {
    const uint32_t q = i / elems, e = i % elems;
    const uint32_t pair = float2_to_bf16x2(static_cast<float>((q + e) % 8), 0.f);
    in[i] = static_cast<uint16_t>(pair & 0xffffu);
  }
  // weights: in registers for the unrolled loop; in shared memory, as combine's stage header
  // holds them, for the loop bounded at run time (a register array indexed at run time would
  // live in local memory)
  float w[kReduceMaxRows];
#pragma unroll
  for (int q = 0; q < kReduceMaxRows; ++q) w[q] = a.weight[q];
  uint8_t* out = smem + static_cast<size_t>(k) * a.row_bytes;
  float* shared_w = reinterpret_cast<float*>(out + a.row_bytes);
  if (threadIdx.x < kReduceMaxRows) shared_w[threadIdx.x] = a.weight[threadIdx.x];
  const uint32_t vecs = a.row_bytes / kVecBytes;
  __syncthreads();
  const SpanClock clock = SpanClock::start();
  for (int r = 0; r < a.reps; ++r) {
    asm volatile("" ::: "memory");  // each repetition reads and writes shared memory again
    for (uint32_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      float acc[kElems];
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[e] = 0.f;
      if constexpr (kFixedK > 0) {
#pragma unroll
        for (int q = 0; q < kFixedK; ++q) accumulate<kVecBytes>(smem + q * a.row_bytes, v, w[q], acc);
      } else {
        for (int q = 0; q < k; ++q) accumulate<kVecBytes>(smem + q * a.row_bytes, v, shared_w[q], acc);
      }
      ReduceVec<kVecBytes> y;
#pragma unroll
      for (int p = 0; p < kVecBytes / 4; ++p) y.pair[p] = float2_to_bf16x2(acc[2 * p], acc[2 * p + 1]);
      reinterpret_cast<ReduceVec<kVecBytes>*>(out)[v] = y;
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) clock.stop(a.c);
  for (uint32_t e = threadIdx.x; e < elems; e += blockDim.x) a.result[e] = reinterpret_cast<const uint16_t*>(out)[e];
}

}  // namespace hybrid_ep::micro
