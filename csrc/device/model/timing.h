// The timing model of the CPU model: a virtual clock per thread, advanced by the costs of the
// device layer's operations, and waits that take the time of what they waited for.
//
// The scheduler (runtime.cpp) tells a Timer what each thread does, in the order the seeded
// schedule runs it; the Timer only observes, so the schedule, the checks and the kernels'
// own timeouts are the same with timing on or off. Which phase, flag value or bulk group
// satisfies a wait is fixed by the kernels' program order, not by the schedule, so the
// clocks follow the kernels' causal order: a wait ends at the later of the thread's own
// time and the time of the event it waited for plus that hand-off's latency (max-plus).
//
//   - own work: each operation costs its constant on the thread that runs it; plain code
//     between them where it converts 16-bit floats (the reductions), per instruction of a
//     pair (its kind's count, below), where the hot loops load and store through the
//     device layer's accessors (dev::ld, dev::st), and per vector a reducer adds in a loop
//     with a branch around each vector's load and add (dev::PlainCode::kBoundedVector: the
//     branches' latency, bounded_vector_ns);
//   - issue slots: plain code is also counted in warp instructions (per access, per pair by the
//     kind of conversion, per block of plain code a kernel names (dev::plain_code: the count
//     kernel's tile loop): counts from the kernels' SASS), issued on the SM's scheduler of its
//     warp (warp w on scheduler w % 4), one instruction per cycle per scheduler and per warp.
//     The lanes of a warp run the same instructions, so only a lane ahead of its warp's count
//     takes slots; a lane behind runs on no earlier than the warp issued the same instruction.
//     A warp that spins (a failed try_wait, a failed poll of global memory) issues a turn of
//     spin_instructions per try_wait turn or poll from then until its next operation, taken
//     from the other warps of its scheduler (at most half of it while they work);
//   - plain loads and stores (dev::ld / dev::st): each costs its instructions on its thread. Loads
//     in a row overlap: they form a batch that costs the latency of its slowest memory class
//     (shared, L2 or device memory), paid when the batch ends: at the thread's next store, at a
//     dev::chain() (the loads after it depend on those before), or at its next operation of
//     any other kind above (a synchronisation, a copy, a fence, its exit). A plain global store
//     also takes its SM's request path to the crossbar: its write requests (request_ns each),
//     a lane's stores in a row as one piece of the copy engine's store calendar, placed at the lane's
//     next other operation by its time there (the lane does not wait for it);
//   - global reads (plain and bulk loads) by traffic class, per 64-byte unit: written in the
//     launch (rows a peer just stored), read before in the launch (re-reads), neither (input
//     rows streamed in); each class hits in L2 with its fraction, which sets a load's latency
//     (L2 or device memory) and the bytes it moves through device memory. Which read of a line
//     comes first follows the schedule, not the clocks;
//   - device memory: one calendar for the launch (every SM, every rank of the emulation: one
//     GPU's bandwidth for all, an upper bound on the sharing), which the misses and every
//     global write go through, bulk copies from their start through the engine on;
//   - __syncthreads, named barriers (bar.sync), warp collectives: every participant runs on at the
//     last arrival's time plus the barrier's cost (a bar.sync's is __syncthreads', barrier_ns);
//   - mbarriers: a phase completes at the latest of its arrivals and of the bulk loads that
//     completed bytes on it; a try_wait that finds it complete ends at that time plus the
//     wake-up (a try_wait that fails costs the thread nothing: how often a thread spins depends
//     on the schedule, not on time; its warp's issue slots while it spins are costed above);
//   - flags: a release store, reduction or atomic stamps the address with its writer's time
//     (the latest, for several writes); a poll that reads a value written in the launch
//     ends at that time plus the flag latency; polls of values from before the launch cost
//     the thread nothing; a global atomic also runs after the atomics before it at its address;
//   - posted puts (runtime.h, set_posted_puts: a cluster's NIC, not the emulation's copy by the
//     warp's lanes): the issuing thread pays the post; the bytes go through the putting rank's
//     NIC and the receiving rank's, one calendar each per direction, at the NIC's rate, first come
//     (in the schedule) first served, from the post on; the op is seen on the other node the
//     network latency after its last byte, and no earlier than the thread's previous op to that
//     rank (one queue pair per peer delivers in order); its signal is stamped then; a quiet ends
//     when the acknowledgement of the thread's last op is back (another latency). The NIC's
//     reads and writes of device memory are not put on its calendar;
//   - bulk copies: the issuing thread pays the issue; a thread's copies of one direction start
//     through the engine at least an issue interval apart (load_issue_interval_ns,
//     store_issue_interval_ns: the microbenchmarks' one thread moved copies of 8 KiB in the
//     time of 16); the bytes go through the SM's copy
//     engine, one calendar per direction (loads come in from the crossbar, stores and plain
//     store requests go out to it: the two run side by side, as the microbenchmarks' mixes of
//     one load and 2-8 stores show), first come (by issue time) first served, a
//     load's at the engine's load rate and a store's at its store rate; a load completes its bytes on the mbarrier
//     after its last byte plus the load latency, a store has read its shared memory after its last byte plus the read
//     latency and written after the write latency; a bulk wait ends at the latest read or write of the groups it
//     covers.
//
// The schedule runs threads in no order of their clocks, so a copy may be issued (in the
// schedule) before another copy of the same SM that was issued earlier in virtual time. A
// copy is therefore placed on its engine's calendar only when its time is needed (the load
// lands, a wait covers the store, the launch ends): then after the copies already placed, and
// after those still open that were issued before it, ahead of the open ones issued after it.
// What still depends on the schedule is which copies are placed by then; the tests bound it.
//
// A report per launch gives the kernel's time (the last thread's end, or the last copy's
// write, plus the launch cost), per warp role the busy time and the waits by site (its busiest
// lane's, and per group of its lanes that passed the same synchronisation sites: the paths of a
// diverged warp), and the critical path: each wait that another thread's event decided
// remembers that event, so the path is walked back from the last thread to the launch's start.
#pragma once
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <limits>
#include <map>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "device/model/runtime.h"

