#include "transport/registered_memory.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <functional>
#include <iterator>
#include <stdexcept>
#include <utility>

#include "transport/driver.h"

namespace hybrid_ep {
namespace {

using driver::check;
const driver::Driver& drv() { return driver::get(); }

CUmemAllocationProp fabric_prop(int device) { return driver::device_memory(device, CU_MEM_HANDLE_TYPE_FABRIC); }

size_t fabric_size(size_t bytes, int device) {
  CUmemAllocationProp prop = fabric_prop(device);
  size_t gran = 0;
  check(drv().granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED), "cuMemGetAllocationGranularity");
  return (bytes + gran - 1) / gran * gran;
}

// Undoes a step when a later one throws: every failure path releases what the steps before it
// made (an allocation, a handle, an address range, a mapping), so a failed setup leaks nothing.
class Undo {
 public:
  explicit Undo(std::function<void()> undo) : undo_(std::move(undo)) {}
  Undo(const Undo&) = delete;
  Undo& operator=(const Undo&) = delete;
  ~Undo() {
    if (undo_) undo_();
  }
  void keep() { undo_ = nullptr; }

 private:
  std::function<void()> undo_;
};

// `handle` mapped read-write for `device` at a new address range; on failure the range is
// freed (the handle stays the caller's).
uint64_t map_handle(CUmemGenericAllocationHandle handle, size_t bytes, int device) {
  CUdeviceptr ptr = 0;
  check(drv().reserve(&ptr, bytes, 0, 0, 0), "cuMemAddressReserve");
  Undo reserved([&] { drv().address_free(ptr, bytes); });
  check(drv().map(ptr, bytes, 0, handle, 0), "cuMemMap");
  Undo mapped([&] { drv().unmap(ptr, bytes); });
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  check(drv().set_access(ptr, bytes, &access, 1), "cuMemSetAccess");
  mapped.keep();
  reserved.keep();
  return static_cast<uint64_t>(ptr);
}

// Unmaps, frees the range and releases the allocation behind it: every step runs even when one
// fails (a step skipped would leak what it releases), then the first failure is raised.
void unmap(uint64_t ptr, size_t bytes) {
  CUmemGenericAllocationHandle handle;
  check(drv().retain(&handle, reinterpret_cast<void*>(ptr)), "cuMemRetainAllocationHandle");
  const CUresult results[] = {drv().unmap(static_cast<CUdeviceptr>(ptr), bytes),
                              drv().address_free(static_cast<CUdeviceptr>(ptr), bytes),
                              drv().release(handle),   // the retain above
                              drv().release(handle)};  // the create / import
  const char* steps[] = {"cuMemUnmap", "cuMemAddressFree", "cuMemRelease", "cuMemRelease"};
  for (size_t i = 0; i < std::size(results); ++i) check(results[i], steps[i]);
}

}  // namespace

bool fabric_supported(int device) {
  int value = 0;
  try {
    if (drv().device_get_attribute(&value, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED, device) != CUDA_SUCCESS)
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
    const driver::Driver& d = drv();
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
    Undo allocated([p] { cudaFree(p); });
    check(cudaMemset(p, 0, bytes), "cudaMemset of the registered buffer");
    cudaIpcMemHandle_t h;
    check(cudaIpcGetMemHandle(&h, p), "cudaIpcGetMemHandle");
    allocated.keep();
    out.ptr = reinterpret_cast<uint64_t>(p);
    out.bytes = bytes;
    out.handle.assign(reinterpret_cast<const char*>(&h), sizeof(h));
    return out;
  }
  const size_t size = fabric_size(bytes, device);
  CUmemAllocationProp prop = fabric_prop(device);
  CUmemGenericAllocationHandle handle;
  check(drv().create(&handle, size, &prop, 0), "cuMemCreate (fabric)");
  Undo created([&] { drv().release(handle); });
  out.ptr = map_handle(handle, size, device);
  Undo mapped([&] {
    drv().unmap(static_cast<CUdeviceptr>(out.ptr), size);
    drv().address_free(static_cast<CUdeviceptr>(out.ptr), size);
  });
  out.bytes = size;
  check(cudaMemset(reinterpret_cast<void*>(out.ptr), 0, size), "cudaMemset of the registered buffer");
  CUmemFabricHandle fh;
  check(drv().export_handle(&fh, handle, CU_MEM_HANDLE_TYPE_FABRIC, 0), "cuMemExportToShareableHandle");
  out.handle.assign(reinterpret_cast<const char*>(&fh), sizeof(fh));
  mapped.keep();
  created.keep();
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
  check(drv().import_handle(&h, &fh, CU_MEM_HANDLE_TYPE_FABRIC), "cuMemImportFromShareableHandle");
  Undo imported([&] { drv().release(h); });
  const uint64_t ptr = map_handle(h, bytes, device);
  imported.keep();
  return ptr;
}

void close_peer(uint64_t ptr, size_t bytes, HandleKind kind) {
  if (kind == HandleKind::kIpc) {
    check(cudaIpcCloseMemHandle(reinterpret_cast<void*>(ptr)), "cudaIpcCloseMemHandle");
    return;
  }
  unmap(ptr, bytes);
}

}  // namespace hybrid_ep
