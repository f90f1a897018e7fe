// The per-call host path (HostPath): one call fills the launch arguments of a kernel sequence
// from the seam's structs (bindings/seam.h) and launches it. Production drives one rank per
// process and passes one struct per call; the single-GPU emulation
// (hybrid_ep/backends/cuda/emulation.py) drives its W virtual ranks in one launch and passes a
// list of one struct per rank. Below it, a launch as the host makes it: the launch arguments
// with their ranks past the inline ones (HostLaunchArgs), the switch that turns launches off for
// the host-time bench, and the count of launches per kernel that the tests read.
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "bindings/arena.h"
#include "bindings/buffer_layout.h"
#include "bindings/seam.h"
#include "common/params.h"
#include "kernels/launch.h"

namespace hybrid_ep::bindings {

namespace py = pybind11;

// The five launchers (kernels/launch.h), by the index of their launch counter.
enum class Kernel : int { count, dispatch_receive, dispatch_direct, combine_receive, combine_direct, kinds };
inline constexpr const char* kKernelNames[] = {"count", "dispatch_receive", "dispatch_direct", "combine_receive",
                                               "combine_direct"};
static_assert(sizeof(kKernelNames) / sizeof(kKernelNames[0]) == static_cast<int>(Kernel::kinds));

inline void check_launch(LaunchStatus status, Kernel kernel) {
  if (status != nullptr)
    throw std::runtime_error(std::string("hybrid_ep: launching the ") + kKernelNames[static_cast<int>(kernel)] +
                             " kernel failed: " + status);
}

// Off only to measure the host path without kernels (hybrid_ep.bench.host): the HostPath
// calls then fill the arguments and return without launching. One flag per module.
inline bool& launches_enabled() {
  static bool on = true;
  return on;
}

// The kernel launches the HostPath calls made, per kernel (indexed by Kernel), counted with
// launches on or off: tests/model/test_launches_made.py asserts how many each call makes. One
// table per module.
inline uint64_t (&launches_made()) [static_cast<int>(Kernel::kinds)] {
  static uint64_t counts[static_cast<int>(Kernel::kinds)] = {};
  return counts;
}

// Where a launch's ranks past the inline ones go (LaunchArgs::more_ranks): a block of device
// memory for that one launch, holding `bytes` from `src` once the copy on the launch's stream has
// landed, before the kernel. The block goes back when the last copy of the pointer returned is
// dropped, which the launcher does once the kernel is queued: stream-ordered, after the kernel,
// and no other launch shares it. Each module sets its own (cuda_module.cpp: cudaMallocAsync and
// cudaFreeAsync on the launch's stream, refusing CUDA graph capture by name; model_module.cpp:
// host memory, the model's launches running inside the call).
struct MoreRanksCopy {
  std::shared_ptr<void> (*copy)(const void* src, size_t bytes, uint64_t stream) = nullptr;
};
inline MoreRanksCopy& more_ranks_copy() {
  static MoreRanksCopy copy;
  return copy;
}

// A launch's arguments as the host holds them: the kernel's LaunchArgs, its first
// kInlineLaunchRanks ranks inline, and the ranks past those, copied to device memory for each
// launch (an emulated launch of more than 16 ranks; a production launch holds one).
struct HostLaunchArgs : LaunchArgs {
  static constexpr int kMoreRanks = kMaxLaunchRanks - kInlineLaunchRanks;
  RankArgs more[kMoreRanks] = {};

  HostLaunchArgs() : LaunchArgs{} {}
  RankArgs& rank(int i) { return i < kInlineLaunchRanks ? ranks[i] : more[i - kInlineLaunchRanks]; }
  const RankArgs& rank(int i) const { return i < kInlineLaunchRanks ? ranks[i] : more[i - kInlineLaunchRanks]; }

