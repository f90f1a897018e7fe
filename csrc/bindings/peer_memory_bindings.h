// The peer memory calls of hybrid_ep._C and hybrid_ep._model under the same names
// (transport/peer_memory.h, the device; bindings/model_peer_memory.h, the CPU model), so the
// protocol in hybrid_ep/backends/cuda/peer_memory.py drives either.
#pragma once
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <string>

namespace hybrid_ep::bindings {

namespace py = pybind11;

// Backend: a struct whose static members are the calls of transport/peer_memory.h.
template <typename Backend>
void bind_peer_memory(py::module_& m) {
  m.def("peer_granularity", Backend::granularity, py::arg("device"),
        "bytes every chunk and mapping of peer memory is a multiple of");
  m.def("peer_reserve", Backend::reserve, py::arg("nbytes"), "a range of virtual addresses, no memory behind it");
  // Mapping and unmapping without the GIL: the CPU model's wait for its lock (its allocations),
  // which a launch on another thread holds while it runs (csrc/device/model/runtime.h, threads).
  using WithoutGil = py::call_guard<py::gil_scoped_release>;
  m.def("peer_free_reservation", Backend::free_reservation, py::arg("va"), py::arg("nbytes"), WithoutGil());
  m.def("peer_create", Backend::create, py::arg("nbytes"), py::arg("device"), py::arg("fabric") = false,
        "a new chunk: (handle, a file descriptor sharing it, the caller's to close); fabric: also exportable "
        "as a fabric handle");
  m.def("peer_import", Backend::import_fd, py::arg("fd"), py::arg("device"),
        "a peer's chunk from its file descriptor (which stays the caller's to close): its handle");
  m.def(
      "peer_export_fabric", [](uint64_t handle) { return py::bytes(Backend::export_fabric(handle)); },
      py::arg("handle"), "a chunk made with fabric=True as a fabric handle: 64 opaque bytes, no file descriptor");
  m.def(
      "peer_import_fabric",
      [](const py::bytes& fabric_handle, int device) {
        return Backend::import_fabric(std::string(fabric_handle), device);
      },
      py::arg("fabric_handle"), py::arg("device"), "a peer's chunk from the fabric handle it published: its handle");
  m.def("peer_map", Backend::map, py::arg("va"), py::arg("nbytes"), py::arg("handle"), py::arg("device"), WithoutGil());
  m.def("peer_unmap", Backend::unmap, py::arg("va"), py::arg("nbytes"), WithoutGil());
  m.def("peer_release", Backend::release, py::arg("handle"));
}

}  // namespace hybrid_ep::bindings
