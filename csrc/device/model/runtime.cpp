// The CPU model's scheduler and checks (runtime.h says what is checked and why).
#include "device/model/runtime.h"

#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "device/model/fiber.h"
#include "device/model/happens_before.h"
#include "device/model/timing.h"

namespace hybrid_ep::model {
namespace {

constexpr size_t kStackBytes = 64 * 1024 * kStackScale;
constexpr size_t kArenaBytes = 48 * 1024;  // a block's static shared memory (block_shared), as CUDA's
constexpr int kMaxCopyDelay = 3;           // rounds a bulk copy usually takes, drawn per copy
constexpr int kLongCopyDelay = 40;         // ... and one in eight takes up to this many
constexpr uint64_t kRoundNs = 100;
constexpr uint64_t kIdleRoundNs = 10'000'000;
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

thread_local Launch* g_launch = nullptr;
uint64_t g_seed = 0;
bool g_payload = true;                                       // set_payload
bool g_weak[static_cast<int>(Weak::kCount)] = {true, true};  // set_weak
bool g_posted = false;                                       // set_posted_puts
uint64_t g_launches_since_seed = 0;                          // with the seed, picks each launch's schedule
Stats g_stats;
std::string g_message;
std::map<uint64_t, uint64_t> g_persistent;              // ptr -> bytes
std::vector<std::pair<uint64_t, uint64_t>> g_declared;  // per call
struct Injection {
  uint64_t flag = 0;
  int64_t round = -1;
  std::string kernel;
} g_injection;
struct Hold {
  int key = -1;
  std::string kernel;
} g_hold;
// ThreadSanitizer's fibers (happens_before.h) cost about half a millisecond each to make, so
// they are kept across launches: one per thread slot, one per warp's copy engine.
constexpr size_t kMaxRaceFibers = 8000;  // its runtime stops at 8128 threads and fibers
std::vector<void*> g_thread_fibers, g_engine_fibers;
void* race_fiber(std::vector<void*>& pool, size_t i) {
  while (pool.size() <= i) pool.push_back(hb::new_fiber());
  return pool[i];
}

// Gives the launch's threads and copy engines their fibers, named as reports should show them.
void name_race_fibers(Launch& L, size_t warps_per_block) {
  char text[96];
  for (auto& b : L.blocks) {
    for (Thread* t : b->threads) {
      t->ctx.race_fiber = race_fiber(g_thread_fibers, static_cast<size_t>(b->index) * L.block_dim.x + t->tid);
      std::snprintf(text, sizeof(text), "%s kernel, block %d, thread %d", L.name, b->index, t->tid);
      hb::name(t->ctx.race_fiber, text);
    }
    for (size_t w = 0; w < warps_per_block; ++w) {
      b->engine_fibers.push_back(race_fiber(g_engine_fibers, static_cast<size_t>(b->index) * warps_per_block + w));
      std::snprintf(text, sizeof(text), "%s kernel, block %d, bulk copies of warp %zu", L.name, b->index, w);
      hb::name(b->engine_fibers.back(), text);
    }
  }
}

StackPool& stack_pool() {
  static StackPool pool(kStackBytes);
  return pool;
}

uint64_t splitmix(uint64_t& s) {
  uint64_t z = (s += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Rounds until a bulk copy (or its read) completes: mostly soon, sometimes late, so a wait
// that is missing, or placed too early, shows up as wrong data or as a check.
int64_t copy_delay(uint64_t& rng) {
  const uint64_t r = splitmix(rng);
  return static_cast<int64_t>((r & 7) == 0 ? (r >> 8) % (kLongCopyDelay + 1) : (r >> 8) % (kMaxCopyDelay + 1));
}

size_t page_bytes() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

size_t round_up(size_t v, size_t m) { return (v + m - 1) / m * m; }

bool same_site(Site a, Site b) { return a.line == b.line && std::strcmp(a.file, b.file) == 0; }

std::string hex(uint64_t v) {
  char buf[24];
  std::snprintf(buf, sizeof(buf), "0x%llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string lanes_text(unsigned mask) {
  std::string s;
  for (int l = 0; l < 32; ++l)
    if ((mask >> l) & 1u) s += (s.empty() ? "" : ",") + std::to_string(l);
  return "{" + s + "}";
}

std::string where(const Launch& L, const Thread* t) {
  std::string s = std::string(L.name) + " kernel";
  if (t != nullptr)
    s += ", block " + std::to_string(t->block->index) + " of " + std::to_string(L.grid.x) + ", thread " +
         std::to_string(t->tid) + " (warp " + std::to_string(t->warp) + ", lane " + std::to_string(t->lane) + ")";
  return s + ": ";
}

Launch& launch_state() {
  if (g_launch == nullptr) {
    std::fprintf(stderr, "hybrid_ep CPU model: a device primitive ran outside a model launch\n");
    std::abort();
  }
  return *g_launch;
}

int thread_index(const Launch& L, const Thread* t) { return static_cast<int>(t - L.threads.data()); }

Thread* cur() {
  Launch& L = launch_state();
  if (L.current == nullptr) {
    std::fprintf(stderr, "hybrid_ep CPU model: a thread primitive ran in the scheduler\n");
    std::abort();
  }
  return L.current;
}

// Stops the launch. In a fiber the thread is abandoned (never resumed); in the scheduler the
// caller returns and the loop ends.
void fail(const std::string& message, const Thread* about = nullptr) {
  Launch& L = launch_state();
  const Thread* t = about != nullptr ? about : L.current;
  if (L.error.empty()) L.error = where(L, t) + message;
  if (L.current != nullptr) {
    Thread* self = L.current;
    self->state = State::kDone;
    switch_context(self->ctx, L.scheduler);
    std::abort();  // never resumed
  }
}

void yield(Thread* t) {
  ++g_stats.switches;
  if (!t->stack.intact()) fail("stack overflow of the thread's fiber (" + std::to_string(kStackBytes) + " bytes)");
  switch_context(t->ctx, launch_state().scheduler);
}

// The thread gives way at a poll: the segment that ends here was idle when the previous
// poll saw nothing new and no other primitive ran since.
void yield_at_poll(Thread* t, Site site) {
  t->idle = t->last_poll_unchanged && !t->busy;
  t->busy = false;
  t->site = site;
  yield(t);
}

bool remember(Thread* t, const volatile void* addr, uint64_t value) {
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

bool in_smem(const Block* b, const void* p, size_t n) {
  const auto* a = static_cast<const unsigned char*>(p);
  return (a >= b->arena && a + n <= b->arena + b->arena_used) || (a >= b->dyn && a + n <= b->dyn + b->dyn_bytes);
}

std::string smem_text(const Block* b, const void* p) {
  const auto* a = static_cast<const unsigned char*>(p);
  if (a >= b->dyn && a <= b->dyn + b->dyn_bytes + page_bytes())
    return "dynamic shared memory + " + std::to_string(a - b->dyn);
  if (a >= b->arena && a < b->arena + kArenaBytes) return "static shared memory + " + std::to_string(a - b->arena);
  return hex(reinterpret_cast<uint64_t>(p));
}

// Registered buffers and the error record: memory other threads and ranks write during a launch
// (a call's own tensors are declared per call).
bool registered(const void* p) {
  const auto a = reinterpret_cast<uint64_t>(p);
  auto it = g_persistent.upper_bound(a);
  if (it == g_persistent.begin()) return false;
  --it;
  return a >= it->first && a < it->first + it->second;
}

bool in_global(const void* p, size_t n) {
  const auto a = reinterpret_cast<uint64_t>(p);
  auto it = g_persistent.upper_bound(a);
  if (it != g_persistent.begin()) {
    --it;
    if (a >= it->first && a + n <= it->first + it->second) return true;
  }
  for (const auto& [base, bytes] : g_declared)
    if (a >= base && a + n <= base + bytes) return true;
  return false;
}

Mbar& mbar_of(Block* b, const uint64_t* bar, const char* what) {
  if (!in_smem(b, bar, 8) || reinterpret_cast<uintptr_t>(bar) % 8 != 0)
    fail(std::string(what) + " on an mbarrier at " + smem_text(b, bar) +
         ", which is not an 8-byte slot of this block's shared memory");
  auto it = b->mbars.find(bar);
  if (it == b->mbars.end()) fail(std::string(what) + " on an mbarrier at " + smem_text(b, bar) + " before mbar_init");
  return it->second;
}

void mbar_settle(Block* b, const uint64_t* bar, Mbar& m, const Thread* about) {
  if (m.pending == 0 && m.tx < 0)
    fail("the mbarrier at " + smem_text(b, bar) + " received " + std::to_string(-m.tx) +
             " transaction bytes more than its phase " + std::to_string(m.phase) + " expected",
         about);
  if (m.pending == 0 && m.tx == 0) {
    ++m.phase;
    m.pending = m.count;
    each_timer(launch_state().timers, [&](timing::Timer& timer) { timer.phase_complete(bar); });
  }
}

Thread& lane_thread(Block* b, int warp, int lane) { return *b->threads[warp * 32 + lane]; }

void block_exit(Block* b) {
  Launch& L = launch_state();
  for (size_t i : L.pending) {
    const Copy& c = L.copies[i];
    if (c.block != b) continue;
    if (c.g2s && !c.written)
      fail("the block exits while a bulk load issued at " + site_text(c.site) + " by thread " +
           std::to_string(c.owner->tid) + " still writes its shared memory (" + smem_text(b, c.dst) +
           "): wait for its mbarrier first");
    if (!c.g2s && !c.read)
      fail("the block exits while a bulk store issued at " + site_text(c.site) + " by thread " +
           std::to_string(c.owner->tid) + " still reads its shared memory (" + smem_text(b, c.src) +
           "): wait_group.read first");
  }
  for (const auto& [bar, m] : b->mbars) {
    if (m.pending == 0 && m.tx > 0) {
      bool in_flight = false;
      for (size_t i : L.pending) in_flight |= L.copies[i].bar == bar;
      if (!in_flight)
        fail("the block exits with the mbarrier at " + smem_text(b, bar) + " owed " + std::to_string(m.tx) +
             " transaction bytes in phase " + std::to_string(m.phase) +
             ": every arrival came, but the bulk copies delivered fewer bytes than expect_tx announced");
    }
  }
}

void thread_exit(Thread* t) {
  Launch& L = launch_state();
  Block* b = t->block;
  WarpSync& w = b->warps[t->warp];
  if (w.open && ((w.mask >> t->lane) & 1u) && !((w.arrived >> t->lane) & 1u))
    fail("exits while lanes " + lanes_text(w.arrived) + " of its warp wait for it at " + collective_name(w.kind) +
         " (" + site_text(w.site) + ", mask " + hex(w.mask) + ")");
  if (b->barrier_open)
    fail("exits while " + std::to_string(b->at_barrier) + " thread(s) of its block wait at __syncthreads (" +
         site_text(b->barrier_site) + ")");
  b->warp_gone[t->warp] |= 1u << t->lane;
  each_timer(L.timers, [&](timing::Timer& timer) { timer.exit(thread_index(L, t)); });
  --b->live;
  ++b->exited;
  --L.live;
  t->busy = true;
  if (b->live == 0) block_exit(b);
  t->state = State::kDone;
  t->idle = false;
  yield(t);
  std::abort();  // a finished thread is never resumed
}

void fiber_entry(void* arg) {
  auto* t = static_cast<Thread*>(arg);
  Launch& L = launch_state();
  hb::acquire(&L.start_key);
  hold_point(kStartOfBlock + t->block->index, Site{"(the block's start)", 0});
  L.body(L.ctx);
  thread_exit(t);
}

// The fiber a copy's accesses are made on under the race check (none without it: the blocks
// then have no engine fibers).
void* engine_fiber(const Copy& c) { return hb::kEnabled ? c.block->engine_fibers[c.owner->warp] : nullptr; }

// One step of a bulk copy, told to the race check: its reads (of src) and writes (of dst),
// made by the issuing warp's copy engine at the issue site, after what the issuer had done
// when it issued the copy and before `done` (a load's mbarrier, a store's bulk-group wait).
void race_copy_step(const Launch& L, const Copy& c, const Copy::Piece& piece, bool reads, bool writes,
                    const void* done) {
  if (!hb::kEnabled) return;
  hb::enter(engine_fiber(c));
  hb::acquire(c.issued);
  hb::frame_begin(c.issue_pc);
  if (reads) hb::reads(c.src + piece.offset, piece.bytes);
  if (writes) hb::writes(c.dst + piece.offset, piece.bytes);
  hb::frame_end();
  hb::release(done);
  hb::enter(L.scheduler.race_fiber);
}

// Whether a bulk copy moves its bytes: the one place payload is told from control. Every bulk
// copy of the kernels carries payload (token rows, expert rows, fp8 scales, partial sums in the
// wire dtype): what a kernel decides by (counts, layout tables, route rows, signals, the
// headers of its stages) it reads and writes with plain code and flags, which always run. So in
// payload-free mode no bulk copy moves bytes, and the schedule, the checks and the timing are
// those of a run that moves them (tests/test_timing_payload.py compares the two).
bool moves_bytes(const Launch& L, const Copy&) { return L.payload; }

// One round's progress of the bulk copies in flight; true when any is in flight.
bool advance_copies(Launch& L) {
  if (L.pending.empty()) return false;
  std::vector<size_t> still;
  for (size_t i : L.pending) {
    Copy& c = L.copies[i];
    if (c.g2s) {
      int64_t landed = 0;  // bytes that land this round: their complete_tx
      bool all = true;
      for (Copy::Piece& piece : c.pieces) {
        if (!piece.done && L.round >= piece.round) {
          race_copy_step(L, c, piece, true, true, c.bar);
          if (moves_bytes(L, c)) std::memcpy(c.dst + piece.offset, c.src + piece.offset, piece.bytes);
          piece.done = true;
          landed += piece.bytes;
        }
        all &= piece.done;
      }
      if (landed > 0) {
        auto it = c.block->mbars.find(c.bar);
        if (it == c.block->mbars.end()) {
          fail("a bulk load completed on an mbarrier that no longer exists", c.owner);
          return true;
        }
        it->second.tx -= landed;
        if (all) {
          c.read = c.written = true;
          ++g_stats.copies;
          each_timer(L.timers, [&](timing::Timer& timer) { timer.copy_lands(i, c.bar); });
        }
        mbar_settle(c.block, c.bar, it->second, c.owner);
        if (!L.error.empty()) return true;
      }
      if (all) continue;
    } else {
      if (!c.read && L.round >= c.read_round) {
        race_copy_step(L, c, Copy::Piece{0, c.bytes, 0, false}, true, false, &c.owner->bulk_key);
        if (moves_bytes(L, c)) c.data.assign(c.src, c.src + c.bytes);
        c.read = true;
      }
      bool all = c.read;
      for (Copy::Piece& piece : c.pieces) {
        if (c.read && !piece.done && L.round >= piece.round) {
          race_copy_step(L, c, piece, false, true, &c.owner->bulk_key);
          if (moves_bytes(L, c)) std::memcpy(c.dst + piece.offset, c.data.data() + piece.offset, piece.bytes);
          piece.done = true;
        }
        all &= piece.done;
      }
      if (all) {
        std::vector<unsigned char>().swap(c.data);
        c.written = true;
        ++g_stats.copies;
        continue;
      }
    }
    still.push_back(i);
  }
  L.pending.swap(still);
  return true;
}

// ---- remote operations (runtime.h, remote_put) ----------------------------------------------

constexpr int kRemoteLaunches = 8;        // a queued op lands within this many launches after its own
constexpr int64_t kCarriedRounds = 2048;  // ... at a round below this of the launch it is due in

struct RemoteOp {
  uint64_t seq = 0;
  uint64_t issuer = 0;             // launch serial << 24 | thread index
  const Thread* thread = nullptr;  // the issuing thread while its launch runs (quiet), then nullptr
  int dst_rank = 0;
  uint32_t fences = 0;  // the issuer's remote_fence count when it was issued
  unsigned char* dst = nullptr;
  const unsigned char* src = nullptr;
  uint64_t bytes = 0;
  uint64_t* sig = nullptr;
  uint64_t value = 0;
  uint64_t due_launch = 0;   // lands in that launch at round due_round (or at its end, or later:
  int64_t due_round = 0;     // see after_write)
  bool after_write = false;  // carried: lands right after the next op that writes its signal word
  Site site{"", 0};
  const char* issued = nullptr;  // happens_before.h: what its issuing thread had done by then
};
std::deque<RemoteOp> g_remote;   // queued, in issue order
std::deque<char> g_remote_keys;  // RemoteOp::issued
uint64_t g_remote_seq = 0;
void* g_remote_fiber = nullptr;  // happens_before.h: the deliveries' accesses

bool overlaps(const void* a, uint64_t an, const void* b, uint64_t bn) {
  const auto x = reinterpret_cast<uintptr_t>(a), y = reinterpret_cast<uintptr_t>(b);
  return x < y + bn && y < x + an;
}

// An op may land once every op its issuer put before a remote_fence, to the same rank, landed.
bool orderable(const RemoteOp& op) {
  for (const RemoteOp& o : g_remote) {
    if (o.seq >= op.seq) break;
    if (o.issuer == op.issuer && o.dst_rank == op.dst_rank && o.fences < op.fences) return false;
  }
  return true;
}

bool in_global(const void* p, size_t n);

// Writes the op's data, then its signal, as the transport's engine (the race check's fiber).
// An op whose memory was freed meanwhile (its buffer destroyed) is dropped.
void land(const Launch& L, RemoteOp op) {
  const bool alive = (op.bytes == 0 || (in_global(op.dst, op.bytes) && in_global(op.src, op.bytes))) &&
                     (op.sig == nullptr || in_global(op.sig, 8));
  if (!alive) return;
  if (hb::kEnabled) {
    if (g_remote_fiber == nullptr) {
      g_remote_fiber = hb::new_fiber();
      hb::name(g_remote_fiber, "the loopback transport's deliveries");
    }
    hb::enter(g_remote_fiber);
    hb::acquire(op.issued);
    if (op.bytes > 0) {
      hb::reads(op.src, op.bytes);
      hb::writes(op.dst, op.bytes);
    }
  }
  if (op.bytes > 0) std::memmove(op.dst, op.src, op.bytes);
  if (op.sig != nullptr) {
    hb::release(op.sig);
    __atomic_store_n(op.sig, op.value, __ATOMIC_RELEASE);
  }
  if (hb::kEnabled) hb::enter(L.scheduler.race_fiber);
}

// Delivers g_remote[i] and then the carried ops waiting for a write to the same words.
void deliver_remote(const Launch& L, size_t i) {
  const RemoteOp op = g_remote[i];
  g_remote.erase(g_remote.begin() + static_cast<std::ptrdiff_t>(i));
  land(L, op);
  for (size_t j = 0; j < g_remote.size();) {
    const RemoteOp& o = g_remote[j];
    const bool same = o.after_write && ((o.sig != nullptr && op.sig != nullptr && o.sig == op.sig) ||
                                        (o.bytes > 0 && op.bytes > 0 && overlaps(o.dst, o.bytes, op.dst, op.bytes)));
    if (same && orderable(o)) {
      const RemoteOp late = o;
      g_remote.erase(g_remote.begin() + static_cast<std::ptrdiff_t>(j));
      land(L, late);
      ++g_stats.remote_reordered;
      continue;
    }
    ++j;
  }
}

bool due(const Launch& L, const RemoteOp& op) {
  if (op.after_write) return L.serial >= op.due_launch + kRemoteLaunches;  // only at the end (below)
  return L.serial > op.due_launch || (L.serial == op.due_launch && L.round >= op.due_round);
}

// One round of the queued ops: those due land. `idle`: no thread made progress this round, so
// one op that is not due lands all the same (the earliest due of this launch, else the oldest
// carried one): ops lag behind the threads while they work, and a waiter is never starved into
// a timeout by the queue. True when an op landed.
bool advance_remote(Launch& L, bool idle) {
  bool landed = false;
  for (size_t i = 0; i < g_remote.size();) {
    if (!g_remote[i].after_write && due(L, g_remote[i]) && orderable(g_remote[i])) {
      deliver_remote(L, i);
      landed = true;
      continue;
    }
    ++i;
  }
  if (idle && !landed) {
    // a carried op is forced only when a thread spins on its words (it may wait for nothing else)
    auto awaited = [&](const RemoteOp& op) {
      for (const Thread& t : L.threads)
        if (t.state == State::kReady)
          for (const auto& m : t.memo)
            if (m.addr != nullptr && ((op.sig != nullptr && m.addr == op.sig) ||
                                      (op.bytes > 0 && overlaps(const_cast<const void*>(m.addr), 1, op.dst, op.bytes))))
              return true;
      return false;
    };
    size_t pick = g_remote.size();
    for (size_t i = 0; i < g_remote.size(); ++i) {
      const RemoteOp& op = g_remote[i];
      if (!orderable(op)) continue;
      if (op.thread != nullptr) {
        if (pick == g_remote.size() || g_remote[pick].thread == nullptr || op.due_round < g_remote[pick].due_round)
          pick = i;
      } else if (pick == g_remote.size() && awaited(op)) {
        pick = i;
      }
    }
    if (pick < g_remote.size()) {
      deliver_remote(L, pick);
      landed = true;
    }
  }
  return landed;
}

// At the end of a launch: the ops due by now land; those of this launch's threads are carried
// into the next launches (drawn from the seed: a round of one of them, or after the next write
// of the same words).
void carry_remote(Launch& L) {
  for (size_t i = 0; i < g_remote.size();) {
    RemoteOp& op = g_remote[i];
    if (op.thread == nullptr && L.serial >= op.due_launch + (op.after_write ? kRemoteLaunches : 0) && orderable(op)) {
      deliver_remote(L, i);
      continue;
    }
    if (op.thread != nullptr) {
      const uint64_t r = splitmix(L.rng);
      ++g_stats.remote_carried;
      op.thread = nullptr;
      op.after_write = (r & 1) != 0;
      op.due_launch = L.serial + (op.after_write ? 0 : 1 + (r >> 8) % kRemoteLaunches);
      op.due_round = static_cast<int64_t>((r >> 16) % kCarriedRounds);
    }
    ++i;
  }
}

std::string deadlock_report(Launch& L) {
  std::string s = "deadlock: no thread can run and no bulk copy is in flight;";
  int lines = 0;
  for (auto& bp : L.blocks) {
    Block* b = bp.get();
    if (b->live == 0) continue;
    std::map<std::string, int> at;
    for (Thread* t : b->threads) {
      if (t->state == State::kBarrier) ++at["__syncthreads (" + site_text(t->site) + ")"];
      if (t->state == State::kWarp) {
        const WarpSync& w = b->warps[t->warp];
        ++at[std::string(collective_name(w.kind)) + " (" + site_text(w.site) + ") of warp " + std::to_string(t->warp) +
             ", lanes " + lanes_text(w.mask & ~w.arrived) + " never came"];
      }
    }
    for (const auto& [what, n] : at) {
      if (lines++ == 6) return s + " ...";
      s += " block " + std::to_string(b->index) + ": " + std::to_string(n) + " thread(s) at " + what + ";";
    }
  }
  return s;
}

void schedule(Launch& L) {
  std::vector<Thread*> ready;
  ready.reserve(L.threads.size());
  while (L.live > 0 && L.error.empty()) {
    if (L.inject_flag != nullptr && L.round == L.inject_round) *reinterpret_cast<volatile int*>(L.inject_flag) = 1;
    ready.clear();
    for (Thread& t : L.threads)
      if (t.state == State::kReady && !t.held) ready.push_back(&t);
    if (ready.empty() && L.pending.empty() && L.held > 0) {  // nothing else can run: the held go on
      L.hold_key = -1;
      L.held = 0;
      for (Thread& t : L.threads)
        if (t.held) {
          t.held = false;
          ready.push_back(&t);
        }
    }
    for (size_t i = ready.size(); i > 1; --i) std::swap(ready[i - 1], ready[splitmix(L.rng) % i]);
    bool progress = false;
    for (Thread* t : ready) {
      if (t->state != State::kReady) continue;
      L.current = t;
      switch_context(L.scheduler, t->ctx);
      L.current = nullptr;
      if (!L.error.empty()) return;
      progress |= !t->idle;
    }
    progress |= advance_copies(L);
    if (L.remote_late) progress = advance_remote(L, !progress) || progress;
    if (!L.error.empty() || L.live == 0) return;
    bool runnable = !L.pending.empty();
    for (const RemoteOp& op : g_remote) runnable |= op.thread != nullptr;
    for (Thread& t : L.threads) runnable |= t.state == State::kReady;
    if (!runnable) {
      L.error = where(L, nullptr) + deadlock_report(L);
      return;
    }
    L.now += progress ? kRoundNs : kIdleRoundNs;
    g_stats.idle_rounds += progress ? 0 : 1;
    ++g_stats.rounds;
    if (++L.round > kMaxRounds) {
      L.error = where(L, nullptr) + "no end after " + std::to_string(kMaxRounds) + " scheduling rounds";
      return;
    }
  }
}

// ---- faults: shared memory past its size, stack overflow, invalid addresses -------------

struct sigaction g_old_segv, g_old_bus;
std::vector<unsigned char> g_alt_stack;

void on_fault(int sig, siginfo_t* info, void*) {
  Launch* L = g_launch;
  if (L == nullptr || !L->running) {
    sigaction(sig, sig == SIGSEGV ? &g_old_segv : &g_old_bus, nullptr);
    raise(sig);
    return;
  }
  const void* addr = info->si_addr;
  std::string what = "invalid memory access at " + hex(reinterpret_cast<uint64_t>(addr));
  for (auto& b : L->blocks)
    if (addr >= b->guard && addr < b->guard + page_bytes())
      what = "shared memory accessed past the launch's " + std::to_string(L->smem) +
             " bytes of dynamic shared "
             "memory (" +
             smem_text(b.get(), addr) + ")";
  if (L->current != nullptr) {  // just below the running fiber's stack: it ran past its end
    const auto* a = static_cast<const char*>(addr);
    const auto* low = static_cast<const char*>(L->current->stack.low);
    if (a < low && a + (1 << 20) >= low)
      what = "stack overflow of the thread's fiber (" + std::to_string(kStackBytes) + " bytes)";
  }
  if (L->error.empty()) L->error = where(*L, L->current) + what;
  L->jumped_from_fiber = L->current != nullptr;
  if (L->jumped_from_fiber) before_jump_out_of_fiber(L->scheduler);
  siglongjmp(L->jump, 1);
}

void install_fault_handlers() {
  if (g_alt_stack.empty()) g_alt_stack.resize(256 * 1024);
  stack_t ss{};
  ss.ss_sp = g_alt_stack.data();
  ss.ss_size = g_alt_stack.size();
  sigaltstack(&ss, nullptr);
  struct sigaction sa{};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
}

void remove_fault_handlers() {
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  sigaction(SIGBUS, &g_old_bus, nullptr);
}

Block* make_block(int index, int threads, size_t smem) {
  auto* b = new Block;
  b->index = index;
  const size_t page = page_bytes();
  const size_t arena = round_up(kArenaBytes, page), dyn = round_up(std::max<size_t>(smem, 16), page);
  b->mapping_bytes = arena + dyn + page;
  b->mapping = mmap(nullptr, b->mapping_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (b->mapping == MAP_FAILED) {
    delete b;
    return nullptr;
  }
  auto* base = static_cast<unsigned char*>(b->mapping);
  b->arena = base;
  b->guard = base + arena + dyn;
  mprotect(b->guard, page, PROT_NONE);
  b->dyn_bytes = smem;
  b->dyn = b->guard - round_up(smem, 16);
  // Shared memory holds garbage when a block starts: make reads of it before a write visible.
  std::memset(b->arena, 0xCD, kArenaBytes);
  std::memset(base + arena, 0xAB, dyn);
  const int warps = (threads + 31) / 32;
  b->warps.resize(warps);
  b->warp_gone.assign(warps, 0u);
  if (threads % 32 != 0) b->warp_gone[warps - 1] = ~((1u << (threads % 32)) - 1u);
  b->live = threads;
  return b;
}

}  // namespace

// ---- runtime.h ----------------------------------------------------------------------------

std::string site_text(Site s) {
  const char* slash = std::strrchr(s.file, '/');
  return std::string(slash ? slash + 1 : s.file) + ":" + std::to_string(s.line);
}

const char* collective_name(Collective k) {
  switch (k) {
    case Collective::kSyncwarp: return "__syncwarp";
    case Collective::kShfl: return "__shfl_sync";
    case Collective::kBallot: return "__ballot_sync";
  }
  return "?";
}

const Dim3& thread_idx() { return cur()->idx; }
const Dim3& block_idx() {
  static thread_local Dim3 d;
  d.x = cur()->block->index;
  return d;
}
const Dim3& block_dim() { return launch_state().block_dim; }
const Dim3& grid_dim() { return launch_state().grid; }

void syncthreads(Site site) {
  Thread* t = cur();
  Block* b = t->block;
  t->busy = true;
  if (b->exited > 0)
    fail("__syncthreads (" + site_text(site) + ") after " + std::to_string(b->exited) +
         " thread(s) of the block exited: a barrier in divergent code");
  if (!b->barrier_open) {
    b->barrier_open = true;
    b->barrier_site = site;
    b->at_barrier = 0;
  } else if (!same_site(b->barrier_site, site)) {
    fail("threads of one block reach different __syncthreads: " + site_text(b->barrier_site) + " and " +
         site_text(site));
  }
  hb::release(&b->barrier_key);
  if (++b->at_barrier == b->live) {
    Launch& L = launch_state();
    if (!L.timers.empty()) {
      std::vector<int> at{thread_index(L, t)};
      for (Thread* u : b->threads)
        if (u->state == State::kBarrier) at.push_back(thread_index(L, u));
      each_timer(L.timers, [&](timing::Timer& timer) { timer.barrier(at, site); });
    }
    for (Thread* u : b->threads)
      if (u->state == State::kBarrier) u->state = State::kReady;
    b->barrier_open = false;
    hb::acquire(&b->barrier_key);
    return;
  }
  t->state = State::kBarrier;
  t->site = site;
  t->idle = false;
  yield(t);
  hb::acquire(&b->barrier_key);
}

uint64_t collective(Collective kind, unsigned mask, uint64_t value, int src, Site site) {
  Thread* t = cur();
  Block* b = t->block;
  WarpSync& w = b->warps[t->warp];
  t->busy = true;
  const unsigned bit = 1u << t->lane;
  if (!(mask & bit))
    fail(std::string(collective_name(kind)) + " (" + site_text(site) + ") with mask " + hex(mask) +
         ", which leaves out the calling lane");
  if (mask & b->warp_gone[t->warp])
    fail(std::string(collective_name(kind)) + " (" + site_text(site) + "): its mask " + hex(mask) + " names lanes " +
         lanes_text(mask & b->warp_gone[t->warp]) + ", which exited");
  if (!w.open) {
    w.open = true;
    w.mask = mask;
    w.arrived = 0;
    w.kind = kind;
    w.site = site;
    w.first_lane = t->lane;
  } else if (w.mask != mask || w.kind != kind || (kind != Collective::kSyncwarp && !same_site(w.site, site))) {
    fail("lanes of one warp meet at different warp collectives: lane " + std::to_string(w.first_lane) + " at " +
         collective_name(w.kind) + " (" + site_text(w.site) + ", mask " + hex(w.mask) + "), lane " +
         std::to_string(t->lane) + " at " + collective_name(kind) + " (" + site_text(site) + ", mask " + hex(mask) +
         ")");
  }
  t->value = value;
  t->src = src;
  w.arrived |= bit;
  hb::release(&w);
  if (w.arrived != mask) {
    t->state = State::kWarp;
    t->site = site;
    t->idle = false;
    yield(t);
    hb::acquire(&w);
    return t->result;
  }
  hb::acquire(&w);
  Launch& L = launch_state();
  if (!L.timers.empty()) {
    std::vector<int> lanes;
    for (int l = 0; l < 32; ++l)
      if ((mask >> l) & 1u) lanes.push_back(thread_index(L, &lane_thread(b, t->warp, l)));
    each_timer(L.timers, [&](timing::Timer& timer) { timer.collective(lanes, kind, site); });
  }
  uint64_t ballot = 0;
  for (int l = 0; l < 32; ++l)
    if (((mask >> l) & 1u) && lane_thread(b, t->warp, l).value != 0) ballot |= 1ull << l;
  for (int l = 0; l < 32; ++l) {
    if (!((mask >> l) & 1u)) continue;
    Thread& u = lane_thread(b, t->warp, l);
    if (kind == Collective::kShfl) {
      const int s = u.src & 31;
      if (!((mask >> s) & 1u))
        fail("__shfl_sync (" + site_text(site) + ") reads lane " + std::to_string(s) + ", outside its mask " +
             hex(mask));
      u.result = lane_thread(b, t->warp, s).value;
    } else {
      u.result = kind == Collective::kBallot ? ballot : 0;
    }
    if (l != t->lane) u.state = State::kReady;
  }
  w.open = false;
  return t->result;
}

uint64_t poll(const volatile void* p, size_t bytes, Site site, PollKind kind) {
  Thread* t = cur();
  yield_at_poll(t, site);
  uint64_t v = 0;
  switch (bytes) {
    case 4: v = *static_cast<const volatile uint32_t*>(p); break;
    case 8: v = *static_cast<const volatile uint64_t*>(p); break;
    default: fail("poll of " + std::to_string(bytes) + " bytes");
  }
  t->last_poll_unchanged = !remember(t, p, v);
  Launch& L = launch_state();
  if (!L.timers.empty()) {
    const bool shared = in_smem(t->block, const_cast<const void*>(p), bytes);
    each_timer(L.timers,
               [&](timing::Timer& timer) { timer.poll(thread_index(L, t), p, !t->last_poll_unchanged, shared, site); });
  }
  if (kind == PollKind::kRelaxed) {  // ordered by the thread's next fence (fence_acquire)
    t->unfenced = site;
    if (hb::kEnabled && std::find(t->relaxed_reads.begin(), t->relaxed_reads.end(), p) == t->relaxed_reads.end())
      t->relaxed_reads.push_back(p);
    return v;
  }
  if (kind == PollKind::kAcquire && !in_smem(t->block, const_cast<const void*>(p), bytes)) t->unproxied = site;
  hb::acquire(const_cast<const void*>(p));
  return v;
}

void fence_acquire(Fence kind, Site site) {
  note_fence(kind);
  Launch* L = g_launch;
  if (L == nullptr || L->current == nullptr) return;
  Thread* t = L->current;
  if (t->unfenced.file != nullptr) t->unproxied = site;  // the generic proxy acquired what the polls saw
  t->unfenced = Site{nullptr, 0};
  for (const volatile void* p : t->relaxed_reads) hb::acquire(const_cast<const void*>(p));
  t->relaxed_reads.clear();
}

void fence_proxy(Site) {
  note_fence(Fence::kProxyAsync);
  Launch* L = g_launch;
  if (L == nullptr || L->current == nullptr) return;
  L->current->unproxied = Site{nullptr, 0};
}

bool remote_deferred() {
  const Launch* L = g_launch;
  return L != nullptr && (L->remote_late || L->posted);
}

// Rounds until a queued remote op lands: half of them soon, a quarter up to 256 rounds later, and
// one in eight only when no thread can make progress without it (advance_remote), its issuer
// quiets, or the launch ends (then it is carried into the next launches).
static int64_t remote_delay(uint64_t& rng) {
  const uint64_t r = splitmix(rng);
  if ((r & 7) == 0) return kMaxRounds;
  return static_cast<int64_t>((r & 7) < 4 ? (r >> 8) % 4 : (r >> 8) % 257);
}

// An unfenced relaxed poll, before `what` (a bulk copy or a put) that may read what it guarded.
static void check_fenced(const Thread* t, const std::string& what) {
  if (t->unfenced.file != nullptr)
    fail(what + " after the relaxed poll at " + site_text(t->unfenced) +
         " with no fence.acq_rel since: what the flag guards may not be visible yet (a relaxed poll orders nothing)");
}

// A posted put (set_posted_puts) lands at once, written by its issuing thread; the timing model
// prices it as the putting rank's NIC would (timing.h, nic_put).
static void post_now(Launch& L, Thread* t, int src_rank, int dst_rank, void* dst, const void* src, uint64_t bytes,
                     uint64_t* sig, uint64_t value, Site site) {
  if (bytes > 0) {
    hb::reads(src, bytes);
    hb::writes(dst, bytes);
    std::memmove(dst, src, bytes);
  }
  if (sig != nullptr) {
    hb::release(sig);
    __atomic_store_n(sig, value, __ATOMIC_RELEASE);
  }
  each_timer(L.timers,
             [&](timing::Timer& timer) { timer.nic_put(thread_index(L, t), src_rank, dst_rank, bytes, sig, site); });
}

void remote_put(int src_rank, int dst_rank, void* dst, const void* src, uint64_t bytes, uint64_t* sig, uint64_t value,
                Site site) {
  if (bytes == 0 && sig == nullptr) return;
  Thread* t = cur();
  Launch& L = launch_state();
  t->busy = true;
  const std::string at = std::string(sig != nullptr ? "put with signal (" : "put (") + site_text(site) + ") of " +
                         std::to_string(bytes) + " bytes to rank " + std::to_string(dst_rank);
  if (bytes > 0) check_fenced(t, at);  // a signal alone reads nothing
  if (bytes % 16 != 0) fail(at + ": the size must be a multiple of 16");
  if (bytes > 0 && !in_global(dst, bytes)) fail(at + ": the destination is not inside one registered buffer");
  if (bytes > 0 && !in_global(src, bytes)) fail(at + ": the source is not inside one registered buffer");
  if (sig != nullptr && (reinterpret_cast<uintptr_t>(sig) % 8 != 0 || !in_global(sig, 8)))
    fail(at + ": the signal word is not an aligned u64 of a registered buffer");
  if (L.posted) return post_now(L, t, src_rank, dst_rank, dst, src, bytes, sig, value, site);
  RemoteOp op;
  op.seq = ++g_remote_seq;
  op.issuer = L.serial << 24 | static_cast<uint64_t>(thread_index(L, t));
  op.thread = t;
  op.dst_rank = dst_rank;
  op.fences = t->remote_fences;
  op.dst = static_cast<unsigned char*>(dst);
  op.src = static_cast<const unsigned char*>(src);
  op.bytes = bytes;
  op.sig = sig;
  op.value = value;
  op.due_launch = L.serial;
  op.due_round = L.round + remote_delay(L.rng);
  op.site = site;
  if (hb::kEnabled) {
    g_remote_keys.push_back(0);
    op.issued = &g_remote_keys.back();
    hb::release(op.issued);
  }
  g_remote.push_back(op);
  ++g_stats.remote_ops;
}

void remote_fence(Site) {
  Thread* t = cur();
  t->busy = true;
  ++t->remote_fences;
}

void remote_quiet(Site site) {
  Thread* t = cur();
  Launch& L = launch_state();
  ++t->remote_fences;
  if (L.posted) {  // every op landed when it was posted: the quiet waits for their acknowledgements
    each_timer(L.timers, [&](timing::Timer& timer) { timer.nic_quiet(thread_index(L, t), site); });
    return;
  }
  for (;;) {
    bool mine = false;
    for (RemoteOp& op : g_remote)
      if (op.thread == t) {
        mine = true;
        op.due_round = std::min(op.due_round, L.round);  // quiet completes them
      }
    if (!mine) break;
    t->busy = true;  // ops in flight: the round is not idle
    yield_at_poll(t, site);
  }
}

uint64_t timer_ns() { return launch_state().now; }

void* block_shared(const void* tag, size_t bytes, size_t align) {
  Thread* t = cur();
  Block* b = t->block;
  for (const auto& [slot_tag, offset] : b->slots)
    if (slot_tag == tag) return b->arena + offset;
  const size_t offset = round_up(b->arena_used, std::max<size_t>(align, 16));
  if (offset + bytes > kArenaBytes)
    fail("static shared memory of the block over the model's " + std::to_string(kArenaBytes) + " bytes");
  b->slots.emplace_back(tag, offset);
  b->arena_used = offset + bytes;
  // As on the GPU, where the kernel's static shared memory and the launch's dynamic size share
  // the block's opt-in limit, and a cooperative launch needs every block resident at once.
  const Launch& L = launch_state();
  if (b->arena_used + L.smem > kSmemPerBlockOptin)
    fail("static shared memory (" + std::to_string(b->arena_used) + " bytes so far) plus the launch's " +
         std::to_string(L.smem) + " bytes of dynamic shared memory: over the " + std::to_string(kSmemPerBlockOptin) +
         " a block may have");
  const size_t per_sm = 228 * 1024;  // an H100's shared memory per SM, 1 KiB of it reserved per block
  const size_t resident = per_sm / (b->arena_used + L.smem + 1024);
  if (static_cast<size_t>(L.grid.x) > resident * kDeviceSms)
    fail("a cooperative launch of " + std::to_string(L.grid.x) + " blocks, while only " + std::to_string(resident) +
         " per SM fit with " + std::to_string(b->arena_used + L.smem) + " bytes of shared memory each (" +
         std::to_string(kDeviceSms) + " SMs)");
  return b->arena + offset;
}

void* dynamic_smem() { return cur()->block->dyn; }

void mbar_init(uint64_t* bar, uint32_t count, Site site) {
  Thread* t = cur();
  Block* b = t->block;
  t->busy = true;
  if (!in_smem(b, bar, 8) || reinterpret_cast<uintptr_t>(bar) % 8 != 0)
    fail("mbar_init (" + site_text(site) + ") at " + smem_text(b, bar) + ", not an 8-byte slot of shared memory");
  if (count == 0) fail("mbar_init (" + site_text(site) + ") with a count of 0");
  Mbar m;
  m.count = count;
  m.pending = count;
  b->mbars[bar] = m;
  each_timer(launch_state().timers, [&](timing::Timer& timer) { timer.mbar_init(bar); });
}

void mbar_arrive(uint64_t* bar, uint32_t expect_tx_bytes, Site site) {
  Thread* t = cur();
  Block* b = t->block;
  t->busy = true;
  Mbar& m = mbar_of(b, bar, "arrive");
  hb::release(bar);
  Launch& L = launch_state();
  each_timer(L.timers, [&](timing::Timer& timer) { timer.arrive(thread_index(L, t), bar, site); });
  m.tx += expect_tx_bytes;
  --m.pending;
  mbar_settle(b, bar, m, t);
}

bool mbar_try_wait(uint64_t* bar, uint32_t parity, Site site) {
  Thread* t = cur();
  yield_at_poll(t, site);
  Block* b = t->block;
  Mbar& m = mbar_of(b, bar, "try_wait");
  const bool done = static_cast<uint32_t>(m.phase & 1) != (parity & 1u);
  t->last_poll_unchanged = !remember(t, bar, static_cast<uint64_t>(m.phase));
  if (!done) {
    each_timer(launch_state().timers, [&](timing::Timer& timer) { timer.spinning(thread_index(launch_state(), t)); });
    return false;
  }
  const int64_t phase = m.phase - 1;  // the latest completed phase of that parity (-1: before the first)
  auto seen = std::find_if(t->waited.begin(), t->waited.end(), [&](const auto& w) { return w.first == bar; });
  if (seen == t->waited.end()) {
    t->waited.emplace_back(bar, phase);
  } else {
    if (seen->second == phase)
      fail("waits a second time (" + site_text(site) + ") on phase " + std::to_string(phase) + " of the mbarrier at " +
           smem_text(b, bar) + ": that phase was already consumed, so the wait proves nothing (a stale parity)");
    seen->second = phase;
  }
  hb::acquire(bar);
  Launch& L = launch_state();
  each_timer(L.timers, [&](timing::Timer& timer) { timer.wait_done(thread_index(L, t), bar, site); });
  return true;
}

// Checks one bulk copy between `smem` and `gmem` and queues it; returns its index.
size_t enqueue_copy(bool g2s, void* smem, const void* gmem, uint32_t bytes, uint64_t* bar, Site site, void* pc) {
  Thread* t = cur();
  Launch& L = launch_state();
  Block* b = t->block;
  t->busy = true;
  const std::string at =
      std::string(g2s ? "bulk load (" : "bulk store (") + site_text(site) + ") of " + std::to_string(bytes) + " bytes";
  const std::string global = hex(reinterpret_cast<uint64_t>(gmem));
  if (bytes == 0 || bytes % 16 != 0) fail(at + ": the size must be a positive multiple of 16");
  if (reinterpret_cast<uintptr_t>(smem) % 16 != 0 || reinterpret_cast<uintptr_t>(gmem) % 16 != 0)
    fail(at + ": addresses must be 16-byte aligned (shared " + smem_text(b, smem) + ", global " + global + ")");
  if (!in_smem(b, smem, bytes))
    fail(at + (g2s ? " into " : " from ") + smem_text(b, smem) + ": past the block's shared memory");
  if (!in_global(gmem, bytes)) fail(at + (g2s ? " from " : " to ") + global + ": not inside one declared allocation");
  if (g2s) mbar_of(b, bar, "a bulk load's complete_tx");
  check_fenced(t, at);
  if (t->unproxied.file != nullptr && registered(gmem))
    fail(at + (g2s ? " from " : " to ") + "registered memory after the acquire at " + site_text(t->unproxied) +
         " with no fence.proxy.async since: the bulk copy engine (the async proxy) may not see what that acquire "
         "made visible");
  Copy c;
  c.g2s = g2s;
  c.dst = static_cast<unsigned char*>(g2s ? smem : const_cast<void*>(gmem));
  c.src = static_cast<const unsigned char*>(g2s ? gmem : smem);
  c.bytes = bytes;
  c.block = b;
  c.bar = bar;
  c.owner = t;
  c.site = site;
  if (hb::kEnabled) {  // only the race check reads them
    L.copy_keys.push_back(0);
    c.issued = &L.copy_keys.back();
    c.issue_pc = pc;
    hb::release(c.issued);
  }
  c.read_round = L.round + copy_delay(L.rng);
  c.write_round = g2s ? c.read_round : c.read_round + copy_delay(L.rng);  // a load lands as it reads
  c.pieces.push_back(Copy::Piece{0, bytes, c.write_round, false});
  if (L.torn && bytes >= 32) {  // up to four pieces of 16-byte multiples, each landing at its own round
    const uint64_t r = splitmix(L.rng);
    const uint32_t n = std::min<uint32_t>(1 + r % 4, bytes / 16);
    c.pieces.clear();
    g_stats.torn_copies += n > 1;
    uint32_t at_byte = 0;
    for (uint32_t k = 0; k < n; ++k) {
      const uint32_t end = k + 1 == n ? bytes : (bytes / 16 * (k + 1) / n) * 16;
      c.pieces.push_back(Copy::Piece{at_byte, end - at_byte, c.write_round + copy_delay(L.rng), false});
      at_byte = end;
    }
  }
  L.copies.push_back(std::move(c));
  L.pending.push_back(L.copies.size() - 1);
  each_timer(L.timers, [&](timing::Timer& timer) {
    timer.copy_issue(thread_index(L, t), L.copies.size() - 1, b->index, g2s, gmem, bytes, site);
  });
  return L.copies.size() - 1;
}

void bulk_g2s(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar, Site site) {
  enqueue_copy(true, smem_dst, gmem_src, bytes, bar, site, __builtin_return_address(0));
}

void bulk_s2g(void* gmem_dst, const void* smem_src, uint32_t bytes, Site site) {
  hold_point(kStoresOfBlock + cur()->block->index, site);
  const size_t id =
      enqueue_copy(false, const_cast<void*>(smem_src), gmem_dst, bytes, nullptr, site, __builtin_return_address(0));
  Thread* t = cur();
  t->open_group.push_back(id);
  Launch& L = launch_state();
  each_timer(L.timers, [&](timing::Timer& timer) { timer.store_in_group(thread_index(L, t), id); });
}

void bulk_commit(Site) {
  Thread* t = cur();
  t->busy = true;
  t->groups.push_back(std::move(t->open_group));
  t->open_group.clear();
  Launch& L = launch_state();
  each_timer(L.timers, [&](timing::Timer& timer) { timer.commit(thread_index(L, t)); });
}

void bulk_wait(bool reads_only, int except_newest, Site site) {
  Thread* t = cur();
  Launch& L = launch_state();
  const size_t waited = t->groups.size() > static_cast<size_t>(except_newest) ? t->groups.size() - except_newest : 0;
  for (;;) {
    bool done = true;
    for (size_t g = 0; g < waited; ++g)
      for (size_t i : t->groups[g]) done &= reads_only ? L.copies[i].read : L.copies[i].written;
    if (done) break;
    t->busy = true;  // copies in flight: the round is not idle
    yield_at_poll(t, site);
  }
  hb::acquire(&t->bulk_key);
  each_timer(L.timers,
             [&](timing::Timer& timer) { timer.bulk_wait(thread_index(L, t), reads_only, except_newest, site); });
  // Groups whose writes completed, oldest first, need no further wait.
  size_t complete = 0;
  while (complete < t->groups.size()) {
    bool written = true;
    for (size_t i : t->groups[complete]) written &= L.copies[i].written;
    if (!written) break;
    ++complete;
  }
  t->groups.erase(t->groups.begin(), t->groups.begin() + static_cast<std::ptrdiff_t>(complete));
}

const char* launch(void (*body)(const void*), const void* ctx, int blocks, int threads, size_t smem, const char* name) {
  const char* short_name = std::strncmp(name, "launch_", 7) == 0 ? name + 7 : name;
  if (blocks < 1 || threads < 1 || threads > 1024) {
    g_message = std::string("CPU model: ") + short_name + " kernel: invalid launch configuration (" +
                std::to_string(blocks) + " blocks of " + std::to_string(threads) + " threads)";
    return g_message.c_str();
  }
  if (smem > kSmemPerBlockOptin) {
    g_message = std::string("CPU model: ") + short_name + " kernel: " + std::to_string(smem) +
                " bytes of dynamic shared memory, more than the " + std::to_string(kSmemPerBlockOptin) +
                " a block may have";
    return g_message.c_str();
  }
  if (g_launch != nullptr) {
    g_message = "CPU model: a launch from inside a launch";
    return g_message.c_str();
  }
  const size_t warps_per_block = (static_cast<size_t>(threads) + 31) / 32;
  const size_t race_fibers = std::max(g_thread_fibers.size(), static_cast<size_t>(blocks) * threads) +
                             std::max(g_engine_fibers.size(), blocks * warps_per_block);  // the pools after it
  if (hb::kEnabled && race_fibers > kMaxRaceFibers) {
    g_message = std::string("CPU model: ") + short_name + " kernel: " + std::to_string(blocks) + " blocks of " +
                std::to_string(threads) + " threads need more fibers than ThreadSanitizer's limit allows (" +
                std::to_string(kMaxRaceFibers) +
                ": one per thread and one per warp's bulk copies, kept across "
                "launches)";
    return g_message.c_str();
  }
  auto L = std::make_unique<Launch>();
  L->name = short_name;
  L->body = body;
  L->ctx = ctx;
  L->grid.x = static_cast<unsigned>(blocks);
  L->block_dim.x = static_cast<unsigned>(threads);
  L->smem = smem;
  L->payload = g_payload;
  L->serial = g_stats.launches;
  const bool timing_on = !timing::configured().empty();  // it times the GPU emulation's behaviour
  L->remote_late = g_weak[static_cast<int>(Weak::kRemoteLate)] && !timing_on;
  L->torn = g_weak[static_cast<int>(Weak::kTornCopies)] && !timing_on;
  L->posted = g_posted;
  uint64_t mix = g_seed ^ (0x51ed270b27ull * ++g_launches_since_seed);
  L->rng = splitmix(mix);
  L->threads.resize(static_cast<size_t>(blocks) * threads);
  StackPool& pool = stack_pool();
  for (int bi = 0; bi < blocks; ++bi) {
    Block* b = make_block(bi, threads, smem);
    if (b == nullptr) {
      g_message = "CPU model: could not map a block's shared memory";
      return g_message.c_str();
    }
    L->blocks.emplace_back(b);
    for (int ti = 0; ti < threads; ++ti) {
      Thread& t = L->threads[static_cast<size_t>(bi) * threads + ti];
      t.block = b;
      t.tid = ti;
      t.idx.x = static_cast<unsigned>(ti);
      t.lane = ti & 31;
      t.warp = ti >> 5;
      t.stack = pool.acquire();
      make_context(t.ctx, t.stack, fiber_entry, &t);
      b->threads.push_back(&t);
    }
  }
  if (hb::kEnabled) name_race_fibers(*L, warps_per_block);
  for (size_t i = 0; i < timing::configured().size(); ++i)
    L->timers.push_back(
        std::make_unique<timing::Timer>(timing::configured()[i], static_cast<int>(i), short_name, blocks, threads));
  L->live = blocks * threads;
  if (g_injection.flag != 0 && g_injection.kernel == short_name) {
    L->inject_flag = reinterpret_cast<int*>(g_injection.flag);
    L->inject_round = g_injection.round;
    g_injection = Injection{};
  }
  if (g_hold.key >= 0 && g_hold.kernel == short_name) {
    L->hold_key = g_hold.key;
    g_hold = Hold{};
  }
  const uint64_t started_ns = L->now;
  g_launch = L.get();
  L->scheduler.race_fiber = hb::current_fiber();
  hb::release(&L->start_key);
  install_fault_handlers();
  if (sigsetjmp(L->jump, 1) == 0) {
    L->running = true;
    schedule(*L);
  } else if (L->jumped_from_fiber) {
    after_jump_out_of_fiber();
  }
  L->running = false;
  carry_remote(*L);
  if (hb::kEnabled) {  // the host's next work is ordered after everything the launch did
    for (Thread& t : L->threads) {
      hb::enter(t.ctx.race_fiber);
      hb::release(&L->end_key);
    }
    for (auto& b : L->blocks)
      for (void* f : b->engine_fibers) {
        hb::enter(f);
        hb::release(&L->end_key);
      }
    hb::enter(L->scheduler.race_fiber);
    hb::acquire(&L->end_key);
  }
  remove_fault_handlers();
  g_launch = nullptr;
  for (Thread& t : L->threads) {
    pool.release(t.stack);
    free_context(t.ctx);
  }
  free_context(L->scheduler);
  for (auto& b : L->blocks) munmap(b->mapping, b->mapping_bytes);
  ++g_stats.launches;
  g_stats.virtual_ns += L->now - started_ns;
  if (L->error.empty()) each_timer(L->timers, [&](timing::Timer& timer) { timing::add_report(timer.finish()); });
  if (!L->error.empty()) {
    g_message = "CPU model: " + L->error;
    return g_message.c_str();
  }
  return nullptr;
}

int max_active_blocks(int threads, size_t smem) {
  if (threads < 1 || threads > 1024 || smem > kSmemPerBlockOptin) return 0;
  const int by_threads = 2048 / threads;
  const int by_smem = smem == 0 ? 32 : static_cast<int>(228 * 1024 / (smem + 1024));
  return std::max(0, std::min({by_threads, by_smem, 32}));
}

void inject_abort(uint64_t flag, int64_t round, const std::string& kernel) {
  g_injection.flag = flag;
  g_injection.round = round;
  g_injection.kernel = kernel;
}

void hold_at(int key, const std::string& kernel) {
  g_hold.key = key;
  g_hold.kernel = kernel;
}

void hold_point(int key, Site site) {
  Launch& L = launch_state();
  if (key < 0 || key != L.hold_key) return;
  Thread* t = cur();
  t->held = true;
  ++L.held;
  yield_at_poll(t, site);  // the scheduler resumes it once it lets the held go on
}

void note_flag_write(const volatile void* p, Site site) {
  Launch* L = g_launch;
  if (L == nullptr || L->timers.empty() || L->current == nullptr) return;
  const bool shared = in_smem(L->current->block, const_cast<const void*>(p), 1);
  each_timer(L->timers, [&](timing::Timer& timer) { timer.flag_write(thread_index(*L, L->current), p, shared, site); });
}

void note_flag_seen(const volatile void* p, Site site) {
  Launch* L = g_launch;
  if (L == nullptr || L->timers.empty() || L->current == nullptr) return;
  const bool shared = in_smem(L->current->block, const_cast<const void*>(p), 1);
  each_timer(L->timers, [&](timing::Timer& timer) { timer.poll(thread_index(*L, L->current), p, true, shared, site); });
}

void note_atomic(const volatile void* p, Site site) {
  Launch* L = g_launch;
  if (L == nullptr || L->timers.empty() || L->current == nullptr) return;
  const bool shared = in_smem(L->current->block, const_cast<const void*>(p), 1);
  each_timer(L->timers, [&](timing::Timer& timer) { timer.atomic(thread_index(*L, L->current), p, shared, site); });
}

void note_plain_pair(Pair kind) {
  Launch* L = g_launch;
  if (L == nullptr || L->timers.empty() || L->current == nullptr) return;
  each_timer(L->timers, [&](timing::Timer& timer) { timer.plain_pair(thread_index(*L, L->current), kind); });
}

void note_access(const volatile void* p, uint32_t bytes, bool load) {
  Launch* L = g_launch;
  if (L == nullptr || L->timers.empty() || L->current == nullptr) return;
  const bool shared = in_smem(L->current->block, const_cast<const void*>(p), bytes);
  each_timer(L->timers,
             [&](timing::Timer& timer) { timer.access(thread_index(*L, L->current), p, shared, bytes, load); });
}

void check_shared(const void* p, Site site) {
  const Block* b = cur()->block;
  if (!in_smem(b, p, 1))
    fail("assume_shared (" + site_text(site) + "): " + smem_text(b, p) + " is not in the block's shared memory");
}

void note_chain() {
  Launch* L = g_launch;
  if (L == nullptr || L->timers.empty() || L->current == nullptr) return;
  each_timer(L->timers, [&](timing::Timer& timer) { timer.chain(thread_index(*L, L->current)); });
}

void note_plain_code(const dev::PlainRun* runs, int n) {
  Launch* L = g_launch;
  if (L == nullptr || L->timers.empty() || L->current == nullptr) return;
  each_timer(L->timers, [&](timing::Timer& timer) { timer.plain_code(thread_index(*L, L->current), runs, n); });
}

void note_instructions(int n) {
  Launch* L = g_launch;
  if (L == nullptr || L->timers.empty() || L->current == nullptr) return;
  each_timer(L->timers, [&](timing::Timer& timer) { timer.instructions(thread_index(*L, L->current), n); });
}

void note_fence(Fence kind) {
  Launch* L = g_launch;
  if (L == nullptr || L->timers.empty() || L->current == nullptr) return;
  each_timer(L->timers, [&](timing::Timer& timer) { timer.fence(thread_index(*L, L->current), kind); });
}

void set_seed(uint64_t seed) {
  g_seed = seed;
  g_launches_since_seed = 0;
}
uint64_t seed() { return g_seed; }
void set_payload(bool moves) { g_payload = moves; }
void set_posted_puts(bool on) { g_posted = on; }
bool posted_puts() { return g_posted; }
bool payload() { return g_payload; }

void declare_allocations(const std::vector<std::pair<uint64_t, uint64_t>>& ranges) { g_declared = ranges; }
void add_allocation(uint64_t ptr, uint64_t bytes) { g_persistent[ptr] = bytes; }
void remove_allocation(uint64_t ptr) {
  auto it = g_persistent.find(ptr);
  if (it == g_persistent.end()) return;
  const auto* base = reinterpret_cast<const void*>(ptr);
  const uint64_t bytes = it->second;
  auto freed = [&](const RemoteOp& op) {  // queued ops into or out of a freed buffer: never land
    return (op.bytes > 0 && (overlaps(op.dst, op.bytes, base, bytes) || overlaps(op.src, op.bytes, base, bytes))) ||
           (op.sig != nullptr && overlaps(op.sig, 8, base, bytes));
  };
  g_remote.erase(std::remove_if(g_remote.begin(), g_remote.end(), freed), g_remote.end());
  g_persistent.erase(it);
}

const char* weak_name(Weak w) {
  switch (w) {
    case Weak::kRemoteLate: return "remote_late";
    case Weak::kTornCopies: return "torn_copies";
    case Weak::kCount: break;
  }
  return "?";
}
void set_weak(Weak w, bool on) { g_weak[static_cast<int>(w)] = on; }
bool weak(Weak w) { return g_weak[static_cast<int>(w)]; }

Stats stats() { return g_stats; }

}  // namespace hybrid_ep::model