  // The ranks past the inline ones copied for one launch on `stream` (more_ranks points at
  // them; null and 0 where the launch has none): the block lives while the pointer returned does.
  std::shared_ptr<void> copy_more_ranks(uint64_t stream) {
    const int extra = num_ranks - kInlineLaunchRanks;
    if (extra <= 0) {
      more_ranks = 0;
      return nullptr;
    }
    std::shared_ptr<void> block = more_ranks_copy().copy(more, sizeof(RankArgs) * static_cast<size_t>(extra), stream);
    more_ranks = reinterpret_cast<uint64_t>(block.get());
    return block;
  }
};

using Launcher = LaunchStatus (*)(const LaunchArgs&, uint64_t);

// One launch on `a`, its ranks past the inline ones staged for it alone, without the GIL: a
// launch can block (a full launch queue, CUDA_LAUNCH_BLOCKING, the CPU model running the kernel
// and waiting for its lock while another thread's launch runs) until a peer's kernel runs, and
// that peer may first need this process's Python threads (the chunk server of peer memory).
inline LaunchStatus launch_staged(Launcher launcher, HostLaunchArgs& a, uint64_t stream) {
  const std::shared_ptr<void> more = a.copy_more_ranks(stream);
  LaunchStatus status;
  {
    py::gil_scoped_release unlocked;
    status = launcher(a, stream);
  }
  a.more_ranks = 0;  // the block goes back with `more`, the kernel queued
  return status;
}

// A HostPath call's launch: counted, then launched where launches are on.
inline void launch_checked(Launcher launcher, HostLaunchArgs& host, uint64_t stream, Kernel kernel) {
  ++launches_made()[static_cast<int>(kernel)];
  if (!launches_enabled()) return;
  check_launch(launch_staged(launcher, host, stream), kernel);
}

// A call's per-rank structs of one seam type: one struct (one rank) or a list of one per rank.
template <typename S>
class __attribute__((visibility("hidden"))) PerRank {
 public:
  PerRank(const StructSeq<S>& seq, py::handle given, const char* what) : seq_(seq), given_(given), what_(what) {
    if (seq.type.is_instance(given.ptr())) {
      size_ = 1;
      one_ = true;
    } else if (PyList_Check(given.ptr())) {
      size_ = static_cast<size_t>(PyList_GET_SIZE(given.ptr()));
    } else {
      throw py::type_error(std::string(what) + ": a " + seq.type.name() + " or a list of one per rank, got " +
                           Py_TYPE(given.ptr())->tp_name);
    }
  }
  size_t size() const { return size_; }
  S operator[](size_t i) const {
    if (one_) return seq_.read(given_.ptr(), what_);
    return seq_.read(PyList_GET_ITEM(given_.ptr(), i), what_, static_cast<Py_ssize_t>(i));
  }

 private:
  const StructSeq<S>& seq_;
  py::handle given_;
  const char* what_;
  size_t size_ = 0;
  bool one_ = false;
};

// The per-call host path of one engine: the ranks it drives with what stays fixed per rank
// (rank, peer table, transport, arena bases), and per kernel sequence one call that fills
// every rank slot of the launch arguments, each from a zeroed RankArgs as a fresh one would
// be, and launches. The launch arguments (geometry, pipeline shape) are the engine's, cached
// per launch shape; the launchers copy them when they launch.
class __attribute__((visibility("hidden"))) HostPath {
 public:
  // Each rank's peer_bases (its own table: a virtual rank of the emulation may see its peers'
  // memory at other addresses than another does) is in ranks[i]. seam: the module's seam
  // types, which the calls read per rank and make (OutputTensors, the calls on arena blocks).
  // one_rank: made for one rank (production), whose calls return one struct, not a list.
  HostPath(const std::vector<RankArgs>& ranks, const SeamTypes* seam, bool one_rank)
      : fixed_(ranks), seam_(seam), one_rank_(one_rank) {
    if (ranks.empty() || ranks.size() > static_cast<size_t>(kMaxLaunchRanks))
      throw py::value_error("a launch drives 1 to " + std::to_string(kMaxLaunchRanks) + " ranks");
  }

  // The test hook (tests/harness/faults.py: ranks_absent), set once, not passed per call: bit i
  // of `absent` launches driven rank i's kernels with RankArgs::absent (it never arrives, as a
  // crashed peer would); bit i of `after_count` does so for a dispatch kernel only (its counts
  // are exchanged). Both 0: every rank arrives.
  void set_absent(uint64_t absent, uint64_t after_count) {
    absent_ = absent;
    absent_after_count_ = after_count;
  }

  // Rank i's words of the data-path agreement for the next count kernels (RankArgs::agree).
  void set_agree(size_t i, const std::vector<int32_t>& words) {
    if (i >= fixed_.size() || words.size() != static_cast<size_t>(kAgreeWords))
      throw py::value_error("set_agree: a driven rank and " + std::to_string(kAgreeWords) + " words");
    std::copy(words.begin(), words.end(), fixed_[i].agree);
  }

  // Rank i's refusal of its own input for the next count kernels (RankArgs::refused: 0 none,
  // else the refused argument's code); the caller clears it after the call.
  void set_refused(size_t i, int32_t code) {
    if (i >= fixed_.size() || code < 0) throw py::value_error("set_refused: a driven rank and a code >= 0");
    fixed_[i].refused = code;
  }

