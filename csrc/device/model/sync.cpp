// Barriers, warp collectives, polls and fences on the CPU model: where a thread waits for
// others (and gives way to them), with the checks runtime.h lists for each.
#include <algorithm>

#include "device/model/state.h"

namespace hybrid_ep::model {
namespace detail {
namespace {

Thread& lane_thread(Block* b, int warp, int lane) { return *b->threads[warp * 32 + lane]; }

}  // namespace

// An unfenced relaxed poll, before `what` (a bulk copy or a put) that may read what it guarded.
void check_fenced(const Thread* t, const std::string& what) {
  if (t->unfenced.file != nullptr)
    fail(what + " after the relaxed poll at " + site_text(t->unfenced) +
         " with no fence.acq_rel since: what the flag guards may not be visible yet (a relaxed poll orders nothing)");
}

}  // namespace detail

using namespace detail;

const char* collective_name(Collective k) {
  switch (k) {
    case Collective::kSyncwarp: return "__syncwarp";
    case Collective::kShfl: return "__shfl_sync";
    case Collective::kBallot: return "__ballot_sync";
  }
  return "?";
}

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

void named_barrier_stuck(uint32_t id, uint32_t arrived, uint32_t threads, Site site) {
  fail("named barrier " + std::to_string(id) + " (" + site_text(site) + "): " + std::to_string(arrived) + " of " +
       std::to_string(threads) + " threads arrived and no other came for " +
       std::to_string(kNamedBarrierBoundNs / 1000000000ull) +
       " s of virtual time: a participant exited or waits elsewhere (bar.sync waits unbounded on a GPU)");
}

void named_barrier_mismatch(uint32_t id, uint32_t first, uint32_t threads, Site site) {
  fail("named barrier " + std::to_string(id) + " (" + site_text(site) + "): a thread arrives for " +
       std::to_string(threads) + " threads where this generation's first arrival named " + std::to_string(first));
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

}  // namespace hybrid_ep::model
