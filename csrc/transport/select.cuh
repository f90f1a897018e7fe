// The transport a kernel instantiation uses, built from the rank's launch arguments.
#pragma once
#include "common/params.h"
#include "transport/loopback.cuh"

namespace hybrid_ep {

template <typename Rdma>
__device__ Rdma make_transport(const RankArgs& a);

template <>
__device__ inline LoopbackTransport make_transport<LoopbackTransport>(const RankArgs& a) {
  return LoopbackTransport{reinterpret_cast<uint8_t* const*>(a.rdma_regions), a.rank};
}

}  // namespace hybrid_ep