  // The count kernel of a dispatch: every rank's inputs and its part of `workspace`; rows
  // is the static output size, or -1 (the count kernel computes it). read: the caller reads
  // the info (needed, bad_route) before it launches the dispatch kernel, and raises a bad
  // routing itself (LaunchArgs::info_read). in: DispatchInputs.
  void dispatch_count(HostLaunchArgs& a, uint64_t stream, uint64_t workspace, const WorkspaceLayout& l, int64_t rows,
                      py::handle in, bool read) {
    count_of(a, stream, workspace, l, rows, PerRank<DispatchInputs>(seam_->dispatch_inputs, in, "inputs"), read);
  }

  // The dispatch kernel, after dispatch_count on the same arguments: every rank's outputs
  // and the rest of its part (route rows on the direct path, else row positions and chunk
  // spans; forwarded chunks with several nodes). out: DispatchOutputs.
  void dispatch_rows(HostLaunchArgs& a, bool direct, uint64_t stream, uint64_t workspace, const WorkspaceLayout& l,
                     py::handle out) {
    const PerRank<DispatchOutputs> outs(seam_->dispatch_outputs, out, "outputs");
    rows_of(a, direct, stream, workspace, l, outs.size(), [&outs](size_t i) { return outs[i]; });
  }

  // The same into the arena blocks `taken` holds, one per rank (the engine's arena_take; the
  // direct path only), then the blocks' tensors (output_tensors).
  py::object dispatch_rows_into(HostLaunchArgs& a, uint64_t stream, uint64_t workspace, const WorkspaceLayout& l,
                                ArenaTaken& taken) {
    check_blocks(taken, taken.size());
    rows_of(a, true, stream, workspace, l, taken.size(), [&taken](size_t i) { return block_outputs(taken, i); });
    return output_tensors(taken);
  }

  // A dispatch whose output size is known before the count kernel (static size, or a
  // handle's): both kernels in one call. The outputs are read before the count kernel
  // launches: a bad one launches neither.
  void dispatch(HostLaunchArgs& a, bool direct, uint64_t stream, uint64_t workspace, const WorkspaceLayout& l,
                int64_t rows, py::handle in, py::handle out) {
    const PerRank<DispatchInputs> ins(seam_->dispatch_inputs, in, "inputs");
    const PerRank<DispatchOutputs> given(seam_->dispatch_outputs, out, "outputs");
    if (ins.size() != given.size()) throw py::value_error("dispatch: one output per input");
    const size_t n = check_count(given.size());
    DispatchOutputs outs[kMaxLaunchRanks];
    for (size_t i = 0; i < n; ++i) outs[i] = given[i];
    count_of(a, stream, workspace, l, rows, ins, false);
    rows_of(a, direct, stream, workspace, l, n, [&outs](size_t i) { return outs[i]; });
  }

  // A direct dispatch of known size into the arena blocks `taken` holds, one per rank (the
  // engine's arena_take): both kernels, then the blocks' tensors (output_tensors).
  // One call instead of the addresses, the launch and the tensors one by one.
  py::object dispatch_into(HostLaunchArgs& a, uint64_t stream, uint64_t workspace, const WorkspaceLayout& l,
                           int64_t rows, py::handle in, ArenaTaken& taken) {
    const PerRank<DispatchInputs> ins(seam_->dispatch_inputs, in, "inputs");
    check_blocks(taken, ins.size());
    count_of(a, stream, workspace, l, rows, ins, false);
    rows_of(a, true, stream, workspace, l, taken.size(), [&taken](size_t i) { return block_outputs(taken, i); });
    return output_tensors(taken);
  }

  // A combine on the parts of the dispatch handles' workspaces. in: CombineInputs.
  void combine(HostLaunchArgs& a, bool direct, uint64_t stream, py::handle in) {
    const PerRank<CombineInputs> ins(seam_->combine_inputs, in, "inputs");
    const size_t n = check_count(ins.size());
    for (size_t i = 0; i < n; ++i) {
      RankArgs r = fixed_[i];
      const CombineInputs c = ins[i];
      r.absent = static_cast<int32_t>((absent_ >> i) & 1);
      r.num_tokens = c.num_tokens;
      r.topk = c.topk;
      r.send_ord = at_offset(c.part, c.layout.send_ord);
      r.info = at_offset(c.part, c.layout.info);
      if (direct) r.topk_idx = c.topk_idx;
      else r.peer_bases = 0;
      set_row_tables(r, direct, c.part, c.layout);
      r.expert_out = c.expert_out;
      r.probs = c.probs;
      r.y = c.y;
      r.num_out_rows = c.num_rows;
      a.rank(static_cast<int>(i)) = r;
    }
    a.num_ranks = static_cast<int32_t>(n);
    if (direct) launch_checked(&launch_combine_direct, a, stream, Kernel::combine_direct);
    else launch_checked(&launch_combine_receive, a, stream, Kernel::combine_receive);
  }

 private:
  size_t check_count(size_t n) const {
    if (n != fixed_.size())
      throw py::value_error("this host path drives " + std::to_string(fixed_.size()) + " rank(s), got " +
                            std::to_string(n));
    return n;
  }