namespace hybrid_ep::model::timing {

// The constants (name, what it is); each is in ns except the rates (*_bytes_per_ns, sm_clock_ghz), the instruction
// counts and the fractions.
#define HYBRID_EP_TIMING_COSTS(X)                                                                                     \
  X(launch_ns, "a launch's fixed cost, added to its last thread's end")                                               \
  X(barrier_ns, "__syncthreads or a named barrier (bar.sync): the last arrival -> every participant runs on")         \
  X(collective_ns, "a warp collective (__syncwarp, __shfl_sync, __ballot_sync): the last lane -> all run on")         \
  X(reconverge_ns,                                                                                                    \
    "a warp collective that some of its lanes, not all, reach from an mbarrier wait since the warp's last "           \
    "collective (a lane in a wait loop while the others stand at the collective): the last lane -> all run on")       \
  X(arrive_ns, "an mbarrier arrive (with or without expect_tx), on the arriving thread")                              \
  X(try_wait_ns, "an mbarrier try_wait that finds its phase complete, on the waiting thread")                         \
  X(wake_ns, "an mbarrier phase completes -> a thread waiting on it runs on")                                         \
  X(poll_ns, "a flag load (acquire or volatile) that reads a value written in the launch")                            \
  X(flag_latency_ns, "a flag's release store, reduction or atomic -> a poll on the same GPU reads it")                \
  X(release_ns, "a release store or reduction to global memory, on the writing thread")                               \
  X(atomic_ns, "a global-memory atomic (add, min, CAS), on the calling thread")                                       \
  X(fence_gpu_ns, "__threadfence")                                                                                    \
  X(fence_sys_ns, "__threadfence_system")                                                                             \
  X(fence_proxy_ns, "fence.proxy.async")                                                                              \
  X(issue_ns, "a bulk copy's issue, on the issuing thread")                                                           \
  X(commit_ns, "a bulk-group commit")                                                                                 \
  X(wait_group_ns, "a bulk wait_group whose groups are done, on the waiting thread")                                  \
  X(g2s_latency_ns, "bulk load: its last byte through the copy engine -> its bytes complete on the mbarrier")         \
  X(s2g_read_latency_ns, "bulk store: its last byte through the copy engine -> its shared memory is read")            \
  X(s2g_write_latency_ns, "bulk store: its shared memory read -> its writes are visible")                             \
  X(engine_load_bytes_per_ns, "an SM's copy engine (TMA): bytes per ns of a bulk load (global -> shared)")            \
  X(engine_store_bytes_per_ns, "an SM's copy engine (TMA): bytes per ns of a bulk store (shared -> global)")          \
  X(store_copy_ns, "a bulk store's fixed time on its SM's copy engine beside its bytes (docs/dev/request_path.md)")   \
  X(load_issue_interval_ns,                                                                                           \
    "a thread's bulk loads: the least time from one's start through the copy engine to its next's (one thread's "     \
    "copies of 2-32 KiB each took as long, whatever their bytes)")                                                    \
  X(store_issue_interval_ns,                                                                                          \
    "a thread's bulk stores: the least time from one's start through the copy engine to its next's (one thread's "    \
    "stores of 8 KiB or less each took as long)")                                                                     \
  X(request_ns,                                                                                                       \
    "a write request (a 32-byte sector) of a plain global store on its SM's L1TEX-to-crossbar path, which the "       \
    "bulk stores take as well (the copy engine's store calendar): one per store under 16 bytes, half per 16-byte "    \
    "vector")                                                                                                         \
  X(pair_instruction_ns,                                                                                              \
    "per warp instruction of a converted pair (16-bit floats to or from fp32), what it costs the converting "         \
    "thread beside its issue slot: the loop's dependent latency, so a loop of fewer instructions costs less")         \
  X(smem_load_ns, "a batch of plain loads from shared memory: issue -> the values are there")                         \
  X(gmem_load_ns, "a batch of plain loads with one from device memory (an L2 miss): issue -> the values are there")   \
  X(l2_load_ns, "a batch of plain global loads that all hit in L2: issue -> the values are there")                    \
  X(g2s_l2_latency_ns, "bulk load from L2: its last byte through the copy engine -> complete on the mbarrier")        \
  X(sm_clock_ghz, "SM cycles per ns: the issue slots' clock")                                                         \
  X(access_instructions, "warp instructions per plain access of a hot loop (dev::ld, dev::st)")                       \
  X(cvt_pair_instructions,                                                                                            \
    "warp instructions per pair widened with the cvt builtins (__bfloat1622float2, __half22float2), with "            \
    "the loop around it")                                                                                             \
  X(shift_pair_instructions,                                                                                          \
    "warp instructions per bf16 pair widened by shift and mask (dev::bf16x2_to_float2), "                             \
    "with the loop around it")                                                                                        \
  X(pack_pair_instructions, "warp instructions per pair narrowed (__float22bfloat162_rn, __float22half2_rn)")         \
  X(plain_code_cycles,                                                                                                \
    "SM cycles of its scheduler per warp instruction of named plain code (dev::plain_code: the count kernel's "       \
    "blocks), for a mix whose pipes issue slower than one instruction per cycle")                                     \
  X(bounded_vector_instructions,                                                                                      \
    "warp instructions per vector a reducer thread adds in a bounded loop (dev::PlainCode::kBoundedVector: a "        \
    "branch around its load and one around its add) beyond the same vector in a straight block")                      \
  X(bounded_vector_ns,                                                                                                \
    "per vector of a bounded loop (kBoundedVector), the reducer thread's time beside those instructions' issue "      \
    "slots: the branches' dependent latency")                                                                         \
  X(count_tile_instructions,                                                                                          \
    "warp instructions per tile of the count kernel (dev::PlainCode::kCountTile): zeroing, prefix popcs, the "        \
    "loop's head and tail, the routes k >= K skipped")                                                                \
  X(count_route_instructions,                                                                                         \
    "warp instructions per route of a tile's token (kCountRoute): its load, rank and node (two divisions), "          \
    "atomicOr, ordinal")                                                                                              \
  X(count_route_pair_instructions,                                                                                    \
    "warp instructions per pair of a token's routes (kCountRoutePair): the duplicate check")                          \
  X(count_dest_instructions,                                                                                          \
    "warp instructions per destination rank of a tile (kCountDest): two ballots, its count, a send_ord store")        \
  X(count_node_instructions, "warp instructions per destination node of a tile (kCountNode): a ballot and its count") \
  X(count_scan_column_instructions,                                                                                   \
    "warp instructions per counter column a lane scans over the warps' counts (kCountScanColumn, the tally warps "    \
    "unrolled)")                                                                                                      \
  X(spin_instructions, "warp instructions per turn of a spinning wait (a failed poll or try_wait, its loop)")         \
  X(spin_period_ns, "one turn of a warp spinning on an mbarrier (try_wait that fails and its loop)")                  \
  X(hbm_bytes_per_ns, "device memory: bytes per ns read and written, all SMs of the launch together")                 \
  X(l2_hit_written, "L2-hit fraction of global reads of lines written in the launch (rows a peer just wrote)")        \
  X(l2_hit_reread, "L2-hit fraction of global reads of lines read before in the launch (re-reads)")                   \
  X(l2_hit_stream, "L2-hit fraction of global reads of lines not touched before in the launch (input rows)")          \
  X(nic_post_ns,                                                                                                      \
    "a posted put or signal (runtime.h, set_posted_puts), on the issuing thread: building and posting its work "      \
    "request")                                                                                                        \
  X(nic_bytes_per_ns, "a rank's NIC: bytes per ns of posted puts, out of it and into it, each direction apart")       \
  X(nic_latency_ns,                                                                                                   \
    "a posted put's last byte through the NIC -> its signal is seen on the other node; the same again for its "       \
    "acknowledgement (a quiet)")

struct Costs {
#define HYBRID_EP_TIMING_FIELD(name, what) double name = 0;
  HYBRID_EP_TIMING_COSTS(HYBRID_EP_TIMING_FIELD)
#undef HYBRID_EP_TIMING_FIELD
};

// (name, meaning) of every constant, in Costs' order.
const std::vector<std::pair<std::string, std::string>>& cost_fields();
// Costs from a full table of name -> value; the message names a missing, unknown or
// invalid entry (every cost >= 0, the engine's capacity > 0).
bool costs_from(const std::map<std::string, double>& table, Costs& out, std::string& message);

struct RoleTime {
  int warp = 0;                                       // the role: the warp's index in its block
  double busy_ns = 0, end_ns = 0;                     // means over the blocks
  std::vector<std::pair<std::string, double>> waits;  // wait site -> ns, mean over the blocks
  // The warp's lanes grouped by the synchronisation sites they passed (with or without a wait):
  // lanes that went through different sites ran different code, so a warp whose lanes wait at
  // different sites at once is diverged, one group per path (lane 0 spinning on an mbarrier, the
  // others at the __syncwarp after it). Per group, its lanes and blocks, and its busiest lane's
  // times, mean over the blocks it is in. The fields above are the busiest lane of the warp's.
  struct Path {
    int lanes = 0, blocks = 0;  // lanes of the group, all blocks together; blocks it is in
    double busy_ns = 0, end_ns = 0;
    std::vector<std::pair<std::string, double>> waits;
  };
  std::vector<Path> paths;
};

struct Report {
  std::string kernel;
  int table = 0;  // which of the configured cost tables
  int blocks = 0, threads = 0;
  double time_ns = 0;
  std::vector<RoleTime> roles;
  std::vector<std::pair<std::string, double>> critical_path;  // what -> ns on the path, largest first
  std::vector<double> block_end_ns;                           // when each block's last thread ended
  double engine_busy_ns = 0;  // the copy engine's busy time (its busier direction), mean over the blocks
  uint64_t copies = 0, copy_bytes = 0;
  // The plain accesses of the hot loops (dev::ld / dev::st), every thread's together, by
  // memory class: [kShared], [kGlobal].
  struct Accesses {
    uint64_t loads = 0, stores = 0, load_bytes = 0, store_bytes = 0;
  };
  static constexpr int kShared = 0, kGlobal = 1;
  Accesses plain[2];
  uint64_t chains = 0;  // dev::chain() calls
  // Issue slots: warp instructions the SMs' schedulers issued for plain code (accessors,
  // converted pairs) and for spinning waits, every block's together.
  double instructions = 0, spin_instructions = 0;
  // Global reads (bulk loads and plain loads) by traffic class: lines written in the launch,
  // lines read before in the launch, lines not touched before; their bytes and the bytes
  // served from L2. hbm_bytes: what went through device memory (misses and every write).
  struct Reads {
    double bytes = 0, l2_bytes = 0;
  };
  static constexpr int kWritten = 0, kReread = 1, kStream = 2;
  Reads reads[3];
  double hbm_bytes = 0;
  double nic_bytes = 0;  // bytes of posted puts, every rank's together (runtime.h, set_posted_puts)
};

// The cost tables of the next launches (none: timing off, the model as it is without it), and
// the reports of the launches since the last take_reports. Several tables time one run at
// once, each with its own clocks (the schedule does not depend on them): one report per
// launch and table.
void configure(std::vector<Costs> tables);
const std::vector<Costs>& configured();
void add_report(Report report);
std::vector<Report> take_reports();

constexpr double kNever = -std::numeric_limits<double>::infinity();

// An event a wait may depend on: when the waiter may run on (before the hand-off's latency),
// and for the critical path where it came from: the thread's role and path node at the time
// `t_src` the event started on that thread, and what the event was.
struct Origin {
  double t = kNever;
  double t_src = 0;
  uint32_t node = 0;
  int32_t role = -1;
  int32_t what = -1;
};

// The critical path's tree: each node is one wait that another thread's event decided,
// linked to that thread's node at the time of the event. Nodes nothing refers to any more
// are reused.
class PathArena {
 public:
  PathArena();
  uint32_t make(const Origin& from, double t_at);  // one reference, held by the caller
  void retain(uint32_t n);
  void release(uint32_t n);
  struct Node {
    uint32_t parent = 0, refs = 0;
    double t_from = 0, t_at = 0;
    int32_t what = -1, role = -1;
  };
  const Node& at(uint32_t n) const { return nodes_[n]; }

