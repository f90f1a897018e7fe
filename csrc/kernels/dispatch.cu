// Dispatch kernel's host side: the loopback instantiation (single node, emulation, CPU model)
// and the launcher that picks the transport. The NVSHMEM instantiation is kernels_nvshmem.cu.
#include "kernels/dispatch.cuh"

namespace hybrid_ep {

using namespace dispatch_impl;

size_t dispatch_smem_bytes(const LaunchArgs& args) {
  return 2 * static_cast<size_t>(args.fifo_stages) * static_cast<size_t>(args.stage_bytes);  // send + expand FIFOs
}

LaunchStatus launch_dispatch(const LaunchArgs& args, uint64_t stream) {
  if (uses_nvshmem(args)) return launch_dispatch_nvshmem(args, stream);
  return launch_dispatch_with<LoopbackTransport>(args, stream);
}

int dispatch_max_blocks_per_sm(size_t smem) {
  return dev::max_active_blocks(dispatch_kernel<LoopbackTransport>, kThreads, smem);
}

}  // namespace hybrid_ep
