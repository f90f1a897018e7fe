// Loopback transport: puts between the virtual ranks of one process (single-GPU emulation, CPU
// model) through plain peer pointers to their RDMA regions. On a GPU: stores of the warp, then
// a system-scope fence and a release of the signal word: the same ordering NVSHMEM gives a put
// with signal, with nothing outstanding after a put returns. On the CPU model (while its
// weakening kRemoteLate is on, dev::remote_deferred) each put and signal is queued and lands
// later, out of order, as over a NIC: only a fence orders a thread's ops to a rank, only its
// quiet completes them, and the source is read when the op lands (model/runtime.h, remote_put).
// While the timing model prices a cluster (model/runtime.h, set_posted_puts) the same queued
// path posts each op as a NIC would: the warp's lanes copy nothing.
#pragma once
#include "transport/rdma.cuh"

namespace hybrid_ep {

struct LoopbackTransport {
  static constexpr TransportKind kKind = kTransportLoopback;
  uint8_t* const* regions;  // [W] RDMA-region bases of every rank of the launch
  int rank;

  __device__ uint8_t* local(uint64_t offset) const { return regions[rank] + offset; }

  __device__ void put(int lane, int dst, uint64_t dst_off, const void* src, uint64_t bytes) const {
    if (dev::remote_deferred()) return queued(lane, dst, dst_off, src, bytes, nullptr, 0);
    warp_copy(lane, regions[dst] + dst_off, src, bytes);
  }
  __device__ void put_signal(int lane, int dst, uint64_t dst_off, const void* src, uint64_t bytes, uint64_t sig_off,
                             uint64_t value) const {
    dev::hold_point(rank);  // tests stall a rank's puts here (CPU model); nothing on a GPU
    if (dev::remote_deferred())
      return queued(lane, dst, dst_off, src, bytes, reinterpret_cast<uint64_t*>(regions[dst] + sig_off), value);
    put(lane, dst, dst_off, src, bytes);
    if (lane == 0) {
      __threadfence_system();  // every lane's stores were ordered before lane 0's by __syncwarp
      signal(dst, sig_off, value);
    }
    __syncwarp();
  }
  __device__ void signal(int dst, uint64_t sig_off, uint64_t value) const {
    auto* sig = reinterpret_cast<uint64_t*>(regions[dst] + sig_off);
    if (dev::remote_deferred()) return dev::remote_put(rank, dst, nullptr, nullptr, 0, sig, value);
    dev::st_release_sys(sig, value);
  }
  __device__ void fence() const {
    __threadfence_system();
    if (dev::remote_deferred()) dev::remote_fence();
  }
  __device__ void quiet() const {
    __threadfence_system();
    if (dev::remote_deferred()) dev::remote_quiet();
  }
  // The poll's own acquire made the peer's stores visible: nothing more.
  __device__ void delivered(const uint64_t*, uint64_t) const {}

 private:
  // The CPU model's queued put (warp-collective as put is): one op, issued by lane 0 once every
  // lane reached it.
  __device__ void queued(int lane, int dst, uint64_t dst_off, const void* src, uint64_t bytes, uint64_t* sig,
                         uint64_t value) const {
    __syncwarp();
    if (lane == 0) dev::remote_put(rank, dst, regions[dst] + dst_off, src, bytes, sig, value);
    __syncwarp();
  }
};

}  // namespace hybrid_ep