 private:
  std::vector<Node> nodes_;  // [0]: the launch's start, never released
  std::vector<uint32_t> free_;
};

// A resource shared in time by several requesters (an SM scheduler's issue slots, device
// memory's bytes): per bucket of fixed width, how much of its capacity is taken. A request
// takes what is free from its start on, first come (in the schedule) first served; for issue
// slots (`in_turn`) it ends in a bucket no earlier than the bucket's start plus everything taken
// in it so far (warps that issue at once take turns).
// Spinning (`add`, and `reserved` while it goes on) yields: it holds at most half a bucket
// from a request, the share a round-robin scheduler leaves a working warp beside a spinning one.
class Buckets {
 public:
  explicit Buckets(double width_ns = 1, bool in_turn = true) : width_(width_ns), in_turn_(in_turn) {}
  // Takes `amount` at up to `rate` per ns (the requester's own limit and the capacity: per
  // bucket rate * width) from t on, less what spinning holds (added, and `reserved(bucket)`);
  // returns its end.
  template <typename Reserved>
  double take(double t, double amount, double rate, Reserved reserved);
  void add(double a, double b, double per_ns);  // spinning: per_ns over [a, b)

 private:
  void grow(size_t b) {
    if (b >= taken_.size()) {
      taken_.resize(b + 1 + b / 2, 0.0f);
      spun_.resize(taken_.size(), 0.0f);
    }
  }
  double width_;
  bool in_turn_;
  std::vector<float> taken_, spun_;
};

template <typename Reserved>
double Buckets::take(double t, double amount, double rate, Reserved reserved) {
  if (!(amount > 0)) return t;
  const double cap = rate * width_;
  for (size_t b = static_cast<size_t>(std::max(t, 0.0) / width_);; ++b) {
    const double start = b * width_, end = start + width_;
    if (t < start) t = start;
    if (t >= end) continue;
    grow(b);
    const double held = std::min(spun_[b] + reserved(b), cap / 2);
    const double room = std::min(cap - taken_[b] - held, (end - t) * rate);
    if (room <= 0) continue;
    const double x = std::min(amount, room);
    taken_[b] = static_cast<float>(taken_[b] + x);
    amount -= x;
    if (amount <= 0) return in_turn_ ? std::max(t + x / rate, start + (taken_[b] + held) / rate) : t + x / rate;
  }
}

// Busy intervals of one SM's copy engine; a transfer fills the free time from its start on.
class Calendar {
 public:
  using Pieces = std::vector<std::pair<double, double>>;  // [start, end) intervals, sorted
  // Where a transfer of `duration` from t0 on would go, around the placed intervals and the
  // tentative ones in `also` (disjoint from them): its pieces (appended to `out`) and its end.
  // Touching intervals are kept as one, which leaves the free gaps, and so every fit, the same.
  double fit(double t0, double duration, const Calendar& also, Pieces& out) const;
  void insert(double a, double b);
  void add(double a, double b);  // a tentative piece (for `also`)
  double busy_ns() const;

