// Host side of the NVSHMEM transport: bootstrap with a unique id, symmetric heap, queries.
//
// The unique id is created by one process (rank 0 of the EP group) and handed to the others
// by the caller (hybrid_ep/backends/cuda/nvshmem.py shares it over torch.distributed). Every
// failure is a std::runtime_error naming the NVSHMEM call and its status, never NVSHMEM's own
// exit(): the Python layer turns it into an error that says what to do. Only built where the
// build found NVSHMEM (HYBRID_EP_WITH_NVSHMEM).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>

namespace hybrid_ep::nvshmem_host {

// nvshmemx_get_uniqueid, as the bytes of an nvshmemx_uniqueid_t.
std::string unique_id();

// nvshmemx_set_attr_uniqueid_args + init with NVSHMEMX_INIT_WITH_UNIQUEID. Collective over the
// `nranks` processes; `id` must be the bytes unique_id() returned on one of them. The heap size
// is read by NVSHMEM from NVSHMEM_SYMMETRIC_SIZE at this point.
void init(int rank, int nranks, const std::string& id);

// nvshmemx_init_status(): 0 not initialised, 1 bootstrapped, 2 initialised, 3 limited and
// 4 full support of several PEs on one GPU (NVSHMEM_STATUS_*).
int init_status();

int my_pe();
int n_pes();

// A zeroed symmetric allocation (nvshmem_calloc) / nvshmem_free, both collective. 0 when the
// heap has no room for `bytes`.
uint64_t malloc(size_t bytes);
void free(uint64_t ptr);

void barrier_all();
void finalize();

}  // namespace hybrid_ep::nvshmem_host
