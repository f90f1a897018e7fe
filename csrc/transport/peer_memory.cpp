#include "transport/peer_memory.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "transport/driver.h"

namespace hybrid_ep::peer_memory {
namespace {

using driver::check;

CUmemAllocationProp chunk_prop(int device, bool fabric = false) {
  const auto types = static_cast<CUmemAllocationHandleType>(CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR |
                                                            (fabric ? CU_MEM_HANDLE_TYPE_FABRIC : 0));
  return driver::device_memory(device, types);
}

// check(), with the likely cause of a refused fabric handle named.
void check_fabric(CUresult res, const char* what) {
  if (res == CUDA_ERROR_NOT_PERMITTED)
    throw std::runtime_error(std::string("hybrid_ep: ") + what + " failed (CUresult " +
                             std::to_string(static_cast<int>(res)) + "): no IMEX channel is open to this process");
  check(res, what);
}

}  // namespace

size_t granularity(int device) {
  CUmemAllocationProp prop = chunk_prop(device);
  size_t gran = 0;
  check(driver::get().granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
        "cuMemGetAllocationGranularity (peer memory)");
  return gran;
}

uint64_t reserve(size_t bytes) {
  CUdeviceptr va = 0;
  check(driver::get().reserve(&va, bytes, 0, 0, 0), "cuMemAddressReserve (peer memory)");
  return static_cast<uint64_t>(va);
}

void free_reservation(uint64_t va, size_t bytes) {
  check(driver::get().address_free(static_cast<CUdeviceptr>(va), bytes), "cuMemAddressFree (peer memory)");
}

std::pair<uint64_t, int> create(size_t bytes, int device, bool fabric) {
  check(cudaSetDevice(device), "cudaSetDevice");
  const driver::Driver& d = driver::get();
  CUmemAllocationProp prop = chunk_prop(device, fabric);
  CUmemGenericAllocationHandle handle;
  if (fabric) check_fabric(d.create(&handle, bytes, &prop, 0), "cuMemCreate (peer memory, fabric)");
  else check(d.create(&handle, bytes, &prop, 0), "cuMemCreate (peer memory)");
  int fd = -1;
  const CUresult res = d.export_handle(&fd, handle, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
  if (res != CUDA_SUCCESS) {
    d.release(handle);
    check(res, "cuMemExportToShareableHandle (peer memory, POSIX file descriptor)");
  }
  return {static_cast<uint64_t>(handle), fd};
}

uint64_t import_fd(int fd, int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  CUmemGenericAllocationHandle handle;
  check(driver::get().import_handle(&handle, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR),
        "cuMemImportFromShareableHandle (peer memory)");
  return static_cast<uint64_t>(handle);
}

std::string export_fabric(uint64_t handle) {
  CUmemFabricHandle fh;
  check_fabric(
      driver::get().export_handle(&fh, static_cast<CUmemGenericAllocationHandle>(handle), CU_MEM_HANDLE_TYPE_FABRIC, 0),
      "cuMemExportToShareableHandle (peer memory, fabric)");
  return std::string(reinterpret_cast<const char*>(&fh), sizeof(fh));
}

uint64_t import_fabric(const std::string& fabric_handle, int device) {
  if (fabric_handle.size() != sizeof(CUmemFabricHandle))
    throw std::invalid_argument("hybrid_ep: peer memory: a fabric handle is " +
                                std::to_string(sizeof(CUmemFabricHandle)) + " bytes, got " +
                                std::to_string(fabric_handle.size()));
  check(cudaSetDevice(device), "cudaSetDevice");
  CUmemFabricHandle fh;
  std::memcpy(&fh, fabric_handle.data(), sizeof(fh));
  CUmemGenericAllocationHandle handle;
  check_fabric(driver::get().import_handle(&handle, &fh, CU_MEM_HANDLE_TYPE_FABRIC),
               "cuMemImportFromShareableHandle (peer memory, fabric)");
  return static_cast<uint64_t>(handle);
}

void map(uint64_t va, size_t bytes, uint64_t handle, int device) {
  const driver::Driver& d = driver::get();
  check(d.map(static_cast<CUdeviceptr>(va), bytes, 0, static_cast<CUmemGenericAllocationHandle>(handle), 0),
        "cuMemMap (peer memory)");
  CUmemAccessDesc access;
  std::memset(&access, 0, sizeof(access));
  access.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  access.location.id = device;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  const CUresult res = d.set_access(static_cast<CUdeviceptr>(va), bytes, &access, 1);
  if (res != CUDA_SUCCESS) {
    d.unmap(static_cast<CUdeviceptr>(va), bytes);
    check(res, "cuMemSetAccess (peer memory)");
  }
}

void unmap(uint64_t va, size_t bytes) {
  check(driver::get().unmap(static_cast<CUdeviceptr>(va), bytes), "cuMemUnmap (peer memory)");
}

void release(uint64_t handle) {
  check(driver::get().release(static_cast<CUmemGenericAllocationHandle>(handle)), "cuMemRelease (peer memory)");
}

}  // namespace hybrid_ep::peer_memory