 private:
  std::map<double, double> busy_;  // start -> end: disjoint, never touching
};

class Timer {
 public:
  Timer(const Costs& costs, int table, const char* kernel, int blocks, int threads);
  ~Timer();
  Timer(const Timer&) = delete;
  Timer& operator=(const Timer&) = delete;

  // `th` is the thread's index in the launch (block * threads + thread).
  void barrier(const std::vector<int>& participants, Site site);
  void collective(const std::vector<int>& lanes, Collective kind, Site site);
  void named_barrier(int th, const volatile void* stamp, Site site);  // its generation's arrivals stamped `stamp`
  void mbar_init(const void* bar);
  void arrive(int th, const void* bar, Site site);
  void phase_complete(const void* bar);
  void wait_done(int th, const void* bar, Site site);  // a try_wait that returned true
  void poll(int th, const volatile void* p, bool changed, bool shared, Site site);
  void flag_write(int th, const volatile void* p, bool shared, Site site);
  void atomic(int th, const volatile void* p, bool shared, Site site);
  void fence(int th, Fence kind);
  void plain_pair(int th, Pair kind);
  void access(int th, const volatile void* p, bool shared, uint32_t bytes, bool load);
  void spinning(int th);  // an mbarrier try_wait that failed: the warp spins until its next operation
  void chain(int th);
  void plain_code(int th, const dev::PlainRun* runs, int n);  // blocks of plain code (dev::plain_code)
  void instructions(int th, int n);  // plain code counted from SASS, written out (dev::plain_instructions)
  // A posted put of `bytes` (0: a signal alone) from rank src to rank dst, its signal word `sig`
  // (nullptr: none); a quiet of the thread's posted puts.
  void nic_put(int th, int src_rank, int dst_rank, uint64_t bytes, const volatile void* sig, Site site);
  void nic_quiet(int th, Site site);
  void copy_issue(int th, size_t copy, int block, bool g2s, const void* gmem, uint32_t bytes, Site site);
  void copy_lands(size_t copy, const void* bar);  // a bulk load completed its bytes on `bar`
  void store_in_group(int th, size_t copy);
  void commit(int th);
  void bulk_wait(int th, bool reads_only, int except_newest, Site site);
  void exit(int th);
  Report finish();

