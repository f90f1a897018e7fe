// What crosses between Python and the extension per call and rank (the seam: Python builds
// the inputs in hybrid_ep/backends/cuda/engine.py and reads the outputs). Addresses are
// data_ptr() integers; 0 where a call has no such tensor. A dispatch's outputs are in one
// order in every form: rows, scales, probs (DispatchOutputs, OutputTensors, the arena's block
// of a direct dispatch, RankArgs::out, out_scales, out_probs), as are its inputs (x,
// x_scales, then topk_weights). Each crosses as a struct sequence of the module
// (bindings/struct_seq.h), built and read by field name on both sides:
//
//   DispatchInputs   num_tokens, topk, x, x_scales, topk_idx, topk_weights
//   DispatchOutputs  num_rows, rows, scales, probs
//   CombineInputs    num_tokens, topk, part, layout (a WorkspaceLayout), topk_idx, expert_out,
//                    probs, y, num_rows
//   OutputTensors    rows, scales, probs (tensors; scales None without fp8; made here only)
//
// Python: ext.DispatchInputs(num_tokens=T, topk=K, x=..., ...), read by name (.rows).
#pragma once
#include <pybind11/pybind11.h>

#include <cstdint>
#include <string>

#include "bindings/buffer_layout.h"
#include "bindings/struct_seq.h"

namespace hybrid_ep::bindings {

namespace py = pybind11;

// One rank's inputs of a dispatch: the tensors the kernels read.
struct DispatchInputs {
  int32_t num_tokens, topk;
  uint64_t x, x_scales, topk_idx, topk_weights;  // x_scales: fp8 only
};
// One rank's outputs of a dispatch: where its second kernel writes them.
struct DispatchOutputs {
  int64_t num_rows;
  uint64_t rows, scales, probs;  // scales: fp8 only
};
// One rank's part of a combine: the dispatch handle's part of its workspace and that
// workspace's layout, the routing's experts (direct path, else 0), the expert outputs, their
// probs and y.
struct CombineInputs {
  int32_t num_tokens, topk;
  uint64_t part;
  WorkspaceLayout layout;
  uint64_t topk_idx, expert_out, probs, y;
  int64_t num_rows;
};
// One rank's output tensors of a dispatch (made in C++ only, never read).
struct OutputTensors {};

// The module's four seam types, made once (bind_common) and kept for good: every HostPath of
// the module reads and makes them.
class __attribute__((visibility("hidden"))) SeamTypes {
 public:
  explicit SeamTypes(const py::module_& m)
      : dispatch_inputs(
            m, "DispatchInputs", "One rank's inputs of a dispatch: the tensors the kernels read.",
            {HYBRID_EP_SEQ_INT(DispatchInputs, num_tokens, "T, the rank's tokens"),
             HYBRID_EP_SEQ_INT(DispatchInputs, topk, "K, its routes per token"),
             HYBRID_EP_SEQ_INT(DispatchInputs, x, "address of x [T, H]"),
             HYBRID_EP_SEQ_INT(DispatchInputs, x_scales, "address of x's float32 scales [T, H / 128] (fp8), else 0"),
             HYBRID_EP_SEQ_INT(DispatchInputs, topk_idx, "address of the routing's experts [T, K] int64"),
             HYBRID_EP_SEQ_INT(DispatchInputs, topk_weights, "address of the routing's float32 weights [T, K]")}),
        dispatch_outputs(
            m, "DispatchOutputs", "One rank's outputs of a dispatch: where its second kernel writes them.",
            {HYBRID_EP_SEQ_INT(DispatchOutputs, num_rows, "R, the rank's output rows"),
             HYBRID_EP_SEQ_INT(DispatchOutputs, rows, "address of the output rows [R, H]"),
             HYBRID_EP_SEQ_INT(DispatchOutputs, scales, "address of their float32 scales [R, H / 128] (fp8), else 0"),
             HYBRID_EP_SEQ_INT(DispatchOutputs, probs, "address of their float32 routing weights [R]")}),
        combine_inputs(
            m, "CombineInputs",
            "One rank's part of a combine: its dispatch's workspace part and layout, the routing's "
            "experts (direct path, else 0), the expert outputs, their probs and y.",
            {HYBRID_EP_SEQ_INT(CombineInputs, num_tokens, "T, the rank's tokens"),
             HYBRID_EP_SEQ_INT(CombineInputs, topk, "K, its routes per token"),
             HYBRID_EP_SEQ_INT(CombineInputs, part, "address of the rank's part of its dispatch's workspace"),
             {"layout", "that workspace's WorkspaceLayout", &read_layout},
             HYBRID_EP_SEQ_INT(CombineInputs, topk_idx,
                               "address of the routing's experts [T, K] (direct path), else 0"),
             HYBRID_EP_SEQ_INT(CombineInputs, expert_out, "address of the expert outputs [R, C]"),
             HYBRID_EP_SEQ_INT(CombineInputs, probs, "address of their float32 routing weights [R]"),
             HYBRID_EP_SEQ_INT(CombineInputs, y, "address of the combined tokens [T, C]"),
             HYBRID_EP_SEQ_INT(CombineInputs, num_rows, "R, the rank's rows")}),
        output_tensors(m, "OutputTensors", "One rank's output tensors of a dispatch: rows, scales, probs.",
                       {{"rows", "[R, H] the output rows, expert-major", nullptr},
                        {"scales", "[R, H / 128] float32 scales of fp8 rows, else None", nullptr},
                        {"probs", "[R] float32 routing weight of each row", nullptr}}) {}

  const StructSeq<DispatchInputs> dispatch_inputs;
  const StructSeq<DispatchOutputs> dispatch_outputs;
  const StructSeq<CombineInputs> combine_inputs;
  const StructSeq<OutputTensors> output_tensors;  // made from rows, scales, probs in that order

 private:
  static void read_layout(const StructSeqType& t, PyObject* o, Py_ssize_t i, CombineInputs& c) {
    PyObject* layout = PyStructSequence_GET_ITEM(o, i);
    try {
      c.layout = py::cast<const WorkspaceLayout&>(py::handle(layout));
    } catch (const py::cast_error&) {
      throw py::type_error(t.field(i) + ": a WorkspaceLayout (workspace_layout()), got " + Py_TYPE(layout)->tp_name);
    }
  }
};

}  // namespace hybrid_ep::bindings
