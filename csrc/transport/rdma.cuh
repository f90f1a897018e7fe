// The inter-node transport contract, and the transport the kernels are instantiated with.
//
// Ranks inside one NVLink domain write each other's registered buffers through peer pointers
// (bulk stores, then a release of a flag). Ranks on other nodes cannot be addressed that way:
// a kernel reaches them only through a transport `Rdma`, which every kernel takes as a
// template parameter. Each rank owns an RDMA region (on clusters, a block of NVSHMEM's
// symmetric heap: the same offsets on every rank); the kernels address it by byte offsets
// built by csrc/bindings/buffer_layout.h (RdmaLayout).
//
// A transport provides (all offsets are bytes into the RDMA region, all sizes multiples of 16):
//   uint8_t* local(offset)                  this rank's region: staging areas and the signal
//                                           words other ranks set
//   put(lane, dst, dst_off, src, bytes)     warp-collective (every lane, same arguments):
//                                           copy `bytes` from this rank's region (`src` points
//                                           into it) to rank dst's region; non-blocking
//   put_signal(lane, dst, dst_off, src, bytes, sig_off, value)
//                                           the same, then rank dst's u64 at sig_off becomes
//                                           `value`, delivered after the data
//   signal(dst, sig_off, value)             one thread: rank dst's u64 at sig_off := value
//   fence()                                 one thread: its earlier puts to a rank are
//                                           delivered before its later ones
//   quiet()                                 one thread: every put it issued has completed, so
//                                           the source bytes may be overwritten
//   delivered(sig, value)                   one thread, after its poll of local(sig_off) saw
//                                           `value`: what the puts before that signal wrote is
//                                           visible to its later reads (a proxy transport's
//                                           consistency step; kernels wait through
//                                           PeerRing::reader_wait_delivered and
//                                           Hierarchy::wait_delivered)
// Signals carry the call (a ring's: the tag of the call and the chunk, kernels/peer_ring.cuh)
// and are set, never added: both only grow, so a wait is the same `>=` test as for NVLink
// flags, and a signal that is set twice is harmless. The receiver waits on local(sig_off) with the bounded wait of
// common/state.cuh.
//
// Transports: LoopbackTransport (transport/loopback.cuh: the NVLink mechanism standing in for
// RDMA between the virtual nodes of the single-GPU emulation and of the CPU model) and
// NvshmemTransport (transport/nvshmem.cuh: the warp's own copy to a PE NVSHMEM maps for
// load/store, else nvshmemx_putmem_signal_nbi_warp; IBGDA on clusters).
#pragma once
#include <cstdint>

#include "common/params.h"
#include "device/device.cuh"

namespace hybrid_ep {

// A warp's copy of `bytes` (a multiple of 16) from `from` to `to`, through the lanes' registers:
// each lane loads kPutBatch int4 before it stores any, independent loads, so more of them are in
// flight per lane than one load-then-store at a time. The puts of transports whose destination
// the warp can address (the loopback's peer pointers, an NVSHMEM peer mapped for load/store).
constexpr int kPutBatch = 8;
__device__ inline void warp_copy(int lane, uint8_t* to, const void* from, uint64_t bytes) {
  auto* dst = reinterpret_cast<int4*>(to);
  const auto* src = reinterpret_cast<const int4*>(from);
  const uint64_t n = bytes / 16;
  for (uint64_t v0 = lane; v0 < n; v0 += 32 * kPutBatch) {
    int4 val[kPutBatch];
#pragma unroll
    for (int j = 0; j < kPutBatch; ++j)
      if (v0 + 32 * j < n) val[j] = dev::ld(src + v0 + 32 * j);
#pragma unroll
    for (int j = 0; j < kPutBatch; ++j)
      if (v0 + 32 * j < n) dev::st(dst + v0 + 32 * j, val[j]);
  }
  __syncwarp();
}

// Where each rank sits: rank r = (node r / G, local index r % G); ranks with the same local
// index form a rail, and the rail peer of rank r on node n is n * G + r % G.
struct Topology {
  int W, G, N;
  __device__ __host__ int node(int r) const { return r / G; }
  __device__ __host__ int local(int r) const { return r % G; }
  __device__ __host__ int rail_peer(int r, int n) const { return n * G + r % G; }
  __device__ __host__ bool same_node(int a, int b) const { return a / G == b / G; }
};

}  // namespace hybrid_ep
