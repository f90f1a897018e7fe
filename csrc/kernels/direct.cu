// The direct path's host side (the ranks of each node address each other's tensors): the
// dispatch that writes each route's final row and the combine that reads each route's
// expert output from its host, their loopback instantiations (one node, emulation, CPU model), launchers,
// shared memory and occupancy. The NVSHMEM instantiations are kernels_nvshmem.cu.
#include "kernels/combine_direct.cuh"
#include "kernels/dispatch_direct.cuh"

namespace hybrid_ep {

size_t dispatch_direct_smem_bytes(const LaunchArgs& args) {
  return static_cast<size_t>(args.fifo_stages) * static_cast<size_t>(args.stage_bytes);
}

LaunchStatus launch_dispatch_direct(const LaunchArgs& args, uint64_t stream) {
  using namespace dispatch_direct_impl;
  if (LaunchStatus refused = fifo_stages_refusal(args)) return refused;
  const KernelFn kernel =
      uses_nvshmem(args) ? dispatch_direct_kernel_nvshmem() : &dispatch_direct_kernel<LoopbackTransport>;
  if (kernel == nullptr) return kNoNvshmem;
  return dev::launch_cooperative(kernel, args.num_ranks * args.num_sms, kDirectThreads,
                                 dispatch_direct_smem_bytes(args), stream, args, "dispatch_direct");
}

int dispatch_direct_max_blocks_per_sm(size_t smem) {
  return dev::max_active_blocks(dispatch_direct_impl::dispatch_direct_kernel<LoopbackTransport>,
                                dispatch_direct_impl::kDirectThreads, smem);
}

size_t combine_direct_smem_bytes(const LaunchArgs& args) {
  return combine_direct_impl::combine_direct_stage_bytes(args);
}

LaunchStatus launch_combine_direct(const LaunchArgs& args, uint64_t stream) {
  const KernelChoice k = uses_nvshmem(args) ? combine_direct_kernel_nvshmem(args)
                                            : combine_direct_impl::combine_direct_kernel_for<LoopbackTransport>(args);
  if (k.refused != nullptr) return k.refused;
  if (k.kernel == nullptr) return kNoNvshmem;
  return dev::launch_cooperative(k.kernel, args.num_ranks * args.num_sms, k.threads, combine_direct_smem_bytes(args),
                                 stream, args, "combine_direct");
}

int combine_direct_max_blocks_per_sm(size_t smem, int reducer_warps) {
  using namespace combine_direct_impl;
  if (reducer_warps == kReducerWarpsWide)
    return dev::max_active_blocks(
        combine_direct_kernel<LoopbackTransport, __nv_bfloat16, __nv_bfloat16, kReducerWarpsWide, kCombineStageRoute>,
        DirectCombineBlock<kReducerWarpsWide>::kThreads, smem);
  return dev::max_active_blocks(
      combine_direct_kernel<LoopbackTransport, __nv_bfloat16, __nv_bfloat16, kReducerWarpsNarrow, kCombineStageRoute>,
      DirectCombineBlock<kReducerWarpsNarrow>::kThreads, smem);
}

}  // namespace hybrid_ep
