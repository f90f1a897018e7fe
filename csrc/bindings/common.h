// Bindings shared by hybrid_ep._C (the GPU) and hybrid_ep._model (the CPU model of the
// device layer): limits, the codes of dtypes, transports and error phases, the argument
// structs, the launchers and the occupancy queries. Both modules expose the same names, so the Python engine drives
// either.
//
// Only pybind11 is used here (no ATen), so this compiles fast; Python passes tensors as
// data_ptr() integers and streams as integers.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <stdexcept>
#include <string>

#include "common/params.h"
#include "kernels/launch.h"

namespace hybrid_ep::bindings {

namespace py = pybind11;

inline void check_launch(LaunchStatus status, const char* what) {
  if (status != nullptr)
    throw std::runtime_error(std::string("hybrid_ep: launching the ") + what + " kernel failed: " + status);
}

// The host-visible error record as a dict, None while no kernel recorded a failure.
inline py::object error_record_dict(const volatile ErrorRecord* r) {
  if (r->phase == 0) return py::none();
  py::dict d;
  d["phase"] = static_cast<int>(r->phase);
  d["rank"] = static_cast<int>(r->rank);
  d["peer"] = static_cast<int>(r->peer);
  d["epoch"] = static_cast<uint64_t>(r->epoch);
  d["expected"] = static_cast<uint64_t>(r->expected);
  d["observed"] = static_cast<uint64_t>(r->observed);
  return d;
}

// A code table of common/params.h as a dict {name: code}.
template <size_t N>
py::dict code_dict(const CodeName (&names)[N]) {
  py::dict d;
  for (const CodeName& n : names) d[n.name] = n.code;
  return d;
}

// Classes are module-local: _C and _model bind the same C++ types and may both be imported.
inline void bind_common(py::module_& m) {
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_LAUNCH_RANKS") = kMaxLaunchRanks;
  m.attr("MAX_TOPK") = kMaxTopK;
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("THREADS") = kThreads;
  m.attr("CHUNK_TOKENS") = kChunkTokens;
  m.attr("COMBINE_MAX_SEG_COLS") = kCombineMaxSegCols;
  m.attr("MAX_STAGES") = kMaxStages;
  m.attr("MAX_STORE_GROUPS") = kMaxStoreGroups;
  m.attr("PULL_PIPELINES") = kPullPipelines;
  m.attr("CHUNK_SIGNAL_BYTES") = sizeof(ChunkSignal);
  m.attr("LOCAL_STATE_BYTES") = sizeof(LocalState);
  m.attr("META_ENTRY_BYTES") = sizeof(MetaEntry);
  m.attr("TOKEN_META_BYTES") = sizeof(TokenMeta);
  m.attr("PEER_TENSORS_BYTES") = sizeof(PeerTensors);
  // The codes Python passes (LaunchArgs::dtype, wire_dtype, Geometry::transport) and reads
  // (the error record's phase), by name: the one definition is common/params.h.
  m.attr("DTYPE_CODES") = code_dict(kDTypeNames);
  m.attr("TRANSPORTS") = code_dict(kTransportNames);
  m.attr("PHASES") = code_dict(kPhaseNames);

#define RW(cls, field) .def_readwrite(#field, &cls::field)
  py::class_<RegLayout>(m, "RegLayout", py::module_local())
      .def(py::init<>()) RW(RegLayout, count_epoch) RW(RegLayout, chunk_signal) RW(RegLayout, max_chunks)
          RW(RegLayout, combine_signal) RW(RegLayout, done_dispatch) RW(RegLayout, done_combine) RW(RegLayout, state)
              RW(RegLayout, count_in) RW(RegLayout, count_row_ints) RW(RegLayout, recv_meta) RW(RegLayout, meta_entries)
                  RW(RegLayout, recv_rows) RW(RegLayout, row_stride) RW(RegLayout, recv_scales)
                      RW(RegLayout, scale_stride) RW(RegLayout, comb_rows) RW(RegLayout, comb_stride)
                          RW(RegLayout, comb_fwd) RW(RegLayout, comb_fwd_signal) RW(RegLayout, direct_tensors)
                              RW(RegLayout, direct_first) RW(RegLayout, direct_done) RW(RegLayout, total);
  py::class_<RdmaLayout>(m, "RdmaLayout", py::module_local())
      .def(py::init<>()) RW(RdmaLayout, count_epoch) RW(RdmaLayout, count_out) RW(RdmaLayout, count_in)
          RW(RdmaLayout, done_dispatch) RW(RdmaLayout, done_combine) RW(RdmaLayout, disp_signal)
              RW(RdmaLayout, token_meta_bytes) RW(RdmaLayout, chunk_meta_bytes) RW(RdmaLayout, disp_meta_out)
                  RW(RdmaLayout, disp_meta_in) RW(RdmaLayout, disp_rows_out) RW(RdmaLayout, disp_rows_in)
                      RW(RdmaLayout, comb_signal) RW(RdmaLayout, comb_rows_out) RW(RdmaLayout, comb_rows_in)
                          RW(RdmaLayout, total);
  py::class_<InfoLayout>(m, "InfoLayout", py::module_local())
      .def(py::init<>()) RW(InfoLayout, tokens_per_expert) RW(InfoLayout, expert_start) RW(InfoLayout, expert_rows)
          RW(InfoLayout, src_prefix) RW(InfoLayout, recv_count) RW(InfoLayout, src_tokens)
              RW(InfoLayout, recv_offset) RW(InfoLayout, send_count)
              RW(InfoLayout, needed) RW(InfoLayout, dropped) RW(InfoLayout, num_recv) RW(InfoLayout, count_matrix)
                  RW(InfoLayout, node_counts) RW(InfoLayout, total);
  py::class_<Geometry>(m, "Geometry", py::module_local())
      .def(py::init<>()) RW(Geometry, world_size) RW(Geometry, ranks_per_node) RW(Geometry, num_nodes)
          RW(Geometry, num_experts) RW(Geometry, local_experts) RW(Geometry, max_tokens) RW(Geometry, hidden)
              RW(Geometry, pad_multiple) RW(Geometry, min_rows_per_expert) RW(Geometry, transport) RW(Geometry, reg)
                  RW(Geometry, rdma) RW(Geometry, info);
  py::class_<RankArgs>(m, "RankArgs", py::module_local())
      .def(py::init([] { return RankArgs{}; })) RW(RankArgs, rank) RW(RankArgs, absent) RW(RankArgs, num_tokens)
          RW(RankArgs, topk) RW(RankArgs, peers) RW(RankArgs, x) RW(RankArgs, x_scales) RW(RankArgs, topk_idx)
              RW(RankArgs, topk_weights) RW(RankArgs, send_slot) RW(RankArgs, entry_ord) RW(RankArgs, info)
                  RW(RankArgs, out) RW(RankArgs, out_scales) RW(RankArgs, out_probs) RW(RankArgs, row_pos)
                      RW(RankArgs, recv_spans) RW(RankArgs, fwd_slots) RW(RankArgs, fwd_rows) RW(RankArgs, rdma_regions)
                          RW(RankArgs, rdma_base) RW(RankArgs, rdma_pes) RW(RankArgs, num_out_rows)
                              RW(RankArgs, expert_out) RW(RankArgs, probs) RW(RankArgs, y) RW(RankArgs, route_rows)
                                  RW(RankArgs, arena_bases);
  py::class_<LaunchArgs>(m, "LaunchArgs", py::module_local())
      .def(py::init([] { return LaunchArgs{}; })) RW(LaunchArgs, geo) RW(LaunchArgs, num_ranks)
          RW(LaunchArgs, blocks_per_rank) RW(LaunchArgs, dtype) RW(LaunchArgs, row_elems) RW(LaunchArgs, scale_cols)
              RW(LaunchArgs, kd) RW(LaunchArgs, apply_probs) RW(LaunchArgs, chunk_tokens) RW(LaunchArgs, fifo_stages)
                  RW(LaunchArgs, stage_bytes) RW(LaunchArgs, rows_per_stage) RW(LaunchArgs, store_groups)
                      RW(LaunchArgs, wire_dtype) RW(LaunchArgs, seg_cols) RW(LaunchArgs, host_stages)
                          RW(LaunchArgs, host_stage_bytes) RW(LaunchArgs, host_out_stages) RW(LaunchArgs, src_stages) RW(LaunchArgs, src_stage_bytes) RW(LaunchArgs, timeout_ns) RW(LaunchArgs, abort_flag)
                      RW(LaunchArgs, error)
      .def("set_rank",
           [](LaunchArgs& self, int i, const RankArgs& r) {
             if (i < 0 || i >= kMaxLaunchRanks) throw py::index_error("rank slot out of range");
             self.ranks[i] = r;
           })
      .def("get_rank", [](const LaunchArgs& self, int i) {
        if (i < 0 || i >= kMaxLaunchRanks) throw py::index_error("rank slot out of range");
        return self.ranks[i];
      });
#undef RW

  m.def("launch_layout", [](const LaunchArgs& a, uint64_t stream) { check_launch(launch_layout(a, stream), "layout"); });
  m.def("launch_dispatch",
        [](const LaunchArgs& a, uint64_t stream) { check_launch(launch_dispatch(a, stream), "dispatch"); });
  m.def("launch_combine", [](const LaunchArgs& a, uint64_t stream) { check_launch(launch_combine(a, stream), "combine"); });
  m.def("launch_dispatch_direct", [](const LaunchArgs& a, uint64_t stream) {
    check_launch(launch_dispatch_direct(a, stream), "dispatch_direct");
  });
  m.def("launch_combine_pull",
        [](const LaunchArgs& a, uint64_t stream) { check_launch(launch_combine_pull(a, stream), "combine_pull"); });
  m.def("layout_smem_bytes", &layout_smem_bytes);
  m.def("dispatch_smem_bytes", &dispatch_smem_bytes);
  m.def("combine_smem_bytes", &combine_smem_bytes);
  m.def("dispatch_direct_smem_bytes", &dispatch_direct_smem_bytes);
  m.def("combine_pull_smem_bytes", &combine_pull_smem_bytes);
  m.def("layout_max_blocks_per_sm", &layout_max_blocks_per_sm);
  m.def("dispatch_max_blocks_per_sm", &dispatch_max_blocks_per_sm);
  m.def("combine_max_blocks_per_sm", &combine_max_blocks_per_sm);
  m.def("dispatch_direct_max_blocks_per_sm", &dispatch_direct_max_blocks_per_sm);
  m.def("combine_pull_max_blocks_per_sm", &combine_pull_max_blocks_per_sm);
}

}  // namespace hybrid_ep::bindings
