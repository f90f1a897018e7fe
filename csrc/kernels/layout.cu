// Layout kernel's host side: the loopback instantiation and the launcher that picks the
// transport (kernels_nvshmem.cu holds the NVSHMEM one).
#include "kernels/layout.cuh"

namespace hybrid_ep {

using namespace layout_impl;

size_t layout_smem_bytes(const Geometry& geo) {
  const size_t cols = geo.num_experts + geo.world_size + geo.num_nodes;
  return (kWarps + 1) * cols * sizeof(int32_t);
}

LaunchStatus launch_layout(const LaunchArgs& args, uint64_t stream) {
  if (uses_nvshmem(args)) return launch_layout_nvshmem(args, stream);
  return launch_layout_with<LoopbackTransport>(args, stream);
}

int layout_max_blocks_per_sm(size_t smem) {
  return dev::max_active_blocks(layout_kernel<LoopbackTransport>, kPrepareThreads, smem);
}

}  // namespace hybrid_ep
