// What the direct path's kernels share (kernels/dispatch_direct.cuh, kernels/combine_direct.cuh):
// each rank publishes its tensors of the call (output rows, or expert outputs) in its
// registered buffer with the call's number; its peers read them, write or read the rows
// themselves, and tell the rank when they are done, so that no kernel returns while a peer
// still touches its tensors.
//
// Addresses cross processes as offsets from each rank's arena base, the table
// RankArgs::peer_bases of where every rank's arena starts in this process (all 0 in
// single-process emulation, where every tensor is addressable as it is).
#pragma once
#include "common/state.cuh"
#include "kernels/skeleton.cuh"

namespace hybrid_ep {

enum DirectKind : int { kDirectDispatch = 0, kDirectCombine = 1 };

// A peer's published tensors, in this process's addresses.
struct PeerView {
  uint64_t rows, probs, scales;
  int64_t num_rows;
};

__device__ __forceinline__ uint64_t arena_base(const RankArgs& a, int r) {
  return reinterpret_cast<const uint64_t*>(a.peer_bases)[r];
}
__device__ __forceinline__ PeerTensors* peer_tensors(const RankView& view, int r, int kind) {
  return reinterpret_cast<PeerTensors*>(view.base(r) + view.geo.reg.direct_tensors) + kind;
}
// Source s is done with rank r's tensors of the call (its writes landed, or its reads ended).
__device__ __forceinline__ uint64_t* direct_done(const RankView& view, int r, int kind, int s) {
  return reinterpret_cast<uint64_t*>(view.base(r) + view.geo.reg.direct_done) + kind * view.geo.world_size + s;
}

// One thread of block 0: this rank's tensors of the call, for its peers (scales only where
// the call has them).
__device__ inline void publish_tensors(const RankView& view, const RankArgs& a, int kind, uint64_t call, uint64_t rows,
                                       uint64_t probs, uint64_t scales, int64_t num_rows) {
  const uint64_t base = arena_base(a, a.rank);
  PeerTensors* t = peer_tensors(view, a.rank, kind);
  t->rows = rows - base;
  t->probs = probs - base;
  t->scales = scales - base;
  t->num_rows = num_rows;
  __threadfence_system();  // the fields, and what the count kernel wrote before this kernel
  dev::st_release_sys(&t->call, call);
}

// Peer r's tensors of the call, once published (bounded). The fields were written in this
// call: read past L1.
__device__ inline bool read_tensors(const LaunchArgs& args, const RankView& view, const RankArgs& a, int r, int kind,
                                    uint64_t call, PeerView& out) {
  PeerTensors* t = peer_tensors(view, r, kind);
  if (!wait_at_least(args, &t->call, call, kPhaseDirectTensors, a.rank, r, call)) return false;
  const volatile PeerTensors* v = t;
  const uint64_t base = arena_base(a, r);
  out.rows = base + v->rows;
  out.probs = base + v->probs;
  out.scales = base + v->scales;
  out.num_rows = v->num_rows;
  return true;
}

// The ranks whose tensors a rank's direct kernels touch, and which touch its own: those of its
// node (with several nodes, rows and partials cross nodes only through the rail peers' RDMA
// staging, kernels/hierarchy.cuh).
__device__ __forceinline__ int node_first(const RankView& view) {
  return view.rank / view.geo.ranks_per_node * view.geo.ranks_per_node;
}

// The last block of this rank to finish: every peer of its node learns that this rank is done
// with its tensors of the call; what this rank's blocks wrote or read before is released with it.
__device__ inline void signal_done(const RankView& view, const RankArgs& a, int kind, uint64_t call) {
  __threadfence_system();
  const int first = node_first(view);
  for (int g = 0; g < view.geo.ranks_per_node; ++g)
    dev::st_release_sys(direct_done(view, first + g, kind, a.rank), call);
}

// Until peer r is done with this rank's tensors of the call (bounded).
__device__ inline bool wait_done(const LaunchArgs& args, const RankView& view, const RankArgs& a, int r, int kind,
                                 uint64_t call) {
  return wait_at_least(args, direct_done(view, a.rank, kind, r), call,
                       kind == kDirectDispatch ? kPhaseDirectRows : kPhaseDirectReads, a.rank, r, call);
}

// The end of a direct kernel, once every role of the block is done and the block agreed it
// was not aborted (roles_done); every thread of the block calls it. The last block of this
// rank to get here tells every peer of its node that this rank is done with their tensors;
// block 0 then waits until every such peer is done with this rank's. True in thread 0 of block 0 when the call
// completed (the caller publishes it). blocks_done: this kernel's block counter in the rank's
// state.
__device__ inline bool finish_direct(const KernelCall& k, int kind, uint32_t* blocks_done) {
  const int tid = static_cast<int>(threadIdx.x);
  if (tid == 0 && last_block(k, blocks_done)) signal_done(k.view, k.a, kind, k.call);
  if (k.b != 0) return false;
  if (tid < k.geo.ranks_per_node && !wait_done(k.args, k.view, k.a, node_first(k.view) + tid, kind, k.call))
    k.ctl.fail = 1;
  __syncthreads();
  return tid == 0 && !k.ctl.fail;
}

}  // namespace hybrid_ep
