// The CPU model of the device layer: what builtins.h, primitives.h and launch.h call (one file
// per job implements it: state.h lists them).
//
// A launch runs every thread of every block as a fiber on one OS thread. Threads switch only
// at the device layer's synchronisation points (barriers, warp collectives, polls of flags
// and mbarriers, waits on bulk copies), so blocks may wait on each other as on a GPU whose
// blocks are all resident. The order of the runnable fibers and the completion of bulk
// copies are drawn from a seeded generator. Each check below stops the launch with a message
// that names the kernel, block, thread and source line:
//   - bulk copies: size a positive multiple of 16, both addresses 16-byte aligned, the
//     global side inside one declared allocation, the shared side inside the block's shared
//     memory, the mbarrier initialised and in the block;
//   - mbarriers: used before mbar_init or outside the block's shared memory, more
//     transaction bytes than a phase expected, a phase still owed bytes when the block
//     exits, a phase a thread waits on twice (a stale parity);
//   - a block that exits with a bulk copy still reading or writing its shared memory;
//   - warp collectives reached by lanes of the mask at other collectives or never (a lane
//     exited), __syncthreads reached at two sites or after a thread exited;
//   - shared memory accessed past the launch's size (a guard page), fiber stack overflow,
//     and any other invalid access (SIGSEGV / SIGBUS);
//   - a launch in which no thread can run any more and no bulk copy is in flight (deadlock).
// Built for ThreadSanitizer (happens_before.h), the synchronisation above also tells it what
// orders what, so that unordered plain accesses are reported as data races.
// Virtual time (%globaltimer) advances a little per scheduling round and by 10 ms per round
// in which every runnable thread only polled values that did not change, so the kernels'
// own bounded waits time out after a few thousand rounds instead of minutes.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "device/plain_code.h"

