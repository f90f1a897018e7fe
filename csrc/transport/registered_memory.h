// Registered buffers of the NVLink transport: allocated once per rank, zeroed, and opened
// by every peer of the node through a shareable handle.
//
// Two handle kinds: CUDA IPC (cudaMalloc memory, works on every NVLink/PCIe node) and fabric
// handles (cuMemCreate with CU_MEM_HANDLE_TYPE_FABRIC, needed across an NVLink domain that
// spans hosts, e.g. GB200 NVL72). Driver entry points are resolved at run time through the
// runtime API, so the extension does not link libcuda and imports on machines without a GPU.
//
// A call that fails releases what it made before it raised (an allocation, an imported handle,
// an address range, a mapping): a setup that fails on one rank leaks nothing there.
//
// Transport seam: kernels only see a table of peer base pointers. Ranks outside the NVLink
// domain need a put-with-signal transport (NVSHMEM/IBGDA, or the loopback of the single-GPU
// emulation) that fills the same receive-buffer layout.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace hybrid_ep {

enum class HandleKind : int { kIpc = 0, kFabric = 1 };

struct Allocation {
  uint64_t ptr;
  size_t bytes;        // rounded up to the allocation granularity (fabric)
  std::string handle;  // opaque bytes a peer passes to open_peer
};

bool fabric_supported(int device);
// "" when a fabric allocation can be created and exported here, else why not. The device
// attribute alone is not enough: without an IMEX channel cuMemCreate is refused.
std::string fabric_probe(int device);
Allocation allocate_registered(size_t bytes, HandleKind kind, int device);
void free_registered(uint64_t ptr, size_t bytes, HandleKind kind);
uint64_t open_peer(const std::string& handle, size_t bytes, HandleKind kind, int device);
void close_peer(uint64_t ptr, size_t bytes, HandleKind kind);

}  // namespace hybrid_ep
