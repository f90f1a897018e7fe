// Bindings shared by hybrid_ep._C (the GPU) and hybrid_ep._model (the CPU model of the
// device layer): limits, the codes of dtypes, transports and error phases, the argument
// structs, the per-call host path (HostPath: one call fills every rank's arguments of a
// kernel sequence and launches it), the arena's blocks (arena.h), the launchers and the
// occupancy queries. Both modules
// expose the same names, so the Python engine drives either.
//
// Only pybind11 is used here (no ATen), so this compiles fast; Python passes tensors as
// data_ptr() integers and streams as integers.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include "bindings/arena.h"
#include "bindings/buffer_layout.h"
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

// Off only to measure the host path without kernels (hybrid_ep.bench.host): the HostPath
// calls then fill the arguments and return without launching. One flag per module.
inline bool& launches_enabled() {
  static bool on = true;
  return on;
}

// The kernel launches the HostPath calls made, per kernel, counted with launches on or off:
// tests/model/test_launch_count.py asserts how many each call makes. One table per module.
struct LaunchCount {
  const char* kernel;
  uint64_t count;
};
inline LaunchCount (&launch_counts())[5] {
  static LaunchCount counts[5] = {
      {"count", 0}, {"dispatch_receive", 0}, {"dispatch_direct", 0}, {"combine_receive", 0}, {"combine_direct", 0}};
  return counts;
}

// Where a launch's ranks past the inline ones go (LaunchArgs::more_ranks): a block of device
// memory for that one launch, holding `bytes` from `src` once the copy on the launch's stream has
// landed, before the kernel. The block goes back when the last copy of the pointer returned is
// dropped, which the launcher does once the kernel is queued: stream-ordered, after the kernel,
// and no other launch shares it. Each module sets its own (cuda_module.cpp: cudaMallocAsync and
// cudaFreeAsync on the launch's stream, refusing CUDA graph capture by name; model_module.cpp:
// host memory, the model's launches running inside the call).
struct RankStaging {
  std::shared_ptr<void> (*stage)(const void* src, size_t bytes, uint64_t stream) = nullptr;
};
inline RankStaging& rank_staging() {
  static RankStaging staging;
  return staging;
}

// A launch's arguments as the host holds them: the kernel's LaunchArgs, its first
// kInlineLaunchRanks ranks inline, and the ranks past those, staged in device memory for each
// launch (an emulated launch of more than 16 ranks; a production launch holds one).
struct HostLaunchArgs : LaunchArgs {
  static constexpr int kMoreRanks = kMaxLaunchRanks - kInlineLaunchRanks;
  RankArgs more[kMoreRanks] = {};

  HostLaunchArgs() : LaunchArgs{} {}
  RankArgs& rank(int i) { return i < kInlineLaunchRanks ? ranks[i] : more[i - kInlineLaunchRanks]; }
  const RankArgs& rank(int i) const { return i < kInlineLaunchRanks ? ranks[i] : more[i - kInlineLaunchRanks]; }

  // The ranks past the inline ones staged for one launch on `stream` (more_ranks points at
  // them; null and 0 where the launch has none): the block lives while the pointer returned does.
  std::shared_ptr<void> stage_more_ranks(uint64_t stream) {
    const int extra = num_ranks - kInlineLaunchRanks;
    if (extra <= 0) {
      more_ranks = 0;
      return nullptr;
    }
    std::shared_ptr<void> block = rank_staging().stage(more, sizeof(RankArgs) * static_cast<size_t>(extra), stream);
    more_ranks = reinterpret_cast<uint64_t>(block.get());
    return block;
  }
};

// One launch on `a`, its ranks past the inline ones staged for it alone, without the GIL: a
// launch can block (a full launch queue, CUDA_LAUNCH_BLOCKING, the CPU model running the kernel
// and waiting for its lock while another thread's launch runs) until a peer's kernel runs, and
// that peer may first need this process's Python threads (the chunk server of peer memory).
inline LaunchStatus launch_staged(LaunchStatus (*launcher)(const LaunchArgs&, uint64_t), HostLaunchArgs& a,
                                  uint64_t stream) {
  const std::shared_ptr<void> more = a.stage_more_ranks(stream);
  LaunchStatus status;
  {
    py::gil_scoped_release unlocked;
    status = launcher(a, stream);
  }
  a.more_ranks = 0;  // the block goes back with `more`, the kernel queued
  return status;
}

