// Count kernel: from this rank's routing, everything the metadata module computes, on the
// device, with no host synchronisation.
//
// One block per rank, its warps in two roles (count_warps): the tally warps walk the rank's
// tokens in tiles of one token per tally thread, while the peers warp waits for every peer to
// be done with the previous call (flow control), so that wait overlaps the counting. Within a
// warp the order of tokens is the lane order, so a (token, expert) ordinal is the number of
// earlier lanes routed to the same expert plus a per-warp base from a scan over warps and
// tiles. The same scan gives each token's slot in the rows sent to each destination rank.
// The block then joins: it writes its count row into every peer's registered buffer, signals
// with the call's number, waits for every peer's row and computes the expert-major offsets.
// Ranks on other nodes get their rows through the transport, into a copy per call parity:
// a rank can only start call e + 2 after it read every rank's counts of call e + 1, which
// each rank writes after it read those of call e, so the copy of call e is never overwritten
// while it is read. Flow control waits for the peers of this node (their receive buffers) and
// for the rail peers on other nodes (their staging areas).
//
// This kernel starts the dispatch's call: it takes the call's number (dispatch_calls + 1) and
// publishes it in the rank's state at its end, so the skeleton's kernel_call (which reads the
// call already started) and its control words (init_block, roles_done: rings, the launch's
// abort flag) do not fit it; its RoleTable does.
//
// A bad route (an id outside [-1, E), or a token's second route to one expert) is counted as
// not routed, and the block's first bad token goes into its count row beside the counts, so
// after the exchange every rank holds every rank's and picks the same one, the lowest bad
// rank's, for its info. The call then moves no rows: this kernel completes it in the dispatch
// kernel's place (its done flags), so the next call proceeds. Where the host reads the info
// before the dispatch launch (dynamic size, LaunchArgs::info_read) it raises the error and
// launches no dispatch kernel; where the dispatch kernel follows unread (a static size), that
// kernel returns at its start on the info's word, and this one records the route
// (LaunchArgs::bad_route) for the host to raise at its next call.
//
// A rank that refused its own input (RankArgs::refused: an argument the host could not take)
// makes the call with no tokens and puts the refusal in the same words: token geo.max_tokens,
// which no route has, and the argument's code as the id; every rank then raises it by name
// (hybrid_ep/refusals.py) and the group stays usable.
//
// The waits (flow control, then the count rows) draw on one bound from the kernel's start: the
// host that reads the counts gave the launch what its call had left (HYBRID_EP_TIMEOUT_S from
// the call's start), so a peer that is slow twice costs the call no more than that.
#include "common/state.cuh"
#include "kernels/hierarchy.cuh"
#include "kernels/launch.h"
#include "kernels/skeleton.cuh"

