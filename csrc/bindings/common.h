// What hybrid_ep._C (the GPU) and hybrid_ep._model (the CPU model of the device layer) both
// bind (bind_common): limits, the codes of dtypes, transports and error phases, the argument
// structs, the buffer's and a call's layouts (buffer_layout.h), the seam's struct sequences
// (seam.h), the per-call host path and the launchers (host_path.h), the arena's blocks (arena.h)
// and the occupancy queries. Both modules expose the same names, so the
// Python engine drives either.
//
// Only pybind11 is used here (no ATen), so this compiles fast; Python passes tensors as
// data_ptr() integers and streams as integers.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <string>
#include <vector>

#include "bindings/arena.h"
#include "bindings/buffer_layout.h"
#include "bindings/host_path.h"
#include "bindings/seam.h"
#include "common/params.h"
#include "kernels/launch.h"

namespace hybrid_ep::bindings {

namespace py = pybind11;

// The host-visible error record as a dict, None while no kernel recorded a failure.
inline py::object error_record_dict(const volatile ErrorRecord* r) {
  if (r->phase == 0) return py::none();
  py::dict d;
  d["phase"] = static_cast<int>(r->phase);
  d["rank"] = static_cast<int>(r->rank);
  d["peer"] = static_cast<int>(r->peer);
  d["site"] = static_cast<int>(r->site);
  d["call"] = static_cast<uint64_t>(r->call);
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
  m.attr("MAX_DOMAIN_RANKS") = kMaxDomainRanks;
  m.attr("MAX_NODES") = kMaxNodes;
  m.attr("MAX_LAUNCH_RANKS") = kMaxLaunchRanks;
  m.attr("MAX_TOPK") = kMaxTopK;
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("THREADS") = kThreads;
  m.attr("CHUNK_TOKENS") = kChunkTokens;
  m.attr("COUNT_TALLY_WARPS") = kCountTallyWarps;
  m.attr("COMBINE_MAX_SEG_COLS") = kCombineMaxSegCols;
  m.attr("MAX_STAGES") = kMaxStages;
  m.attr("STATIC_SMEM_RESERVE") = kStaticSmemReserve;
  m.attr("MAX_STORE_GROUPS") = kMaxStoreGroups;
  m.attr("DIRECT_COMBINE_PIPELINES") = kDirectCombinePipelines;
  m.attr("REDUCER_WAIT_OBSERVE") = kReducerWaitObserve;
  m.attr("REDUCER_WAIT_ELECT") = kReducerWaitElect;
  m.attr("REDUCER_WAIT_CONVERGED") = kReducerWaitConverged;
  m.attr("REDUCER_WAIT_NAMED") = kReducerWaitNamed;
  m.attr("COMBINE_STAGE_ROUTE") = kCombineStageRoute;
  m.attr("COMBINE_STAGE_TOKEN") = kCombineStageToken;
  m.attr("REDUCER_WARPS_NARROW") = kReducerWarpsNarrow;
  m.attr("REDUCER_WARPS_WIDE") = kReducerWarpsWide;
  m.attr("DIRECT_STORE_THREADS") = kDirectStoreWarps;
  m.attr("CHUNK_META_HEADER") = kChunkMetaHeader;
  m.attr("COUNT_ROW_TAIL") = kCountRowTail;
  m.attr("AGREE_WORDS") = kAgreeWords;
  m.attr("RING_TAG_CHUNK_BITS") = kRingTagChunkBits;
  m.attr("CHUNK_SIGNAL_BYTES") = sizeof(ChunkSignal);
  m.attr("LOCAL_STATE_BYTES") = sizeof(LocalState);
  m.attr("META_ENTRY_BYTES") = sizeof(MetaEntry);
  m.attr("TOKEN_META_BYTES") = sizeof(TokenMeta);
  m.attr("PEER_TENSORS_BYTES") = sizeof(PeerTensors);
  // Where the host polls the error records (pinned host memory) without a call into the module.
  m.attr("ERROR_RECORD_PHASE_OFFSET") = offsetof(ErrorRecord, phase);
  m.attr("ERROR_RECORD_CALL_OFFSET") = offsetof(ErrorRecord, call);
  // The codes Python passes (LaunchArgs::dtype, wire_dtype, Geometry::transport) and reads
  // (the error record's phase and pipeline site), by name: the one definition is common/params.h.
  m.attr("DTYPE_CODES") = code_dict(kDTypeNames);
  m.attr("TRANSPORTS") = code_dict(kTransportNames);
  m.attr("PHASES") = code_dict(kPhaseNames);
  m.attr("PIPE_SITES") = code_dict(kPipeSiteNames);

#define RW(cls, field) .def_readwrite(#field, &cls::field)
  py::class_<RingLayout>(m, "RingLayout", py::module_local())
      .def(py::init<>()) RW(RingLayout, rings) RW(RingLayout, slots);
  py::class_<RegLayout>(m, "RegLayout", py::module_local())
      .def(py::init<>()) RW(RegLayout, count_call) RW(RegLayout, recv_signal) RW(RegLayout, max_chunks)
          RW(RegLayout, done_dispatch) RW(RegLayout, done_combine) RW(RegLayout, state) RW(RegLayout, count_in)
              RW(RegLayout, count_row_ints) RW(RegLayout, recv) RW(RegLayout, recv_meta) RW(RegLayout, meta_entries)
                  RW(RegLayout, recv_rows) RW(RegLayout, row_stride) RW(RegLayout, recv_scales)
                      RW(RegLayout, scale_stride) RW(RegLayout, recv_credit) RW(RegLayout, partial)
                          RW(RegLayout, forward) RW(RegLayout, partial_signal) RW(RegLayout, partial_credit)
                              RW(RegLayout, partial_rows) RW(RegLayout, wire_stride) RW(RegLayout, forward_rows)
                                  RW(RegLayout, forward_signal) RW(RegLayout, forward_credit)
                                      RW(RegLayout, direct_tensors) RW(RegLayout, direct_first)
                                          RW(RegLayout, direct_done) RW(RegLayout, total);
  py::class_<RdmaLayout>(m, "RdmaLayout", py::module_local())
      .def(py::init<>()) RW(RdmaLayout, staged) RW(RdmaLayout, node_part) RW(RdmaLayout, count_call)
          RW(RdmaLayout, count_out) RW(RdmaLayout, count_in) RW(RdmaLayout, done_dispatch) RW(RdmaLayout, done_combine)
              RW(RdmaLayout, staged_signal) RW(RdmaLayout, token_meta_bytes) RW(RdmaLayout, chunk_meta_bytes)
                  RW(RdmaLayout, staged_meta_out) RW(RdmaLayout, staged_meta_in) RW(RdmaLayout, staged_rows_out)
                      RW(RdmaLayout, staged_rows_in) RW(RdmaLayout, staged_credit) RW(RdmaLayout, node_part_signal)
                          RW(RdmaLayout, node_part_credit) RW(RdmaLayout, node_part_rows_out)
                              RW(RdmaLayout, node_part_rows_in) RW(RdmaLayout, total);
  // The layouts of the registered buffer and the RDMA region, built from the list of rings
  // (bindings/buffer_layout.h), with their regions: hybrid_ep/backends/cuda/layout.py reads them.
  py::class_<BufferShape>(m, "BufferShape", py::module_local())
      .def(py::init<>()) RW(BufferShape, world_size) RW(BufferShape, ranks_per_node) RW(BufferShape, local_experts)
          RW(BufferShape, max_tokens) RW(BufferShape, hidden) RW(BufferShape, ring_chunks) RW(BufferShape, scale_cols)
              RW(BufferShape, ring_elem_bytes);
  py::class_<Region>(m, "Region", py::module_local())
      .def_readonly("name", &Region::name)
      .def_readonly("offset", &Region::offset)
      .def_readonly("bytes", &Region::bytes)
      .def_readonly("purpose", &Region::purpose)
      .def("__repr__", [](const Region& r) {
        return "Region(" + r.name + ", offset=" + std::to_string(r.offset) + ", bytes=" + std::to_string(r.bytes) + ")";
      });
  py::class_<BufferLayouts>(m, "BufferLayouts", py::module_local())
      .def_readonly("reg", &BufferLayouts::reg)
      .def_readonly("rdma", &BufferLayouts::rdma)
      .def_readonly("registered", &BufferLayouts::registered)
      .def_readonly("rdma_regions", &BufferLayouts::rdma_regions);
  m.def("buffer_layouts", &buffer_layouts, py::arg("shape"),
        "the registered buffer's and the RDMA region's layouts and regions, from the rings between ranks");
  py::class_<InfoLayout>(m, "InfoLayout", py::module_local())
      .def(py::init<>()) RW(InfoLayout, tokens_per_expert) RW(InfoLayout, expert_start) RW(InfoLayout, expert_rows)
          RW(InfoLayout, src_prefix) RW(InfoLayout, recv_count) RW(InfoLayout, src_tokens) RW(InfoLayout, recv_offset)
              RW(InfoLayout, send_count) RW(InfoLayout, needed) RW(InfoLayout, bad_route) RW(InfoLayout, agreement)
                  RW(InfoLayout, dropped) RW(InfoLayout, num_recv) RW(InfoLayout, count_matrix)
                      RW(InfoLayout, node_counts) RW(InfoLayout, total);
  py::class_<Geometry>(m, "Geometry", py::module_local())
      .def(py::init<>()) RW(Geometry, world_size) RW(Geometry, ranks_per_node) RW(Geometry, num_nodes)
          RW(Geometry, num_experts) RW(Geometry, local_experts) RW(Geometry, max_tokens) RW(Geometry, hidden)
              RW(Geometry, pad_multiple) RW(Geometry, min_rows_per_expert) RW(Geometry, transport) RW(Geometry, reg)
                  RW(Geometry, rdma) RW(Geometry, info);
  py::class_<RankArgs>(m, "RankArgs", py::module_local())
      .def(py::init([] { return RankArgs{}; })) RW(RankArgs, rank) RW(RankArgs, absent) RW(RankArgs, num_tokens)
          RW(RankArgs, topk) RW(RankArgs, peers) RW(RankArgs, x) RW(RankArgs, x_scales) RW(RankArgs, topk_idx)
              RW(RankArgs, topk_weights) RW(RankArgs, send_ord) RW(RankArgs, entry_ord) RW(RankArgs, info)
                  RW(RankArgs, out) RW(RankArgs, out_scales) RW(RankArgs, out_probs) RW(RankArgs, row_pos)
                      RW(RankArgs, recv_spans) RW(RankArgs, fwd_slots) RW(RankArgs, fwd_rows) RW(RankArgs, rdma_regions)
                          RW(RankArgs, rdma_base) RW(RankArgs, rdma_pes) RW(RankArgs, num_out_rows)
                              RW(RankArgs, expert_out) RW(RankArgs, probs) RW(RankArgs, y) RW(RankArgs, route_rows)
                                  RW(RankArgs, peer_bases) RW(RankArgs, fwd_routes)
      .def_property(
          "agree", [](const RankArgs& r) { return std::vector<int32_t>(r.agree, r.agree + kAgreeWords); },
          [](RankArgs& r, const std::vector<int32_t>& v) {
            if (v.size() != static_cast<size_t>(kAgreeWords))
              throw py::value_error("agree: " + std::to_string(kAgreeWords) + " words");
            std::copy(v.begin(), v.end(), r.agree);
          });
  py::class_<HostLaunchArgs>(m, "LaunchArgs", py::module_local())
      .def(py::init<>()) RW(LaunchArgs, geo) RW(LaunchArgs, num_ranks) RW(LaunchArgs, dtype) RW(LaunchArgs, row_elems)
          RW(LaunchArgs, scale_cols) RW(LaunchArgs, kd) RW(LaunchArgs, apply_probs) RW(LaunchArgs, chunk_tokens)
              RW(LaunchArgs, fifo_stages) RW(LaunchArgs, stage_bytes) RW(LaunchArgs, rows_per_stage)
                  RW(LaunchArgs, store_groups) RW(LaunchArgs, wire_dtype) RW(LaunchArgs, seg_cols)
                      RW(LaunchArgs, host_stages) RW(LaunchArgs, host_stage_bytes) RW(LaunchArgs, host_out_stages)
                          RW(LaunchArgs, src_stages) RW(LaunchArgs, src_stage_bytes) RW(LaunchArgs, reducer_wait)
                              RW(LaunchArgs, reducer_warps) RW(LaunchArgs, combine_stage) RW(LaunchArgs, store_runs)
                                  RW(LaunchArgs, info_read) RW(LaunchArgs, timeout_ns) RW(LaunchArgs, abort_flag)
                                      RW(LaunchArgs, error) RW(LaunchArgs, bad_route) RW(LaunchArgs, num_sms)
      .def("set_rank",
           [](HostLaunchArgs& self, int i, const RankArgs& r) {
             if (i < 0 || i >= kMaxLaunchRanks) throw py::index_error("rank slot out of range");
             self.rank(i) = r;
           })
      .def("get_rank", [](const HostLaunchArgs& self, int i) {
        if (i < 0 || i >= kMaxLaunchRanks) throw py::index_error("rank slot out of range");
        return self.rank(i);
      });
  py::class_<WorkspaceLayout>(m, "WorkspaceLayout", py::module_local())
      .def_readonly("info", &WorkspaceLayout::info)
      .def_readonly("send_ord", &WorkspaceLayout::send_ord)
      .def_readonly("row_pos", &WorkspaceLayout::row_pos)
      .def_readonly("recv_spans", &WorkspaceLayout::recv_spans)
      .def_readonly("fwd_slots", &WorkspaceLayout::fwd_slots)
      .def_readonly("fwd_rows", &WorkspaceLayout::fwd_rows)
      .def_readonly("fwd_routes", &WorkspaceLayout::fwd_routes)
      .def_readonly("entry_ord", &WorkspaceLayout::entry_ord)
      .def_readonly("route_rows", &WorkspaceLayout::route_rows)
      .def_readonly("bytes", &WorkspaceLayout::bytes);
  m.def("workspace_layout", &workspace_layout, py::arg("geo"), py::arg("kd"), py::arg("topk"), py::arg("direct"),
        py::arg("receive"), "where one rank's per-call tensors of a dispatch lie in its part of the call's workspace");
  m.attr("CALL_ALIGN") = kCallAlign;
  // The seam's struct sequences (SeamTypes): ext.DispatchInputs(num_tokens=..., topk=..., ...),
  // every field by name.
  const auto* seam = new SeamTypes(m);  // for good: every HostPath of the module reads and makes them
  m.attr("DispatchInputs") = seam->dispatch_inputs.type.type();
  m.attr("DispatchOutputs") = seam->dispatch_outputs.type.type();
  m.attr("CombineInputs") = seam->combine_inputs.type.type();
  m.attr("OutputTensors") = seam->output_tensors.type.type();
  // One rank (production: one RankArgs, then one struct per call) or several (the emulation: a
  // list of each).
  py::class_<HostPath>(m, "HostPath", py::module_local())
      .def(py::init([seam](const RankArgs& rank) { return new HostPath({rank}, seam, true); }), py::arg("rank"))
      .def(py::init([seam](const std::vector<RankArgs>& ranks) { return new HostPath(ranks, seam, false); }),
           py::arg("ranks"))
      .def("set_agree", &HostPath::set_agree, py::arg("i"), py::arg("words"))
      .def("set_absent", &HostPath::set_absent, py::arg("absent"), py::arg("after_count"))
      .def("set_refused", &HostPath::set_refused, py::arg("i"), py::arg("code"))
      .def("dispatch_count", &HostPath::dispatch_count, py::arg("args"), py::arg("stream"), py::arg("workspace"),
           py::arg("layout"), py::arg("rows"), py::arg("inputs"), py::arg("read"),
           "inputs: a DispatchInputs (one rank), or a list of one per rank")
      .def("dispatch_rows", &HostPath::dispatch_rows, py::arg("args"), py::arg("direct"), py::arg("stream"),
           py::arg("workspace"), py::arg("layout"), py::arg("outputs"),
           "outputs: a DispatchOutputs (one rank) or a list of one per rank")
      .def("dispatch_rows_into", &HostPath::dispatch_rows_into, py::arg("args"), py::arg("stream"),
           py::arg("workspace"), py::arg("layout"), py::arg("taken"),
           "the direct path into the arena blocks an ArenaTaken holds; returns their OutputTensors (one, or a list "
           "of one per rank)")
      .def("dispatch", &HostPath::dispatch, py::arg("args"), py::arg("direct"), py::arg("stream"), py::arg("workspace"),
           py::arg("layout"), py::arg("rows"), py::arg("inputs"), py::arg("outputs"),
           "inputs, outputs: a DispatchInputs and a DispatchOutputs (one rank), or lists of one per rank")
      .def("dispatch_into", &HostPath::dispatch_into, py::arg("args"), py::arg("stream"), py::arg("workspace"),
           py::arg("layout"), py::arg("rows"), py::arg("inputs"), py::arg("taken"))
      .def("combine", &HostPath::combine, py::arg("args"), py::arg("direct"), py::arg("stream"), py::arg("inputs"),
           "inputs: a CombineInputs (one rank), or a list of one per rank");
  m.def(
      "set_launches_enabled", [](bool on) { launches_enabled() = on; },
      "off: HostPath calls fill the arguments but launch nothing (host-time measurement only)");
  m.def("launches_enabled", [] { return launches_enabled(); });
  m.def(
      "launches_made",
      [] {
        py::dict d;
        for (int k = 0; k < static_cast<int>(Kernel::kinds); ++k) d[kKernelNames[k]] = launches_made()[k];
        return d;
      },
      "the kernel launches HostPath calls made so far, per kernel (with launches off too)");
  bind_arena(m);
#undef RW

  // One kernel launched on arguments set field by field (the HostPath calls launch these too).
  const auto launcher = [&m](const char* name, Launcher launch, Kernel kernel) {
    m.def(name, [launch, kernel](HostLaunchArgs& a, uint64_t stream) {
      check_launch(launch_staged(launch, a, stream), kernel);
    });
  };
  launcher("launch_count", &launch_count, Kernel::count);
  launcher("launch_dispatch_receive", &launch_dispatch_receive, Kernel::dispatch_receive);
  launcher("launch_combine_receive", &launch_combine_receive, Kernel::combine_receive);
  launcher("launch_dispatch_direct", &launch_dispatch_direct, Kernel::dispatch_direct);
  launcher("launch_combine_direct", &launch_combine_direct, Kernel::combine_direct);
  m.def("count_smem_bytes", &count_smem_bytes);
  m.def("dispatch_receive_smem_bytes", &dispatch_receive_smem_bytes);
  m.def("combine_receive_smem_bytes", &combine_receive_smem_bytes);
  m.def("dispatch_direct_smem_bytes", &dispatch_direct_smem_bytes);
  m.def("combine_direct_smem_bytes", &combine_direct_smem_bytes);
  m.def("count_max_blocks_per_sm", &count_max_blocks_per_sm);
  m.def("dispatch_receive_max_blocks_per_sm", &dispatch_receive_max_blocks_per_sm);
  m.def("combine_receive_max_blocks_per_sm", &combine_receive_max_blocks_per_sm);
  m.def("dispatch_direct_max_blocks_per_sm", &dispatch_direct_max_blocks_per_sm);
  m.def("combine_direct_max_blocks_per_sm", &combine_direct_max_blocks_per_sm);
}

}  // namespace hybrid_ep::bindings
