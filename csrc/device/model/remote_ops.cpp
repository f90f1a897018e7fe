// The loopback transport's remote ops between the model's ranks (runtime.h, remote_put): queued
// and delivered late and out of order while the weakening is on, carried across launches,
// posted at once while the timing model prices a cluster.
#include <algorithm>
#include <cstring>
#include <deque>

#include "device/model/state.h"

namespace hybrid_ep::model {
namespace detail {
namespace {

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

}  // namespace

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

bool remote_ops_in_flight() {
  for (const RemoteOp& op : g_remote)
    if (op.thread != nullptr) return true;
  return false;
}

void drop_remote_ops(const void* base, uint64_t bytes) {
  auto freed = [&](const RemoteOp& op) {
    return (op.bytes > 0 && (overlaps(op.dst, op.bytes, base, bytes) || overlaps(op.src, op.bytes, base, bytes))) ||
           (op.sig != nullptr && overlaps(op.sig, 8, base, bytes));
  };
  g_remote.erase(std::remove_if(g_remote.begin(), g_remote.end(), freed), g_remote.end());
}

namespace {

// Rounds until a queued remote op lands: half of them soon, a quarter up to 256 rounds later, and
// one in eight only when no thread can make progress without it (advance_remote), its issuer
// quiets, or the launch ends (then it is carried into the next launches).
int64_t remote_delay(uint64_t& rng) {
  const uint64_t r = splitmix(rng);
  if ((r & 7) == 0) return kMaxRounds;
  return static_cast<int64_t>((r & 7) < 4 ? (r >> 8) % 4 : (r >> 8) % 257);
}

// A posted put (set_posted_puts) lands at once, written by its issuing thread; the timing model
// prices it as the putting rank's NIC would (timing.h, nic_put).
void post_now(Launch& L, Thread* t, int src_rank, int dst_rank, void* dst, const void* src, uint64_t bytes,
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

}  // namespace
}  // namespace detail

using namespace detail;

bool remote_deferred() {
  const Launch* L = g_launch;
  return L != nullptr && (L->remote_late || L->posted);
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

}  // namespace hybrid_ep::model
