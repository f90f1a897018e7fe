// Python bindings of hybrid_ep._C: the argument structs, the three launchers, occupancy
// queries, the host-visible error record and the registered-memory transport.
//
// Only pybind11 and the CUDA runtime are used here (no ATen), so this file compiles fast;
// Python passes tensors as data_ptr() integers and streams as cuda_stream integers.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "common/params.h"
#include "kernels/launch.h"
#include "transport/registered_memory.h"

namespace py = pybind11;
using namespace hybrid_ep;

namespace hybrid_ep {
int layout_max_blocks_per_sm(size_t smem);
int dispatch_max_blocks_per_sm(size_t smem);
int combine_max_blocks_per_sm();
}  // namespace hybrid_ep

namespace {

void check_launch(cudaError_t err, const char* what) {
  if (err != cudaSuccess)
    throw std::runtime_error(std::string("hybrid_ep: launching the ") + what + " kernel failed: " +
                             cudaGetErrorString(err));
}

cudaStream_t as_stream(uint64_t s) { return reinterpret_cast<cudaStream_t>(s); }

// Pinned host memory mapped into the device address space, so a kernel can report a
// failure that the host reads without synchronising.
class ErrorRecordHost {
 public:
  ErrorRecordHost() {
    void* p = nullptr;
    if (cudaHostAlloc(&p, sizeof(ErrorRecord), cudaHostAllocMapped) != cudaSuccess)
      throw std::runtime_error("hybrid_ep: cudaHostAlloc of the error record failed");
    host_ = static_cast<ErrorRecord*>(p);
    clear();
    void* d = nullptr;
    if (cudaHostGetDevicePointer(&d, p, 0) != cudaSuccess)
      throw std::runtime_error("hybrid_ep: cudaHostGetDevicePointer of the error record failed");
    device_ = reinterpret_cast<uint64_t>(d);
  }
  ~ErrorRecordHost() { cudaFreeHost(host_); }
  uint64_t device_ptr() const { return device_; }
  void clear() { std::memset(host_, 0, sizeof(ErrorRecord)); }
  py::object read() const {
    const volatile ErrorRecord* r = host_;
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

 private:
  ErrorRecord* host_ = nullptr;
  uint64_t device_ = 0;
};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hybrid-ep CUDA kernels and NVLink transport";
  m.attr("MAX_RANKS") = kMaxRanks;
  m.attr("MAX_LAUNCH_RANKS") = kMaxLaunchRanks;
  m.attr("MAX_TOPK") = kMaxTopK;
  m.attr("MAX_EXPERTS") = kMaxExperts;
  m.attr("THREADS") = kThreads;
  m.attr("LOCAL_STATE_BYTES") = sizeof(LocalState);
  m.attr("META_ENTRY_BYTES") = sizeof(MetaEntry);

#define RW(cls, field) .def_readwrite(#field, &cls::field)
  py::class_<RegLayout>(m, "RegLayout")
      .def(py::init<>()) RW(RegLayout, count_epoch) RW(RegLayout, dispatch_signal) RW(RegLayout, combine_signal)
          RW(RegLayout, done_dispatch) RW(RegLayout, done_combine) RW(RegLayout, state) RW(RegLayout, count_in)
              RW(RegLayout, count_row_ints) RW(RegLayout, recv_meta) RW(RegLayout, meta_entries)
                  RW(RegLayout, recv_rows) RW(RegLayout, row_stride) RW(RegLayout, recv_scales)
                      RW(RegLayout, scale_stride) RW(RegLayout, comb_rows) RW(RegLayout, comb_stride)
                          RW(RegLayout, total);
  py::class_<InfoLayout>(m, "InfoLayout")
      .def(py::init<>()) RW(InfoLayout, tokens_per_expert) RW(InfoLayout, expert_start) RW(InfoLayout, expert_rows)
          RW(InfoLayout, src_prefix) RW(InfoLayout, recv_count) RW(InfoLayout, recv_offset) RW(InfoLayout, send_count)
              RW(InfoLayout, needed) RW(InfoLayout, dropped) RW(InfoLayout, num_recv) RW(InfoLayout, count_matrix)
                  RW(InfoLayout, node_counts) RW(InfoLayout, total);
  py::class_<Geometry>(m, "Geometry")
      .def(py::init<>()) RW(Geometry, world_size) RW(Geometry, ranks_per_node) RW(Geometry, num_nodes)
          RW(Geometry, num_experts) RW(Geometry, local_experts) RW(Geometry, max_tokens) RW(Geometry, hidden)
              RW(Geometry, pad_multiple) RW(Geometry, min_rows_per_expert) RW(Geometry, reg) RW(Geometry, info);
  py::class_<RankArgs>(m, "RankArgs")
      .def(py::init([] { return RankArgs{}; })) RW(RankArgs, rank) RW(RankArgs, absent) RW(RankArgs, num_tokens)
          RW(RankArgs, topk) RW(RankArgs, peers) RW(RankArgs, x) RW(RankArgs, x_scales) RW(RankArgs, topk_idx)
              RW(RankArgs, topk_weights) RW(RankArgs, send_slot) RW(RankArgs, entry_ord) RW(RankArgs, info)
                  RW(RankArgs, out) RW(RankArgs, out_scales) RW(RankArgs, out_probs) RW(RankArgs, row_pos)
                      RW(RankArgs, num_out_rows) RW(RankArgs, expert_out) RW(RankArgs, probs) RW(RankArgs, y);
  py::class_<LaunchArgs>(m, "LaunchArgs")
      .def(py::init([] { return LaunchArgs{}; })) RW(LaunchArgs, geo) RW(LaunchArgs, num_ranks)
          RW(LaunchArgs, blocks_per_rank) RW(LaunchArgs, dtype) RW(LaunchArgs, row_elems) RW(LaunchArgs, scale_cols)
              RW(LaunchArgs, kd) RW(LaunchArgs, apply_probs) RW(LaunchArgs, chunk_tokens) RW(LaunchArgs, fifo_stages)
                  RW(LaunchArgs, stage_bytes) RW(LaunchArgs, timeout_ns) RW(LaunchArgs, abort_flag)
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

