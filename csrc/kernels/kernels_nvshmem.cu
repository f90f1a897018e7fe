// The kernels that cross nodes instantiated with the NVSHMEM transport. Compiled only where the build
// found NVSHMEM, with relocatable device code and NVSHMEM's device library linked in.
#include "kernels/combine_direct.cuh"
#include "kernels/combine_receive.cuh"
#include "kernels/count.cuh"
#include "kernels/dispatch_direct.cuh"
#include "kernels/dispatch_receive.cuh"
#include "transport/nvshmem.cuh"

namespace hybrid_ep {

KernelFn count_kernel_nvshmem() { return &count_impl::count_kernel<NvshmemTransport>; }

LaunchStatus launch_dispatch_receive_nvshmem(const LaunchArgs& args, uint64_t stream) {
  return dispatch_receive_impl::launch_dispatch_receive_with<NvshmemTransport>(args, stream);
}

LaunchStatus launch_combine_receive_nvshmem(const LaunchArgs& args, uint64_t stream) {
  return combine_receive_impl::launch_combine_receive_with<NvshmemTransport>(args, stream);
}

KernelFn dispatch_direct_kernel_nvshmem() { return &dispatch_direct_impl::dispatch_direct_kernel<NvshmemTransport>; }

KernelChoice combine_direct_kernel_nvshmem(const LaunchArgs& args) {
  return combine_direct_impl::combine_direct_kernel_for<NvshmemTransport>(args);
}

}  // namespace hybrid_ep