inline void launch_checked(LaunchStatus (*launcher)(const LaunchArgs&, uint64_t), HostLaunchArgs& host, uint64_t stream,
                           const char* what) {
  for (LaunchCount& c : launch_counts()) {
    if (c.kernel == what || std::string_view(c.kernel) == what) {
      ++c.count;
      break;
    }
  }
  if (!launches_enabled()) return;
  check_launch(launch_staged(launcher, host, stream), what);
}

// Where one rank's per-call tensors of a dispatch lie in its part of the call's workspace
// (bytes from the part's start; -1 where the data path has none). The part is sized for
// max_tokens tokens and `topk` routes, so it depends only on the engine, K and the path:
// rank i's part of a call starts at i * bytes. The handle keeps the part for the combine.
struct CallLayout {
  int64_t info = -1;        // InfoLayout tensor (i64)
  int64_t send_slot = -1;   // [T, W] i32
  int64_t row_pos = -1;     // receive path: [W, max_tokens, kd] i32
  int64_t recv_spans = -1;  // receive path: [W, max_chunks, 2] i32
  int64_t fwd_slots = -1;   // several nodes: [N, max_chunks * kChunkTokens, G] i32
  int64_t fwd_rows = -1;    // several nodes: [N, max_chunks] i32
  int64_t fwd_routes = -1;  // direct path, several nodes: [N, max_chunks * kChunkTokens, fwd_route_width] i32
  int64_t entry_ord = -1;   // [T, K] i32
  int64_t route_rows = -1;  // direct path: [T, K] i32
  int64_t bytes = 0;        // the part, a multiple of kCallAlign
};

inline constexpr int64_t kCallAlign = 128;  // every tensor of a part starts on its own 128-byte line

// direct: the direct path's route rows; receive: the receive path's row positions and
// chunk spans. A layout with both serves a dispatch that chooses its path after the layout
// kernel (the engine's per-call fallback when the arena can not hold the output).
inline CallLayout call_layout(const Geometry& g, int32_t kd, int32_t topk, bool direct, bool receive) {
  if (topk < 0 || topk > kMaxTopK) throw py::value_error("topk out of range for a call layout");
  CallLayout l;
  int64_t at = 0;
  auto place = [&at](int64_t& field, int64_t bytes) {
    field = at;
    at += (bytes + kCallAlign - 1) / kCallAlign * kCallAlign;
  };
  const int64_t W = g.world_size, T = g.max_tokens, N = g.num_nodes, G = g.ranks_per_node;
  const int64_t chunks = static_cast<int64_t>(g.reg.max_chunks);
  place(l.info, g.info.total * 8);
  place(l.send_slot, T * W * 4);
  if (receive) {
    place(l.row_pos, W * T * kd * 4);
    place(l.recv_spans, W * chunks * 2 * 4);
  }
  if (N > 1) {
    if (receive) place(l.fwd_slots, N * chunks * kChunkTokens * G * 4);
    if (direct) place(l.fwd_routes, N * chunks * kChunkTokens * fwd_route_width(g) * 4);
    place(l.fwd_rows, N * chunks * 4);
  }
  place(l.entry_ord, T * topk * 4);
  if (direct) place(l.route_rows, T * topk * 4);
  l.bytes = at < kCallAlign ? kCallAlign : at;
  return l;
}

inline uint64_t at_offset(uint64_t part, int64_t offset) {
  return offset < 0 ? 0 : part + static_cast<uint64_t>(offset);
}

