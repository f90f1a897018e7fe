// The NVSHMEM transport's self-test kernel and its host launcher (see nvshmem_selftest.h).
// Region layout: the put_signal word at 0, the 0-byte put_signal's word at 32, the fenced signal
// word at 64, the pattern this PE sends at 128, the pattern it receives right after.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "common/params.h"  // TransportKind
#include "transport/nvshmem.cuh"
#include "transport/nvshmem_selftest.h"

namespace hybrid_ep::nvshmem_selftest {

namespace {

constexpr uint64_t kSignalPut = 0;
constexpr uint64_t kSignalEmpty = 32;  // a put of 0 bytes with its signal (the kernels' chunks without rows)
constexpr uint64_t kSignalFenced = 64;
constexpr uint64_t kPayload = 128;
constexpr int kThreads = 256;

__device__ __forceinline__ uint32_t pattern(int src, uint64_t call, uint64_t word) {
  return (static_cast<uint32_t>(src) + 1u) * 0x9E3779B1u ^ static_cast<uint32_t>(call * 0x85EBCA77u) ^
         static_cast<uint32_t>(word * 0xC2B2AE3Du);
}

// Spins until *flag >= target or the timeout passes; the observed value either way.
__device__ uint64_t bounded_wait(const uint64_t* flag, uint64_t target, uint64_t timeout_ns, bool* timed_out) {
  const uint64_t start = dev::global_timer_ns();
  for (;;) {
    uint64_t v = dev::ld_acquire_sys(flag);
    if (v >= target) return v;
    if (dev::global_timer_ns() - start > timeout_ns) {
      *timed_out = true;
      return v;
    }
  }
}

__global__ void __launch_bounds__(kThreads)
    selftest_kernel(NvshmemTransport t, int n, uint64_t bytes, uint64_t call, uint64_t timeout_ns, Result* out) {
  __shared__ bool timed_out;
  const uint64_t words = bytes / 4, half = bytes / 2;
  const uint64_t send = kPayload, recv = kPayload + bytes;
  const int dst = (t.rank + 1) % n, src = (t.rank + n - 1) % n;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;

  auto* mine = reinterpret_cast<uint32_t*>(t.local(send));
  for (uint64_t w = threadIdx.x; w < words; w += blockDim.x) mine[w] = pattern(t.rank, call, w);
  if (threadIdx.x == 0) timed_out = false;
  __syncthreads();

  if (warp == 0) {
    t.put_signal(lane, dst, recv, t.local(send), half, kSignalPut, call);
    if (lane == 0) t.quiet();
  } else if (warp == 1) {
    t.put(lane, dst, recv + half, t.local(send + half), half);
    if (lane == 0) {
      t.fence();
      t.signal(dst, kSignalFenced, call);
      t.quiet();
    }
  } else if (warp == 2) {
    t.put_signal(lane, dst, recv, t.local(send), 0, kSignalEmpty, call);
    if (lane == 0) t.quiet();
  }
  if (threadIdx.x == 0) {
    bool late = false;
    out->signal_put = bounded_wait(reinterpret_cast<uint64_t*>(t.local(kSignalPut)), call, timeout_ns, &late);
    out->signal_fenced = bounded_wait(reinterpret_cast<uint64_t*>(t.local(kSignalFenced)), call, timeout_ns, &late);
    out->signal_empty = bounded_wait(reinterpret_cast<uint64_t*>(t.local(kSignalEmpty)), call, timeout_ns, &late);
    out->timed_out = late ? 1 : 0;
    timed_out = late;
  }
  __syncthreads();
  if (timed_out) return;
  const auto* got = reinterpret_cast<const uint32_t*>(t.local(recv));
  for (uint64_t w = threadIdx.x; w < words; w += blockDim.x) {
    if (got[w] != pattern(src, call, w)) {
      atomicAdd(&out->mismatches, 1);
      atomicMin(&out->first_bad, static_cast<int32_t>(w));
    }
  }
}

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("hybrid_ep: NVSHMEM self-test: ") + what + ": " + cudaGetErrorString(err));
}

}  // namespace

uint64_t region_bytes(uint64_t bytes) { return kPayload + 2 * bytes; }

void clear(uint64_t region, uint64_t bytes, uint64_t stream) {
  auto s = reinterpret_cast<cudaStream_t>(stream);
  check(cudaMemsetAsync(reinterpret_cast<void*>(region), 0, region_bytes(bytes), s), "clearing the region");
  check(cudaStreamSynchronize(s), "clearing the region");
}

Result run(uint64_t region, const std::vector<int32_t>& pes, int rank, uint64_t bytes, uint64_t call,
           uint64_t timeout_ns, uint64_t stream) {
  const int n = static_cast<int>(pes.size());
  if (n < 2 || rank < 0 || rank >= n)
    throw std::invalid_argument("hybrid_ep: the NVSHMEM self-test needs >= 2 PEs and 0 <= rank < PEs");
  if (bytes == 0 || bytes % 32 != 0 || bytes / 4 > 0x7fffffffu)
    throw std::invalid_argument("hybrid_ep: the NVSHMEM self-test's bytes must be a positive multiple of 32, got " +
                                std::to_string(bytes));
  if (call == 0) throw std::invalid_argument("hybrid_ep: the NVSHMEM self-test's calls count from 1");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  int32_t* d_pes = nullptr;
  Result* d_out = nullptr;
  Result init{0, 0x7fffffff, 0, 0, 0, 0, 0};
  check(cudaMalloc(&d_pes, sizeof(int32_t) * n), "cudaMalloc");
  check(cudaMalloc(&d_out, sizeof(Result)), "cudaMalloc");
  Result res{};
  try {
    check(cudaMemcpyAsync(d_pes, pes.data(), sizeof(int32_t) * n, cudaMemcpyHostToDevice, s), "copy of the PE table");
    check(cudaMemcpyAsync(d_out, &init, sizeof(Result), cudaMemcpyHostToDevice, s), "copy of the result");
    NvshmemTransport t{reinterpret_cast<uint8_t*>(region), d_pes, rank};
    selftest_kernel<<<1, kThreads, 0, s>>>(t, n, bytes, call, timeout_ns, d_out);
    check(cudaGetLastError(), "launch");
    check(cudaMemcpyAsync(&res, d_out, sizeof(Result), cudaMemcpyDeviceToHost, s), "copy back");
    check(cudaStreamSynchronize(s), "kernel");
  } catch (...) {
    cudaFree(d_pes);
    cudaFree(d_out);
    throw;
  }
  cudaFree(d_pes);
  cudaFree(d_out);
  if (res.mismatches == 0) res.first_bad = -1;
  return res;
}

}  // namespace hybrid_ep::nvshmem_selftest
