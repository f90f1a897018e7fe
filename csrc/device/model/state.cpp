// The helpers of state.h, and the controls the Python module sets between launches (runtime.h,
// configuration): the seed, the weakenings, payload-free mode, posted puts, the declared
// allocations and the statistics.
#include "device/model/state.h"

#include <cstring>
#include <map>
#include <mutex>

namespace hybrid_ep::model {
namespace detail {

uint64_t g_seed = 0;
bool g_payload = true;                                       // set_payload
bool g_weak[static_cast<int>(Weak::kCount)] = {true, true};  // set_weak
bool g_posted = false;                                       // set_posted_puts
uint64_t g_launches_since_seed = 0;                          // with the seed, picks each launch's schedule
Stats g_stats;

namespace {
std::map<uint64_t, uint64_t> g_persistent;                           // ptr -> bytes
thread_local std::vector<std::pair<uint64_t, uint64_t>> g_declared;  // per call, the launching thread's
}  // namespace

std::mutex& model_lock() {
  static std::mutex lock;
  return lock;
}

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

void fail(const std::string& message, const Thread* about) {
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

std::string smem_text(const Block* b, const void* p) {
  const auto* a = static_cast<const unsigned char*>(p);
  if (a >= b->dyn && a <= b->dyn + b->dyn_bytes + page_bytes())
    return "dynamic shared memory + " + std::to_string(a - b->dyn);
  if (a >= b->arena && a < b->arena + kArenaBytes) return "static shared memory + " + std::to_string(a - b->arena);
  return hex(reinterpret_cast<uint64_t>(p));
}

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

}  // namespace detail

using namespace detail;

std::string site_text(Site s) {
  const char* slash = std::strrchr(s.file, '/');
  return std::string(slash ? slash + 1 : s.file) + ":" + std::to_string(s.line);
}

namespace {
// A control read or set between launches, under the model's lock.
template <typename T>
T locked_read(const T& control) {
  Locked locked;
  return control;
}
template <typename T>
void locked_write(T& control, T value) {
  Locked locked;
  control = value;
}
}  // namespace

void set_seed(uint64_t seed) {
  Locked locked;
  g_seed = seed;
  g_launches_since_seed = 0;
}
uint64_t seed() { return locked_read(g_seed); }
void set_payload(bool moves) { locked_write(g_payload, moves); }
bool payload() { return locked_read(g_payload); }
void set_posted_puts(bool on) { locked_write(g_posted, on); }
bool posted_puts() { return locked_read(g_posted); }

const char* weak_name(Weak w) {
  switch (w) {
    case Weak::kRemoteLate: return "remote_late";
    case Weak::kTornCopies: return "torn_copies";
    case Weak::kCount: break;
  }
  return "?";
}
void set_weak(Weak w, bool on) { locked_write(g_weak[static_cast<int>(w)], on); }
bool weak(Weak w) { return locked_read(g_weak[static_cast<int>(w)]); }

void declare_allocations(const std::vector<std::pair<uint64_t, uint64_t>>& ranges) { g_declared = ranges; }
void add_allocation(uint64_t ptr, uint64_t bytes) {
  Locked locked;
  g_persistent[ptr] = bytes;
}
void remove_allocation(uint64_t ptr) {
  Locked locked;
  auto it = g_persistent.find(ptr);
  if (it == g_persistent.end()) return;
  const auto* base = reinterpret_cast<const void*>(ptr);
  const uint64_t bytes = it->second;
  drop_remote_ops(base, bytes);  // queued ops into or out of the freed buffer never land
  g_persistent.erase(it);
}

std::vector<std::pair<uint64_t, uint64_t>> allocations() {
  Locked locked;
  return {g_persistent.begin(), g_persistent.end()};
}

Stats stats() { return locked_read(g_stats); }

uint64_t launch_serial() { return launch_state().serial; }

}  // namespace hybrid_ep::model