// What crosses between Python and the extension per call and rank (the seam: Python builds
// the inputs in hybrid_ep/backends/cuda/engine.py and reads the outputs). Addresses are
// data_ptr() integers; 0 where a call has no such tensor. A dispatch's outputs are in one
// order in every form: rows, scales, probs (DispatchOutputs, OutputTensors, the arena's block
// of a direct dispatch, RankArgs::out, out_scales, out_probs), as are its inputs (x,
// x_scales, then topk_weights). Each crosses as a struct sequence of the module (SeamTypes),
// with these fields in this order, the one order of every form:
//
//   DispatchInputs   num_tokens, topk, x, x_scales, topk_idx, topk_weights
//   DispatchOutputs  num_rows, rows, scales, probs
//   CombineInputs    num_tokens, topk, part, layout (a CallLayout), topk_idx, expert_out,
//                    probs, y, num_rows
//   OutputTensors    rows, scales, probs (tensors; scales None without fp8)
//
// Python builds one from the tuple of its items, ext.DispatchInputs((num_tokens, topk, x,
// x_scales, topk_idx, topk_weights)), one C call, and reads it by name (.rows) at a tuple
// item's cost; the host path reads its items by index (SeamTypes) into the C++ structs below.

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
  CallLayout layout;
  uint64_t topk_idx, expert_out, probs, y;
  int64_t num_rows;
};

template <typename Int>
constexpr const char* int_name() {
  if constexpr (std::is_same_v<Int, int32_t>) return "int32";
  else if constexpr (std::is_same_v<Int, int64_t>) return "int64";
  else return "uint64";
}

// A struct sequence type, the C API's named tuple (as os.stat_result), named
// <module>.<name>: made from the tuple of its items (Type((a, b, ...)), a wrong length a
// TypeError naming it) or in C++ (make), read by name in Python and by index here, each
// at the cost of a tuple's item, where a pybind11 class costs an instance's allocation and
// registration per object and a call per field read (about 0.2 us).
class __attribute__((visibility("hidden"))) StructSeqType {
 public:
  // fields: its fields in order, then {nullptr, nullptr}; static, as the type keeps them.
  StructSeqType(const py::module_& m, const char* name, const char* doc, PyStructSequence_Field* fields)
      : fields_(fields) {
    while (fields[size_].name != nullptr) ++size_;
    // The type's name lives as long as the type: for good.
    const auto* full = new std::string(m.attr("__name__").cast<std::string>() + "." + name);
    PyStructSequence_Desc desc{full->c_str(), doc, fields, static_cast<int>(size_)};
    PyTypeObject* t = PyStructSequence_NewType(&desc);
    if (t == nullptr) throw py::error_already_set();
    type_ = py::reinterpret_steal<py::object>(reinterpret_cast<PyObject*>(t));
  }

  const py::object& type() const { return type_; }
  const char* name() const { return reinterpret_cast<PyTypeObject*>(type_.ptr())->tp_name; }

  // One of items[0, size) (the references move into it).
  py::object make(py::object* items) const {
    PyObject* t = PyStructSequence_New(reinterpret_cast<PyTypeObject*>(type_.ptr()));
    if (t == nullptr) throw py::error_already_set();
    for (Py_ssize_t i = 0; i < size_; ++i) PyStructSequence_SetItem(t, i, items[i].release().ptr());
    return py::reinterpret_steal<py::object>(t);
  }

  // `o`, item i of the list `what`, if it is one of this type; else a TypeError naming both.
  PyObject* instance(PyObject* o, const char* what, size_t i) const {
    if (Py_TYPE(o) != reinterpret_cast<PyTypeObject*>(type_.ptr()))
      throw py::type_error(std::string(what) + "[" + std::to_string(i) + "]: a " + name() +
                           " (its fields in order: " + field_names() + "), got " + Py_TYPE(o)->tp_name);
    return o;
  }

