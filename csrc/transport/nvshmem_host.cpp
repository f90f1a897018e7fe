// Host side of the NVSHMEM transport (see nvshmem_host.h).
#include "transport/nvshmem_host.h"

#include <nvshmem_host.h>

#include <cstring>
#include <stdexcept>

namespace hybrid_ep::nvshmem_host {

namespace {

[[noreturn]] void fail(const char* call, int status) {
  throw std::runtime_error(std::string("hybrid_ep: ") + call + " failed with status " + std::to_string(status));
}

void require_initialized(const char* what) {
  if (init_status() < NVSHMEM_STATUS_IS_INITIALIZED)
    throw std::runtime_error(std::string("hybrid_ep: ") + what + " before NVSHMEM was initialised");
}

}  // namespace

std::string unique_id() {
  nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
  if (int status = nvshmemx_get_uniqueid(&id)) fail("nvshmemx_get_uniqueid", status);
  return std::string(reinterpret_cast<const char*>(&id), sizeof(id));
}

void init(int rank, int nranks, const std::string& id) {
  if (id.size() != sizeof(nvshmemx_uniqueid_t))
    throw std::invalid_argument("hybrid_ep: an NVSHMEM unique id has " + std::to_string(sizeof(nvshmemx_uniqueid_t)) +
                                " bytes, got " + std::to_string(id.size()));
  if (nranks < 1 || rank < 0 || rank >= nranks)
    throw std::invalid_argument("hybrid_ep: NVSHMEM init needs 0 <= rank < nranks, got rank " + std::to_string(rank) +
                                " of " + std::to_string(nranks));
  nvshmemx_uniqueid_t uid;
  std::memcpy(&uid, id.data(), sizeof(uid));
  nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
  if (int status = nvshmemx_set_attr_uniqueid_args(rank, nranks, &uid, &attr))
    fail("nvshmemx_set_attr_uniqueid_args", status);
  // nvshmemx_init_attr() without its exit(-1) on failure: the same call, the status returned.
  int provided = 0;
  nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                NVSHMEM_VENDOR_PATCH_VERSION};
  if (int status =
          nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version))
    fail("nvshmemx_init_attr(NVSHMEMX_INIT_WITH_UNIQUEID)", status);
}

int init_status() { return nvshmemx_init_status(); }

int my_pe() {
  require_initialized("nvshmem_my_pe");
  return nvshmem_my_pe();
}

int n_pes() {
  require_initialized("nvshmem_n_pes");
  return nvshmem_n_pes();
}

uint64_t malloc(size_t bytes) {
  require_initialized("nvshmem_malloc");
  // Zeroed: the transport's signal words must start below every call's number.
  return reinterpret_cast<uint64_t>(nvshmem_calloc(bytes, 1));
}

void free(uint64_t ptr) {
  require_initialized("nvshmem_free");
  nvshmem_free(reinterpret_cast<void*>(ptr));
}

void barrier_all() {
  require_initialized("nvshmem_barrier_all");
  nvshmem_barrier_all();
}

void finalize() {
  if (init_status() >= NVSHMEM_STATUS_IS_INITIALIZED) nvshmem_finalize();
}

}  // namespace hybrid_ep::nvshmem_host
