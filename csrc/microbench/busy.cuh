// M10's neighbours: kernels that keep every SM busy for a given time while the copy engine
// copies, one with arithmetic only, one copying memory with plain loads and stores (the
// SMs' share of HBM taken too). Launched as two blocks of 1024 threads per SM, they take
// every thread slot, so a copy done by a kernel would have to wait for them. Block 0
// records its span (the SM clock of the run).
#pragma once
#include <cstdint>

#include "microbench/probe.cuh"

namespace hybrid_ep::micro {

struct BusyArgs {
  Common c;
  uint64_t duration_ns;  // each thread stops this long after it started
  const int4* src;       // kMemory: words read ...
  int4* dst;             // ... and written, grid-strided, again and again
  uint64_t words;
  float* sink;       // keeps the arithmetic
  uint64_t* passes;  // [0] FMA rounds (compute) or grid-stride passes (memory) of block 0's thread 0
};

__global__ void __launch_bounds__(1024, 2) busy_compute_kernel(const __grid_constant__ BusyArgs a) {
  const SpanClock clock = SpanClock::start();
  const uint64_t until = clock.ns0 + a.duration_ns;
  float x = static_cast<float>(threadIdx.x), y = 1.0001f;
  uint64_t rounds = 0;
  while (dev::global_timer_ns() < until) {
#pragma unroll 16
    for (int i = 0; i < 256; ++i) x = x * y + 0.5f;
    ++rounds;
  }
  if (x == 12345.f) a.sink[threadIdx.x] = x;  // (never true) keeps the loop
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    a.passes[0] = rounds;
    clock.stop(a.c);
  }
}

__global__ void __launch_bounds__(1024, 2) busy_memory_kernel(const __grid_constant__ BusyArgs a) {
  const SpanClock clock = SpanClock::start();
  const uint64_t until = clock.ns0 + a.duration_ns;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  uint64_t passes = 0;
  while (dev::global_timer_ns() < until) {
    for (uint64_t i = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < a.words; i += stride)
      a.dst[i] = a.src[i];
    ++passes;
  }
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    a.passes[0] = passes;
    clock.stop(a.c);
  }
}

}  // namespace hybrid_ep::micro
