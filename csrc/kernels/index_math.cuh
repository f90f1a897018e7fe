// 32-bit arithmetic on the kernels' 64-bit counts and expert ids. A 64-bit division or remainder
// is a call to a division routine on the GPU (with the spills around it); the values below fit
// 32 bits, so their 32-bit forms are a few instructions inline.
#pragma once
#include <cstdint>

#include "device/device.cuh"

namespace hybrid_ep {

// Chunks of `chunk` rows that `rows` rows take (rows: a rank's tokens, below 2^31).
__host__ __device__ inline int chunks_of(int64_t rows, int chunk) {
  return static_cast<int>((static_cast<uint32_t>(rows) + chunk - 1) / static_cast<uint32_t>(chunk));
}

// The rank that hosts expert e (e >= 0: a route, not -1) of L local experts per rank, and its
// index there.
__host__ __device__ inline int expert_rank(int64_t e, int L) {
  return static_cast<int>(static_cast<uint32_t>(e) / static_cast<uint32_t>(L));
}
__host__ __device__ inline int local_expert(int64_t e, int L) {
  return static_cast<int>(static_cast<uint32_t>(e) % static_cast<uint32_t>(L));
}

// Whether unit `unit` (>= 0: a chunk numbered across the nodes, below 2^32) falls to block b of
// nb taking every nb-th.
__host__ __device__ inline bool block_takes(int64_t unit, int nb, int b) {
  return static_cast<uint32_t>(unit) % static_cast<uint32_t>(nb) == static_cast<uint32_t>(b);
}

}  // namespace hybrid_ep
