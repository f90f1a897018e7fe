// Dispatch kernel's host side: the loopback instantiation (single node, emulation, CPU model)
// and the launcher that picks the transport. The NVSHMEM instantiation is kernels_nvshmem.cu.
#include "kernels/dispatch_receive.cuh"

namespace hybrid_ep {

using namespace dispatch_receive_impl;

size_t dispatch_receive_smem_bytes(const LaunchArgs& args) {
  return 2 * static_cast<size_t>(args.fifo_stages) * static_cast<size_t>(args.stage_bytes);  // send + expand FIFOs
}

LaunchStatus launch_dispatch_receive(const LaunchArgs& args, uint64_t stream) {
  if (uses_nvshmem(args)) return launch_dispatch_receive_nvshmem(args, stream);
  return launch_dispatch_receive_with<LoopbackTransport>(args, stream);
}

int dispatch_receive_max_blocks_per_sm(size_t smem) {
  return dev::max_active_blocks(dispatch_receive_kernel<LoopbackTransport>, kThreads, smem);
}

}  // namespace hybrid_ep
