// Growable peer-mapped memory, the device backend (hybrid_ep/backends/cuda/peer_memory.py
// holds the protocol: which chunk is mapped where and when). A rank reserves a range of
// virtual addresses for its own memory and one per node peer, creates physical chunks that
// it maps at the end of its own range and exports as POSIX file descriptors (passed to its
// peers on the same host over a Unix socket) and, where the NVLink domain spans hosts (GB200
// NVL72), as fabric handles (64 opaque bytes, published for peers on other hosts), and maps
// each peer's chunks at the same offset of its range for that peer. The CPU model has the same
// calls over memfd chunks and mmap (csrc/bindings/model_peer_memory.h), so one protocol runs
// on both.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>

namespace hybrid_ep::peer_memory {

// The size every chunk and mapping is a multiple of.
size_t granularity(int device);
// A range of virtual addresses with no memory behind it.
uint64_t reserve(size_t bytes);
void free_reservation(uint64_t va, size_t bytes);
// A new chunk of `bytes` on the device: (its handle, a POSIX file descriptor that shares it,
// owned by the caller). fabric: the chunk can also be exported as a fabric handle.
std::pair<uint64_t, int> create(size_t bytes, int device, bool fabric);
// A peer's chunk from the descriptor it sent (the descriptor stays the caller's to close).
uint64_t import_fd(int fd, int device);
// A chunk made with fabric = true as a fabric handle: 64 opaque bytes, no file descriptor, that
// a process on another host of the NVLink domain imports (the driver needs an IMEX channel).
std::string export_fabric(uint64_t handle);
// A peer's chunk from the fabric handle it published: its handle.
uint64_t import_fabric(const std::string& fabric_handle, int device);
// The chunk mapped at [va, va + bytes), readable and writable by the device.
void map(uint64_t va, size_t bytes, uint64_t handle, int device);
void unmap(uint64_t va, size_t bytes);
void release(uint64_t handle);

}  // namespace hybrid_ep::peer_memory