namespace hybrid_ep {
namespace count_impl {  // kernels/count.cu and kernels_nvshmem.cu instantiate it

// Warp roles: kCountTallyWarps tally warps (common/params.h: the timing model's tests read it
// from the extension), then the peers warp. The tally warps keep in step by a named barrier of
// their own, so the peers warp's wait holds none of them; the block joins after both roles.
enum class CountRole { kTally, kPeers };
constexpr int kBlockWarps = kCountThreads / 32;
constexpr int kTallyThreads = kCountTallyWarps * 32;  // tokens per tile
constexpr uint32_t kTallyBarrier = 1;                 // the tally warps' named barrier (0: __syncthreads')
__host__ __device__ constexpr RoleTable<CountRole, 2> count_warps() {
  return {{{CountRole::kTally, 0, kCountTallyWarps}, {CountRole::kPeers, kCountTallyWarps, 1}}};
}
static_assert(count_warps().tiles(kBlockWarps), "the count kernel's roles tile its block");

__device__ __forceinline__ int32_t ld_count(const int32_t* p) { return *reinterpret_cast<const volatile int32_t*>(p); }

// The tile loop's plain code per lane, for the CPU model's timing (dev::plain_code: nothing on the
// GPU; the model issues each block's instructions, a constant of the timing model counted on this
// kernel's SASS, on the warp's scheduler, up to 8 tally warps to a scheduler here): the blocks a
// valid routing runs, each by what repeats it. The scan's passes are named where they run.
__device__ __forceinline__ void tile_code(int K, int W, int N) {
  using dev::PlainCode;
  using dev::PlainRun;
  dev::plain_code(PlainRun{PlainCode::kCountTile, 1}, PlainRun{PlainCode::kCountRoute, K},
                  PlainRun{PlainCode::kCountRoutePair, K * (K - 1) / 2}, PlainRun{PlainCode::kCountDest, W},
                  PlainRun{PlainCode::kCountNode, N});
}

constexpr int kNoBadToken = 0x7fffffff;

struct CountShared {
  uint64_t call;
  unsigned long long dropped;
  int64_t bad_id;    // the expert id of this rank's first bad route, then of the lowest bad rank's
  int64_t bad_rank;  // the lowest rank with a bad route, -1: none (the same on every rank)
  int bad_token;     // this rank's first token with a bad route (kNoBadToken: none), then that rank's
  int fail;
};
static_assert(sizeof(CountShared) <= kStaticSmemReserve,
              "the count kernel's static shared memory outgrew the launch plans' reserve");

// The expert id of a token's first bad route in route order, by the tile loop's rule: out of
// [-1, E), or a second route to an expert an earlier route of the token took.
__device__ inline int64_t first_bad_id(const int64_t* routes, int K, int E) {
  for (int k = 0; k < K; ++k) {
    const int64_t id = routes[k];
    if (id < -1 || id >= E) return id;
    for (int k2 = 0; k2 < k; ++k2)
      if (id >= 0 && routes[k2] == id) return id;
  }
  return -1;  // not reached for a token the tile loop found bad
}

// A call with a bad route moves no rows: the count kernel publishes the done flags the
// dispatch kernel would have, once it read every count row, so every peer's next call finds
// this rank done with this one (thread 0).
template <typename Rdma>
__device__ inline void complete_unmoved(const RankView& view, const Hierarchy<Rdma>& h, uint64_t call) {
  const Geometry& geo = view.geo;
  __threadfence_system();
  dev::st_release_sys(view.flag(view.rank, geo.reg.done_dispatch, 0), call);
  h.signal_done_to_rail_peers(geo.rdma.done_dispatch, call);
}

// A call with a bad route moves no rows on any rank (each holds the same word in its info):
// this kernel completes it, and where no host reads the info before the dispatch kernel (a
// static size) it records the route for the host's next call; the dispatch kernel returns at
// its start (call_refused). Thread 0.
template <typename Rdma>
__device__ inline void refuse_call(const LaunchArgs& args, const RankView& view, const Hierarchy<Rdma>& h,
                                   const CountShared& sh, uint64_t call, int E) {
  complete_unmoved(view, h, call);
  if (!args.info_read) record_bad_route(args, static_cast<int>(sh.bad_rank), sh.bad_token, call, E, sh.bad_id);
}

// What both roles read: the call, the rank's routing and the block's shared memory.
template <typename Rdma>
struct CountCall {
  const LaunchArgs& args;
  const RankArgs& a;
  const Geometry& geo;
  RankView view;
  Hierarchy<Rdma> h;
  int W, E, L, N, G, T, K;
  int cols;  // counters: experts, destination ranks, destination nodes
  uint64_t call;
  uint64_t started;   // the kernel's start (global timer): every wait's bound runs from it
  int32_t* warp_cnt;  // [kCountTallyWarps][cols], scanned in place to per-warp bases
  int32_t* carry;     // [cols] totals of the tiles before
  CountShared& sh;
};

// Bit i of the ranks (per = L experts each) or nodes (per = G x L) base + i, i < 64, that a
// token's routes reach: the kernels count W ranks and N nodes in windows of 64 (an EP group of up
// to kMaxRanks), the first window kept in registers across the tally's passes.
__device__ __forceinline__ uint64_t reach_mask(const int (&e)[kMaxTopK], int K, int per, int base) {
  uint64_t m = 0;
#pragma unroll
  for (int k = 0; k < kMaxTopK; ++k) {
    if (k < K && e[k] >= 0) {
      const int i = e[k] / per - base;
      if (i >= 0 && i < 64) m |= 1ull << i;
    }
  }
  return m;
}

// The tally warps (thread `tid` of kTallyThreads): the rank's tokens in tiles of kTallyThreads,
// each token's (token, expert) ordinals and slots in the rows to each rank, the totals in
// `carry`; then the first bad route's id, for the count row (thread 0). A warp whose tokens of
// the tile all lie past the last (the last tile's) counts nothing: its counters stay 0.
template <typename Rdma>
__device__ void tally(const CountCall<Rdma>& c, int tid) {
  const int W = c.W, E = c.E, L = c.L, N = c.N, G = c.G, T = c.T, K = c.K, cols = c.cols;
  const int lane = tid & 31, warp = tid >> 5;
  const auto* idx = reinterpret_cast<const int64_t*>(c.a.topk_idx);
  auto* send_ord = reinterpret_cast<int32_t*>(c.a.send_ord);
  auto* entry_ord = reinterpret_cast<int32_t*>(c.a.entry_ord);
  int32_t* warp_cnt = c.warp_cnt;
  int32_t* carry = c.carry;
  CountShared& sh = c.sh;
  const unsigned full = 0xffffffffu;
  const unsigned lt_mask = (1u << lane) - 1u;

  for (int tile = 0; tile < T; tile += kTallyThreads) {
    const int t = tile + tid;
    const bool valid = t < T;
    const bool counts = tile + warp * 32 < T;  // the warp holds a token (warp-uniform)
    if (counts) tile_code(K, W, N);
    int e[kMaxTopK];  // expert ids fit 32 bits (E <= kMaxExperts); -1 = not routed
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      e[k] = -1;
      if (k < K && valid) {
        const int64_t raw = idx[static_cast<int64_t>(t) * K + k];
        if (raw < -1 || raw >= E) atomicMin(&sh.bad_token, t);  // not routed
        else e[k] = static_cast<int>(raw);
      }
    }
#pragma unroll
    for (int k = 0; k < kMaxTopK; ++k) {
      if (k >= K || !valid) continue;
#pragma unroll
      for (int k2 = 0; k2 < kMaxTopK; ++k2) {
        if (k2 < k && e[k] >= 0 && e[k2] == e[k]) {
          atomicMin(&sh.bad_token, t);
          e[k] = -1;  // not routed
        }
      }
    }
    // the ranks and nodes of the first window of 64 (every one where W <= 64), kept for both passes
    const uint64_t dmask0 = reach_mask(e, K, L, 0), nmask0 = reach_mask(e, K, L * G, 0);
    // Each expert's counter word of this warp first holds the lanes routed to it, as a lane
    // mask (a token routes to an expert at most once), then their count: a route's ordinal
    // in the warp is the number of earlier lanes in its expert's mask. K shared atomics per
    // lane, where comparing every lane's K routes with every other lane's took about 1000
    // instructions per lane and per source lane (32 x K x K compares, 2026-11-26 SASS).
    int32_t* lanes_of = warp_cnt + warp * cols;
    for (int col = lane; col < cols; col += 32) lanes_of[col] = 0;
    int prefix[kMaxTopK];
    if (counts) {
      __syncwarp();
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k)
        if (k < K && e[k] >= 0) atomicOr(&lanes_of[e[k]], static_cast<int32_t>(1u << lane));
      __syncwarp();
#pragma unroll
      for (int k = 0; k < kMaxTopK; ++k)
        prefix[k] = k < K && e[k] >= 0 ? __popc(static_cast<unsigned>(lanes_of[e[k]]) & lt_mask) : 0;
      __syncwarp();  // every lane has read the masks before they become counts
      for (int col = lane; col < E; col += 32) lanes_of[col] = __popc(static_cast<unsigned>(lanes_of[col]));
      for (int base = 0; base < W; base += 64) {
        const uint64_t dmask = base == 0 ? dmask0 : reach_mask(e, K, L, base);
        for (int d = base; d < min(W, base + 64); ++d) {
          const unsigned bal = __ballot_sync(full, (dmask >> (d - base)) & 1);
          if (lane == 0) lanes_of[E + d] = __popc(bal);
        }
      }
      for (int base = 0; base < N; base += 64) {
        const uint64_t nmask = base == 0 ? nmask0 : reach_mask(e, K, L * G, base);
        for (int n = base; n < min(N, base + 64); ++n) {
          const unsigned bal = __ballot_sync(full, (nmask >> (n - base)) & 1);
          if (lane == 0) lanes_of[E + W + n] = __popc(bal);
        }
      }
    }
    dev::named_barrier_sync(kTallyBarrier, kTallyThreads);