  // Item i of instance `o` as an Int: a TypeError (not an int: a tensor is not its address)
  // or an OverflowError (out of Int's range) naming the struct and field otherwise.
  template <typename Int>
  Int integer(PyObject* o, Py_ssize_t i) const {
    static_assert(sizeof(Int) <= sizeof(long), "read through PyLong_AsLong / PyLong_AsUnsignedLong");
    PyObject* v = PyStructSequence_GET_ITEM(o, i);
    if (!PyLong_Check(v)) throw py::type_error(field(i) + ": an int, got " + Py_TYPE(v)->tp_name);
    bool ok;
    Int value;
    if constexpr (std::is_signed_v<Int>) {
      const long x = PyLong_AsLong(v);
      ok = !(x == -1 && PyErr_Occurred()) && x >= std::numeric_limits<Int>::min() &&
           x <= std::numeric_limits<Int>::max();
      value = static_cast<Int>(x);
    } else {
      const unsigned long x = PyLong_AsUnsignedLong(v);
      ok = !(x == static_cast<unsigned long>(-1) && PyErr_Occurred()) && x <= std::numeric_limits<Int>::max();
      value = static_cast<Int>(x);
    }
    if (!ok) {
      PyErr_Clear();
      const std::string text =
          field(i) + ": " + py::repr(v).cast<std::string>() + " is out of range of " + int_name<Int>();
      PyErr_SetString(PyExc_OverflowError, text.c_str());
      throw py::error_already_set();
    }
    return value;
  }

  // "<module>.<name>.<field i>", for messages.
  std::string field(Py_ssize_t i) const { return std::string(name()) + "." + fields_[i].name; }

 private:
  std::string field_names() const {
    std::string s;
    for (Py_ssize_t i = 0; i < size_; ++i) s += (i ? ", " : "") + std::string(fields_[i].name);
    return s;
  }

  py::object type_;
  const PyStructSequence_Field* fields_;
  Py_ssize_t size_ = 0;
};

// The module's four seam types (above), made once (bind_common) and kept for good: every
// HostPath of the module reads and makes them.
class __attribute__((visibility("hidden"))) SeamTypes {
 public:
  explicit SeamTypes(const py::module_& m)
      : dispatch_inputs(m, "DispatchInputs", "One rank's inputs of a dispatch: the tensors the kernels read.",
                        dispatch_inputs_fields()),
        dispatch_outputs(m, "DispatchOutputs", "One rank's outputs of a dispatch: where its second kernel writes them.",
                         dispatch_outputs_fields()),
        combine_inputs(m, "CombineInputs",
                       "One rank's part of a combine: its dispatch's workspace part and layout, the routing's "
                       "experts (direct path, else 0), the expert outputs, their probs and y.",
                       combine_inputs_fields()),
        output_tensors(m, "OutputTensors", "One rank's output tensors of a dispatch: rows, scales, probs.",
                       output_tensors_fields()) {}

  const StructSeqType dispatch_inputs, dispatch_outputs, combine_inputs, output_tensors;

  // Item i of `in` (a list of the Python structs), read into the C++ struct.
  DispatchInputs read_dispatch_inputs(const py::list& in, size_t i) const {
    const StructSeqType& s = dispatch_inputs;
    PyObject* o = s.instance(PyList_GET_ITEM(in.ptr(), i), "inputs", i);
    return {s.integer<int32_t>(o, 0),  s.integer<int32_t>(o, 1),  s.integer<uint64_t>(o, 2),
            s.integer<uint64_t>(o, 3), s.integer<uint64_t>(o, 4), s.integer<uint64_t>(o, 5)};
  }
  DispatchOutputs read_dispatch_outputs(const py::list& out, size_t i) const {
    const StructSeqType& s = dispatch_outputs;
    PyObject* o = s.instance(PyList_GET_ITEM(out.ptr(), i), "outputs", i);
    return {s.integer<int64_t>(o, 0), s.integer<uint64_t>(o, 1), s.integer<uint64_t>(o, 2), s.integer<uint64_t>(o, 3)};
  }
  CombineInputs read_combine_inputs(const py::list& in, size_t i) const {
    const StructSeqType& s = combine_inputs;
    PyObject* o = s.instance(PyList_GET_ITEM(in.ptr(), i), "inputs", i);
    CombineInputs c;
    c.num_tokens = s.integer<int32_t>(o, 0);
    c.topk = s.integer<int32_t>(o, 1);
    c.part = s.integer<uint64_t>(o, 2);
    PyObject* layout = PyStructSequence_GET_ITEM(o, 3);
    try {
      c.layout = py::cast<const CallLayout&>(py::handle(layout));
    } catch (const py::cast_error&) {
      throw py::type_error(s.field(3) + ": a CallLayout (call_layout()), got " + Py_TYPE(layout)->tp_name);
    }
    c.topk_idx = s.integer<uint64_t>(o, 4);
    c.expert_out = s.integer<uint64_t>(o, 5);
    c.probs = s.integer<uint64_t>(o, 6);
    c.y = s.integer<uint64_t>(o, 7);
    c.num_rows = s.integer<int64_t>(o, 8);
    return c;
  }