namespace hybrid_ep::model {

enum class Fence : int { kGpu = 0, kSystem = 1, kProxyAsync = 2 };

struct Dim3 {
  unsigned x = 1, y = 1, z = 1;
};

struct Site {
  const char* file;
  int line;
};

// "file:line" (the file's base name) and a collective's CUDA name, as messages and reports
// print them.
std::string site_text(Site site);

// ---- identity of the running thread ----------------------------------------------------
const Dim3& thread_idx();
const Dim3& block_idx();
const Dim3& block_dim();
const Dim3& grid_dim();

// ---- barriers and warp collectives -----------------------------------------------------
void syncthreads(Site site);
enum class Collective : int { kSyncwarp = 0, kShfl = 1, kBallot = 2 };
// Every lane of `mask` must reach the same collective; returns this lane's result (shfl: the
// value of lane `src`; ballot: the mask of lanes whose value was non-zero; syncwarp: 0).
uint64_t collective(Collective kind, unsigned mask, uint64_t value, int src, Site site);
const char* collective_name(Collective kind);

// ---- polls (the only places a spinning thread gives way) -------------------------------
// `acquire`: the poll orders the writer's earlier accesses before the caller's later ones (the
// race check's edge). A relaxed poll (ld.relaxed.sys) does not: the thread's next fence does
// (fence_acquire), and a bulk copy or remote put it issues before that fence is reported.
enum class PollKind : int { kAcquire = 0, kRelaxed = 1, kVolatile = 2 };
uint64_t poll(const volatile void* p, size_t bytes, Site site, PollKind kind = PollKind::kAcquire);
uint64_t timer_ns();
// A named barrier's checks (device/model/primitives.h, dev::named_barrier_sync): the threads
// of one generation name the same count, and none waits longer than kNamedBarrierBoundNs of
// virtual time, past every bounded wait of a kernel (2 x HYBRID_EP_TIMEOUT_S, 200 s by
// default): a participant that exited or waits elsewhere would hang the GPU (bar.sync is not
// bounded), so the launch stops with where the waiter is. Each fails the launch.
constexpr uint64_t kNamedBarrierBoundNs = 1000ull * 1000 * 1000 * 1000;
void named_barrier_stuck(uint32_t id, uint32_t arrived, uint32_t threads, Site site);
void named_barrier_mismatch(uint32_t id, uint32_t first, uint32_t threads, Site site);

// ---- fences -------------------------------------------------------------------------------
// Checked, not only timed: fence.acq_rel / fence.sc (gpu or system scope) acquires what the
// thread's relaxed polls read since its last fence, and a bulk copy or remote put issued after
// a relaxed poll with no such fence since is an error; fence.proxy.async orders what the
// thread acquired before its later bulk copies, and a bulk copy of registered memory issued
// after an acquire (a flag another thread released) with no proxy fence since is an error.
void fence_acquire(Fence kind, Site site);
void fence_proxy(Site site);

// ---- what only the timing model reads (timing.h): writes that polls wait for, fences ------
// Each does nothing unless timing is on. The flag's store itself stays in the caller, as a
// compiler atomic the race check sees.
void note_flag_write(const volatile void* p, Site site);  // release stores, reductions, relaxed stores
void note_flag_seen(const volatile void* p, Site site);   // a value read without a poll (no yield)
// A named barrier passed: its generation's arrivals stamped `stamp` (note_flag_write); the thread
// runs on after the latest of them plus the barrier's cost, its warp reconverged.
void note_named_barrier(const volatile void* stamp, Site site);
void note_atomic(const volatile void* p, Site site);
void note_fence(Fence kind);
// A pair of 16-bit floats converted to or from fp32: the kernels' reduction loops convert every
// element they load and store, so the count stands for the plain code around it; the kind
// says which conversion (the timing model counts each kind's instructions, taken from SASS).
enum class Pair : int { kWidenCvt = 0, kWidenShift = 1, kNarrow = 2 };
void note_plain_pair(Pair kind);
// A plain load or store of `bytes` at p in a hot loop (dev::ld / dev::st), and the hint that the
// loads after it depend on those before it (dev::chain).
void note_access(const volatile void* p, uint32_t bytes, bool load);
void note_chain();
// dev::assume_shared: fails the launch unless p points into the calling block's shared memory.
void check_shared(const void* p, Site site);
// Blocks of plain code the kernel ran (dev::plain_code), `n` of them, costed by the timing model's
// constants; `n` warp instructions of plain code written out (dev::plain_instructions).
void note_plain_code(const dev::PlainRun* runs, int n);
void note_instructions(int n);

// ---- shared memory ----------------------------------------------------------------------
void* block_shared(const void* tag, size_t bytes, size_t align);
void* dynamic_smem();

// ---- mbarriers and bulk copies ----------------------------------------------------------
void mbar_init(uint64_t* bar, uint32_t count, Site site);
void mbar_arrive(uint64_t* bar, uint32_t expect_tx_bytes, Site site);
bool mbar_try_wait(uint64_t* bar, uint32_t parity, Site site);
void bulk_g2s(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar, Site site);
void bulk_s2g(void* gmem_dst, const void* smem_src, uint32_t bytes, Site site);
void bulk_commit(Site site);
// Until every committed group of this thread but the newest `except_newest` has read its
// shared memory (reads_only) or completed its writes.
void bulk_wait(bool reads_only, int except_newest, Site site);

// ---- remote operations: the loopback transport between the model's ranks ------------------
// A put (with a signal, or a signal alone: bytes 0) is queued and delivered a few scheduling
// rounds later, sometimes many; ops are unordered, except that the signal of a put comes after
// its data and remote_fence orders the thread's earlier ops to a rank before its later ones.
// The source is read when the op is delivered, so it may not change before remote_quiet, which
// waits until every op of the calling thread was delivered. Ops still queued when the launch
// ends stay queued into the next launches (no kernel boundary completes them): each lands at a
// random round of one of the next three launches, or right after the next op that writes the
// same words (out of order), at the latest at the end of the third launch. Whether the
// loopback transport queues (the weakening kRemoteLate) or stores at once as on a GPU:
// remote_deferred().
// The putting rank is `src_rank` (the NIC whose bytes a posted put takes, below).
bool remote_deferred();
void remote_put(int src_rank, int dst_rank, void* dst, const void* src, uint64_t bytes, uint64_t* sig, uint64_t value,
                Site site);
void remote_fence(Site site);
void remote_quiet(Site site);
// Posted puts, for timing the kernels as a cluster runs them: with it on, the loopback
// transport's puts and signals (remote_deferred() is true) land at once, written by the issuing
// thread as one op, and the timing model prices each as a NIC does (timing.h, nic_put): the
// warp posts it, its bytes take the putting rank's NIC and the receiving rank's at the NIC's
// rate, its signal is seen a network latency after its last byte. Off (the default), the
// loopback transport copies with the warp's lanes, as the single-GPU emulation on a GPU does,
// which is what an emulated bench measures. Takes effect at the next launch.
void set_posted_puts(bool on);
bool posted_puts();

// ---- threads ----------------------------------------------------------------------------
// The model's state is the process's: the controls below, the persistent allocations, the remote
// ops queued across launches, the pools a launch takes its fibers and stacks from, the timing
// tables and reports. One lock guards it: a launch holds it from its start to its end and every
// call below that reads or sets that state takes it, so OS threads that each launch (two buffers
// driven from two threads) run their launches one after the other, each whole. What a thread
// asks for its own next launches is that thread's: declare_allocations, inject_abort, hold_at,
// and a launch's message. A caller that holds a lock a launch may wait for (Python's GIL: a
// peer's kernel may need this process's chunk server) lets it go before it calls in.

// ---- launches ---------------------------------------------------------------------------
// Runs body(ctx) in every thread of `blocks` x `threads`; nullptr on success, else the
// message of the first check that failed (valid until this thread's next launch).
const char* launch(void (*body)(const void*), const void* ctx, int blocks, int threads, size_t smem, const char* name);
int max_active_blocks(int threads, size_t smem);
// The launches before the running one (inside a launch: stats().launches when it began).
uint64_t launch_serial();

// ---- configuration (the Python module's controls) ----------------------------------------
constexpr int kDeviceSms = 132;                    // an H100 SXM's, so launch plans match
constexpr size_t kSmemPerBlockOptin = 227 * 1024;  // its opt-in shared memory per block
void set_seed(uint64_t seed);
uint64_t seed();
// Where the model is made no stronger than an H100 in what it does (docs/dev/cpu_model.md,
// "Weakened"): each is on unless turned off, drawn from the seed; the timing model turns both
// off while it times (it times the GPU emulation's loopback and whole copies).
//   kRemoteLate  the loopback transport's puts and signals are queued (remote_put above);
//   kTornCopies  a bulk copy lands in up to four pieces, each at its own round.
enum class Weak : int { kRemoteLate = 0, kTornCopies = 1, kCount = 2 };
const char* weak_name(Weak w);
void set_weak(Weak w, bool on);
bool weak(Weak w);
// Payload-free mode, for timing runs at shapes whose rows do not fit this machine's memory:
// bulk copies are checked, scheduled and timed as always (the same bytes through the copy
// engine, the same mbarrier completions) but move no bytes, so the tensors they would read and
// write are never touched. Which data is payload is decided in one place (bulk_copies.cpp,
// moves_bytes): the kernels move rows, scales and partial sums by bulk copy, and everything
// they decide by (counts, tables, route rows, flags, stage headers) by plain code, which
// still runs. The results of a launch in this mode are not the kernels' results. Off (the
// default: every copy moves its bytes) until set; takes effect at the next launch.
void set_payload(bool moves);
bool payload();
// Global memory a bulk copy may touch: [ptr, ptr + bytes). Persistent allocations (the
// registered buffers, the error record, mapped peer memory) stay until removed; the tensors of
// the calling thread's next launches are declared per call and replace its previous call's.
// allocations(): the persistent ones now (a test counts what setup left behind).
void declare_allocations(const std::vector<std::pair<uint64_t, uint64_t>>& ranges);
void add_allocation(uint64_t ptr, uint64_t bytes);
void remove_allocation(uint64_t ptr);
std::vector<std::pair<uint64_t, uint64_t>> allocations();
// Fault injection: in the calling thread's next launch of the kernel named `kernel` (its launcher's name
// without "launch_", e.g. "dispatch_receive"), write 1 to the int at `flag` when scheduling round
// `round` begins, as a peer's failure would raise the abort flag in the middle of the
// pipeline. Tests check that every block then leaves cleanly.
void inject_abort(uint64_t flag, int64_t round, const std::string& kernel);
// Stalls: in the next launch of `kernel`, every thread that reaches a hold point with this key
// is held there, not scheduled, until no other thread of the launch can run and no bulk copy
// is in flight (the others finished, or wait at a barrier for the held ones); then the held
// threads go on and the point holds no more in that launch. Hold points: dev::hold_point(key)
// (the loopback transport's puts, key = the putting rank), every bulk store of block b
// (bulk_s2g, before the copy: key = kStoresOfBlock + b) and the start of block b's threads
// (a block that starts late: kStartOfBlock + b). Tests stall one role this way and check that
// the waits on it give up, bounded, with their error record.
constexpr int kStoresOfBlock = 1 << 20, kStartOfBlock = 2 << 20;
void hold_at(int key, const std::string& kernel);
void hold_point(int key, Site site);
struct Stats {
  uint64_t launches = 0, rounds = 0, switches = 0, copies = 0, idle_rounds = 0;
  uint64_t virtual_ns = 0;  // %globaltimer time the launches took, summed
  // the weakenings at work: remote ops queued, those carried past their launch's end, those that
  // landed right after a later write of the same words, bulk copies that landed in pieces
  uint64_t remote_ops = 0, remote_carried = 0, remote_reordered = 0, torn_copies = 0;
};
Stats stats();

}  // namespace hybrid_ep::model
