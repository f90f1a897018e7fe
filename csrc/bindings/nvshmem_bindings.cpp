// The NVSHMEM part of hybrid_ep._C (see nvshmem_bindings.h). Names start with nvshmem_; the
// Python side is hybrid_ep/backends/cuda/nvshmem.py.
#include "bindings/nvshmem_bindings.h"

#include <pybind11/stl.h>

#include "transport/nvshmem_host.h"
#include "transport/nvshmem_selftest.h"

namespace hybrid_ep::bindings {

namespace py = pybind11;

void bind_nvshmem(py::module_& m) {
  namespace host = nvshmem_host;
  m.def("nvshmem_unique_id", [] { return py::bytes(host::unique_id()); });
  m.def("nvshmem_init", [](int rank, int nranks, py::bytes id) {
    std::string bytes(id);
    py::gil_scoped_release release;  // collective: blocks until every PE joined
    host::init(rank, nranks, bytes);
  });
  m.def("nvshmem_init_status", &host::init_status);
  m.def("nvshmem_my_pe", &host::my_pe);
  m.def("nvshmem_n_pes", &host::n_pes);
  m.def("nvshmem_malloc", &host::malloc, py::call_guard<py::gil_scoped_release>());
  m.def("nvshmem_free", &host::free, py::call_guard<py::gil_scoped_release>());
  m.def("nvshmem_barrier_all", &host::barrier_all, py::call_guard<py::gil_scoped_release>());
  m.def("nvshmem_finalize", &host::finalize, py::call_guard<py::gil_scoped_release>());

  m.def("nvshmem_selftest_region_bytes", &nvshmem_selftest::region_bytes);
  m.def("nvshmem_selftest_clear", &nvshmem_selftest::clear, py::call_guard<py::gil_scoped_release>());
  m.def("nvshmem_selftest", [](uint64_t region, const std::vector<int32_t>& pes, int rank, uint64_t bytes,
                               uint64_t call, uint64_t timeout_ns, uint64_t stream) {
    nvshmem_selftest::Result r;
    {
      py::gil_scoped_release release;
      r = nvshmem_selftest::run(region, pes, rank, bytes, call, timeout_ns, stream);
    }
    py::dict d;
    d["mismatches"] = r.mismatches;
    d["first_bad"] = r.first_bad;
    d["timed_out"] = r.timed_out != 0;
    d["signal_put"] = r.signal_put;
    d["signal_fenced"] = r.signal_fenced;
    d["signal_empty"] = r.signal_empty;
    return d;
  });
}

}  // namespace hybrid_ep::bindings