 private:
  static PyStructSequence_Field* dispatch_inputs_fields() {
    static PyStructSequence_Field f[] = {{"num_tokens", "T, the rank's tokens"},
                                         {"topk", "K, its routes per token"},
                                         {"x", "address of x [T, H]"},
                                         {"x_scales", "address of x's float32 scales [T, H / 128] (fp8), else 0"},
                                         {"topk_idx", "address of the routing's experts [T, K] int64"},
                                         {"topk_weights", "address of the routing's float32 weights [T, K]"},
                                         {nullptr, nullptr}};
    return f;
  }
  static PyStructSequence_Field* dispatch_outputs_fields() {
    static PyStructSequence_Field f[] = {{"num_rows", "R, the rank's output rows"},
                                         {"rows", "address of the output rows [R, H]"},
                                         {"scales", "address of their float32 scales [R, H / 128] (fp8), else 0"},
                                         {"probs", "address of their float32 routing weights [R]"},
                                         {nullptr, nullptr}};
    return f;
  }
  static PyStructSequence_Field* combine_inputs_fields() {
    static PyStructSequence_Field f[] = {{"num_tokens", "T, the rank's tokens"},
                                         {"topk", "K, its routes per token"},
                                         {"part", "address of the rank's part of its dispatch's workspace"},
                                         {"layout", "that workspace's CallLayout"},
                                         {"topk_idx", "address of the routing's experts [T, K] (direct path), else 0"},
                                         {"expert_out", "address of the expert outputs [R, C]"},
                                         {"probs", "address of their float32 routing weights [R]"},
                                         {"y", "address of the combined tokens [T, C]"},
                                         {"num_rows", "R, the rank's rows"},
                                         {nullptr, nullptr}};
    return f;
  }
  static PyStructSequence_Field* output_tensors_fields() {
    static PyStructSequence_Field f[] = {{"rows", "[R, H] the output rows, expert-major"},
                                         {"scales", "[R, H / 128] float32 scales of fp8 rows, else None"},
                                         {"probs", "[R] float32 routing weight of each row"},
                                         {nullptr, nullptr}};
    return f;
  }
};

// The per-call host path of one engine: the ranks it drives with what stays fixed per rank
// (rank, peer table, transport, arena bases), and per kernel sequence one call that fills
// every rank slot of the launch arguments, each from a zeroed RankArgs as a fresh one would
// be, and launches. The launch arguments (geometry, pipeline shape) are the engine's, cached
// per launch shape; the launchers copy them when they launch.
class __attribute__((visibility("hidden"))) HostPath {
 public:
  // Each rank's arena_bases (its own table: a virtual rank of the emulation may see its peers'
  // memory at other addresses than another does) is in ranks[i]. seam: the module's seam
  // types, which the calls read per rank (a list of one per rank) and make (OutputTensors, the
  // calls on arena blocks).
  HostPath(const std::vector<RankArgs>& ranks, const SeamTypes* seam) : fixed_(ranks), seam_(seam) {
    if (ranks.empty() || ranks.size() > static_cast<size_t>(kMaxLaunchRanks))
      throw py::value_error("a launch drives 1 to " + std::to_string(kMaxLaunchRanks) + " ranks");
  }

