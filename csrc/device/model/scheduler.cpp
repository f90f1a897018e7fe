// The CPU model's scheduler: a launch runs every thread of every block as a fiber, in rounds
// whose order is drawn from the seed, until every thread has exited, a check fails, or no
// thread can run any more (a deadlock: its report says where each block waits).
#include <sys/mman.h>

#include <algorithm>
#include <cstring>
#include <map>

#include "device/model/state.h"

namespace hybrid_ep::model {
namespace detail {
namespace {

constexpr uint64_t kRoundNs = 100;
constexpr uint64_t kIdleRoundNs = 10'000'000;
thread_local std::string g_message;  // this thread's last launch's error (runtime.h, launch)

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
    runnable |= remote_ops_in_flight();
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
}  // namespace detail

using namespace detail;

const Dim3& thread_idx() { return cur()->idx; }
const Dim3& block_idx() {
  static thread_local Dim3 d;
  d.x = cur()->block->index;
  return d;
}
const Dim3& block_dim() { return launch_state().block_dim; }
const Dim3& grid_dim() { return launch_state().grid; }

uint64_t timer_ns() { return launch_state().now; }

const char* launch(void (*body)(const void*), const void* ctx, int blocks, int threads, size_t smem, const char* name) {
  Locked locked;  // one launch at a time, whole (runtime.h, threads)
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
  arm_injections(*L);
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

}  // namespace hybrid_ep::model
