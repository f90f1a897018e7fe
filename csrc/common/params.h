// Plain structs shared by the host launchers, the Python bindings and the kernels.
//
// Every pointer is carried as uint64_t so pybind11 can fill the fields from Python
// (tensor.data_ptr()) and the same struct is passed by value to a kernel. The offsets of
// the registered buffer and the RDMA region are built by csrc/bindings/buffer_layout.h, those
// of the per-call info tensor are planned in Python (hybrid_ep/backends/cuda/layout.py), so
// memory_plan() knows them before allocation.
#pragma once
#include <cstddef>
#include <cstdint>

namespace hybrid_ep {

constexpr int kMaxRanks = 288;                 // EP group size: 4 NVLink domains of 72 (the count kernel counts
                                               // ranks in windows of 64, and keeps a column per rank in smem)
constexpr int kMaxDomainRanks = 72;            // ranks of one node, an NVLink domain (GB200 NVL72): the kernels'
                                               // per-node arrays, node-local indices in uint8_t tables
constexpr int kMaxNodes = 128;                 // nodes of an EP group: kStagedTarget + a node in uint8_t tables
constexpr int kMaxLaunchRanks = 72;            // virtual ranks one emulated launch can hold (2 domains of 36)
constexpr int kInlineLaunchRanks = 16;         // of them in the kernel's parameters (LaunchArgs::ranks), the rest
                                               // in device memory (LaunchArgs::more_ranks)
constexpr int kMaxTopK = 16;                   // routes per token (register arrays in the count kernel)
constexpr int kMaxExperts = 1024;              // count kernel keeps [tally warps][E] counters in smem
constexpr int kThreads = 512;                  // threads per dispatch / combine block
constexpr int kChunkTokens = 32;               // tokens per chunk: the unit of signalling between ranks
constexpr int kCountThreads = 1024;            // threads of the one count block per rank
constexpr int kCountTallyWarps = 31;           // its warps that count tokens (kernels/count.cuh: one waits for peers)
constexpr int kCombineMaxSegCols = 8192;       // columns of a row segment a combine reducer group holds in registers
constexpr int kMaxStages = 16;                 // slots of one pipeline's ring (mbarrier arrays are sized by it)
constexpr int kStaticSmemReserve = 16 * 1024;  // a kernel's static shared memory at most: each kernel's shared
                                               // struct is checked against it, and the launch plans leave it out of
                                               // the dynamic shared memory (static + dynamic share one limit)
constexpr int kMaxStoreGroups = 7;  // store groups left in flight: the wait_group switches of kernels/pipeline.cuh
constexpr int kDirectCombinePipelines = 2;  // pipelines of a combine_direct block, sharing its dynamic shared memory
// How a direct-combine reducer warp learns that a stage is full (LaunchArgs::reducer_wait; the
// host picks it from HYBRID_EP_REDUCER_WAIT, a measurement knob): with kReducerWaitObserve and
// kReducerWaitElect lane 0 waits (bounded) and the warp agrees on the verdict; with
// kReducerWaitObserve the other 31 lanes then observe the completed phase themselves, with
// kReducerWaitElect they rely on the agreement's __syncwarp, which orders lane 0's acquire before
// their reads. With kReducerWaitConverged every lane waits (bounded) itself, the warp converged,
// and a vote of lanes that arrive together gives the verdict: no lane runs a wait loop while the
// others stand at a collective. With kReducerWaitNamed one thread of the whole reducer group
// waits (bounded) and the group meets at a named barrier (bar.sync), which hands every warp the
// stage and the verdict at once (Hybrid-EP's hand-off): no warp_uniform, no lane observes.
constexpr int kReducerWaitObserve = 0;
constexpr int kReducerWaitElect = 1;
constexpr int kReducerWaitConverged = 2;
constexpr int kReducerWaitNamed = 3;
// What one stage of a direct-combine pipeline holds (LaunchArgs::combine_stage; the host picks it
// from HYBRID_EP_COMBINE_STAGE, a design under measurement): one route's row segment
// (kCombineStageRoute: a hand-off per route row) or every part of one token's column segment
// (kCombineStageToken: the load warp issues the token's parts under one expected-bytes arrival,
// the reducers wait once, sum the parts, store the segment and release the stage once).
constexpr int kCombineStageRoute = 0;
constexpr int kCombineStageToken = 1;
// Reducer warps per pipeline of a combine_direct block (LaunchArgs::reducer_warps; the host picks
// it from HYBRID_EP_REDUCER_WARPS, a design under measurement): a segment of up to
// kCombineMaxSegCols columns spread over 4 warps (8 vectors a thread, 162 registers)
// or over 8 (4 vectors a thread, 96 registers): each of a stage's parts added by twice the
// threads, each adding half the vectors.
constexpr int kReducerWarpsNarrow = 4;
constexpr int kReducerWarpsWide = 8;
constexpr int kDirectStoreWarps = 2;       // store warps of a direct dispatch block (one store thread each)
constexpr uint32_t kChunkMetaHeader = 16;  // a staged chunk's routing starts with {int32 rows, pad}
// A ring between ranks tags its slots with the call in the high bits and chunk + 1 in the low
// kRingTagChunkBits (kernels/peer_ring.cuh, PeerRing::tag): max_chunks stays below 2^24 - 1, and
// the call field of 40 bits is not reached (2^40 calls: 35 years at 1000 calls a second).
constexpr int kRingTagChunkBits = 24;
constexpr int kAgreeWords = 5;                  // a rank's words of the data-path agreement (RankArgs::agree)
constexpr int kCountRowTail = 4 + kAgreeWords;  // a count row's ints after its per-expert counts: the source's
                                                // tokens, its first bad token (-1: none) and that route's expert
                                                // id (low, high word), then its agreement words; W ints of its
                                                // routes to each rank follow

// The codes below are the one definition of each: the bindings export them to Python by the
// names in the tables after them (TRANSPORTS, DTYPE_CODES, PHASES, PIPE_SITES;
// csrc/bindings/common.h),
// and hybrid_ep/backends/cuda/engine.py reads them from the loaded module. Each enum ends with
// its count, which is not a code.

// The inter-node transport of a build (csrc/transport/rdma.cuh).
enum TransportKind : int32_t { kTransportLoopback = 0, kTransportNvshmem = 1, kNumTransports };

enum DType : int32_t { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kFloat8 = 3, kNumDTypes };

enum Phase : int32_t {
  kPhaseNone = 0,
  kPhaseBadRouting = 1,      // topk_idx out of range or duplicated (peer = token)
  kPhaseDispatchFlow = 2,    // waiting for a peer to finish reading the previous dispatch
  kPhaseCounts = 3,          // waiting for a peer's counts
  kPhaseDispatchRows = 4,    // waiting for a peer's rows
  kPhaseCombineFlow = 5,     // waiting for a peer to finish reading the previous combine
  kPhaseCombineRows = 6,     // waiting for a peer's partial sums
  kPhasePipeline = 7,        // a shared-memory FIFO stage never completed
  kPhaseRdmaFlow = 8,        // waiting for a rail peer on another node to finish reading the previous call
  kPhaseRdmaCounts = 9,      // waiting for the counts of a rank on another node
  kPhaseRdmaRows = 10,       // forwarder: waiting for a chunk of a source on another node (RDMA)
  kPhaseNodePartials = 11,   // forwarder: waiting for a rank of its node's partial sums of a chunk
  kPhaseRdmaPartials = 12,   // source: waiting for the node partial sums of another node (RDMA)
  kPhaseDirectTensors = 13,  // direct path: waiting for a peer to publish its tensors of the call
  kPhaseDirectRows = 14,     // direct path: waiting for a peer to finish writing this rank's output rows
  kPhaseDirectReads = 15,    // direct path: waiting for a peer to finish reading this rank's expert_out
  kPhaseRecvRing = 16,       // dispatch: waiting for a rank of this node to free a chunk slot of its receive ring
  kPhasePartialRing = 17,    // expert host: waiting for source P to free a chunk slot of its partial-sum ring
  kPhaseForwardRing = 18,    // expert host: waiting for rail peer P (forwarding for a source on another node)
                             // to free a chunk slot of its forward ring
  kPhaseNodePartRing = 19,   // forwarder: waiting for source P on another node to free a chunk slot of its
                             // node-partial ring (RDMA)
  kPhaseStagedRing = 20,     // dispatch: waiting for a rail peer on another node to free a chunk slot of its staging
  kNumPhases
};

// The ring of a block's shared memory a pipeline wait (kPhasePipeline) waited on: which
// kernel, and which warps fill and free its stages (kernels/pipeline.cuh, Ring::site).
enum PipeSite : int32_t {
  kSiteNone = 0,           // not a ring's wait
  kSiteSendFifo = 1,       // dispatch: token rows, bulk-loaded by the send load warp, stored by the send store warp
  kSiteExpandFifo = 2,     // dispatch: received rows, bulk-loaded and stored by the expand load / store warps
  kSiteSendEntries = 3,    // dispatch: a chunk's routing entries (meta warps) before its signal (send store warp)
  kSiteExpandTables = 4,   // dispatch: a received chunk's position table (expand meta warps) for the expand warps
  kSiteStagedRows = 5,     // dispatch, several nodes: own chunks staged (send store warp) for the RDMA warps
  kSiteHostInputs = 6,     // combine: expert outputs, bulk-loaded by the host load warp, summed by the host reducers
  kSiteHostPartials = 7,   // combine: partials of the host reducers, bulk-stored by the host store warp
  kSiteSourceParts = 8,    // combine: partials, bulk-loaded by the source load warp, summed by the source reducers
  kSiteForwardPuts = 9,    // combine, several nodes: node partials of the source reducers, put by the put warp
  kSiteDirectRows = 10,    // dispatch_direct: token rows, bulk-loaded by the load warp, stored by the store warps
  kSiteDirectTables = 11,  // dispatch_direct: a chunk's route table (table warp) for the store warps
  kSiteDirectCombineRoutes =
      12,                // combine_direct: routes' expert outputs, bulk-loaded by a load warp, summed by its reducers
  kSiteDirectDone = 13,  // dispatch_direct, several nodes: units the store warps are done with, for the RDMA warp
  kSiteDirectCombinePuts = 14,  // combine_direct, several nodes: node partials of the reducers, put by the put warp
  kNumPipeSites
};

// ErrorRecord::observed of a pipeline wait: which barrier of the slot it waited on.
enum PipeSide : int32_t { kWaitedForData = 0, kWaitedForFreeSlot = 1 };

// The name Python knows a code by; entry i of each table names code i (checked below).
struct CodeName {
  int32_t code;
  const char* name;
};

inline constexpr CodeName kTransportNames[] = {{kTransportLoopback, "loopback"}, {kTransportNvshmem, "nvshmem"}};

// Named as torch names the dtype (str(torch.float8_e4m3fn) less "torch.").
inline constexpr CodeName kDTypeNames[] = {
    {kFloat32, "float32"}, {kBFloat16, "bfloat16"}, {kFloat16, "float16"}, {kFloat8, "float8_e4m3fn"}};

inline constexpr CodeName kPhaseNames[] = {
    {kPhaseNone, "none"},
    {kPhaseBadRouting, "bad_routing"},
    {kPhaseDispatchFlow, "dispatch_flow"},
    {kPhaseCounts, "counts"},
    {kPhaseDispatchRows, "dispatch_rows"},
    {kPhaseCombineFlow, "combine_flow"},
    {kPhaseCombineRows, "combine_rows"},
    {kPhasePipeline, "pipeline"},
    {kPhaseRdmaFlow, "rdma_flow"},
    {kPhaseRdmaCounts, "rdma_counts"},
    {kPhaseRdmaRows, "rdma_rows"},
    {kPhaseNodePartials, "node_partials"},
    {kPhaseRdmaPartials, "rdma_partials"},
    {kPhaseDirectTensors, "direct_tensors"},
    {kPhaseDirectRows, "direct_rows"},
    {kPhaseDirectReads, "direct_reads"},
    {kPhaseRecvRing, "recv_ring"},
    {kPhasePartialRing, "partial_ring"},
    {kPhaseForwardRing, "forward_ring"},
    {kPhaseNodePartRing, "node_part_ring"},
    {kPhaseStagedRing, "staged_ring"},
};

inline constexpr CodeName kPipeSiteNames[] = {
    {kSiteNone, "none"},
    {kSiteSendFifo, "send_fifo"},
    {kSiteExpandFifo, "expand_fifo"},
    {kSiteSendEntries, "send_entries"},
    {kSiteExpandTables, "expand_tables"},
    {kSiteStagedRows, "staged_rows"},
    {kSiteHostInputs, "host_inputs"},
    {kSiteHostPartials, "host_partials"},
    {kSiteSourceParts, "source_partials"},
    {kSiteForwardPuts, "forward_puts"},
    {kSiteDirectRows, "direct_rows"},
    {kSiteDirectTables, "direct_tables"},
    {kSiteDirectCombineRoutes, "direct_combine_routes"},
    {kSiteDirectDone, "direct_done"},
    {kSiteDirectCombinePuts, "direct_combine_puts"},
};

// Every code named once, in order: a code added to an enum without a name does not compile.
template <size_t N>
constexpr bool names_every_code(const CodeName (&names)[N], int count) {
  if (N != static_cast<size_t>(count)) return false;
  for (size_t i = 0; i < N; ++i)
    if (names[i].code != static_cast<int32_t>(i)) return false;
  return true;
}
static_assert(names_every_code(kTransportNames, kNumTransports), "kTransportNames must name every TransportKind");
static_assert(names_every_code(kDTypeNames, kNumDTypes), "kDTypeNames must name every DType");
static_assert(names_every_code(kPhaseNames, kNumPhases), "kPhaseNames must name every Phase");
static_assert(names_every_code(kPipeSiteNames, kNumPipeSites), "kPipeSiteNames must name every PipeSite");

// One family of rings between ranks in a buffer (kernels/peer_ring.cuh): `rings` rings of
// `slots` chunk slots each (csrc/bindings/buffer_layout.h sizes them).
struct RingLayout {
  uint64_t rings;
  uint64_t slots;
};

// Offsets (bytes) inside one rank's registered buffer. Peers write into it. Built by
// csrc/bindings/buffer_layout.h (its regions: the memory plan's lines).
struct RegLayout {
  uint64_t count_call;      // u64 [W]: the call whose counts source s wrote
  uint64_t recv_signal;     // ChunkSignal [W][max_chunks]: chunk c of source s arrived
  uint64_t max_chunks;      // ceil(max_tokens / kChunkTokens)
  uint64_t done_dispatch;   // u64: last dispatch call whose receive buffers were fully read
  uint64_t done_combine;    // u64: last combine call whose partial buffers were fully read
  uint64_t state;           // LocalState (only this rank touches it)
  uint64_t count_in;        // i32 [W][count_row_ints]: counts written by source s
  uint64_t count_row_ints;  // W (rows to each rank) + N (tokens to each node) + L (rows per my expert)
                            // + kCountRowTail (the source's tokens, its first bad route, its agreement
                            // words) + W (its routes to each rank)
  // The receive rings (recv: a ring per source s, slot rows for the chunk's rows to this rank):
  // written by s, or for a source on another node by its rail peer on this node (the forwarder).
  RingLayout recv;
  uint64_t recv_meta;     // MetaEntry [W][slots][kChunkTokens][meta_entries]
  uint64_t meta_entries;  // entries per received row: min(L, kMaxTopK)
  uint64_t recv_rows;     // rows [W][slots][kChunkTokens], each the call's row bytes (packed: a chunk's
                          // rows are contiguous); sized for rows of the buffer's ring dtype
  uint64_t row_stride;    // bytes per row at the ring dtype (BufferConfig.ring_dtype): the region's size
  uint64_t recv_scales;   // f32 [W][slots][kChunkTokens][scale_stride / 4]
  uint64_t scale_stride;
  uint64_t recv_credit;  // u64 [N][G][recv slots], the credits of the receive rings this rank writes:
                         // [source node n][reader g of this node][slot]
  // The partial-sum rings (partial: a ring per expert host g of this node, written by g) and, with
  // several nodes, the forward rings (forward: partials for a source on another node whose rail
  // peer this rank is, a ring per (source node, writer g of this node)).
  RingLayout partial, forward;
  uint64_t partial_signal;  // u64 [G][partial slots]: host g stored its partials of the slot's chunk
  uint64_t partial_credit;  // u64 [G][partial slots]: source g of this node read this rank's partials
  uint64_t partial_rows;    // [G][partial slots][kChunkTokens] rows, each the call's row in the wire dtype
                          // (packed); row q the q-th of the chunk's receive slots at the host; sized for the ring dtype
  uint64_t wire_stride;     // bytes per partial-sum row (partial, forward, node_part rings) at the ring
                            // dtype, the widest wire dtype they carry: the regions' size
  uint64_t forward_rows;    // [N][G][forward slots][kChunkTokens] rows in the wire dtype (packed), row q
                            // the q-th of the chunk's receive slots at writer g
  uint64_t forward_signal;  // u64 [N][G][forward slots]: writer g stored its partials of the slot's chunk
  uint64_t forward_credit;  // u64 [W][forward slots]: the rail peer of source s read this rank's partials
  // The direct path (a single node whose ranks can address each other's tensors: sources write
  // output rows straight into their final row, and read expert outputs straight from their row).
  uint64_t direct_tensors;  // PeerTensors [2]: this rank's tensors of the running dispatch [0] / combine [1]
  uint64_t direct_first;    // i32 [W][L]: first output row of source s's rows of local expert j (count kernel)
  uint64_t direct_done;     // u64 [2][W]: source s finished writing this rank's output rows [0] / reading its
                            // expert_out [1] in that call (the call)
  uint64_t total;
};

// A rank's tensors of the running call that its peers write (dispatch) or read (combine) on
// the direct path: offsets from the rank's arena base (RankArgs::peer_bases), published with
// the call once the tensors exist.
struct PeerTensors {
  uint64_t call;
  uint64_t rows;     // dispatch: the output rows [R, H]; combine: expert_out [R, C]
  uint64_t probs;    // [R] f32 routing weight of each output row
  uint64_t scales;   // dispatch with fp8 rows: [R, H/128] f32
  int64_t num_rows;  // R
  uint64_t pad[3];
};

// Offsets (bytes) inside one rank's RDMA region (the symmetric heap on clusters: the same
// offsets on every rank). Only ranks on other nodes write into it, through the transport. Built
// by csrc/bindings/buffer_layout.h. The staging rings (staged) and node-partial rings
// (node_part): a ring per node n (this rank's own node's stays unused, which keeps every offset
// the same on every rank), row q of a chunk's slot the chunk's q-th token for that node.
struct RdmaLayout {
  RingLayout staged, node_part;
  uint64_t count_call;          // u64 [W]: a source on another node wrote its counts (the call)
  uint64_t count_out;           // i32 [W][count_row_ints]: this rank's count rows, staged for the puts
  uint64_t count_in;            // i32 [2][W][count_row_ints]: counts from sources on other nodes, by call parity
  uint64_t done_dispatch;       // u64 [N]: the rail peer on node n finished forwarding this rank's rows (the call)
  uint64_t done_combine;        // u64 [N]: the rail peer on node n finished reading the node partials
                                // this rank sent it (the call)
  uint64_t staged_signal;       // u64 [N][max_chunks]: chunk c of the rail peer on node n arrived (its tag)
  uint64_t token_meta_bytes;    // bytes of one staged token's routing (TokenMeta + scales)
  uint64_t chunk_meta_bytes;    // bytes of one staged chunk's routing: a 16-byte header + kChunkTokens tokens
  uint64_t staged_meta_out;     // [N][staged slots] chunk routing staged for node n's rail peer
  uint64_t staged_meta_in;      // [N][staged slots] chunk routing from the rail peer on node n
  uint64_t staged_rows_out;     // [N][staged slots][kChunkTokens] rows staged for node n (packed, call's row size)
  uint64_t staged_rows_in;      // [N][staged slots][kChunkTokens] rows from the rail peer on node n
  uint64_t staged_credit;       // u64 [N][staged slots]: the rail peer on node n forwarded this rank's staged chunk
  uint64_t node_part_signal;    // u64 [N][node_part slots]: the node partials of the slot's chunk from node n arrived
  uint64_t node_part_credit;    // u64 [N][node_part slots]: the source on node n read the node partials this rank
                                // put it: the slot is free here and there
  uint64_t node_part_rows_out;  // [N][node_part slots][kChunkTokens] node partials staged for the source on node n
  uint64_t node_part_rows_in;   // [N][node_part slots][kChunkTokens] node partials from node n (wire dtype, packed)
  uint64_t total;
};

// The routing of one staged token, as its source computed it: what the forwarder needs to
// write the entries of every rank of its node, and the receive slot at each of them.
// Followed by G int32 slots and scale_cols floats (fp8) in the staged record.
struct TokenMeta {
  int32_t expert[kMaxTopK];  // global expert, -1 for none
  int32_t ordinal[kMaxTopK];
  float weight[kMaxTopK];
};

// Offsets (int64 elements) inside the per-call info tensor the count kernel fills.
struct InfoLayout {
  int64_t tokens_per_expert;  // [L] output rows per local expert, padding included, clipped at R
  int64_t expert_start;       // [L] first output row of each local expert
  int64_t expert_rows;        // [L] real (routed) rows of each local expert, before clipping
  int64_t src_prefix;         // [W][L] rows of expert j that come from sources before s
  int64_t recv_count;         // [W] rows received from each source
  int64_t src_tokens;         // [W] tokens of each source (its chunks: ceil(tokens / kChunkTokens))
  int64_t recv_offset;        // [W] exclusive prefix of recv_count
  int64_t send_count;         // [W] rows sent to each rank
  int64_t needed;             // [1] rows the unclipped layout needs
  int64_t bad_route;          // [3] the lowest rank with a bad route, its first bad token and expert id,
                              // the same on every rank (rank -1: none); right after needed, for one read
  int64_t agreement;          // [W][1 + kAgreeWords] per rank d: the routes every source sends to d (its
                              // output rows before padding), then d's agreement words; the same on every
                              // rank, right after bad_route, for the same read
  int64_t dropped;            // [1] routed entries that did not fit num_out_tokens
  int64_t num_recv;           // [1] rows received in total
  int64_t count_matrix;       // [W][W] rows sent from s to d (all ranks)
  int64_t node_counts;        // [W][N] tokens of s that reach node n
  int64_t total;
};

struct Geometry {
  int32_t world_size, ranks_per_node, num_nodes;
  int32_t num_experts, local_experts;
  int32_t max_tokens, hidden;
  int32_t pad_multiple, min_rows_per_expert;
  int32_t transport;  // TransportKind of the inter-node path (used only when num_nodes > 1)
  int32_t pad;
  RegLayout reg;
  RdmaLayout rdma;
  InfoLayout info;
};

// Host-visible error record (pinned host memory, mapped into the device address space).
// A flag wait records the flag's target (expected) and the last value it read (observed); a
// pipeline wait records its ring (site), the barrier's parity (expected) and which barrier of
// the slot (observed: PipeSide).
struct ErrorRecord {
  int32_t phase;  // Phase; 0 = no error
  int32_t rank;
  int32_t peer;
  int32_t site;  // PipeSite of a pipeline wait, else kSiteNone
  uint64_t call;
  uint64_t expected;
  uint64_t observed;
};

// One rank's view of one call. In production a launch holds one RankArgs; the single-GPU
// emulation puts every virtual rank of the group into one launch.
struct RankArgs {
  int32_t rank;
  int32_t absent;              // test hook: this virtual rank never arrives
  int32_t num_tokens;          // T on this rank
  int32_t topk;                // K
  uint64_t peers;              // device array of W registered-buffer base pointers (own included)
  uint64_t x;                  // [T, H] rows
  uint64_t x_scales;           // [T, H/128] f32 (fp8 only)
  uint64_t topk_idx;           // [T, K] i64
  uint64_t topk_weights;       // [T, K] f32
  uint64_t send_ord;           // [T, W] i32: position of token t in the rows sent to d, -1 if none
  uint64_t entry_ord;          // [T, K] i32: ordinal of (t, k) among this rank's tokens of expert e
  uint64_t info;               // InfoLayout tensor (i64)
  uint64_t out;                // [R, H] dispatch output
  uint64_t out_scales;         // [R, H/128] f32
  uint64_t out_probs;          // [R] f32
  uint64_t row_pos;            // [W, max_tokens, kd] i32 output row of each entry of a received row
  uint64_t recv_spans;         // [W, max_chunks, 2] i32 (first slot, rows) of each chunk received (dispatch
                               // writes it, combine reads it: the handle's, not the registered buffer's)
  uint64_t fwd_slots;          // [N, max_chunks * kChunkTokens, G] i32: receive slot at each rank of this node
                               // of each token forwarded for the rail peer on node n, -1 if none (handle's)
  uint64_t fwd_rows;           // [N, max_chunks] i32: tokens of each forwarded chunk (handle's)
  uint64_t rdma_regions;       // loopback: device array [W] of every rank's RDMA-region base
  uint64_t rdma_base;          // NVSHMEM: this PE's address of the symmetric RDMA region
  uint64_t rdma_pes;           // NVSHMEM: device i32 [W], the PE of each rank
  int64_t num_out_rows;        // R, or -1 before it is known (count kernel, dynamic mode)
  uint64_t expert_out;         // [R, C] combine input
  uint64_t probs;              // [R] f32 routing weight of each output row (apply_probs)
  uint64_t y;                  // [T, C] combine output
  uint64_t route_rows;         // direct path: [T, K] i32 output row of each route at its expert's rank, -1 if none
                               // (dispatch writes it, combine reads it: the handle's)
  uint64_t peer_bases;         // direct path: device u64 [W], where each rank's peer memory starts in this process
                               // (every published tensor offset is relative to it; 0 in single-process emulation)
  uint64_t fwd_routes;         // direct path, several nodes: [N, max_chunks * kChunkTokens, fwd_route_width] i32:
                               // the routes to this node of each token forwarded for the rail peer on node n,
                               // output row * kMaxDomainRanks + local index of its rank, -1 after the last
                               // (handle's)
  int32_t agree[kAgreeWords];  // the count kernel hands these to every rank in its count rows
                               // (info.agreement): the peer memory's state the data path is agreed on
                               // (hybrid_ep/backends/cuda/agreement.py)
  int32_t refused;             // 0, or the code of the argument this rank refused (no tokens then): the count
                               // kernel hands every rank the refusal in its bad-route words, its token
                               // geo.max_tokens (kernels/count.cuh; hybrid_ep/refusals.py names the codes)
};

// Routes to one node a forwarded token can have on the direct path (fwd_routes' width): at most
// its routes, at most the node's experts.
inline constexpr int fwd_route_width(const Geometry& g) {
  return kMaxTopK < g.ranks_per_node * g.local_experts ? kMaxTopK : g.ranks_per_node * g.local_experts;
}

struct LaunchArgs {
  Geometry geo;
  int32_t num_ranks;   // RankArgs in this launch (1 in production)
  int32_t num_sms;     // blocks per rank, one per SM
  int32_t dtype;       // DType of the rows (dispatch input / combine input)
  int32_t row_elems;   // elements per row moved by this call (combine may use < hidden)
  int32_t scale_cols;  // f32 scales per row (fp8 dispatch), else 0
  int32_t kd;          // entries per received row kept in row_pos: min(K, L)
  int32_t apply_probs;
  int32_t chunk_tokens;  // tokens per dispatch chunk (one signal per chunk and destination)
  int32_t fifo_stages;
  int32_t stage_bytes;
  int32_t rows_per_stage;  // whole rows batched in one stage (1: a row fills a stage or more)
  int32_t store_groups;    // bulk-store groups whose stages stay held while they read (every FIFO
                           // with stores: dispatch send and expand, combine expert host)
  int32_t wire_dtype;      // combine: DType of the partial sums between ranks (kFloat32 or dtype)
  int32_t seg_cols;        // combine: columns per route stage (the whole row up to 8192, else a multiple of 8);
                           // token stages size their own (combine_direct.cuh, token_segment_cols)
  int32_t host_stages;     // combine: stages of expert-output segments (seg_cols of dtype each), and their bytes
  int32_t host_stage_bytes;
  int32_t host_out_stages;  // combine: stages of partials the expert host stores (seg_cols of wire_dtype)
  int32_t src_stages;       // combine: stages of partials the source sums, and their bytes (seg_cols of wire_dtype)
  int32_t src_stage_bytes;
  int32_t reducer_wait;                         // combine_direct: kReducerWait{Observe,Elect,Converged,Named}
  int32_t reducer_warps = kReducerWarpsNarrow;  // combine_direct: kReducerWarpsNarrow or kReducerWarpsWide
  int32_t combine_stage = kCombineStageRoute;   // combine_direct: kCombineStage{Route,Token}
  int32_t store_runs = 0;  // dispatch_direct: a stage's consecutive rows bound for consecutive rows of one
                           // destination leave as one bulk store (1), or every row alone (0)
  int32_t info_read;       // count: the host reads its info before it launches the dispatch kernel
                           // (dynamic size): a bad route is reported there, not in bad_route
  uint64_t timeout_ns;
  uint64_t abort_flag;  // device i32: set by the first failing wait; every wait polls it
  uint64_t error;       // ErrorRecord* in mapped pinned host memory
  uint64_t bad_route;   // ErrorRecord* (mapped pinned host memory) of the last bad route a count kernel
                        // found without a host read (a static size): reported, not a failure (no abort)
  // Ranks past kInlineLaunchRanks (an emulated launch of more ranks): device RankArgs[num_ranks -
  // kInlineLaunchRanks] the host stages before the launch, else 0. A production launch holds one
  // rank, so its parameters keep 16 ranks' size whatever the emulation's limit.
  uint64_t more_ranks;
  RankArgs ranks[kInlineLaunchRanks];
};

// Per-rank device state in the registered buffer; only the owning rank touches it.
struct LocalState {
  uint64_t dispatch_calls;        // dispatch calls started (the count kernel bumps it)
  uint64_t combine_calls;         // combine calls finished
  uint32_t blocks_done_dispatch;  // blocks of the running dispatch that finished
  uint32_t blocks_done_combine;
};

// Chunk c of source s has arrived at this rank: its rows are slots [first, first + rows) of
// the source's receive area. Written by the source (first, rows, then the chunk's ring tag with
// release: kernels/peer_ring.cuh) for every chunk and destination, also with rows = 0.
struct ChunkSignal {
  uint64_t tag;
  int32_t first;
  int32_t rows;
};

// One (local expert, ordinal, weight) of a row sent to a rank. j = -1 marks an unused entry.
struct MetaEntry {
  int32_t local_expert;
  int32_t ordinal;
  float prob;
  int32_t pad;
};

}  // namespace hybrid_ep
