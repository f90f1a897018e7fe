// Peer memory on the CPU model (the calls of transport/peer_memory.h): a chunk is a memfd, a
// reservation an inaccessible anonymous mapping, and mapping a chunk maps the memfd shared at a
// fixed address inside it, so every process (or virtual rank) that maps a chunk sees the same
// bytes at its own address. The file descriptor a chunk is exported as is a dup of the memfd;
// nothing touches the file system. The mapped part of each reservation is one allocation of the
// model (model::add_allocation), so the kernels' bulk copies may cross chunk boundaries.
//
// A fabric handle's stand-in is 64 opaque bytes, not a file descriptor, as the device's is
// (model_memfd.h: it names the owner's memfd, and an importer opens it checking the name), so a
// handle of a chunk its owner released, or of an owner that exited, is refused as the driver
// refuses a fabric handle it cannot import. Only a chunk made with fabric = true exports one.
#pragma once
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <stdexcept>
#include <string>
#include <utility>

#include "bindings/model_memfd.h"
#include "device/model/runtime.h"

namespace hybrid_ep::bindings {

struct ModelPeerMemory {
  static constexpr size_t kGranularity = 64 * 1024;

  static std::runtime_error failed(const char* what) {
    return std::runtime_error(std::string("hybrid_ep: peer memory: ") + what + ": " + std::strerror(errno));
  }

  static size_t granularity(int /*device*/) { return kGranularity; }

  static uint64_t reserve(size_t bytes) {
    void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) throw failed("mmap (reservation)");
    return reinterpret_cast<uint64_t>(p);
  }

  static void free_reservation(uint64_t va, size_t bytes) {
    forget(va, bytes);
    if (munmap(reinterpret_cast<void*>(va), bytes) != 0) throw failed("munmap (reservation)");
  }

  static std::pair<uint64_t, int> create(size_t bytes, int /*device*/, bool fabric) {
    const int fd =
        fabric ? memfd::create(kFabricName, bytes, "peer memory") : memfd::create(kChunkName, bytes, "peer memory");
    const int shared = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (shared < 0) {
      close(fd);
      throw failed("dup");
    }
    return {static_cast<uint64_t>(fd), shared};
  }

  static uint64_t import_fd(int fd, int /*device*/) {
    const int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
    if (own < 0) throw failed("dup (import)");
    return static_cast<uint64_t>(own);
  }

  static std::string export_fabric(uint64_t handle) {
    const std::string h = memfd::handle(static_cast<int>(handle), kMagic, kFabricName);
    if (h.empty())
      throw std::runtime_error(
          "hybrid_ep: peer memory: cuMemExportToShareableHandle (fabric): the chunk was not made "
          "for fabric handles");
    return h;
  }

  static uint64_t import_fabric(const std::string& fabric_handle, int /*device*/) {
    return static_cast<uint64_t>(
        memfd::open(fabric_handle, kMagic, kFabricName, "peer memory: cuMemImportFromShareableHandle (fabric)"));
  }

  static void map(uint64_t va, size_t bytes, uint64_t handle, int /*device*/) {
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
                   static_cast<int>(handle), 0);
    if (p == MAP_FAILED) throw failed("mmap (chunk)");
    note(va, bytes);
  }

  static void unmap(uint64_t va, size_t bytes) {
    forget(va, bytes);
    // Back to an inaccessible part of the reservation (the range stays reserved).
    void* p = mmap(reinterpret_cast<void*>(va), bytes, PROT_NONE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0);
    if (p == MAP_FAILED) throw failed("mmap (unmap)");
  }

  static void release(uint64_t handle) {
    if (close(static_cast<int>(handle)) != 0) throw failed("close (chunk)");
  }

 private:
  static constexpr const char* kFabricName = "hybrid_ep_peer_chunk.fabric.";
  static constexpr const char* kChunkName = "hybrid_ep_peer_chunk.";
  static constexpr char kMagic[8] = {'h', 'e', 'p', 'f', 'a', 'b', 'r', '1'};

  // Mapped ranges, merged where they touch: start -> bytes, each one model allocation.
  static std::map<uint64_t, uint64_t>& mapped() {
    static std::map<uint64_t, uint64_t> m;
    return m;
  }
  static std::mutex& lock() {
    static std::mutex m;
    return m;
  }

  static void note(uint64_t va, uint64_t bytes) {
    std::lock_guard<std::mutex> guard(lock());
    auto& m = mapped();
    uint64_t start = va, end = va + bytes;
    auto it = m.upper_bound(va);
    if (it != m.begin() && std::prev(it)->first + std::prev(it)->second == va) {
      --it;
      start = it->first;
      model::remove_allocation(it->first);
      it = m.erase(it);
    }
    if (it != m.end() && it->first == end) {
      end += it->second;
      model::remove_allocation(it->first);
      m.erase(it);
    }
    m[start] = end - start;
    model::add_allocation(start, end - start);
  }

  // [va, va + bytes) no longer mapped: the ranges around it stay allocations of their own.
  static void forget(uint64_t va, uint64_t bytes) {
    std::lock_guard<std::mutex> guard(lock());
    auto& m = mapped();
    const uint64_t lo = va, hi = va + bytes;
    auto it = m.upper_bound(lo);
    if (it != m.begin()) --it;
    while (it != m.end() && it->first < hi) {
      const uint64_t s = it->first, e = s + it->second;
      if (e <= lo) {
        ++it;
        continue;
      }
      model::remove_allocation(s);
      it = m.erase(it);
      if (s < lo) {
        m[s] = lo - s;
        model::add_allocation(s, lo - s);
      }
      if (e > hi) {
        m[hi] = e - hi;
        model::add_allocation(hi, e - hi);
      }
    }
  }
};

}  // namespace hybrid_ep::bindings
