// NVSHMEM transport: every rank's RDMA region is the same block of the symmetric heap, so a
// byte offset names the same place on every PE. Puts to a PE that NVSHMEM maps for load/store
// (nvshmem_ptr not null: a PE on this GPU or over NVLink) are the warp's own copy (warp_copy,
// kPutBatch loads in flight a lane, where NVSHMEM's warp put has one) and a release of the signal;
// to other PEs NVSHMEM's non-blocking warp puts, on clusters with NVSHMEM_IB_ENABLE_IBGDA=1 the
// GPU driving the NIC itself. Only compiled where the build found NVSHMEM
// (HYBRID_EP_WITH_NVSHMEM) and relocatable device code is on.
#pragma once
#include <nvshmem.h>
#include <nvshmemx.h>

#include "transport/rdma.cuh"

namespace hybrid_ep {

struct NvshmemTransport {
  static constexpr TransportKind kKind = kTransportNvshmem;
  uint8_t* base;       // this PE's address of the symmetric RDMA region
  const int32_t* pes;  // [W] PE of each rank of the EP group
  int rank;

  __device__ uint8_t* local(uint64_t offset) const { return base + offset; }

  // Rank dst's address of this offset where NVSHMEM maps its PE for load/store, else nullptr.
  __device__ uint8_t* mapped(int dst, uint64_t off) const {
    return static_cast<uint8_t*>(nvshmem_ptr(base + off, pes[dst]));
  }

  __device__ void put(int lane, int dst, uint64_t dst_off, const void* src, uint64_t bytes) const {
    if (uint8_t* to = mapped(dst, dst_off)) return warp_copy(lane, to, src, bytes);
    nvshmemx_putmem_nbi_warp(base + dst_off, src, bytes, pes[dst]);
  }
  __device__ void put_signal(int lane, int dst, uint64_t dst_off, const void* src, uint64_t bytes, uint64_t sig_off,
                             uint64_t value) const {
    if (uint8_t* to = mapped(dst, dst_off)) {
      warp_copy(lane, to, src, bytes);
      if (lane == 0) {
        __threadfence_system();  // every lane's stores were ordered before lane 0's by warp_copy's __syncwarp
        dev::st_release_sys(reinterpret_cast<uint64_t*>(mapped(dst, sig_off)), value);
      }
      __syncwarp();
      return;
    }
    nvshmemx_putmem_signal_nbi_warp(base + dst_off, src, bytes, reinterpret_cast<uint64_t*>(base + sig_off), value,
                                    NVSHMEM_SIGNAL_SET, pes[dst]);
  }
  __device__ void signal(int dst, uint64_t sig_off, uint64_t value) const {
    if (uint8_t* sig = mapped(dst, sig_off)) return dev::st_release_sys(reinterpret_cast<uint64_t*>(sig), value);
    nvshmemx_signal_op(reinterpret_cast<uint64_t*>(base + sig_off), value, NVSHMEM_SIGNAL_SET, pes[dst]);
  }
  // The warp's own stores to mapped PEs are ordered and completed by the system-scope fence,
  // NVSHMEM's puts by its fence and quiet.
  __device__ void fence() const {
    __threadfence_system();
    nvshmem_fence();
  }
  __device__ void quiet() const {
    __threadfence_system();
    nvshmem_quiet();
  }
  // NVSHMEM's own test on the signal runs the step its waits run after seeing a value: over a
  // proxy transport that enforces consistency at the target (InfiniBand without IBGDA), an
  // operation that makes the NIC's writes before the signal visible; with IBGDA a fence. The
  // kernels poll the word themselves first (a relaxed poll, then a fence), so the test sees the
  // value at once.
  __device__ void delivered(const uint64_t* sig, uint64_t value) const {
    nvshmem_uint64_test(const_cast<uint64_t*>(sig), NVSHMEM_CMP_GE, value);
  }
};

}  // namespace hybrid_ep

#include "transport/select.cuh"

namespace hybrid_ep {

template <>
__device__ inline NvshmemTransport make_transport<NvshmemTransport>(const RankArgs& a) {
  return NvshmemTransport{reinterpret_cast<uint8_t*>(a.rdma_base), reinterpret_cast<const int32_t*>(a.rdma_pes),
                          a.rank};
}

}  // namespace hybrid_ep
