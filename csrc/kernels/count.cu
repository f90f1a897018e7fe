// Count kernel's host side: the loopback instantiation and the launcher that picks the
// transport's kernel (kernels_nvshmem.cu holds the NVSHMEM one) and launches it.
#include "kernels/count.cuh"

namespace hybrid_ep {

using namespace count_impl;

// The tally warps' counters and the totals carried across tiles (count_kernel's warp_cnt, carry).
size_t count_smem_bytes(const Geometry& geo) {
  const size_t cols = geo.num_experts + geo.world_size + geo.num_nodes;
  return (kCountTallyWarps + 1) * cols * sizeof(int32_t);
}

LaunchStatus launch_count(const LaunchArgs& args, uint64_t stream) {
  const KernelFn kernel = uses_nvshmem(args) ? count_kernel_nvshmem() : &count_kernel<LoopbackTransport>;
  if (kernel == nullptr) return kNoNvshmem;
  return dev::launch_cooperative(kernel, args.num_ranks, kCountThreads, count_smem_bytes(args.geo), stream, args,
                                 "count");
}

int count_max_blocks_per_sm(size_t smem) {
  return dev::max_active_blocks(count_kernel<LoopbackTransport>, kCountThreads, smem);
}

}  // namespace hybrid_ep
