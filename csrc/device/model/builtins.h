// The CUDA language the kernels use, for a host compiler: qualifiers, thread identity,
// vector types, bf16 / fp16 conversions (round to nearest even, as the hardware's _rn), block
// barriers, warp collectives, atomics and fences. Synchronisation goes to the model's
// scheduler (runtime.h); each call site is passed along so its checks can name the line.
#pragma once
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "device/model/runtime.h"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))

#define threadIdx (::hybrid_ep::model::thread_idx())
#define blockIdx (::hybrid_ep::model::block_idx())
#define blockDim (::hybrid_ep::model::block_dim())
#define gridDim (::hybrid_ep::model::grid_dim())

// ---- vector types -----------------------------------------------------------------------

struct alignas(16) int4 {
  int x, y, z, w;
};
struct alignas(16) float4 {
  float x, y, z, w;
};
struct alignas(8) float2 {
  float x, y;
};
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }

inline float __int_as_float(int v) {
  float f;
  std::memcpy(&f, &v, 4);
  return f;
}
inline int __float_as_int(float f) {
  int v;
  std::memcpy(&v, &f, 4);
  return v;
}

template <typename T>
inline T min(T a, T b) {
  return b < a ? b : a;
}
template <typename T>
inline T max(T a, T b) {
  return a < b ? b : a;
}

inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(unsigned v) { return __builtin_ffs(static_cast<int>(v)); }  // 1-based, 0 for none

// A load that bypasses L1: on the CPU simply a load.
inline float4 __ldcv(const float4* p) { return *p; }

// ---- 16-bit floats ----------------------------------------------------------------------

struct __nv_bfloat16 {
  uint16_t bits;
};
struct __nv_bfloat162 {
  __nv_bfloat16 x, y;
};
struct __half {
  uint16_t bits;
};
struct __half2 {
  __half x, y;
};

namespace hybrid_ep::model {

inline uint32_t float_bits(float f) { return static_cast<uint32_t>(__float_as_int(f)); }
inline float bits_float(uint32_t u) { return __int_as_float(static_cast<int>(u)); }

inline uint16_t float_to_bf16_rn(float f) {
  uint32_t u = float_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_float(uint16_t h) { return bits_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_half_rn(float f) {
  const uint32_t x = float_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  uint32_t mant = x & 0x7fffffu;
  const int exp = static_cast<int>((x >> 23) & 0xffu);
  if (exp == 0xff) return static_cast<uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0u));
  const int e = exp - 127 + 15;
  if (e >= 0x1f) return static_cast<uint16_t>(sign | 0x7c00u);
  if (e <= 0) {  // a subnormal half (or zero)
    if (e < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000u;
    const int shift = 14 - e;
    uint32_t h = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1u), half_way = 1u << (shift - 1);
    if (rem > half_way || (rem == half_way && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  uint32_t h = sign | (static_cast<uint32_t>(e) << 10) | (mant >> 13);
  const uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return static_cast<uint16_t>(h);
}

inline float half_to_float(uint16_t h) {
  const uint32_t sign = (static_cast<uint32_t>(h) & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu;
  if (exp == 0) {
    if (mant == 0) return bits_float(sign);
    float v = static_cast<float>(mant) * (1.0f / 16777216.0f);  // mant x 2^-24
    return sign ? -v : v;
  }
  if (exp == 0x1f) return bits_float(sign | 0x7f800000u | (mant << 13));
  return bits_float(sign | ((exp + 112) << 23) | (mant << 13));
}

}  // namespace hybrid_ep::model

// Each pair converted is the timing model's count of the plain code around it (runtime.h).
inline float2 __bfloat1622float2(__nv_bfloat162 v) {
  hybrid_ep::model::note_plain_pair(hybrid_ep::model::Pair::kWidenCvt);
  return {hybrid_ep::model::bf16_to_float(v.x.bits), hybrid_ep::model::bf16_to_float(v.y.bits)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v) {
  hybrid_ep::model::note_plain_pair(hybrid_ep::model::Pair::kNarrow);
  return {{hybrid_ep::model::float_to_bf16_rn(v.x)}, {hybrid_ep::model::float_to_bf16_rn(v.y)}};
}
inline float2 __half22float2(__half2 v) {
  hybrid_ep::model::note_plain_pair(hybrid_ep::model::Pair::kWidenCvt);
  return {hybrid_ep::model::half_to_float(v.x.bits), hybrid_ep::model::half_to_float(v.y.bits)};
}
inline __half2 __float22half2_rn(float2 v) {
  hybrid_ep::model::note_plain_pair(hybrid_ep::model::Pair::kNarrow);
  return {{hybrid_ep::model::float_to_half_rn(v.x)}, {hybrid_ep::model::float_to_half_rn(v.y)}};
}

// fp32 products and sums rounded each on its own (never fused into a multiply-add); the host
// compiler's x86-64 code has no fused multiply-add.
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }

// ---- barriers, warp collectives ---------------------------------------------------------

inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  hybrid_ep::model::syncthreads({file, line});
}

inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  hybrid_ep::model::collective(hybrid_ep::model::Collective::kSyncwarp, mask, 0, 0, {file, line});
}

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src, int width = 32, const char* file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
  static_assert(sizeof(T) <= 8, "__shfl_sync moves at most 8 bytes");
  uint64_t in = 0;
  std::memcpy(&in, &var, sizeof(T));
  const int lane = static_cast<int>(threadIdx.x & 31u);
  const int from = width >= 32 ? src : (lane & ~(width - 1)) + (src & (width - 1));
  const uint64_t out = hybrid_ep::model::collective(hybrid_ep::model::Collective::kShfl, mask, in, from, {file, line});
  T r;
  std::memcpy(&r, &out, sizeof(T));
  return r;
}

inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
  return static_cast<unsigned>(
      hybrid_ep::model::collective(hybrid_ep::model::Collective::kBallot, mask, predicate != 0, 0, {file, line}));
}

// ---- atomics and fences: one OS thread runs every fiber, so any read-modify-write is
// atomic here; they are the compiler's atomics so that the race check (happens_before.h)
// sees them as such, acquire-release (the race check credits a fence only to the relaxed
// polls before it: happens_before.h).

// The timing model is told of each atomic (a write a poll may wait for) and fence (a cost).

template <typename T>
inline T atomicAdd(T* p, T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(std::is_integral<T>::value, "the model's atomicAdd is for integers");
  const T old = __atomic_fetch_add(p, v, __ATOMIC_ACQ_REL);
  hybrid_ep::model::note_atomic(p, {file, line});
  return old;
}
template <typename T>
inline T atomicOr(T* p, T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  static_assert(std::is_integral<T>::value, "the model's atomicOr is for integers");
  const T old = __atomic_fetch_or(p, v, __ATOMIC_ACQ_REL);
  hybrid_ep::model::note_atomic(p, {file, line});
  return old;
}
inline int atomicMin(int* p, int v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  int old = __atomic_load_n(p, __ATOMIC_ACQUIRE);
  while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {}
  hybrid_ep::model::note_atomic(p, {file, line});
  return old;
}
inline int atomicCAS(int* p, int compare, int value, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  __atomic_compare_exchange_n(p, &compare, value, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  hybrid_ep::model::note_atomic(p, {file, line});
  return compare;  // the value found: `compare` when the swap happened
}
inline void __threadfence(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  hybrid_ep::model::fence_acquire(hybrid_ep::model::Fence::kGpu, {file, line});
}
inline void __threadfence_system(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  hybrid_ep::model::fence_acquire(hybrid_ep::model::Fence::kSystem, {file, line});
}
