// Memory of the CPU model that another process opens by a handle, as the driver's shareable
// handles (CUDA IPC, fabric) open device memory: a memfd named with a random part, and a handle of
// 64 opaque bytes that names its owner's process, the owner's descriptor and that name. An
// importer opens /proc/<pid>/fd/<fd> and checks the name, so a handle of memory its owner
// released, or of an owner that exited, is refused as the driver refuses a stale handle. Nothing
// touches the file system. Registered buffers (model_module.cpp) and peer memory's fabric
// handles (model_peer_memory.h) use it, each with its own magic and name.
#pragma once
#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>
#include <string>

namespace hybrid_ep::bindings::memfd {

// The stand-in of a shareable handle: 64 bytes.
struct Handle {
  char magic[8];
  uint64_t pid;
  uint64_t fd;
  char name[32];  // the memfd's random part, hex
  char unused[8];
};
static_assert(sizeof(Handle) == 64, "a shareable handle's stand-in is 64 bytes");

inline std::runtime_error failed(const std::string& what) {
  return std::runtime_error("hybrid_ep: " + what + ": " + std::strerror(errno));
}

inline std::string random_hex() {
  static std::mutex m;
  static std::random_device source;
  std::lock_guard<std::mutex> guard(m);
  static const char digits[] = "0123456789abcdef";
  std::string out(sizeof(Handle::name), '0');
  for (char& c : out) c = digits[source() % 16];
  return out;
}

// The name the memfd behind `fd` was made with ("" where it is not a memfd).
inline std::string name(int fd) {
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

// A memfd of `bytes` named `prefix` + a random part (what: the caller's words for errors).
inline int create(const std::string& prefix, size_t bytes, const std::string& what) {
  const std::string full = prefix + random_hex();
  const int fd = static_cast<int>(memfd_create(full.c_str(), MFD_CLOEXEC));
  if (fd < 0) throw failed(what + ": memfd_create");
  if (ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    throw failed(what + ": ftruncate");
  }
  return fd;
}

// The handle of this process's memfd `fd`, made by create with `prefix`; "" where it was not.
inline std::string handle(int fd, const char (&magic)[8], const std::string& prefix) {
  const std::string made = name(fd);
  if (made.rfind(prefix, 0) != 0 || made.size() != prefix.size() + sizeof(Handle::name)) return "";
  Handle h;
  std::memset(&h, 0, sizeof(h));
  std::memcpy(h.magic, magic, sizeof(h.magic));
  h.pid = static_cast<uint64_t>(getpid());
  h.fd = static_cast<uint64_t>(fd);
  std::memcpy(h.name, made.data() + prefix.size(), sizeof(h.name));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

// A descriptor of the memfd `bytes` names (the caller's to close), refused as the driver refuses
// a handle it cannot open: not one of these handles, or its owner released it or exited. what:
// the driver's call the caller stands in for, for errors.
inline int open(const std::string& bytes, const char (&magic)[8], const std::string& prefix, const std::string& what) {
  Handle h;
  if (bytes.size() != sizeof(h))
    throw std::invalid_argument("hybrid_ep: " + what + ": a handle is 64 bytes, got " + std::to_string(bytes.size()));
  std::memcpy(&h, bytes.data(), sizeof(h));
  if (std::memcmp(h.magic, magic, sizeof(h.magic)) != 0)
    throw std::invalid_argument("hybrid_ep: " + what + ": not a handle of this kind of the CPU model");
  const std::string path = "/proc/" + std::to_string(h.pid) + "/fd/" + std::to_string(h.fd);
  const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) throw failed(what + ": the memory's owner no longer holds it");
  if (name(fd) != prefix + std::string(h.name, sizeof(h.name))) {
    close(fd);
    throw std::runtime_error("hybrid_ep: " + what + ": the memory's owner released it");
  }
  return fd;
}

// Bytes of the memfd behind `fd` (what: for errors).
inline size_t size(int fd, const std::string& what) {
  const off_t end = lseek(fd, 0, SEEK_END);
  if (end < 0) throw failed(what + ": lseek");
  return static_cast<size_t>(end);
}

}  // namespace hybrid_ep::bindings::memfd
