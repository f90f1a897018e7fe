// Host-side launchers of the three kernels. Each takes a fully filled LaunchArgs and a
// stream; all blocks of a launch are made co-resident with a cooperative launch, because
// blocks wait on rows that other blocks (of this or another virtual rank) send.
#pragma once
#include <cuda_runtime.h>

#include "common/params.h"

namespace hybrid_ep {

// Per-rank layout: counts, send slots, ordinals, count exchange, expert-major offsets.
// One block per rank (args.num_ranks blocks).
cudaError_t launch_layout(const LaunchArgs& args, cudaStream_t stream);

// Rows to every destination rank, then expansion into the expert-major output.
cudaError_t launch_dispatch(const LaunchArgs& args, cudaStream_t stream);

// Per-rank reduction of local expert rows, push of partials, fp32 sum on the source.
cudaError_t launch_combine(const LaunchArgs& args, cudaStream_t stream);

// Shared memory (bytes) each kernel asks for with these arguments.
size_t layout_smem_bytes(const Geometry& geo);
size_t dispatch_smem_bytes(const LaunchArgs& args);

// How many blocks of each kernel fit on one SM with that shared memory (occupancy API).
int max_blocks_per_sm(int kernel, size_t smem_bytes);  // kernel: 0 layout, 1 dispatch, 2 combine

}  // namespace hybrid_ep