 private:
  struct Group {
    Origin read, write;          // of its copies already placed
    std::vector<size_t> copies;  // its copies not yet placed
  };
  struct Clock {
    double t = 0, busy = 0, end = 0;
    double loads = 0;     // the latency of the batch of plain loads not yet paid (0: none)
    double requests = 0;  // plain global stores not yet put on the SM's request path
    double count = 0;     // warp instructions this lane has issued (issue slots)
    bool waited = false;  // an mbarrier wait since its warp's last collective (or barrier)
    bool spinning = false;
    double spin_from = 0, spin_rate = 0;  // since when it spins, warp instructions per cycle
    uint32_t node = 0;                    // the path node of the last wait another thread's event decided
    std::vector<std::pair<int32_t, double>> waits;
    std::vector<int32_t> sites;  // the synchronisation sites it passed, waited at or not, sorted
    std::deque<Group> groups;    // committed bulk-store groups a wait may still cover
    Group open;
    std::vector<std::pair<int, double>> nic_seen;  // per rank put to: when its last posted op is seen there
    Origin nic_acked;                              // when the acknowledgement of its last posted op is back
    double next_load = 0, next_store = 0;          // the earliest start of its next bulk load, bulk store
  };
  struct CopyTime {
    Origin issued;  // t: when its bytes may start through the engine; where it came from
    double duration = 0;
    double latency = 0;    // a load's: by the L2-hit fraction of what it reads
    double hbm_bytes = 0;  // its bytes through device memory
    bool g2s = false;
    int block = 0;
  };
  struct Engine {
    Calendar loads, stores;  // the two directions: bulk loads in; bulk stores and write requests out
    // Copies issued, not yet placed, with what placing another copy reads of them (kept here, not
    // looked up in copies_: write requests nobody waits for stay open until the launch ends).
    struct Open {
      size_t copy;
      double t;  // its issue time (CopyTime::issued.t)
      bool g2s;
    };
    std::vector<Open> open;
    Calendar& of(bool g2s) { return g2s ? loads : stores; }
  };
  struct MbarTime {
    Origin phase;  // the current phase's latest arrival or landed load
    Origin done;   // the latest completed phase's
  };
  // What happened where, as the report names it: "<what> (<file>:<line>)".
  int32_t category(const char* what, Site site);
  int role(int th) const { return (th % threads_) / 32; }
  int warp_of(int th) const { return th / threads_ * warps_ + role(th); }
  int scheduler_of(int th) const { return th / threads_ * 4 + role(th) % 4; }
  Origin here(int th, int32_t what);
  void advance(int th, double ns);
  // Pays the batch of plain loads in flight and, unless told not to, ends the thread's spinning.
  void settle(int th, bool end_spin = true);
  // On its SM's scheduler (issue slots), `cycles` of them per instruction.
  void issue(int th, double instructions, double cycles = 1);
  void spin_begin(int th, double period_ns);
  void spin_end(int th);
  double spinners(int scheduler, int self, size_t bucket) const;  // cycles of a bucket spinning warps take
  double read_hit(const void* p, uint32_t bytes);                 // L2-hit fraction; marks the lines read
  void mark_written(const void* p, uint32_t bytes);
  void set(Origin& dst, const Origin& src);
  void place(size_t copy, Origin* read, Origin* write);  // folds its times into read and write
  void flush_requests(int th);  // the thread's plain global stores since its last operation, on its engine
  void fold_group(Group& g);
  void keep_max(Origin& dst, const Origin& src);
  void resolve(int th, double own, const Origin& dep, double latency, int32_t wait_what, uint32_t* shared_node);
  void release_all();
  std::vector<RoleTime::Path> lane_paths(int warp) const;  // the report's lane groups of a warp role

