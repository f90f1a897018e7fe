// hybrid_ep._C: the kernels on the GPU, the host-visible error record (mapped pinned memory)
// and the NVLink transport's registered memory.
#include <cuda_runtime.h>

#include <cstring>
#include <memory>
#include <string>

#include "bindings/common.h"
#include "bindings/peer_memory_bindings.h"
#include "transport/peer_memory.h"
#include "transport/registered_memory.h"
#ifdef HYBRID_EP_WITH_NVSHMEM
#include "bindings/nvshmem_bindings.h"
#endif

namespace py = pybind11;
using namespace hybrid_ep;

namespace {

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
  // The host's address of the record (its first word is the phase, 0 while no kernel
  // failed): the engine polls that word per call without a call into this module.
  uint64_t host_ptr() const { return reinterpret_cast<uint64_t>(host_); }
  uint64_t device_ptr() const { return device_; }
  void clear() { std::memset(host_, 0, sizeof(ErrorRecord)); }
  py::object read() const { return bindings::error_record_dict(host_); }

 private:
  ErrorRecord* host_ = nullptr;
  uint64_t device_ = 0;
};

// The device's peer memory calls (transport/peer_memory.h), for bind_peer_memory.
struct DevicePeerMemory {
  static constexpr auto granularity = &peer_memory::granularity;
  static constexpr auto reserve = &peer_memory::reserve;
  static constexpr auto free_reservation = &peer_memory::free_reservation;
  static constexpr auto create = &peer_memory::create;
  static constexpr auto import_fd = &peer_memory::import_fd;
  static constexpr auto export_fabric = &peer_memory::export_fabric;
  static constexpr auto import_fabric = &peer_memory::import_fabric;
  static constexpr auto map = &peer_memory::map;
  static constexpr auto unmap = &peer_memory::unmap;
  static constexpr auto release = &peer_memory::release;
};

// (multiprocessors, shared memory per block with opt-in): what the launch plan needs.
py::tuple device_properties(int device) {
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, device) != cudaSuccess)
    throw std::runtime_error("hybrid_ep: cudaGetDeviceProperties failed");
  return py::make_tuple(prop.multiProcessorCount, static_cast<int64_t>(prop.sharedMemPerBlockOptin));
}

// A launch's ranks past the inline ones (the single-GPU emulation past 16 ranks): a block of the
// CUDA runtime's stream-ordered allocator on the launch's stream, per launch, copied on that
// stream (from pageable memory: the copy has read the source when it returns) and freed on that
// stream after the kernel (cudaFreeAsync once it is queued): it lives exactly as long as the
// launch in stream order, and a launch on another stream never shares it. A graph would replay
// the copy from host memory it does not own, so a capture is refused by name.
std::shared_ptr<void> copy_on_device(const void* src, size_t bytes, uint64_t stream_id) {
  const auto stream = reinterpret_cast<cudaStream_t>(stream_id);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  const cudaError_t asked = cudaStreamIsCapturing(stream, &capture);
  if (asked != cudaSuccess || capture != cudaStreamCaptureStatusNone)
    throw std::runtime_error(
        "hybrid_ep: a launch of more than " + std::to_string(kInlineLaunchRanks) +
        " ranks (the single-GPU emulation of a larger group) cannot be captured in a CUDA graph: the ranks past " +
        std::to_string(kInlineLaunchRanks) +
        " are copied to device memory at each launch, which a graph would not repeat; run it outside the capture, "
        "or capture an emulation of at most " +
        std::to_string(kInlineLaunchRanks) + " ranks" +
        (asked != cudaSuccess ? std::string(" (cudaStreamIsCapturing: ") + cudaGetErrorString(asked) + ")" : ""));
  void* block = nullptr;
  if (cudaMallocAsync(&block, bytes, stream) != cudaSuccess)
    throw std::runtime_error("hybrid_ep: cudaMallocAsync of a launch's ranks past the inline ones failed");
  std::shared_ptr<void> owned(block, [stream](void* p) { cudaFreeAsync(p, stream); });
  if (cudaMemcpyAsync(block, src, bytes, cudaMemcpyHostToDevice, stream) != cudaSuccess)
    throw std::runtime_error("hybrid_ep: the copy of a launch's ranks past the inline ones failed");
  return owned;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hybrid-ep CUDA kernels and NVLink transport";
  bindings::more_ranks_copy() = bindings::MoreRanksCopy{&copy_on_device};
  bindings::bind_common(m);
  m.attr("IS_MODEL") = false;
  m.def("device_properties", &device_properties);
  m.def(
      "note_launch_tensors", [](const std::vector<std::pair<uint64_t, uint64_t>>&) {},
      "no-op on the GPU (the CPU model checks bulk copies against these; compute-sanitizer does it here)");

  py::class_<ErrorRecordHost>(m, "ErrorRecord", py::module_local())
      .def(py::init<>())
      .def_property_readonly("device_ptr", &ErrorRecordHost::device_ptr)
      .def_property_readonly("host_ptr", &ErrorRecordHost::host_ptr)
      .def("read", &ErrorRecordHost::read)
      .def("clear", &ErrorRecordHost::clear);

  m.def("fabric_supported", &fabric_supported);
  m.def("fabric_probe", &fabric_probe);
  m.def("allocate_registered", [](size_t bytes, int kind, int device) {
    Allocation a = allocate_registered(bytes, static_cast<HandleKind>(kind), device);
    return py::make_tuple(a.ptr, a.bytes, py::bytes(a.handle));
  });
  m.def("free_registered",
        [](uint64_t ptr, size_t bytes, int kind) { free_registered(ptr, bytes, static_cast<HandleKind>(kind)); });
  m.def("open_peer", [](py::bytes handle, size_t bytes, int kind, int device) {
    return open_peer(std::string(handle), bytes, static_cast<HandleKind>(kind), device);
  });
  m.def("close_peer",
        [](uint64_t ptr, size_t bytes, int kind) { close_peer(ptr, bytes, static_cast<HandleKind>(kind)); });
  bindings::bind_peer_memory<DevicePeerMemory>(m);

  // The inter-node transport: built only where setup.py found NVSHMEM.
#ifdef HYBRID_EP_WITH_NVSHMEM
  m.def("has_nvshmem", [] { return true; });
  bindings::bind_nvshmem(m);
#else
  m.def("has_nvshmem", [] { return false; });
#endif
}
