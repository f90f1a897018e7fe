// The NVSHMEM part of hybrid_ep._C: bootstrap, symmetric heap and the transport self-test.
// Only built where the build found NVSHMEM (HYBRID_EP_WITH_NVSHMEM).
#pragma once
#include <pybind11/pybind11.h>

namespace hybrid_ep::bindings {

void bind_nvshmem(pybind11::module_& m);

}  // namespace hybrid_ep::bindings