    // Scan over warps (tile order), carried across tiles.
    for (int col = tid; col < cols; col += kTallyThreads) {
      dev::plain_code(dev::PlainRun{dev::PlainCode::kCountScanColumn, 1});
      int32_t run = carry[col];
      for (int w = 0; w < kCountTallyWarps; ++w) {
        const int32_t v = warp_cnt[w * cols + col];
        warp_cnt[w * cols + col] = run;
        run += v;
      }
      carry[col] = run;
    }
    dev::named_barrier_sync(kTallyBarrier, kTallyThreads);

    if (counts) {
      if (valid) {
#pragma unroll
        for (int k = 0; k < kMaxTopK; ++k) {
          if (k >= K) break;
          entry_ord[static_cast<int64_t>(t) * K + k] = e[k] >= 0 ? lanes_of[e[k]] + prefix[k] : -1;
        }
      }
      for (int base = 0; base < W; base += 64) {
        const uint64_t dmask = base == 0 ? dmask0 : reach_mask(e, K, L, base);
        for (int d = base; d < min(W, base + 64); ++d) {
          const bool goes = (dmask >> (d - base)) & 1;
          const unsigned bal = __ballot_sync(full, goes);
          if (valid) send_ord[static_cast<int64_t>(t) * W + d] = goes ? lanes_of[E + d] + __popc(bal & lt_mask) : -1;
        }
      }
    }
    dev::named_barrier_sync(kTallyBarrier, kTallyThreads);  // the bases read before the next tile's counts
  }
  if (tid == 0 && sh.bad_token != kNoBadToken)
    sh.bad_id = first_bad_id(idx + static_cast<int64_t>(sh.bad_token) * K, K, E);
  if (tid == 0 && c.a.refused != 0) {  // no tokens: the refusal in the bad-route words
    sh.bad_token = static_cast<int>(c.geo.max_tokens);
    sh.bad_id = c.a.refused;
  }
}

