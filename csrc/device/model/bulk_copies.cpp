// Shared memory, mbarriers and bulk copies on the CPU model: each copy is checked when issued
// and lands a few rounds later (in pieces while a copy may tear), completing its mbarrier's
// transaction bytes or its bulk group; a block may not exit while one still uses its shared
// memory.
#include <algorithm>
#include <cstring>

#include "device/model/state.h"

namespace hybrid_ep::model {
namespace detail {
namespace {

constexpr int kMaxCopyDelay = 3;    // rounds a bulk copy usually takes, drawn per copy
constexpr int kLongCopyDelay = 40;  // ... and one in eight takes up to this many

// Rounds until a bulk copy (or its read) completes: mostly soon, sometimes late, so a wait
// that is missing, or placed too early, shows up as wrong data or as a check.
int64_t copy_delay(uint64_t& rng) {
  const uint64_t r = splitmix(rng);
  return static_cast<int64_t>((r & 7) == 0 ? (r >> 8) % (kLongCopyDelay + 1) : (r >> 8) % (kMaxCopyDelay + 1));
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
// those of a run that moves them (tests/model/test_timing_payload.py compares the two).
bool moves_bytes(const Launch& L, const Copy&) { return L.payload; }

}  // namespace

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

}  // namespace detail

using namespace detail;

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

void check_shared(const void* p, Site site) {
  const Block* b = cur()->block;
  if (!in_smem(b, p, 1))
    fail("assume_shared (" + site_text(site) + "): " + smem_text(b, p) + " is not in the block's shared memory");
}

}  // namespace hybrid_ep::model
