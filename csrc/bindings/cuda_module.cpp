// hybrid_ep._C: the kernels on the GPU, the host-visible error record (mapped pinned memory)
// and the NVLink transport's registered memory.
#include <cuda_runtime.h>

#include <cstring>

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

// A launch's ranks past the inline ones: device memory, copied on the launch's stream (from
// pageable memory: the copy has read the source when it returns).
const bindings::RankStaging kDeviceRankStaging{
    [](size_t bytes) {
      void* p = nullptr;
      if (cudaMalloc(&p, bytes) != cudaSuccess)
        throw std::runtime_error("hybrid_ep: cudaMalloc of a launch's ranks past the inline ones failed");
      return std::shared_ptr<void>(p, [](void* q) { cudaFree(q); });
    },
    [](void* dst, const void* src, size_t bytes, uint64_t stream) {
      if (cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, reinterpret_cast<cudaStream_t>(stream)) !=
          cudaSuccess)
        throw std::runtime_error("hybrid_ep: the copy of a launch's ranks past the inline ones failed");
    }};

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "hybrid-ep CUDA kernels and NVLink transport";
  bindings::rank_staging() = kDeviceRankStaging;
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
