// Host-side launchers of the five kernels (count, dispatch_receive, dispatch_direct,
// combine_receive, combine_direct). Each takes a fully filled LaunchArgs and a
// stream; all blocks of a launch are co-resident (a cooperative launch on a GPU, every block
// as fibers in the CPU model), because blocks wait on rows that other blocks, of this or
// another virtual rank, send.
#pragma once
#include <cstddef>
#include <cstdint>

#include "common/params.h"

namespace hybrid_ep {

using LaunchStatus = const char*;  // nullptr on success, else the error's text

// Per-rank counts: send slots, ordinals, count exchange, expert-major offsets.
// One block per rank (args.num_ranks blocks).
LaunchStatus launch_count(const LaunchArgs& args, uint64_t stream);

// Rows to every destination rank, then expansion into the expert-major output.
LaunchStatus launch_dispatch_receive(const LaunchArgs& args, uint64_t stream);

// Per-rank reduction of local expert rows, push of partials, fp32 sum on the source.
LaunchStatus launch_combine_receive(const LaunchArgs& args, uint64_t stream);

// The direct path (the ranks of each node address each other's tensors: emulation, or an arena
// every rank maps): rows stored straight into their final row at every route's rank of the
// node, expert outputs read straight from theirs; with several nodes through the rail peers'
// RDMA staging (kernels/dispatch_direct.cuh, combine_direct.cuh).
LaunchStatus launch_dispatch_direct(const LaunchArgs& args, uint64_t stream);
LaunchStatus launch_combine_direct(const LaunchArgs& args, uint64_t stream);

// The NVSHMEM instantiations (kernels_nvshmem.cu, built only where the build found NVSHMEM).
// Every other launch uses the loopback transport, which a single node never calls. The count and
// the direct path's launchers, which production's calls take, get the NVSHMEM kernel itself (its
// address from kernels_nvshmem.cu) and launch it in one frame; the receive path's call its launcher.
inline bool uses_nvshmem(const LaunchArgs& args) {
  return args.geo.num_nodes > 1 && args.geo.transport == kTransportNvshmem;
}
using KernelFn = void (*)(LaunchArgs);
// A kernel and its block's threads as a launcher picks them from the arguments; refused: why the
// arguments have none (a null kernel without a refusal: the build lacks the transport).
struct KernelChoice {
  KernelFn kernel = nullptr;
  int threads = 0;
  LaunchStatus refused = nullptr;
};
constexpr LaunchStatus kNoNvshmem =
    "this build of hybrid_ep has no NVSHMEM transport (rebuild with the nvidia-nvshmem wheel installed)";
#ifdef HYBRID_EP_WITH_NVSHMEM
KernelFn count_kernel_nvshmem();
KernelFn dispatch_direct_kernel_nvshmem();
LaunchStatus launch_dispatch_receive_nvshmem(const LaunchArgs& args, uint64_t stream);
LaunchStatus launch_combine_receive_nvshmem(const LaunchArgs& args, uint64_t stream);
KernelChoice combine_direct_kernel_nvshmem(const LaunchArgs& args);
#else
inline KernelFn count_kernel_nvshmem() { return nullptr; }
inline KernelFn dispatch_direct_kernel_nvshmem() { return nullptr; }
inline LaunchStatus launch_dispatch_receive_nvshmem(const LaunchArgs&, uint64_t) { return kNoNvshmem; }
inline LaunchStatus launch_combine_receive_nvshmem(const LaunchArgs&, uint64_t) { return kNoNvshmem; }
inline KernelChoice combine_direct_kernel_nvshmem(const LaunchArgs&) { return {}; }
#endif

// Shared memory (bytes) each kernel asks for with these arguments.
size_t count_smem_bytes(const Geometry& geo);
size_t dispatch_receive_smem_bytes(const LaunchArgs& args);
size_t combine_receive_smem_bytes(const LaunchArgs& args);
size_t dispatch_direct_smem_bytes(const LaunchArgs& args);
size_t combine_direct_smem_bytes(const LaunchArgs& args);

// How many blocks of each kernel fit on one SM with that shared memory.
int count_max_blocks_per_sm(size_t smem);
int dispatch_receive_max_blocks_per_sm(size_t smem);
int combine_receive_max_blocks_per_sm(size_t smem);
int dispatch_direct_max_blocks_per_sm(size_t smem);
int combine_direct_max_blocks_per_sm(size_t smem, int reducer_warps);  // kReducerWarpsNarrow or Wide

}  // namespace hybrid_ep
