// Count kernel's host side: the loopback instantiation and the launcher that picks the
// transport (kernels_nvshmem.cu holds the NVSHMEM one).
#include "kernels/count.cuh"

namespace hybrid_ep {

using namespace count_impl;

// The tally warps' counters and the totals carried across tiles (count_kernel's warp_cnt, carry).
size_t count_smem_bytes(const Geometry& geo) {
  const size_t cols = geo.num_experts + geo.world_size + geo.num_nodes;
  return (kCountTallyWarps + 1) * cols * sizeof(int32_t);
}

LaunchStatus launch_count(const LaunchArgs& args, uint64_t stream) {
  if (uses_nvshmem(args)) return launch_count_nvshmem(args, stream);
  return launch_count_with<LoopbackTransport>(args, stream);
}

int count_max_blocks_per_sm(size_t smem) {
  return dev::max_active_blocks(count_kernel<LoopbackTransport>, kCountThreads, smem);
}

}  // namespace hybrid_ep