// The peers warp: flow control. A peer must have read everything of the previous dispatch
// before this rank overwrites its count row (and, in the dispatch kernel, its receive rows by
// bulk stores: hence the proxy fence after the acquires). The ranks of this node by their done
// flags, the rail peers on other nodes by their RDMA done words; a peer per lane, lane-strided
// (lane-strided over W ranks). A wait that gave up raises sh.fail (the launch's abort flag,
// raised with its record, ends the other lanes' waits).
template <typename Rdma>
__device__ void wait_for_peers(const CountCall<Rdma>& c, int lane) {
  const Hierarchy<Rdma>& h = c.h;
  const int rank = c.a.rank;
  bool ok = true;
  for (int r = lane; r < c.W && ok; r += 32) {
    if (h.topo.same_node(r, rank))
      ok = wait_at_least(c.args, c.view.flag(r, c.geo.reg.done_dispatch, 0), c.call - 1, kPhaseDispatchFlow, rank, r,
                         c.call, 1, c.started);
    else if (r == h.rail_peer(h.topo.node(r)))
      ok = wait_at_least(c.args, h.flag(c.geo.rdma.done_dispatch, h.topo.node(r)), c.call - 1, kPhaseRdmaFlow, rank, r,
                         c.call, 1, c.started);
  }
  if (ok) dev::fence_proxy_async();
  else dev::st_relaxed(&c.sh.fail, 1);  // several lanes may raise it
}

