#include "transport/peer_memory.h"

#include <cuda.h>
#include <cuda_runtime.h>

#include <cstring>

#include "transport/driver.h"

namespace hybrid_ep::peer_memory {
namespace {

using driver::check;

CUmemAllocationProp chunk_prop(int device) {
  return driver::device_memory(device, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
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

std::pair<uint64_t, int> create(size_t bytes, int device) {
  check(cudaSetDevice(device), "cudaSetDevice");
  const driver::Driver& d = driver::get();
  CUmemAllocationProp prop = chunk_prop(device);
  CUmemGenericAllocationHandle handle;
  check(d.create(&handle, bytes, &prop, 0), "cuMemCreate (peer memory)");
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
