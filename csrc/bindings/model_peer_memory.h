// Peer memory on the CPU model (the calls of transport/peer_memory.h): a chunk is a memfd, a
// reservation an inaccessible anonymous mapping, and mapping a chunk maps the memfd shared at a
// fixed address inside it, so every process (or virtual rank) that maps a chunk sees the same
// bytes at its own address. The file descriptor a chunk is exported as is a dup of the memfd;
// nothing touches the file system. The mapped part of each reservation is one allocation of the
// model (model::add_allocation), so the kernels' bulk copies may cross chunk boundaries.
//
// A fabric handle's stand-in is 64 opaque bytes, not a file descriptor, as the device's is: they
// name the owner's memfd as the owner holds it (process id, descriptor, and the random name the
// memfd was made with), and an importer opens it through /proc/<pid>/fd, checking the name, so a
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
#include <random>
#include <stdexcept>
#include <string>
#include <utility>

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
    const std::string name = fabric ? std::string(kFabricName) + random_hex() : std::string("hybrid_ep_peer_chunk");
    const int fd = static_cast<int>(memfd_create(name.c_str(), MFD_CLOEXEC));
    if (fd < 0) throw failed("memfd_create");
    if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      close(fd);
      throw failed("ftruncate");
    }
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
    const std::string name = memfd_name(static_cast<int>(handle));
    if (name.rfind(kFabricName, 0) != 0)
      throw std::runtime_error(
          "hybrid_ep: peer memory: cuMemExportToShareableHandle (fabric): the chunk was not made "
          "for fabric handles");
    FabricStandIn h;
    std::memset(&h, 0, sizeof(h));
    std::memcpy(h.magic, kMagic, sizeof(h.magic));
    h.pid = static_cast<uint64_t>(getpid());
    h.fd = handle;
    std::memcpy(h.name, name.data() + std::strlen(kFabricName), sizeof(h.name));
    return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
  }

  static uint64_t import_fabric(const std::string& fabric_handle, int /*device*/) {
    FabricStandIn h;
    if (fabric_handle.size() != sizeof(h))
      throw std::invalid_argument("hybrid_ep: peer memory: a fabric handle is 64 bytes, got " +
                                  std::to_string(fabric_handle.size()));
    std::memcpy(&h, fabric_handle.data(), sizeof(h));
    if (std::memcmp(h.magic, kMagic, sizeof(h.magic)) != 0)
      throw std::invalid_argument("hybrid_ep: peer memory: not a fabric handle of the CPU model");
    const std::string path = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.fd);
    const int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) throw failed("cuMemImportFromShareableHandle (fabric): the chunk's owner no longer holds it");
    const std::string want = std::string(kFabricName) + std::string(h.name, sizeof(h.name));
    if (memfd_name(fd) != want) {
      close(fd);
      throw std::runtime_error(
          "hybrid_ep: peer memory: cuMemImportFromShareableHandle (fabric): the chunk's owner "
          "released it");
    }
    return static_cast<uint64_t>(fd);
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
  static constexpr char kMagic[8] = {'h', 'e', 'p', 'f', 'a', 'b', 'r', '1'};

  // The stand-in of a CUmemFabricHandle: 64 bytes.
  struct FabricStandIn {
    char magic[8];
    uint64_t pid;
    uint64_t fd;
    char name[32];  // the memfd's random part, hex
    char unused[8];
  };
  static_assert(sizeof(FabricStandIn) == 64, "a fabric handle is 64 bytes");

  static std::string random_hex() {
    static std::mutex m;
    static std::random_device source;
    std::lock_guard<std::mutex> guard(m);
    static const char digits[] = "0123456789abcdef";
    std::string out(32, '0');
    for (char& c : out) c = digits[source() % 16];
    return out;
  }

  // The name the memfd behind `fd` was made with ("" where it is not a memfd).
  static std::string memfd_name(int fd) {
    char link[512];
    const std::string path = "/proc/self/fd/" + std::to_string(fd);
    const ssize_t n = readlink(path.c_str(), link, sizeof(link) - 1);
    if (n <= 0) return "";
    std::string target(link, static_cast<size_t>(n));
    const std::string prefix = "/memfd:", suffix = " (deleted)";
    if (target.rfind(prefix, 0) != 0) return "";
    target = target.substr(prefix.size());
    if (target.size() >= suffix.size() && target.compare(target.size() - suffix.size(), suffix.size(), suffix) == 0)
      target.resize(target.size() - suffix.size());
    return target;
  }

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