  void count_of(HostLaunchArgs& a, uint64_t stream, uint64_t workspace, const WorkspaceLayout& l, int64_t rows,
                const PerRank<DispatchInputs>& in, bool read) {
    const size_t n = check_count(in.size());
    a.info_read = read ? 1 : 0;
    for (size_t i = 0; i < n; ++i) {
      RankArgs r = fixed_[i];
      const DispatchInputs d = in[i];
      const uint64_t part = workspace + i * static_cast<uint64_t>(l.bytes);
      r.absent = static_cast<int32_t>((absent_ >> i) & 1);
      r.num_tokens = d.num_tokens;
      r.topk = d.topk;
      r.x = d.x;
      r.x_scales = d.x_scales;
      r.topk_idx = d.topk_idx;
      r.topk_weights = d.topk_weights;
      r.send_ord = at_offset(part, l.send_ord);
      r.entry_ord = at_offset(part, l.entry_ord);
      r.info = at_offset(part, l.info);
      r.num_out_rows = rows;
      a.rank(static_cast<int>(i)) = r;
    }
    a.num_ranks = static_cast<int32_t>(n);
    launch_checked(&launch_count, a, stream, Kernel::count);
  }

  // The row tables dispatch wrote into a rank's part of the workspace and combine reads back:
  // route rows (direct path) or row positions and receive spans, and the forwarded chunks.
  static void set_row_tables(RankArgs& r, bool direct, uint64_t part, const WorkspaceLayout& l) {
    if (direct) {
      r.route_rows = at_offset(part, l.route_rows);
      r.fwd_routes = at_offset(part, l.fwd_routes);
    } else {
      r.row_pos = at_offset(part, l.row_pos);
      r.recv_spans = at_offset(part, l.recv_spans);
      r.fwd_slots = at_offset(part, l.fwd_slots);
    }
    r.fwd_rows = at_offset(part, l.fwd_rows);
  }

  // The dispatch kernel on n ranks' outputs, rank i's from out(i) (a DispatchOutputs).
  template <typename Out>
  void rows_of(HostLaunchArgs& a, bool direct, uint64_t stream, uint64_t workspace, const WorkspaceLayout& l, size_t n,
               Out&& out) {
    const uint64_t absent = absent_ | absent_after_count_;
    check_count(n);
    if (static_cast<int32_t>(n) != a.num_ranks)
      throw py::value_error("dispatch_rows: one output per rank of the count kernel");
    for (size_t i = 0; i < n; ++i) {
      RankArgs& r = a.rank(static_cast<int>(i));
      const DispatchOutputs o = out(i);
      const uint64_t part = workspace + i * static_cast<uint64_t>(l.bytes);
      set_row_tables(r, direct, part, l);
      r.out = o.rows;
      r.out_scales = o.scales;
      r.out_probs = o.probs;
      r.num_out_rows = o.num_rows;
      r.absent = static_cast<int32_t>((absent >> i) & 1);
    }
    if (direct) launch_checked(&launch_dispatch_direct, a, stream, Kernel::dispatch_direct);
    else launch_checked(&launch_dispatch_receive, a, stream, Kernel::dispatch_receive);
  }

  // A direct dispatch's blocks, one per rank: each holds rows, scales, probs in that order
  // (arena.py, _call_specs), the scales absent (address 0) without fp8.
  static void check_blocks(const ArenaTaken& taken, size_t ranks) {
    if (taken.size() != ranks) throw py::value_error("dispatch: one arena block per rank");
    if (taken.layout().views.size() != 3) throw py::value_error("dispatch: arena blocks of rows, scales, probs");
  }

  // Block i's outputs (check_blocks first).
  static DispatchOutputs block_outputs(const ArenaTaken& taken, size_t i) {
    uint64_t at[ArenaLayout::kMaxViews];
    const int64_t rows = taken.block_addresses(i, at);
    return DispatchOutputs{rows, at[0], at[1], at[2]};
  }

  // The blocks' OutputTensors: the one rank's (one_rank), else a list of one per rank.
  py::object output_tensors(ArenaTaken& taken) const {
    py::list made = taken.tensors_as([this](py::object* views) { return seam_->output_tensors.type.make(views); });
    if (one_rank_) return made[0];
    return std::move(made);
  }

  std::vector<RankArgs> fixed_;  // rank, peers, rdma_regions, rdma_base, rdma_pes, peer_bases, agree; the rest zero
  const SeamTypes* seam_;        // the module's, alive for good
  const bool one_rank_;
  uint64_t absent_ = 0, absent_after_count_ = 0;  // set_absent
};

}  // namespace hybrid_ep::bindings
