// Combine kernel's host side: the loopback instantiations and the launcher that picks the
// transport (kernels_nvshmem.cu holds the NVSHMEM ones).
#include "kernels/combine_receive.cuh"

namespace hybrid_ep {

using namespace combine_receive_impl;

size_t combine_receive_smem_bytes(const LaunchArgs& args) { return combine_receive_stage_bytes(args); }

LaunchStatus launch_combine_receive(const LaunchArgs& args, uint64_t stream) {
  if (uses_nvshmem(args)) return launch_combine_receive_nvshmem(args, stream);
  return launch_combine_receive_with<LoopbackTransport>(args, stream);
}

int combine_receive_max_blocks_per_sm(size_t smem) {
  return dev::max_active_blocks(combine_receive_kernel<LoopbackTransport, __nv_bfloat16, __nv_bfloat16>,
                                kCombineThreads, smem);
}

}  // namespace hybrid_ep
