// The CUDA driver's virtual-memory entry points, resolved once through the runtime, so the
// extension does not link libcuda and imports on machines without a GPU; and the error checks
// both users share (registered_memory.cpp: fabric handles; peer_memory.cpp: growable
// peer-mapped memory).
#pragma once
#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

namespace hybrid_ep::driver {

inline void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("hybrid_ep: ") + what + ": " + cudaGetErrorString(err));
}

inline void check(CUresult res, const char* what) {
  if (res != CUDA_SUCCESS)
    throw std::runtime_error(std::string("hybrid_ep: ") + what + " failed (CUresult " +
                             std::to_string(static_cast<int>(res)) + ")");
}

struct Driver {
  decltype(&cuDeviceGetAttribute) device_get_attribute = nullptr;
  decltype(&cuMemGetAllocationGranularity) granularity = nullptr;
  decltype(&cuMemCreate) create = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemAddressReserve) reserve = nullptr;
  decltype(&cuMemAddressFree) address_free = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemExportToShareableHandle) export_handle = nullptr;
  decltype(&cuMemImportFromShareableHandle) import_handle = nullptr;
  decltype(&cuMemRetainAllocationHandle) retain = nullptr;
};

template <typename F>
void resolve(const char* name, F& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult result;
  check(cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &result), name);
  if (result != cudaDriverEntryPointSuccess || p == nullptr)
    throw std::runtime_error(std::string("hybrid_ep: driver entry point ") + name + " is not available");
  fn = reinterpret_cast<F>(p);
}

// Pinned device memory on `device` that can be shared as `handle_type`.
inline CUmemAllocationProp device_memory(int device, CUmemAllocationHandleType handle_type) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = handle_type;
  return prop;
}

inline const Driver& get() {
  static const Driver d = [] {
    Driver x;
    resolve("cuDeviceGetAttribute", x.device_get_attribute);
    resolve("cuMemGetAllocationGranularity", x.granularity);
    resolve("cuMemCreate", x.create);
    resolve("cuMemRelease", x.release);
    resolve("cuMemAddressReserve", x.reserve);
    resolve("cuMemAddressFree", x.address_free);
    resolve("cuMemMap", x.map);
    resolve("cuMemUnmap", x.unmap);
    resolve("cuMemSetAccess", x.set_access);
    resolve("cuMemExportToShareableHandle", x.export_handle);
    resolve("cuMemImportFromShareableHandle", x.import_handle);
    resolve("cuMemRetainAllocationHandle", x.retain);
    return x;
  }();
  return d;
}

}  // namespace hybrid_ep::driver
