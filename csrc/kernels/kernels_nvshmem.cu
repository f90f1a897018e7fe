// The kernels that cross nodes instantiated with the NVSHMEM transport. Compiled only where the build
// found NVSHMEM, with relocatable device code and NVSHMEM's device library linked in.
#include "kernels/combine.cuh"
#include "kernels/combine_pull.cuh"
#include "kernels/dispatch.cuh"
#include "kernels/dispatch_direct.cuh"
#include "kernels/layout.cuh"
#include "transport/nvshmem.cuh"

namespace hybrid_ep {

LaunchStatus launch_layout_nvshmem(const LaunchArgs& args, uint64_t stream) {
  return layout_impl::launch_layout_with<NvshmemTransport>(args, stream);
}

LaunchStatus launch_dispatch_nvshmem(const LaunchArgs& args, uint64_t stream) {
  return dispatch_impl::launch_dispatch_with<NvshmemTransport>(args, stream);
}

LaunchStatus launch_combine_nvshmem(const LaunchArgs& args, uint64_t stream) {
  return combine_impl::launch_combine_with<NvshmemTransport>(args, stream);
}

LaunchStatus launch_dispatch_direct_nvshmem(const LaunchArgs& args, uint64_t stream) {
  return dispatch_direct_impl::launch_dispatch_direct_with<NvshmemTransport>(args, stream);
}

LaunchStatus launch_combine_pull_nvshmem(const LaunchArgs& args, uint64_t stream) {
  return combine_pull_impl::launch_combine_pull_with<NvshmemTransport>(args, stream);
}

}  // namespace hybrid_ep