  Costs c_;
  int table_;
  std::string kernel_;
  int blocks_, threads_;
  std::vector<Clock> clocks_;
  std::vector<Engine> engines_;
  // Issue slots: one calendar per SM scheduler (warp w of a block issues on its scheduler w % 4),
  // in warp instructions per cycle; per warp, its leading lane's count and when it issued the
  // last of them (lanes run the same instructions: only a lane ahead of its warp takes slots),
  // the leading lane's issues (which instructions it issued when: a lane behind runs on no
  // earlier than the warp issued the same instruction), and the lanes spinning in it.
  static constexpr double kBucketCycles = 64;
  struct Issued {
    double from, to;    // its instructions: the warp's count before and after
    double start, end;  // when the first of them took its slot, and the last
  };
  struct Warp {
    double count = 0, t = 0;
    std::deque<Issued> issued;  // the leading lane's issues a lane may still be behind
    double forgotten = 0;       // the instructions before the oldest issue kept
    int spinning = 0;           // lanes spinning
    double spin_from = 0, spin_rate = 0, spun_until = kNever;
  };
  double issued_at(Warp& w, int warp, double n);  // when warp `warp` issued its instruction n
  int warps_;
  std::vector<Warp> warp_state_;
  std::vector<Buckets> schedulers_;
  std::vector<std::vector<int>> scheduler_warps_;
  double instructions_ = 0, spin_instructions_ = 0;
  // Device memory: one calendar for the launch, and the global lines touched, by 64-byte unit
  // (a host tensor is 64-byte aligned: no unit holds two tensors, whatever their placement).
  Buckets hbm_;
  // The ranks' NICs: key 2 * rank (out of it) and 2 * rank + 1 (into it), bytes per ns.
  std::unordered_map<int, Buckets> nics_;
  double nic_bytes_ = 0;
  std::unordered_map<uint64_t, uint8_t> lines_;
  Report::Reads reads_[3];
  double hbm_bytes_ = 0;
  std::unordered_map<size_t, CopyTime> copies_;  // issued, not yet placed
  double last_write_ = 0;                        // the latest write of any copy
  uint64_t copy_count_ = 0, copy_bytes_ = 0;
  // Plain global stores' write requests, placed on the engine's calendar as copies of their own
  // (ids from kRequestCopies up, apart from the runtime's copy indices).
  static constexpr size_t kRequestCopies = size_t(1) << 62;
  size_t next_request_ = kRequestCopies;
  Report::Accesses plain_[2];
  uint64_t chains_ = 0;
  std::unordered_map<const void*, MbarTime> mbars_;
  std::unordered_map<const volatile void*, Origin> flags_;
  PathArena path_;
  struct SiteKey {
    const char* what;
    const char* file;
    int line;
    bool operator==(const SiteKey& o) const { return what == o.what && file == o.file && line == o.line; }
  };
  struct SiteHash {
    size_t operator()(const SiteKey& k) const {
      return std::hash<const void*>()(k.file) ^ std::hash<const void*>()(k.what) ^ static_cast<size_t>(k.line) * 131u;
    }
  };
  std::unordered_map<SiteKey, int32_t, SiteHash> site_ids_;
  std::unordered_map<std::string, int32_t> name_ids_;
  std::vector<std::string> names_;
};

}  // namespace hybrid_ep::model::timing