  m.def("launch_layout", [](const LaunchArgs& a, uint64_t stream) { check_launch(launch_layout(a, as_stream(stream)), "layout"); });
  m.def("launch_dispatch", [](const LaunchArgs& a, uint64_t stream) { check_launch(launch_dispatch(a, as_stream(stream)), "dispatch"); });
  m.def("launch_combine", [](const LaunchArgs& a, uint64_t stream) { check_launch(launch_combine(a, as_stream(stream)), "combine"); });
  m.def("layout_smem_bytes", &layout_smem_bytes);
  m.def("dispatch_smem_bytes", &dispatch_smem_bytes);
  m.def("layout_max_blocks_per_sm", &layout_max_blocks_per_sm);
  m.def("dispatch_max_blocks_per_sm", &dispatch_max_blocks_per_sm);
  m.def("combine_max_blocks_per_sm", &combine_max_blocks_per_sm);

  py::class_<ErrorRecordHost>(m, "ErrorRecord")
      .def(py::init<>())
      .def_property_readonly("device_ptr", &ErrorRecordHost::device_ptr)
      .def("read", &ErrorRecordHost::read)
      .def("clear", &ErrorRecordHost::clear);

  m.def("fabric_supported", &fabric_supported);
  m.def("allocate_registered", [](size_t bytes, int kind, int device) {
    Allocation a = allocate_registered(bytes, static_cast<HandleKind>(kind), device);
    return py::make_tuple(a.ptr, a.bytes, py::bytes(a.handle));
  });
  m.def("free_registered", [](uint64_t ptr, size_t bytes, int kind) { free_registered(ptr, bytes, static_cast<HandleKind>(kind)); });
  m.def("open_peer", [](py::bytes handle, size_t bytes, int kind, int device) {
    return open_peer(std::string(handle), bytes, static_cast<HandleKind>(kind), device);
  });
  m.def("close_peer", [](uint64_t ptr, size_t bytes, int kind) { close_peer(ptr, bytes, static_cast<HandleKind>(kind)); });
}