  // The test hook (hybrid_ep.testing.faults.ranks_absent), set once, not passed per call: bit i
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
  // routing itself (LaunchArgs::info_read). in: one DispatchInputs per rank.
  void dispatch_count(HostLaunchArgs& a, uint64_t stream, uint64_t workspace, const CallLayout& l, int64_t rows,
                      const py::list& in, bool read) {
    const size_t n = check_count(in.size());
    a.info_read = read ? 1 : 0;
    for (size_t i = 0; i < n; ++i) {
      RankArgs r = fixed_[i];
      const DispatchInputs d = seam_->read_dispatch_inputs(in, i);
      const uint64_t part = workspace + i * static_cast<uint64_t>(l.bytes);
      r.absent = static_cast<int32_t>((absent_ >> i) & 1);
      r.num_tokens = d.num_tokens;
      r.topk = d.topk;
      r.x = d.x;
      r.x_scales = d.x_scales;
      r.topk_idx = d.topk_idx;
      r.topk_weights = d.topk_weights;
      r.send_slot = at_offset(part, l.send_slot);
      r.entry_ord = at_offset(part, l.entry_ord);
      r.info = at_offset(part, l.info);
      r.num_out_rows = rows;
      a.rank(static_cast<int>(i)) = r;
    }
    a.num_ranks = static_cast<int32_t>(n);
    launch_checked(&launch_count, a, stream, "count");
  }