template <typename Rdma>
__global__ void __launch_bounds__(kCountThreads, 1) count_kernel(const __grid_constant__ LaunchArgs args) {
  const Geometry& geo = args.geo;
  const RankArgs& a = launch_rank(args, blockIdx.x);
  if (a.absent) return;
  const uint64_t started = dev::global_timer_ns();
  const RankView view = rank_view(geo, a);
  const Hierarchy<Rdma> h = make_hierarchy<Rdma>(geo, a);
  const int W = geo.world_size, E = geo.num_experts, L = geo.local_experts, N = geo.num_nodes;
  const int G = geo.ranks_per_node, T = a.num_tokens, K = a.topk;
  const int cols = E + W + N;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  auto* info = reinterpret_cast<int64_t*>(a.info);

  int32_t* smem = dev::dynamic_smem<int32_t>();
  int32_t* warp_cnt = smem;
  int32_t* carry = smem + kCountTallyWarps * cols;
  CountShared& sh = dev::block_shared<CountShared>();

  if (tid == 0) {
    sh.call = view.state()->dispatch_calls + 1;
    sh.fail = 0;
    sh.dropped = 0;
    sh.bad_token = kNoBadToken;
    sh.bad_id = 0;
  }
  for (int c = tid; c < cols; c += blockDim.x) carry[c] = 0;
  __syncthreads();
  const uint64_t call = sh.call;
  const CountCall<Rdma> counting{args, a, geo, view, h, W, E, L, N, G, T, K, cols, call, started, warp_cnt, carry, sh};
  const RoleSpan<CountRole> role = count_warps().of(warp);
  switch (role.role) {
    case CountRole::kTally: tally(counting, role.thread_index(tid)); break;
    case CountRole::kPeers: wait_for_peers(counting, lane); break;
  }
  __syncthreads();  // the roles joined: the counts, the first bad route and the flow control's verdict
  if (sh.fail) return;

  const int row_ints = static_cast<int>(geo.reg.count_row_ints);
  const int row_stride = static_cast<int>(round_up(row_ints, 4));  // RDMA copies: whole 16-byte vectors
  const uint64_t parity_rows = (call & 1) * W;
  const int tail = W + N + L;  // kCountRowTail ints from here, then W ints of routes to each rank
  const bool bad = sh.bad_token != kNoBadToken;
  for (int u = tid; u < W * row_ints; u += blockDim.x) {
    const int d = u / row_ints, c = u % row_ints;
    int32_t value;
    if (c < W) value = carry[E + c];                          // rows to each rank
    else if (c < W + N) value = carry[E + W + (c - W)];       // tokens to each node
    else if (c < tail) value = carry[d * L + (c - W - N)];    // rows for each expert of d
    else if (c == tail) value = T;                            // this rank's tokens
    else if (c == tail + 1) value = bad ? sh.bad_token : -1;  // its first bad token
    else if (c < tail + 4)
      value = static_cast<int32_t>(static_cast<uint64_t>(sh.bad_id) >> (c == tail + 2 ? 0 : 32));  // its id
    else if (c < tail + kCountRowTail) value = a.agree[c - tail - 4];  // the path agreement's words
    else {  // routes to rank c - tail - kCountRowTail: its experts' counts
      const int r = c - tail - kCountRowTail;
      value = 0;
      for (int j = 0; j < L; ++j) value += carry[r * L + j];
    }
    int32_t* row = h.topo.same_node(d, a.rank)
                       ? reinterpret_cast<int32_t*>(view.base(d) + geo.reg.count_in) + a.rank * row_ints
                       : reinterpret_cast<int32_t*>(h.rdma.local(geo.rdma.count_out)) + d * row_stride;  // staged
    row[c] = value;
  }
  __threadfence();  // the staged rows, before the transport reads them
  __syncthreads();  // every count written before the releases below (they are cumulative)
  if (tid < W && h.topo.same_node(tid, a.rank)) {
    __threadfence_system();
    dev::st_release_sys(view.flag(tid, geo.reg.count_call, a.rank), call);
  }
  if (h.multi()) {
    for (int d = warp; d < W; d += kBlockWarps) {
      if (h.topo.same_node(d, a.rank)) continue;
      h.rdma.put_signal(lane, d, geo.rdma.count_in + (parity_rows + a.rank) * row_stride * 4,
                        h.rdma.local(geo.rdma.count_out + static_cast<uint64_t>(d) * row_stride * 4),
                        static_cast<uint64_t>(row_stride) * 4, geo.rdma.count_call + 8 * a.rank, call);
    }
    if (lane == 0) h.rdma.quiet();  // count_out may be staged again in the next call
  }

  if (tid < W) {
    const bool local = h.topo.same_node(tid, a.rank);
    const bool ok =
        local ? wait_at_least(args, view.flag(a.rank, geo.reg.count_call, tid), call, kPhaseCounts, a.rank, tid, call,
                              1, started)
              : h.wait_delivered(args, h.flag(geo.rdma.count_call, tid), call, kPhaseRdmaCounts, tid, call, started);
    if (!ok) dev::st_relaxed(&sh.fail, 1);
  }
  __syncthreads();
  if (sh.fail) return;

  // Source s's count row: in the registered buffer for this node's ranks, in the RDMA region
  // (this call's parity) for the others.
  const auto* nvlink_rows = reinterpret_cast<const int32_t*>(view.own() + geo.reg.count_in);
  const auto* rdma_rows =
      h.multi() ? reinterpret_cast<const int32_t*>(h.rdma.local(geo.rdma.count_in)) + parity_rows * row_stride
                : nullptr;
  auto count_row = [&](int s) {
    return h.topo.same_node(s, a.rank) ? nvlink_rows + s * row_ints : rdma_rows + s * row_stride;
  };
  const InfoLayout& il = geo.info;
  const int64_t R = a.num_out_rows;  // -1: dynamic, the layout decides
  // Per local expert: real rows, and each source's prefix.
  for (int j = tid; j < L; j += blockDim.x) {
    int64_t run = 0;
    for (int s = 0; s < W; ++s) {
      info[il.src_prefix + s * L + j] = run;
      run += ld_count(count_row(s) + W + N + j);
    }
    info[il.expert_rows + j] = run;
  }
  for (int u = tid; u < W * W; u += blockDim.x) info[il.count_matrix + u] = ld_count(count_row(u / W) + (u % W));
  for (int u = tid; u < W * N; u += blockDim.x) info[il.node_counts + u] = ld_count(count_row(u / N) + W + (u % N));
  for (int d = tid; d < W; d += blockDim.x) info[il.send_count + d] = carry[E + d];
  for (int s = tid; s < W; s += blockDim.x) info[il.src_tokens + s] = ld_count(count_row(s) + W + N + L);
  // Every rank's routes in and agreement words, from the same rows on every rank.
  for (int u = tid; u < W * (1 + kAgreeWords); u += blockDim.x) {
    const int d = u / (1 + kAgreeWords), w = u % (1 + kAgreeWords);
    int64_t v = 0;
    if (w == 0)
      for (int s = 0; s < W; ++s) v += ld_count(count_row(s) + tail + kCountRowTail + d);
    else v = ld_count(count_row(d) + tail + 3 + w);
    info[il.agreement + u] = v;
  }
  __syncthreads();
  if (tid == 0) {
    int64_t start = 0;
    for (int j = 0; j < L; ++j) {
      const int64_t n = info[il.expert_rows + j];
      const int64_t rows = round_up(n > geo.min_rows_per_expert ? n : geo.min_rows_per_expert, geo.pad_multiple);
      info[il.expert_start + j] = start;
      info[il.tokens_per_expert + j] = rows;
      start += rows;
    }
    info[il.needed] = start;
    int64_t off = 0;
    for (int s = 0; s < W; ++s) {
      const int64_t n = ld_count(count_row(s) + a.rank);
      info[il.recv_count + s] = n;
      info[il.recv_offset + s] = off;
      off += n;
    }
    info[il.num_recv] = off;
    // The lowest rank with a bad route: every rank reads the same rows, so picks the same.
    sh.bad_rank = -1;
    for (int s = 0; s < W && sh.bad_rank < 0; ++s) {
      const int32_t* row = count_row(s) + tail;
      if (ld_count(row + 1) < 0) continue;
      sh.bad_rank = s;
      sh.bad_token = ld_count(row + 1);
      sh.bad_id = static_cast<int64_t>(static_cast<uint64_t>(static_cast<uint32_t>(ld_count(row + 3))) << 32 |
                                       static_cast<uint32_t>(ld_count(row + 2)));
    }
    info[il.bad_route] = sh.bad_rank;
    info[il.bad_route + 1] = sh.bad_rank < 0 ? -1 : sh.bad_token;
    info[il.bad_route + 2] = sh.bad_rank < 0 ? 0 : sh.bad_id;
  }
  __syncthreads();
  // The direct path: where each source's rows of each local expert start, for the sources to
  // read when they write their rows there themselves (kernels/dispatch_direct.cuh).
  auto* first_row = reinterpret_cast<int32_t*>(view.own() + geo.reg.direct_first);
  for (int u = tid; u < W * L; u += blockDim.x)
    first_row[u] = static_cast<int32_t>(info[il.expert_start + u % L] + info[il.src_prefix + u]);
  if (R >= 0) {
    for (int j = tid; j < L; j += blockDim.x) {
      const int64_t start = info[il.expert_start + j], rows = info[il.tokens_per_expert + j];
      const int64_t n = info[il.expert_rows + j];
      const int64_t lo = start < R ? start : R, hi = start + rows < R ? start + rows : R;
      info[il.tokens_per_expert + j] = hi - lo;
      const int64_t room = R - start > 0 ? R - start : 0;
      const int64_t kept = n < room ? n : room;
      atomicAdd(&sh.dropped, static_cast<unsigned long long>(n - kept));
    }
  }
  __syncthreads();
  if (tid == 0) {
    info[il.dropped] = static_cast<int64_t>(sh.dropped);
    view.state()->dispatch_calls = call;
    if (sh.bad_rank >= 0) refuse_call(args, view, h, sh, call, E);
  }
}

}  // namespace count_impl

}  // namespace hybrid_ep
