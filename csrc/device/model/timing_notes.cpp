// What only the timing model reads (runtime.h, timing.h): flag writes, values seen without a
// poll, atomics, fences, plain accesses and plain code, told to each of the launch's timers.
// Each does nothing unless timing is on.
#include "device/model/state.h"

namespace hybrid_ep::model {

using namespace detail;

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

void note_named_barrier(const volatile void* stamp, Site site) {
  Launch* L = g_launch;
  if (L == nullptr || L->timers.empty() || L->current == nullptr) return;
  each_timer(L->timers, [&](timing::Timer& timer) { timer.named_barrier(thread_index(*L, L->current), stamp, site); });
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

}  // namespace hybrid_ep::model
