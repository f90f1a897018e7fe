// What the four data kernels (the receive path's dispatch_receive and combine_receive, the
// direct path's dispatch_direct and combine_direct) share around their warp roles:
//
//   kernel_call   the call context every role reads (launch, rank, view, block place, call,
//                 the block's control words), built once per block; each kernel's own context
//                 derives from it and names its fields in its constructor;
//   RoleTable     the warp layout as a table of (role, first warp, warps), checked at compile
//                 time to tile the block, and the role of a warp (the count kernel's too, which
//                 starts the call and so builds no kernel_call: kernels/count.cuh);
//   init_block    thread 0 initialises the block's rings and takes the launch's abort flag;
//   block_ready   the block agrees that its setup (rings, flow control, peers' tensors) held;
//   roles_done    the block agrees, once every role returned, whether the call was aborted;
//   last_block    the rank's last block to finish (its counter reset for the next call);
//   publish_done  a rank's done flag of the call, after everything its blocks wrote.
#pragma once
#include "common/state.cuh"
#include "kernels/pipeline.cuh"

namespace hybrid_ep {

// Bytes of one element of a row dtype (DType).
__device__ __forceinline__ int elem_bytes(int dtype) { return dtype == kFloat32 ? 4 : dtype == kFloat8 ? 1 : 2; }

// A word of shared memory that any thread of the block may write and every thread polls:
// each access is a relaxed atomic, so two writers (or a writer and a poller) never race.
struct ControlWord {
  volatile int v;
  __device__ ControlWord& operator=(int x) {
    dev::st_relaxed(&v, x);
    return *this;
  }
  __device__ operator int() const { return dev::ld_relaxed(&v); }
};

// A block's two control words in shared memory: a wait of the setup gave up (fail), the launch
// was aborted or a role stopped (abort: every role leaves its loop when it reads it).
struct BlockControl {
  ControlWord fail;
  ControlWord abort;
};

// Which of the rank's call counters a kernel serves: the count kernel started the dispatch's
// call (its number is already in the state); a combine's call is the one after the last combine.
enum CallKind : int { kDispatchCall = 0, kCombineCall = 1 };

// What every role of a block needs to know about the call.
struct KernelCall {
  const LaunchArgs& args;
  const RankArgs& a;
  const Geometry& geo;
  RankView view;
  int b, nb;  // this block among its rank's blocks
  uint64_t call;
  BlockControl& ctl;

  __device__ void stop() const { ctl.abort = 1; }
  __device__ bool stopped() const { return ctl.abort != 0; }
  // A ring of the block's shared memory, named for the timeout record.
  __device__ Ring ring(uint64_t* full, uint64_t* empty, int stages, PipeSite site) const {
    return Ring{full, empty, stages, a.rank, call, site};
  }
};

// The call context of a block of a rank present in the launch.
__device__ inline KernelCall kernel_call(const LaunchArgs& args, const BlockPlace& place, CallKind kind,
                                         BlockControl& ctl) {
  const RankView view = rank_view(args.geo, place.rank);
  const LocalState* st = view.state();
  const uint64_t call = kind == kDispatchCall ? st->dispatch_calls : st->combine_calls + 1;
  return KernelCall{args, place.rank, args.geo, view, place.block, place.blocks, call, ctl};
}

// The count kernel of the rank's call found a bad route (InfoLayout::bad_route: the same word
// on every rank, written by this rank's count kernel before this kernel in stream order). The
// call moves no rows and the count kernel completed the call, so a dispatch kernel of the
// call, and a combine on its handle, return before they touch a flag or a peer.
__device__ __forceinline__ bool call_refused(const Geometry& geo, const RankArgs& a) {
  return reinterpret_cast<const int64_t*>(a.info)[geo.info.bad_route] >= 0;
}

// Warps [first, first + warps) of a block play `role`.
template <typename Role>
struct RoleSpan {
  Role role;
  int first, warps;

  __device__ int warp_index(int warp) const { return warp - first; }       // among the role's warps
  __device__ int thread_index(int tid) const { return tid - first * 32; }  // among the role's threads
};

// A kernel's warp layout: N spans in warp order. A kernel builds it in a constexpr function
// (host and device see the same table; static_assert checks that it tiles the block).
template <typename Role, int N>
struct RoleTable {
  RoleSpan<Role> span[N];

  // Whether the spans cover warps [0, warps) once each, in order (a span may be empty: a role
  // of another configuration of the kernel).
  __host__ __device__ constexpr bool tiles(int warps) const {
    int next = 0;
    for (int i = 0; i < N; ++i) {
      if (span[i].first != next || span[i].warps < 0) return false;
      next += span[i].warps;
    }
    return next == warps;
  }
  // The span that holds `warp`.
  __host__ __device__ constexpr RoleSpan<Role> of(int warp) const {
    for (int i = 0; i + 1 < N; ++i)
      if (warp < span[i].first + span[i].warps) return span[i];
    return span[N - 1];
  }
};

// Every thread: thread 0 sets up the block's rings (init()), the fence that shows them to the
// bulk copies, and the control words (the launch's abort flag read once for the block); the
// barrier orders them before any thread's setup, whose waits may raise fail.
template <typename Init>
__device__ inline void init_block(const KernelCall& k, Init init) {
  if (threadIdx.x == 0) {
    init();
    dev::mbar_fence_init();
    k.ctl.fail = 0;
    k.ctl.abort = aborted(k.args) ? 1 : 0;
  }
  __syncthreads();
}

// Every thread: the setup is done; true when it held (nothing aborted, no setup wait gave up).
__device__ inline bool block_ready(const KernelCall& k) {
  __syncthreads();
  return !k.ctl.abort && !k.ctl.fail;
}

// Every thread, once its role returned: true when the call was not aborted, by one reading of
// the launch's abort flag for the whole block (or a role that stopped).
__device__ inline bool roles_done(const KernelCall& k) {
  if (threadIdx.x == 0 && aborted(k.args)) k.ctl.abort = 1;
  __syncthreads();
  return !k.ctl.abort;
}

// Thread 0 of each block, after roles_done: true in the rank's last block to get here, which
// resets the counter for the next call. What the rank's blocks wrote before is ordered before
// what the last one does next (each block's fence before its count).
__device__ inline bool last_block(const KernelCall& k, uint32_t* blocks_done) {
  __threadfence();
  const uint32_t prev = atomicAdd(blocks_done, 1u);
  if (prev != static_cast<uint32_t>(k.nb - 1)) return false;
  *blocks_done = 0;
  return true;
}

// The rank's done flag of the call (offset into the registered buffer), released after
// everything the rank's blocks wrote.
__device__ inline void publish_done(const KernelCall& k, uint64_t offset) {
  __threadfence_system();
  dev::st_release_sys(k.view.flag(k.a.rank, offset, 0), k.call);
}

}  // namespace hybrid_ep
