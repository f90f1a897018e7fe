// Cooperative launches and occupancy queries on a GPU. Every launch is cooperative: blocks
// wait on rows that other blocks (of this or another virtual rank) send, so all of them must
// be resident at once. csrc/device/model/launch.h runs the same kernels on the CPU model.
#pragma once
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <unordered_map>

namespace hybrid_ep::dev {

// The static shared memory of `kernel`, read once per kernel: every kernel takes the same
// argument type, so a cache per instantiation of launch_cooperative would hold the first one's.
inline size_t static_smem_bytes(const void* kernel) {
  static std::mutex mutex;
  static std::unordered_map<const void*, size_t> bytes;
  std::lock_guard<std::mutex> lock(mutex);
  auto it = bytes.find(kernel);
  if (it == bytes.end()) {
    cudaFuncAttributes attr{};
    it = bytes.emplace(kernel, cudaFuncGetAttributes(&attr, kernel) == cudaSuccess ? attr.sharedSizeBytes : 0).first;
  }
  return it->second;
}

// nullptr on success, else the CUDA error's text. `name` is the kernel's for the CPU model
// (its fault injection and messages); unused here.
template <typename Args>
const char* launch_cooperative(void (*kernel)(Args), int blocks, int threads, size_t smem, uint64_t stream,
                               const Args& args, const char* /*name*/ = nullptr) {
  // Static and dynamic shared memory share the block's opt-in limit: refuse with both numbers
  // rather than with cudaFuncSetAttribute's "invalid argument".
  const size_t static_bytes = static_smem_bytes(reinterpret_cast<const void*>(kernel));
  int device = 0, optin = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) == cudaSuccess &&
      static_bytes + smem > static_cast<size_t>(optin)) {
    static thread_local char message[160];
    std::snprintf(message, sizeof(message),
                  "%zu bytes of static plus %zu of dynamic shared memory, over the %d a block may have", static_bytes,
                  smem, optin);
    return message;
  }
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  if (err == cudaSuccess) {
    void* params[] = {const_cast<Args*>(&args)};
    err = cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(blocks), dim3(threads), params, smem,
                                      reinterpret_cast<cudaStream_t>(stream));
  }
  return err == cudaSuccess ? nullptr : cudaGetErrorString(err);
}

// Blocks of `kernel` that fit on one SM with this many threads and bytes of dynamic smem.
template <typename Args>
int max_active_blocks(void (*kernel)(Args), int threads, size_t smem) {
  int n = 0;
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem));
  cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, kernel, threads, smem);
  return n;
}

}  // namespace hybrid_ep::dev
