// The direct path's host side (one node whose ranks address each other's tensors): the
// dispatch that writes each route's final row and the combine that pulls each route's
// expert output, their launchers, shared memory and occupancy.
#include "kernels/combine_pull.cuh"
#include "kernels/dispatch_direct.cuh"

namespace hybrid_ep {

namespace {
constexpr LaunchStatus kDirectNodes = "the direct path serves a group of one node";
}

size_t dispatch_direct_smem_bytes(const LaunchArgs& args) {
  return static_cast<size_t>(args.fifo_stages) * static_cast<size_t>(args.stage_bytes);
}

LaunchStatus launch_dispatch_direct(const LaunchArgs& args, uint64_t stream) {
  if (args.geo.num_nodes != 1) return kDirectNodes;
  return dev::launch_cooperative(dispatch_direct_impl::dispatch_direct_kernel, args.num_ranks * args.blocks_per_rank,
                                 dispatch_direct_impl::kDirectThreads, dispatch_direct_smem_bytes(args), stream, args,
                                 "dispatch_direct");
}

int dispatch_direct_max_blocks_per_sm(size_t smem) {
  return dev::max_active_blocks(dispatch_direct_impl::dispatch_direct_kernel, dispatch_direct_impl::kDirectThreads,
                                smem);
}

size_t combine_pull_smem_bytes(const LaunchArgs& args) {
  return static_cast<size_t>(combine_pull_impl::kPipelines) * args.src_stages * args.src_stage_bytes;
}

template <typename Elem>
static LaunchStatus launch_combine_pull_typed(const LaunchArgs& args, uint64_t stream) {
  return dev::launch_cooperative(combine_pull_impl::combine_pull_kernel<Elem>, args.num_ranks * args.blocks_per_rank,
                                 combine_pull_impl::kPullThreads, combine_pull_smem_bytes(args), stream, args,
                                 "combine_pull");
}

LaunchStatus launch_combine_pull(const LaunchArgs& args, uint64_t stream) {
  if (args.geo.num_nodes != 1) return kDirectNodes;
  if (args.seg_cols <= 0 || args.seg_cols > kCombineMaxSegCols || args.seg_cols % 4 != 0)
    return "combine: seg_cols must be a positive multiple of 4 up to 8192 (kCombineMaxSegCols)";
  if (args.seg_cols % vector_cols(args.dtype) != 0 || args.row_elems % vector_cols(args.dtype) != 0)
    return "combine: seg_cols and the row's columns must be whole 16-byte vectors (multiples of 8 for bf16 / fp16, "
           "4 for fp32)";
  switch (args.dtype) {
    case kFloat32: return launch_combine_pull_typed<float>(args, stream);
    case kBFloat16: return launch_combine_pull_typed<__nv_bfloat16>(args, stream);
    case kFloat16: return launch_combine_pull_typed<__half>(args, stream);
    default: return "combine: unsupported dtype code";
  }
}

int combine_pull_max_blocks_per_sm(size_t smem) {
  return dev::max_active_blocks(combine_pull_impl::combine_pull_kernel<__nv_bfloat16>, combine_pull_impl::kPullThreads,
                                smem);
}

}  // namespace hybrid_ep
