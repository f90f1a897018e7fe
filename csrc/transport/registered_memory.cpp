#include "transport/registered_memory.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>

namespace hybrid_ep {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) throw std::runtime_error(std::string("hybrid_ep: ") + what + ": " + cudaGetErrorString(err));
}

void check(CUresult res, const char* what) {
  if (res != CUDA_SUCCESS)
    throw std::runtime_error(std::string("hybrid_ep: ") + what + " failed (CUresult " +
                             std::to_string(static_cast<int>(res)) + ")");
}

// Driver functions used by the fabric path, resolved once through the runtime.
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

const Driver& driver() {
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

CUmemAllocationProp fabric_prop(int device) {
  CUmemAllocationProp prop;
  std::memset(&prop, 0, sizeof(prop));
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_FABRIC;
  return prop;
}

size_t fabric_size(size_t bytes, int device) {
  CUmemAllocationProp prop = fabric_prop(device);
  size_t gran = 0;
  check(driver().granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
  return (bytes + gran - 1) / gran * gran;
}

uint64_t map_handle(CUmemGenericAllocationHandle handle, size_t bytes, int device) {
  CUdeviceptr ptr = 0;
  check(driver().reserve(&ptr, bytes, 0, 0, 0), "cuMemAddressReserve");
  check(driver().map(ptr, bytes, 0, handle, 0), "cuMemMap");
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(driver().set_access(ptr, bytes, &access, 1), "cuMemSetAccess");
  return static_cast<uint64_t>(ptr);
}

void unmap(uint64_t ptr, size_t bytes) {
  CUmemGenericAllocationHandle handle;
  check(driver().retain(&handle, reinterpret_cast<void*>(ptr)), "cuMemRetainAllocationHandle");
  check(driver().unmap(static_cast<CUdeviceptr>(ptr), bytes), "cuMemUnmap");
  check(driver().address_free(static_cast<CUdeviceptr>(ptr), bytes), "cuMemAddressFree");
  check(driver().release(handle), "cuMemRelease");  // the retain above
  check(driver().release(handle), "cuMemRelease");  // the create / import
}

}  // namespace

bool fabric_supported(int device) {
  int value = 0;
  try {
    if (driver().device_get_attribute(&value, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, device) != CUDA_SUCCESS)
      return false;
  } catch (const std::runtime_error&) { return false; }
  return value != 0;
}

std::string fabric_probe(int device) {
  if (!fabric_supported(device)) return "the device does not report fabric handle support";
  auto failed = [](const char* what, CUresult res) {
    std::string why = std::string(what) + " failed (CUresult " + std::to_string(static_cast<int>(res)) + ")";
    if (res == CUDA_ERROR_NOT_PERMITTED) why += ": no IMEX channel is open to this process";
    return why;
  };
  try {
    check(cudaSetDevice(device), "cudaSetDevice");
    const Driver& d = driver();
    CUmemAllocationProp prop = fabric_prop(device);
    size_t gran = 0;
    CUresult res = d.granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (res != CUDA_SUCCESS) return failed("cuMemGetAllocationGranularity (fabric)", res);
    CUmemGenericAllocationHandle handle;
    res = d.create(&handle, gran, &prop, 0);
    if (res != CUDA_SUCCESS) return failed("cuMemCreate (fabric)", res);
    CUmemFabricHandle fh;
    res = d.export_handle(&fh, handle, CU_MEM_HANDLE_TYPE_FABRIC, 0);
    d.release(handle);
    if (res != CUDA_SUCCESS) return failed("cuMemExportToShareableHandle (fabric)", res);
  } catch (const std::exception& e) { return e.what(); }
  return "";
}

Allocation allocate_registered(size_t bytes, HandleKind kind, int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  Allocation out;
  if (kind == HandleKind::kIpc) {
    void* p = nullptr;
    check(cudaMalloc(&p, bytes), "cudaMalloc of the registered buffer");
    check(cudaMemset(p, 0, bytes), "cudaMemset of the registered buffer");
    cudaIpcMemHandle_t h;
    check(cudaIpcGetMemHandle(&h, p), "cudaIpcGetMemHandle");
    out.ptr = reinterpret_cast<uint64_t>(p);
    out.bytes = bytes;
    out.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    return out;
  }
  const size_t size = fabric_size(bytes, device);
  CUmemAllocationProp prop = fabric_prop(device);
  CUmemGenericAllocationHandle handle;
  check(driver().create(&handle, size, &prop, 0), "cuMemCreate (fabric)");
  out.ptr = map_handle(handle, size, device);
  out.bytes = size;
  check(cudaMemset(reinterpret_cast<void*>(out.ptr), 0, size), "cudaMemset of the registered buffer");
  CUmemFabricHandle fh;
  check(driver().export_handle(&fh, handle, CU_MEM_HANDLE_TYPE_FABRIC, 0), "cuMemExportToShareableHandle");
  out.handle.assign(reinterpret_cast<const char*>(&fh), sizeof(fh));
  return out;
}

void free_registered(uint64_t ptr, size_t bytes, HandleKind kind) {
  if (kind == HandleKind::kIpc) {
    check(cudaFree(reinterpret_cast<void*>(ptr)), "cudaFree of the registered buffer");
    return;
  }
  unmap(ptr, bytes);
}

uint64_t open_peer(const std::string& handle, size_t bytes, HandleKind kind, int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  if (kind == HandleKind::kIpc) {
    if (handle.size() != sizeof(cudaIpcMemHandle_t)) throw std::invalid_argument("hybrid_ep: bad CUDA IPC handle size");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof(h));
    void* p = nullptr;
    check(cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess), "cudaIpcOpenMemHandle");
    return reinterpret_cast<uint64_t>(p);
  }
  if (handle.size() != sizeof(CUmemFabricHandle)) throw std::invalid_argument("hybrid_ep: bad fabric handle size");
  CUmemFabricHandle fh;
  std::memcpy(&fh, handle.data(), sizeof(fh));
  CUmemGenericAllocationHandle h;
  check(driver().import_handle(&h, &fh, CU_MEM_HANDLE_TYPE_FABRIC), "cuMemImportFromShareableHandle");
  return map_handle(h, bytes, device);
}

void close_peer(uint64_t ptr, size_t bytes, HandleKind kind) {
  if (kind == HandleKind::kIpc) {
    check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle");
    return;
  }
  unmap(ptr, bytes);
}

}  // namespace hybrid_ep