  // The row tables dispatch wrote into a rank's part of the workspace and combine reads back:
  // route rows (direct path) or row positions and receive spans, and the forwarded chunks.
  void set_row_tables(RankArgs& r, bool direct, uint64_t part, const CallLayout& l) const {
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

  // The dispatch kernel, after dispatch_count on the same arguments: every rank's outputs
  // and the rest of its part (route rows on the direct path, else row positions and chunk
  // spans; forwarded chunks with several nodes). out: one DispatchOutputs per rank.
  void dispatch_rows(HostLaunchArgs& a, bool direct, uint64_t stream, uint64_t workspace, const CallLayout& l,
                     const py::list& out) {
    rows_of(a, direct, stream, workspace, l, out.size(),
            [this, &out](size_t i) { return seam_->read_dispatch_outputs(out, i); });
  }

  // The same into the arena blocks `taken` holds, one per rank (the engine's arena_take; the
  // direct path only), then the blocks' tensors: one OutputTensors per rank.
  py::list dispatch_rows_into(HostLaunchArgs& a, bool direct, uint64_t stream, uint64_t workspace, const CallLayout& l,
                              ArenaTaken& taken) {
    if (!direct) throw py::value_error("dispatch_rows: arena blocks take the direct path");
    check_blocks(taken, taken.size());
    rows_of(a, true, stream, workspace, l, taken.size(), [&taken](size_t i) { return block_outputs(taken, i); });
    return output_tensors(taken);
  }

  // A dispatch whose output size is known before the count kernel (static size, or a
  // handle's): both kernels in one call. The outputs are read before the count kernel
  // launches: a bad one launches neither.
  void dispatch(HostLaunchArgs& a, bool direct, uint64_t stream, uint64_t workspace, const CallLayout& l, int64_t rows,
                const py::list& in, const py::list& out) {
    if (in.size() != out.size()) throw py::value_error("dispatch: one output per input");
    const size_t n = check_count(out.size());
    DispatchOutputs outs[kMaxLaunchRanks];
    for (size_t i = 0; i < n; ++i) outs[i] = seam_->read_dispatch_outputs(out, i);
    dispatch_count(a, stream, workspace, l, rows, in, false);
    rows_of(a, direct, stream, workspace, l, n, [&outs](size_t i) { return outs[i]; });
  }

  // A direct dispatch of known size into the arena blocks `taken` holds, one per rank (the
  // engine's arena_take): both kernels, then the blocks' tensors, one OutputTensors per rank.
  // One call instead of the addresses, the launch and the tensors one by one.
  py::list dispatch_into(HostLaunchArgs& a, uint64_t stream, uint64_t workspace, const CallLayout& l, int64_t rows,
                         const py::list& in, ArenaTaken& taken) {
    check_blocks(taken, in.size());
    dispatch_count(a, stream, workspace, l, rows, in, false);
    rows_of(a, true, stream, workspace, l, taken.size(), [&taken](size_t i) { return block_outputs(taken, i); });
    return output_tensors(taken);
  }

  // A combine on the parts of the dispatch handles' workspaces. in: one CombineInputs per rank.
  void combine(HostLaunchArgs& a, bool direct, uint64_t stream, const py::list& in) {
    const size_t n = check_count(in.size());
    for (size_t i = 0; i < n; ++i) {
      RankArgs r = fixed_[i];
      const CombineInputs c = seam_->read_combine_inputs(in, i);
      r.absent = static_cast<int32_t>((absent_ >> i) & 1);
      r.num_tokens = c.num_tokens;
      r.topk = c.topk;
      r.send_slot = at_offset(c.part, c.layout.send_slot);
      r.info = at_offset(c.part, c.layout.info);
      if (direct) r.topk_idx = c.topk_idx;
      else r.arena_bases = 0;
      set_row_tables(r, direct, c.part, c.layout);
      r.expert_out = c.expert_out;
      r.probs = c.probs;
      r.y = c.y;
      r.num_out_rows = c.num_rows;
      a.rank(static_cast<int>(i)) = r;
    }
    a.num_ranks = static_cast<int32_t>(n);
    if (direct) launch_checked(&launch_combine_direct, a, stream, "combine_direct");
    else launch_checked(&launch_combine_receive, a, stream, "combine_receive");
  }

 private:
  size_t check_count(size_t n) const {
    if (n != fixed_.size())
      throw py::value_error("this host path drives " + std::to_string(fixed_.size()) + " rank(s), got " +
                            std::to_string(n));
    return n;
  }

  // The dispatch kernel on n ranks' outputs, rank i's from out(i) (a DispatchOutputs).
  template <typename Out>
  void rows_of(HostLaunchArgs& a, bool direct, uint64_t stream, uint64_t workspace, const CallLayout& l, size_t n,
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
    if (direct) launch_checked(&launch_dispatch_direct, a, stream, "dispatch_direct");
    else launch_checked(&launch_dispatch_receive, a, stream, "dispatch_receive");
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

  py::list output_tensors(ArenaTaken& taken) const {
    return taken.tensors_as([this](py::object* views) { return seam_->output_tensors.make(views); });
  }

  std::vector<RankArgs> fixed_;  // rank, peers, rdma_regions, rdma_base, rdma_pes, arena_bases, agree; the rest zero
  const SeamTypes* seam_;        // the module's, alive for good
  uint64_t absent_ = 0, absent_after_count_ = 0;  // set_absent
};

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
              RW(RankArgs, topk_weights) RW(RankArgs, send_slot) RW(RankArgs, entry_ord) RW(RankArgs, info)
                  RW(RankArgs, out) RW(RankArgs, out_scales) RW(RankArgs, out_probs) RW(RankArgs, row_pos)
                      RW(RankArgs, recv_spans) RW(RankArgs, fwd_slots) RW(RankArgs, fwd_rows) RW(RankArgs, rdma_regions)
                          RW(RankArgs, rdma_base) RW(RankArgs, rdma_pes) RW(RankArgs, num_out_rows)
                              RW(RankArgs, expert_out) RW(RankArgs, probs) RW(RankArgs, y) RW(RankArgs, route_rows)
                                  RW(RankArgs, arena_bases) RW(RankArgs, fwd_routes)
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
  py::class_<CallLayout>(m, "CallLayout", py::module_local())
      .def_readonly("info", &CallLayout::info)
      .def_readonly("send_slot", &CallLayout::send_slot)
      .def_readonly("row_pos", &CallLayout::row_pos)
      .def_readonly("recv_spans", &CallLayout::recv_spans)
      .def_readonly("fwd_slots", &CallLayout::fwd_slots)
      .def_readonly("fwd_rows", &CallLayout::fwd_rows)
      .def_readonly("fwd_routes", &CallLayout::fwd_routes)
      .def_readonly("entry_ord", &CallLayout::entry_ord)
      .def_readonly("route_rows", &CallLayout::route_rows)
      .def_readonly("bytes", &CallLayout::bytes);
  m.def("call_layout", &call_layout, py::arg("geo"), py::arg("kd"), py::arg("topk"), py::arg("direct"),
        py::arg("receive"), "where one rank's per-call tensors of a dispatch lie in its part of the call's workspace");
  m.attr("CALL_ALIGN") = kCallAlign;
  // The seam's struct sequences (SeamTypes): ext.DispatchInputs((num_tokens, topk, ...)), the
  // items in the order of the fields.
  const auto* seam = new SeamTypes(m);  // for good: every HostPath of the module reads and makes them
  m.attr("DispatchInputs") = seam->dispatch_inputs.type();
  m.attr("DispatchOutputs") = seam->dispatch_outputs.type();
  m.attr("CombineInputs") = seam->combine_inputs.type();
  m.attr("OutputTensors") = seam->output_tensors.type();
  py::class_<HostPath>(m, "HostPath", py::module_local())
      .def(py::init([seam](const std::vector<RankArgs>& ranks) { return new HostPath(ranks, seam); }), py::arg("ranks"))
      .def("set_agree", &HostPath::set_agree, py::arg("i"), py::arg("words"))
      .def("set_absent", &HostPath::set_absent, py::arg("absent"), py::arg("after_count"))
      .def("set_refused", &HostPath::set_refused, py::arg("i"), py::arg("code"))
      .def("dispatch_count", &HostPath::dispatch_count, py::arg("args"), py::arg("stream"), py::arg("workspace"),
           py::arg("layout"), py::arg("rows"), py::arg("inputs"), py::arg("read"),
           "inputs: a list of one DispatchInputs per rank")
      .def("dispatch_rows", &HostPath::dispatch_rows, py::arg("args"), py::arg("direct"), py::arg("stream"),
           py::arg("workspace"), py::arg("layout"), py::arg("outputs"))
      .def(
          "dispatch_rows", &HostPath::dispatch_rows_into, py::arg("args"), py::arg("direct"), py::arg("stream"),
          py::arg("workspace"), py::arg("layout"), py::arg("outputs"),
          "outputs: a list of one DispatchOutputs per rank, or the arena blocks an ArenaTaken holds (direct only; then "
          "returns their OutputTensors)")
      .def("dispatch", &HostPath::dispatch, py::arg("args"), py::arg("direct"), py::arg("stream"), py::arg("workspace"),
           py::arg("layout"), py::arg("rows"), py::arg("inputs"), py::arg("outputs"),
           "inputs, outputs: lists of one DispatchInputs, one DispatchOutputs per rank")
      .def("dispatch_into", &HostPath::dispatch_into, py::arg("args"), py::arg("stream"), py::arg("workspace"),
           py::arg("layout"), py::arg("rows"), py::arg("inputs"), py::arg("taken"))
      .def("combine", &HostPath::combine, py::arg("args"), py::arg("direct"), py::arg("stream"), py::arg("inputs"),
           "inputs: a list of one CombineInputs per rank");
  m.def(
      "set_launches_enabled", [](bool on) { launches_enabled() = on; },
      "off: HostPath calls fill the arguments but launch nothing (host-time measurement only)");
  m.def("launches_enabled", [] { return launches_enabled(); });
  m.def(
      "launch_counts",
      [] {
        py::dict d;
        for (const LaunchCount& c : launch_counts()) d[c.kernel] = c.count;
        return d;
      },
      "the kernel launches HostPath calls made so far, per kernel (with launches off too)");
  bind_arena(m);
#undef RW

  // One kernel launched on arguments set field by field (the HostPath calls launch these too).
  const auto launcher = [&m](const char* name, LaunchStatus (*launch)(const LaunchArgs&, uint64_t), const char* what) {
    m.def(name,
          [launch, what](HostLaunchArgs& a, uint64_t stream) { check_launch(launch_staged(launch, a, stream), what); });
  };
  launcher("launch_count", &launch_count, "count");
  launcher("launch_dispatch_receive", &launch_dispatch_receive, "dispatch_receive");
  launcher("launch_combine_receive", &launch_combine_receive, "combine_receive");
  launcher("launch_dispatch_direct", &launch_dispatch_direct, "dispatch_direct");
  launcher("launch_combine_direct", &launch_combine_direct, "combine_direct");
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
