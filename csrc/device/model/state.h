// The state the CPU model's runtime shares between its parts (runtime.h is what the kernels call):
// a launch's threads, blocks and bulk copies, the controls set between launches, and the
// helpers every part uses to find the running thread, stop the launch and name a place.
//   scheduler.cpp     launches: blocks of threads as fibers, the scheduling rounds, deadlocks
//   sync.cpp          barriers, warp collectives, polls and fences (with the fence checks)
//   bulk_copies.cpp   shared memory, mbarriers and bulk copies, and their checks
//   remote_ops.cpp    the loopback transport's puts between the model's ranks
//   injection.cpp     what a test injects into a launch: an abort flag, threads held
//   faults.cpp        invalid accesses (shared memory past its size, stack overflow) as messages
//   timing_notes.cpp  what only the timing model reads (timing.h)
//   state.cpp         this header's helpers, and the controls (seed, weakenings, allocations)
#pragma once
#include <setjmp.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "device/model/fiber.h"
#include "device/model/happens_before.h"
#include "device/model/runtime.h"
#include "device/model/timing.h"

namespace hybrid_ep::model::detail {

constexpr size_t kStackBytes = 64 * 1024 * kStackScale;
constexpr size_t kArenaBytes = 48 * 1024;  // a block's static shared memory (block_shared), as CUDA's
constexpr int64_t kMaxRounds = 20'000'000;

enum class State : uint8_t { kReady, kBarrier, kWarp, kDone };

struct Block;

struct Thread {
  Context ctx;
  FiberStack stack;
  Block* block = nullptr;
  Dim3 idx;
  int tid = 0, lane = 0, warp = 0;
  State state = State::kReady;
  bool idle = false;                 // the segment that just ended only re-polled an unchanged value
  bool busy = false;                 // a primitive other than a poll ran in this segment
  bool last_poll_unchanged = false;  // the value the last poll returned was the one seen before
  bool held = false;                 // at a hold point (hold_at): not scheduled for now
  Site site{"", 0};                  // where it waits
  struct Memo {
    const volatile void* addr;
    uint64_t value;
  };
  Memo memo[4] = {};
  int memo_next = 0;
  std::vector<std::pair<const uint64_t*, int64_t>> waited;  // mbarrier -> phase its last wait returned
  std::vector<std::vector<size_t>> groups;                  // committed bulk stores, by copy index
  std::vector<size_t> open_group;                           // issued, not yet committed
  uint64_t value = 0, result = 0;
  int src = 0;
  char bulk_key = 0;  // happens_before.h: its bulk stores' reads and writes release here
  // The fence checks (runtime.h, fence_acquire / fence_proxy): the latest relaxed poll with no
  // acquire fence since, and the latest acquire with no proxy fence since (file nullptr: none).
  Site unfenced{nullptr, 0}, unproxied{nullptr, 0};
  std::vector<const volatile void*> relaxed_reads;  // the race check: what its next fence acquires
  uint32_t remote_fences = 0;                       // remote_fence calls: the ops' order groups
};

struct Mbar {
  uint32_t count = 0;
  int64_t pending = 0;  // arrivals still owed in the current phase
  int64_t tx = 0;       // transaction bytes still owed in the current phase
  int64_t phase = 0;    // phases completed
};

struct WarpSync {
  bool open = false;
  unsigned mask = 0, arrived = 0;
  Collective kind = Collective::kSyncwarp;
  Site site{"", 0};
  int first_lane = 0;
};

struct Block {
  int index = 0;
  std::vector<Thread*> threads;
  int live = 0, exited = 0;
  int at_barrier = 0;
  bool barrier_open = false;
  Site barrier_site{"", 0};
  std::vector<WarpSync> warps;
  std::vector<unsigned> warp_gone;  // lanes that exited or do not exist, per warp
  void* mapping = nullptr;          // [arena][dynamic shared memory][guard page]
  size_t mapping_bytes = 0;
  unsigned char* arena = nullptr;
  size_t arena_used = 0;
  unsigned char* dyn = nullptr;
  size_t dyn_bytes = 0;
  unsigned char* guard = nullptr;
  std::vector<std::pair<const void*, size_t>> slots;  // block_shared tag -> arena offset
  std::unordered_map<const uint64_t*, Mbar> mbars;
  char barrier_key = 0;              // happens_before.h: __syncthreads
  std::vector<void*> engine_fibers;  // happens_before.h: each warp's bulk copies run on its own
};

struct Copy {
  bool g2s = false;
  unsigned char* dst = nullptr;
  const unsigned char* src = nullptr;
  uint32_t bytes = 0;
  Block* block = nullptr;
  uint64_t* bar = nullptr;
  Thread* owner = nullptr;
  Site site{"", 0};
  const char* issued = nullptr;  // happens_before.h: what its issuing thread had done by then
  void* issue_pc = nullptr;      // ... and where in the kernel it was issued
  int64_t read_round = 0, write_round = 0;
  bool read = false, written = false;
  std::vector<unsigned char> data;  // what a bulk store read from shared memory
  // The pieces its bytes land in (kTornCopies: up to four, each at its own round; else one):
  // a load's pieces land from read_round on, a store's from write_round on.
  struct Piece {
    uint32_t offset, bytes;
    int64_t round;
    bool done;
  };
  std::vector<Piece> pieces;
};

struct Launch {
  const char* name = "";
  void (*body)(const void*) = nullptr;
  const void* ctx = nullptr;
  Dim3 grid, block_dim;
  size_t smem = 0;
  std::vector<std::unique_ptr<Block>> blocks;
  std::vector<Thread> threads;
  std::vector<Copy> copies;
  std::deque<char> copy_keys;  // Copy::issued (a deque: the addresses stay put)
  std::vector<size_t> pending;
  uint64_t rng = 0;
  int64_t round = 0;
  uint64_t now = 1'000'000'000;  // %globaltimer never reads 0 (the kernels use 0 as "unset")
  int live = 0;
  Thread* current = nullptr;
  Context scheduler;
  std::string error;
  bool running = false;
  char start_key = 0, end_key = 0;  // happens_before.h: the host's work before, after the launch
  int* inject_flag = nullptr;       // inject_abort: raised when round inject_round begins
  int64_t inject_round = -1;
  uint64_t serial = 0;                     // launches before this one (the remote ops' clock across launches)
  bool remote_late = false, torn = false;  // the weakenings in force (runtime.h, Weak)
  bool posted = false;                     // posted puts (runtime.h, set_posted_puts)
  int hold_key = -1;                       // hold_at: the key dev::hold_point holds at in this launch, -1 none
  int held = 0;                            // threads held there now
  bool payload = true;                     // set_payload when the launch began: bulk copies move their bytes
  std::vector<std::unique_ptr<timing::Timer>> timers;  // with timing on: the clocks per cost table (timing.h)
  sigjmp_buf jump;                                     // on_fault jumps back into the scheduler
  bool jumped_from_fiber = false;                      // ... from a fiber's stack (fiber.h, before_jump_out_of_fiber)
};

// Each of a launch's timers, called outside the race check (hb::Unobserved): the timing model's
// clocks are the model's bookkeeping, shared by every fiber on purpose, as the scheduler's is.
template <typename Call>
void each_timer(std::vector<std::unique_ptr<timing::Timer>>& timers, Call&& call) {
  if (timers.empty()) return;
  hb::Unobserved unobserved;
  for (auto& timer : timers) call(*timer);
}

// The launch running on this OS thread (inline: every primitive reads it).
inline thread_local Launch* g_launch = nullptr;
// The model's lock (runtime.h, threads): a launch holds it from its start to its end, and every
// control between launches takes it; never taken inside a launch.
std::mutex& model_lock();
struct Locked {
  std::lock_guard<std::mutex> guard{model_lock()};
};
// The controls (runtime.h, configuration) as the next launch takes them.
extern uint64_t g_seed;
extern bool g_payload;                               // set_payload
extern bool g_weak[static_cast<int>(Weak::kCount)];  // set_weak
extern bool g_posted;                                // set_posted_puts
extern uint64_t g_launches_since_seed;               // with the seed, picks each launch's schedule
extern Stats g_stats;

inline uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

inline size_t page_bytes() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

inline size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

inline bool same_site(Site a, Site b) { return a.line == b.line && std::strcmp(a.file, b.file) == 0; }

std::string hex(uint64_t v);
std::string lanes_text(unsigned mask);
// "<kernel> kernel, block b of n, thread t (warp w, lane l): ", the start of every message.
std::string where(const Launch& L, const Thread* t);
// Where p lies in the block's shared memory ("dynamic shared memory + 64"), else its address.
std::string smem_text(const Block* b, const void* p);

inline Launch& launch_state() {
  if (g_launch == nullptr) {
    std::fprintf(stderr, "hybrid_ep CPU model: a device primitive ran outside a model launch\n");
    std::abort();
  }
  return *g_launch;
}

inline int thread_index(const Launch& L, const Thread* t) { return static_cast<int>(t - L.threads.data()); }

inline Thread* cur() {
  Launch& L = launch_state();
  if (L.current == nullptr) {
    std::fprintf(stderr, "hybrid_ep CPU model: a thread primitive ran in the scheduler\n");
    std::abort();
  }
  return L.current;
}

// Stops the launch. In a fiber the thread is abandoned (never resumed); in the scheduler the
// caller returns and the loop ends.
void fail(const std::string& message, const Thread* about = nullptr);

inline void yield(Thread* t) {
  ++g_stats.switches;
  if (!t->stack.intact()) fail("stack overflow of the thread's fiber (" + std::to_string(kStackBytes) + " bytes)");
  switch_context(t->ctx, launch_state().scheduler);
}

// The thread gives way at a poll: the segment that ends here was idle when the previous
// poll saw nothing new and no other primitive ran since.
inline void yield_at_poll(Thread* t, Site site) {
  t->idle = t->last_poll_unchanged && !t->busy;
  t->busy = false;
  t->site = site;
  yield(t);
}

// Whether the value at addr changed since the thread last polled it (a poll that sees nothing
// new is an idle one).
inline bool remember(Thread* t, const volatile void* addr, uint64_t value) {
  for (auto& m : t->memo)
    if (m.addr == addr) {
      const bool changed = m.value != value;
      m.value = value;
      return changed;
    }
  t->memo[t->memo_next] = {addr, value};
  t->memo_next = (t->memo_next + 1) % 4;
  return true;
}

inline bool in_smem(const Block* b, const void* p, size_t n) {
  const auto* a = static_cast<const unsigned char*>(p);
  return (a >= b->arena && a + n <= b->arena + b->arena_used) || (a >= b->dyn && a + n <= b->dyn + b->dyn_bytes);
}

// Registered buffers and the error record: memory other threads and ranks write during a launch
// (a call's own tensors are declared per call).
bool registered(const void* p);
// Inside one registered buffer or one allocation declared for this call.
bool in_global(const void* p, size_t n);

// ---- what one part asks of another --------------------------------------------------------
// sync.cpp: fails the launch when `what` (a bulk copy or a put) follows a relaxed poll with no
// fence since.
void check_fenced(const Thread* t, const std::string& what);
// bulk_copies.cpp: one round's progress of the bulk copies in flight (true when any is), and
// the checks when a block's last thread exits.
bool advance_copies(Launch& L);
void block_exit(Block* b);
// remote_ops.cpp: one round of the queued remote ops (true when one landed); at a launch's end,
// carries its ops into the next launches; whether ops of this launch's threads are queued; drops
// the ops into or out of a freed buffer.
bool advance_remote(Launch& L, bool idle);
void carry_remote(Launch& L);
bool remote_ops_in_flight();
void drop_remote_ops(const void* base, uint64_t bytes);
// faults.cpp: SIGSEGV and SIGBUS during a launch stop it with a message.
void install_fault_handlers();
void remove_fault_handlers();
// injection.cpp: the abort and the hold asked for this launch's kernel (inject_abort, hold_at).
void arm_injections(Launch& L);

}  // namespace hybrid_ep::model::detail
