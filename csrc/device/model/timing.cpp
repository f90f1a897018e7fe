// The timing model's clocks, copy-engine calendars and report (timing.h says what is costed).
#include "device/model/timing.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <memory>

#include "device/model/state.h"

namespace hybrid_ep::model::timing {
namespace {

constexpr double kInfinity = std::numeric_limits<double>::infinity();

}  // namespace

// ---- constants ----------------------------------------------------------------------------

const std::vector<std::pair<std::string, std::string>>& cost_fields() {
  static const std::vector<std::pair<std::string, std::string>> fields = {
#define HYBRID_EP_TIMING_NAME(name, what) {#name, what},
      HYBRID_EP_TIMING_COSTS(HYBRID_EP_TIMING_NAME)
#undef HYBRID_EP_TIMING_NAME
  };
  return fields;
}

bool costs_from(const std::map<std::string, double>& table, Costs& out, std::string& message) {
  Costs c;
  std::map<std::string, double*> slots = {
#define HYBRID_EP_TIMING_SLOT(name, what) {#name, &c.name},
      HYBRID_EP_TIMING_COSTS(HYBRID_EP_TIMING_SLOT)
#undef HYBRID_EP_TIMING_SLOT
  };
  for (const auto& [name, value] : table) {
    auto it = slots.find(name);
    if (it == slots.end()) {
      message = "unknown timing constant " + name;
      return false;
    }
    const bool rate = name == "engine_load_bytes_per_ns" || name == "engine_store_bytes_per_ns" ||
                      name == "sm_clock_ghz" || name == "hbm_bytes_per_ns" || name == "nic_bytes_per_ns";
    const bool fraction = name.rfind("l2_hit_", 0) == 0;
    if (!std::isfinite(value) || value < 0 || (rate && value <= 0) || (fraction && value > 1)) {
      message = "timing constant " + name + " must be finite and " +
                (rate       ? "> 0"
                 : fraction ? "in [0, 1]"
                            : ">= 0") +
                ", got " + std::to_string(value);
      return false;
    }
    *it->second = value;
  }
  for (const auto& [name, slot] : slots)
    if (table.count(name) == 0) {
      message = "timing constant " + name + " is missing";
      return false;
    }
  out = c;
  return true;
}

namespace {
std::vector<Costs> g_tables;
std::vector<Report> g_reports;
}  // namespace

void configure(std::vector<Costs> tables) {
  model::detail::Locked locked;
  g_tables = std::move(tables);
}
const std::vector<Costs>& configured() { return g_tables; }  // inside a launch, which holds the lock
void add_report(Report report) { g_reports.push_back(std::move(report)); }
std::vector<Report> take_reports() {
  model::detail::Locked locked;
  return std::exchange(g_reports, {});
}

// ---- the critical path's tree ---------------------------------------------------------------

PathArena::PathArena() { nodes_.push_back(Node{0, 1, 0, 0, -1, -1}); }

uint32_t PathArena::make(const Origin& from, double t_at) {
  uint32_t n;
  if (!free_.empty()) {
    n = free_.back();
    free_.pop_back();
  } else {
    n = static_cast<uint32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  retain(from.node);
  nodes_[n] = Node{from.node, 1, from.t_src, t_at, from.what, from.role};
  return n;
}

void PathArena::retain(uint32_t n) {
  if (n != 0) ++nodes_[n].refs;
}

void PathArena::release(uint32_t n) {
  while (n != 0 && --nodes_[n].refs == 0) {
    free_.push_back(n);
    n = nodes_[n].parent;
  }
}

// ---- shared resources in buckets ------------------------------------------------------------

void Buckets::add(double a, double b, double per_ns) {
  if (!(b > a) || !(per_ns > 0)) return;
  for (size_t k = static_cast<size_t>(std::max(a, 0.0) / width_);; ++k) {
    const double start = k * width_, end = start + width_;
    if (start >= b) return;
    const double overlap = std::min(b, end) - std::max(a, start);
    if (overlap <= 0) continue;
    grow(k);
    spun_[k] = static_cast<float>(spun_[k] + overlap * per_ns);
  }
}

// ---- the copy engine's calendar -------------------------------------------------------------

void Calendar::insert(double a, double b) {
  auto next = busy_.lower_bound(a);
  // A zero-length piece at a (left by rounding) lies inside the new piece: the new one replaces
  // it (kept, it took the key, and the new piece was dropped: the engine looked free there).
  if (b > a && next != busy_.end() && next->first == a && next->second == a) next = busy_.erase(next);
  if (next != busy_.end() && next->first == b) {
    b = next->second;
    next = busy_.erase(next);
  }
  if (next != busy_.begin()) {
    auto prev = std::prev(next);
    if (prev->second == a) {
      prev->second = b;
      return;
    }
  }
  busy_.emplace_hint(next, a, b);
}

// A tentative piece: kept as the list of pieces the fits once scanned would keep it. Touching
// pieces are one (the free gaps are the same); a zero-length piece (left by rounding, when a
// transfer's last part is below the clock's resolution) is kept only alone in a free gap,
// where it splits the gap as before; next to or inside a piece it changes no fit.
void Calendar::add(double a, double b) {
  if (b > a) {
    auto at = busy_.find(a);  // a zero-length piece at its start
    if (at != busy_.end() && at->second == a) busy_.erase(at);
    insert(a, b);
    return;
  }
  auto it = busy_.upper_bound(a);
  if (it != busy_.begin() && std::prev(it)->second >= a) return;  // inside or touching a piece (or itself)
  busy_.emplace_hint(it, a, a);
}

namespace {
// The interval of `busy` that holds t, else the next one after t: (start, end), or both
// infinite when none ends after t.
std::pair<double, double> next_busy(const std::map<double, double>& busy, double t) {
  auto it = busy.upper_bound(t);
  if (it != busy.begin() && std::prev(it)->second > t) return *std::prev(it);
  if (it != busy.end()) return *it;
  return {kInfinity, kInfinity};
}
}  // namespace

double Calendar::fit(double t0, double duration, const Calendar& also, Pieces& out) const {
  double t = t0, left = duration;
  if (!(left > 0)) return t0;
  for (;;) {
    // The next busy interval of either calendar that ends after t (the two are disjoint).
    auto [start, end] = next_busy(busy_, t);
    const auto [a, b] = next_busy(also.busy_, t);
    if (a < start) {
      start = a;
      end = b;
    }
    if (start <= t) {  // t is inside it: the engine is free at its end at the earliest
      t = end;
      continue;
    }
    if (left <= start - t) {
      const double stop = left == start - t ? start : t + left;
      out.emplace_back(t, stop);
      return stop;
    }
    out.emplace_back(t, start);
    left -= start - t;
    t = start;
  }
}

double Calendar::busy_ns() const {
  double sum = 0;
  for (const auto& [a, b] : busy_) sum += b - a;
  return sum;
}

// ---- clocks ---------------------------------------------------------------------------------

Timer::Timer(const Costs& costs, int table, const char* kernel, int blocks, int threads)
    : c_(costs), table_(table), kernel_(kernel), blocks_(blocks), threads_(threads),
      clocks_(static_cast<size_t>(blocks) * threads), engines_(blocks), warps_((threads + 31) / 32),
      warp_state_(static_cast<size_t>(blocks) * warps_),
      schedulers_(static_cast<size_t>(blocks) * 4, Buckets(kBucketCycles / costs.sm_clock_ghz)),
      scheduler_warps_(static_cast<size_t>(blocks) * 4), hbm_(kBucketCycles / costs.sm_clock_ghz, false) {
  for (int b = 0; b < blocks; ++b)
    for (int w = 0; w < warps_; ++w) scheduler_warps_[b * 4 + w % 4].push_back(b * warps_ + w);
}

Timer::~Timer() { release_all(); }

void Timer::release_all() {
  auto drop = [&](Origin& o) {
    path_.release(o.node);
    o.node = 0;
  };
  for (Clock& c : clocks_) {
    path_.release(c.node);
    c.node = 0;
    for (Group& g : c.groups) {
      drop(g.read);
      drop(g.write);
    }
    c.groups.clear();
    drop(c.open.read);
    drop(c.open.write);
    drop(c.nic_acked);
  }
  for (auto& [i, ct] : copies_) drop(ct.issued);
  for (auto& [bar, m] : mbars_) {
    drop(m.phase);
    drop(m.done);
  }
  for (auto& [p, o] : flags_) drop(o);
}

int32_t Timer::category(const char* what, Site site) {
  const SiteKey key{what, site.file, site.line};
  auto it = site_ids_.find(key);
  if (it != site_ids_.end()) return it->second;
  const std::string name = std::string(what) + " (" + site_text(site) + ")";
  auto named = name_ids_.find(name);
  int32_t id;
  if (named != name_ids_.end()) {
    id = named->second;
  } else {
    id = static_cast<int32_t>(names_.size());
    names_.push_back(name);
    name_ids_.emplace(name, id);
  }
  site_ids_.emplace(key, id);
  return id;
}

Origin Timer::here(int th, int32_t what) {
  const Clock& c = clocks_[th];
  return Origin{c.t, c.t, c.node, role(th), what};
}

void Timer::advance(int th, double ns) {
  Clock& c = clocks_[th];
  c.t += ns;
  c.busy += ns;
}

void Timer::settle(int th, bool end_spin) {
  Clock& c = clocks_[th];
  if (c.loads > 0) {
    advance(th, c.loads);
    c.loads = 0;
  }
  if (c.requests > 0) flush_requests(th);
  if (end_spin) spin_end(th);
}

// A lane's plain global stores in a row (between two of its other operations) go through its
// SM's request path together: one piece of the copy engine's store calendar, request_ns each, placed
// by its issue time among the bulk copies (the stores do not wait for it: they are posted).
void Timer::flush_requests(int th) {
  Clock& c = clocks_[th];
  const double n = c.requests;
  c.requests = 0;
  if (c_.request_ns <= 0) return;
  const size_t id = next_request_++;
  CopyTime& ct = copies_[id];
  ct.issued = Origin{c.t, c.t, 0, role(th), -1};
  ct.duration = n * c_.request_ns;
  ct.g2s = false;
  ct.block = th / threads_;
  engines_[ct.block].open.push_back({id, c.t, false});
}

// ---- issue slots ------------------------------------------------------------------------------

// The lanes of a warp run the same instructions: the lane ahead of its warp's count takes the
// slots for the instructions past it, from its scheduler's calendar; a lane behind runs on no
// earlier than its warp issued the same instruction: when the leading lane issued it, which the
// warp keeps (the leading lane's own latencies between its issues, a pair's or a load's, are not
// the lane behind's to wait for again: it pays its own).
void Timer::issue(int th, double instructions, double cycles) {
  spin_end(th);
  if (!(instructions > 0)) return;
  Clock& c = clocks_[th];
  const int self = warp_of(th);
  Warp& w = warp_state_[self];
  const double clock = c_.sm_clock_ghz / cycles, n = c.count + instructions;
  double t;
  if (n > w.count) {
    const double behind = std::max(w.count - c.count, 0.0);
    const double from = behind > 0 ? std::max(c.t + behind / clock, w.t) : c.t;
    const int sched = scheduler_of(th);
    t = schedulers_[sched].take(from, (n - w.count) * cycles, c_.sm_clock_ghz,
                                [&](size_t b) { return spinners(sched, self, b); });
    instructions_ += n - w.count;
    w.issued.push_back(Issued{w.count, n, from, t});
    w.count = n;
    w.t = t;
  } else {
    t = std::max(c.t + instructions / clock, issued_at(w, self, n));
  }
  c.count = n;
  advance(th, t - c.t);
}

// The time of instruction n of warp `warp` (its index in the launch): within the leading lane's
// issue that took it, as far into that issue's time as n is into its instructions. Issues every
// lane of the warp is past are forgotten once many are kept, and the oldest beyond kMost (a lane
// far behind runs other code meanwhile: it is not held to them).
double Timer::issued_at(Warp& w, int warp, double n) {
  constexpr size_t kKeep = 1024, kMost = 4096;
  if (w.issued.size() > kKeep) {
    const int role = warp % warps_, first = warp / warps_ * threads_ + role * 32;
    double least = w.count;
    for (int lane = 0; lane < 32 && role * 32 + lane < threads_; ++lane)
      least = std::min(least, clocks_[first + lane].count);
    while (w.issued.size() > 1 && w.issued.front().to <= least) {
      w.forgotten = w.issued.front().to;
      w.issued.pop_front();
    }
    while (w.issued.size() > kMost) {
      w.forgotten = w.issued.front().to;
      w.issued.pop_front();
    }
  }
  if (n <= w.forgotten || w.issued.empty()) return kNever;
  auto it =
      std::lower_bound(w.issued.begin(), w.issued.end(), n, [](const Issued& i, double count) { return i.to < count; });
  if (it == w.issued.end()) return w.t;
  const double span = it->to - it->from;
  return span > 0 ? it->start + (it->end - it->start) * std::max(n - it->from, 0.0) / span : it->end;
}

// Cycles of bucket b that the other warps spinning on the scheduler take (those still spinning;
// finished spins are in the calendar already).
double Timer::spinners(int sched, int self, size_t b) const {
  const double width = kBucketCycles / c_.sm_clock_ghz, start = b * width, end = start + width;
  double cycles = 0;
  for (int w : scheduler_warps_[sched]) {
    const Warp& s = warp_state_[w];
    if (w == self || s.spinning == 0) continue;
    const double from = std::max({s.spin_from, s.spun_until, start});
    if (end > from) cycles += (end - from) * c_.sm_clock_ghz * s.spin_rate;
  }
  return cycles;
}

// A warp spinning on a poll or a try_wait issues a turn (spin_instructions) per period, from
// its first failed probe until its lane's next operation (when its wait ends, at the time it
// waited for). Its lanes spin together: a warp's spin is counted once.
void Timer::spin_begin(int th, double period_ns) {
  Clock& c = clocks_[th];
  if (c.spinning || !(c_.spin_instructions > 0)) return;
  const double cycles = period_ns * c_.sm_clock_ghz;
  c.spinning = true;
  c.spin_from = c.t;
  c.spin_rate = cycles > c_.spin_instructions ? c_.spin_instructions / cycles : 1.0;
  Warp& w = warp_state_[warp_of(th)];
  if (w.spinning++ == 0 || c.t < w.spin_from) w.spin_from = c.t;
  w.spin_rate = std::max(w.spin_rate, c.spin_rate);
}

void Timer::spin_end(int th) {
  Clock& c = clocks_[th];
  if (!c.spinning) return;
  c.spinning = false;
  Warp& w = warp_state_[warp_of(th)];
  const double a = std::max(c.spin_from, w.spun_until), b = c.t;
  if (b > a) {
    const double per_ns = c.spin_rate * c_.sm_clock_ghz;
    schedulers_[scheduler_of(th)].add(a, b, per_ns);
    spin_instructions_ += (b - a) * per_ns;
    w.spun_until = b;
  }
  if (--w.spinning == 0) w.spin_rate = 0;
}

void Timer::spinning(int th) { spin_begin(th, c_.spin_period_ns); }

// A converted pair's instructions take their issue slots and, on the converting thread, each
// its dependent latency beside the slot (the reducers' loops are chains of dependent
// instructions): a pair costs by its kind's instruction count, so the loop that d93f79d made
// three times shorter costs about a third, where one cost per pair of any kind did not move.
void Timer::plain_pair(int th, Pair kind) {
  const double n = kind == Pair::kWidenCvt     ? c_.cvt_pair_instructions
                   : kind == Pair::kWidenShift ? c_.shift_pair_instructions
                                               : c_.pack_pair_instructions;
  advance(th, n * c_.pair_instruction_ns);
  issue(th, n);
}

// ---- device memory and L2 ---------------------------------------------------------------------

namespace {
constexpr uint8_t kLineRead = 1, kLineWritten = 2;
constexpr int kLineShift = 6;  // 64-byte units (see timing.h)
}  // namespace

// The L2-hit fraction of a global read of [p, p + bytes): per line by its class (written in the
// launch, read before in it, neither); counted in the report and the lines marked read.
double Timer::read_hit(const void* p, uint32_t bytes) {
  if (bytes == 0) return 0;
  const uint64_t a = reinterpret_cast<uintptr_t>(p), e = a + bytes;
  const double hit[3] = {c_.l2_hit_written, c_.l2_hit_reread, c_.l2_hit_stream};
  double l2 = 0;
  for (uint64_t line = a >> kLineShift; line <= (e - 1) >> kLineShift; ++line) {
    uint8_t& f = lines_[line];
    const int cls = (f & kLineWritten) ? Report::kWritten : (f & kLineRead) ? Report::kReread : Report::kStream;
    const uint64_t lo = std::max(a, line << kLineShift), hi = std::min(e, (line + 1) << kLineShift);
    const double part = static_cast<double>(hi - lo);
    reads_[cls].bytes += part;
    reads_[cls].l2_bytes += part * hit[cls];
    l2 += part * hit[cls];
    f |= kLineRead;
  }
  return l2 / bytes;
}

void Timer::mark_written(const void* p, uint32_t bytes) {
  if (bytes == 0) return;
  const uint64_t a = reinterpret_cast<uintptr_t>(p);
  for (uint64_t line = a >> kLineShift; line <= (a + bytes - 1) >> kLineShift; ++line) lines_[line] |= kLineWritten;
}

void Timer::access(int th, const volatile void* p, bool shared, uint32_t bytes, bool load) {
  Report::Accesses& a = plain_[shared ? Report::kShared : Report::kGlobal];
  const void* at = const_cast<const void*>(p);
  if (load) {
    ++a.loads;
    a.load_bytes += bytes;
    issue(th, c_.access_instructions);
    double latency = c_.smem_load_ns;
    if (!shared) {
      const double hit = read_hit(at, bytes), miss = bytes * (1 - hit);
      latency = hit * c_.l2_load_ns + (1 - hit) * c_.gmem_load_ns;
      const double t = clocks_[th].t;
      latency = std::max(latency, hbm_.take(t, miss, c_.hbm_bytes_per_ns, [](size_t) { return 0.0; }) - t);
      hbm_bytes_ += miss;
    }
    double& batch = clocks_[th].loads;
    batch = std::max(batch, latency);
  } else {
    ++a.stores;
    a.store_bytes += bytes;
    Clock& c = clocks_[th];
    if (c.loads > 0) {  // what it stores comes from the loads before it
      advance(th, c.loads);
      c.loads = 0;
    }
    issue(th, c_.access_instructions);
    if (!shared) {
      // Its write requests: a store under 16 bytes takes a sector of its own (the kernels' scalar
      // stores are scattered: a row's weight, a route's row); a 16-byte vector, half of one (a
      // warp's lanes store whole sectors together).
      c.requests += bytes < 16 ? 1.0 : bytes / 32.0;
      mark_written(at, bytes);
      hbm_.take(clocks_[th].t, bytes, c_.hbm_bytes_per_ns, [](size_t) { return 0.0; });
      hbm_bytes_ += bytes;
    }
  }
}

// Blocks of plain code a kernel named: their instructions, this table's counts. The count
// kernel's blocks take issue slots only, plain_code_cycles each (its mix of divisions, ballots
// and shared atomics); a bounded loop's vectors (kBoundedVector) cost as the pairs do: their
// branches' latency on the thread (bounded_vector_ns) and an issue slot per instruction.
void Timer::plain_code(int th, const dev::PlainRun* runs, int n) {
  double count = 0, bounded = 0;
  for (int i = 0; i < n; ++i) {
    const dev::PlainCode code = runs[i].code;
    if (code == dev::PlainCode::kBoundedVector) {
      bounded += runs[i].times;
      continue;
    }
    const double each = code == dev::PlainCode::kCountTile        ? c_.count_tile_instructions
                        : code == dev::PlainCode::kCountRoute     ? c_.count_route_instructions
                        : code == dev::PlainCode::kCountRoutePair ? c_.count_route_pair_instructions
                        : code == dev::PlainCode::kCountDest      ? c_.count_dest_instructions
                        : code == dev::PlainCode::kCountNode      ? c_.count_node_instructions
                                                                  : c_.count_scan_column_instructions;
    count += each * runs[i].times;
  }
  if (count > 0) issue(th, count, c_.plain_code_cycles);
  if (bounded > 0) {
    advance(th, bounded * c_.bounded_vector_ns);
    issue(th, bounded * c_.bounded_vector_instructions);
  }
}

// Plain code whose count the kernel wrote out: issue slots only.
void Timer::instructions(int th, int n) { issue(th, n); }

void Timer::chain(int th) {
  ++chains_;
  settle(th);
}

void Timer::set(Origin& dst, const Origin& src) {
  path_.retain(src.node);
  path_.release(dst.node);
  dst = src;
}

void Timer::keep_max(Origin& dst, const Origin& src) {
  if (src.t > dst.t) set(dst, src);
}

// The thread runs on at max(own, dep.t + latency): `own` is its time after its own cost of
// the operation; when the dependency is later, the difference is waited at `wait_what` and
// the path records the dependency (one node for all the waiters of a barrier, `shared_node`).
void Timer::resolve(int th, double own, const Origin& dep, double latency, int32_t wait_what, uint32_t* shared_node) {
  Clock& c = clocks_[th];
  const double via = dep.t + latency;
  c.busy += own - c.t;
  auto site = std::lower_bound(c.sites.begin(), c.sites.end(), wait_what);
  if (site == c.sites.end() || *site != wait_what) c.sites.insert(site, wait_what);
  if (dep.t == kNever || !(via > own)) {
    c.t = own;
    return;
  }
  auto w = std::find_if(c.waits.begin(), c.waits.end(), [&](const auto& e) { return e.first == wait_what; });
  if (w == c.waits.end()) c.waits.emplace_back(wait_what, via - own);
  else w->second += via - own;
  uint32_t n;
  if (shared_node != nullptr) {
    if (*shared_node == 0) *shared_node = path_.make(dep, via);
    n = *shared_node;
    path_.retain(n);
  } else {
    n = path_.make(dep, via);
  }
  path_.release(c.node);
  c.node = n;
  c.t = via;
}

void Timer::barrier(const std::vector<int>& participants, Site site) {
  for (int th : participants) {
    settle(th);
    clocks_[th].waited = false;
  }
  int last = participants.front();
  for (int th : participants)
    if (clocks_[th].t > clocks_[last].t) last = th;
  const int32_t what = category("__syncthreads", site);
  const Origin dep = here(last, what);
  uint32_t shared = 0;
  for (int th : participants) resolve(th, clocks_[th].t + c_.barrier_ns, dep, c_.barrier_ns, what, &shared);
  path_.release(shared);
}

// A named barrier: the thread runs on after its generation's latest arrival (every arrival stamped
// `stamp`) plus the barrier's cost. Like __syncthreads it ends any divergence of the warp: the
// next collective finds it converged.
void Timer::named_barrier(int th, const volatile void* stamp, Site site) {
  settle(th, false);
  clocks_[th].waited = false;
  auto it = flags_.find(stamp);
  const Origin dep = it == flags_.end() ? Origin{} : it->second;
  resolve(th, clocks_[th].t + c_.barrier_ns, dep, c_.barrier_ns, category("named barrier", site), nullptr);
  spin_end(th);
}

// A collective whose lanes come from different paths, some from an mbarrier wait and some not,
// ends a divergence: the waiting lane ran its loop while the others stood here, and the warp
// reconverges (reconverge_ns, micro M1: an elected lane's wait and the __syncwarp after it against
// a lane alone). Lanes that all waited (each its own wait, the warp converged) or none pay
// collective_ns.
void Timer::collective(const std::vector<int>& lanes, Collective kind, Site site) {
  size_t waited = 0;
  for (int th : lanes) {
    settle(th);
    waited += clocks_[th].waited ? 1 : 0;
    clocks_[th].waited = false;
  }
  const double cost = waited > 0 && waited < lanes.size() ? c_.reconverge_ns : c_.collective_ns;
  int last = lanes.front();
  for (int th : lanes)
    if (clocks_[th].t > clocks_[last].t) last = th;
  const int32_t what = category(collective_name(kind), site);
  const Origin dep = here(last, what);
  uint32_t shared = 0;
  for (int th : lanes) resolve(th, clocks_[th].t + cost, dep, cost, what, &shared);
  path_.release(shared);
}

void Timer::mbar_init(const void* bar) {
  MbarTime& m = mbars_[bar];
  set(m.phase, Origin{});
  set(m.done, Origin{});
}

void Timer::arrive(int th, const void* bar, Site site) {
  settle(th);
  advance(th, c_.arrive_ns);
  keep_max(mbars_[bar].phase, here(th, category("mbarrier arrive", site)));
}

void Timer::phase_complete(const void* bar) {
  MbarTime& m = mbars_[bar];
  set(m.done, m.phase);
  set(m.phase, Origin{});
}

void Timer::wait_done(int th, const void* bar, Site site) {
  settle(th, false);
  clocks_[th].waited = true;
  const Origin dep = mbars_[bar].done;
  resolve(th, clocks_[th].t + c_.try_wait_ns, dep, c_.wake_ns, category("mbarrier wait", site), nullptr);
  spin_end(th);  // it spun until the phase it waited for
}

// Polls of shared memory are not counted as spinning: the model's named barriers poll there,
// and on the GPU they are a bar.sync that does not issue while it waits.
void Timer::poll(int th, const volatile void* p, bool changed, bool shared, Site site) {
  settle(th, false);
  if (!changed) {  // the same value again: the thread only spun
    if (!shared) spin_begin(th, c_.poll_ns);
    return;
  }
  auto it = flags_.find(p);
  if (it != flags_.end())  // else a value from before the launch: nothing to wait for
    resolve(th, clocks_[th].t + (shared ? 0 : c_.poll_ns), it->second, shared ? 0 : c_.flag_latency_ns,
            category("flag wait", site), nullptr);
  spin_end(th);
}

void Timer::flag_write(int th, const volatile void* p, bool shared, Site site) {
  settle(th);
  if (!shared) advance(th, c_.release_ns);
  keep_max(flags_[p], here(th, category("flag write", site)));
}

// A global atomic reads what the atomics before it at that address wrote: the thread runs on
// after the latest of them (the one that learns it came last, say, ends after all the others,
// whichever that is in the schedule). Shared-memory atomics cost nothing here and order no one.
void Timer::atomic(int th, const volatile void* p, bool shared, Site site) {
  settle(th);
  const int32_t what = category("atomic", site);
  if (!shared) {
    const Origin before = flags_[p];
    resolve(th, clocks_[th].t + c_.atomic_ns, before, 0, what, nullptr);
  }
  keep_max(flags_[p], here(th, what));
}

void Timer::fence(int th, Fence kind) {
  settle(th);
  advance(th, kind == Fence::kGpu ? c_.fence_gpu_ns : kind == Fence::kSystem ? c_.fence_sys_ns : c_.fence_proxy_ns);
}

void Timer::nic_put(int th, int src_rank, int dst_rank, uint64_t bytes, const volatile void* sig, Site site) {
  settle(th);
  advance(th, c_.nic_post_ns);
  Clock& c = clocks_[th];
  double end = c.t;
  if (bytes > 0) {
    auto nic = [&](int key) -> Buckets& {
      return nics_.try_emplace(key, kBucketCycles / c_.sm_clock_ghz, false).first->second;
    };
    const auto none = [](size_t) { return 0.0; };
    const double amount = static_cast<double>(bytes);
    end = std::max(nic(2 * src_rank).take(c.t, amount, c_.nic_bytes_per_ns, none),
                   nic(2 * dst_rank + 1).take(c.t, amount, c_.nic_bytes_per_ns, none));
    nic_bytes_ += amount;
  }
  auto last = std::find_if(c.nic_seen.begin(), c.nic_seen.end(), [&](const auto& e) { return e.first == dst_rank; });
  if (last == c.nic_seen.end()) last = c.nic_seen.insert(c.nic_seen.end(), {dst_rank, kNever});
  last->second = std::max(end + c_.nic_latency_ns, last->second);
  Origin seen = here(th, category("nic put", site));
  seen.t = last->second;
  if (sig != nullptr) keep_max(flags_[sig], seen);
  seen.t += c_.nic_latency_ns;
  keep_max(c.nic_acked, seen);
}

void Timer::nic_quiet(int th, Site site) {
  settle(th);
  const Origin acked = clocks_[th].nic_acked;
  resolve(th, clocks_[th].t, acked, 0, category("nic quiet", site), nullptr);
}

void Timer::copy_issue(int th, size_t copy, int block, bool g2s, const void* gmem, uint32_t bytes, Site site) {
  settle(th);
  advance(th, c_.issue_ns);
  CopyTime& ct = copies_[copy];
  set(ct.issued, here(th, category(g2s ? "bulk load" : "bulk store", site)));
  // The thread's copies of a direction start through the engine an issue interval apart; the
  // thread itself goes on (a wait for the copy waits for it).
  double& next = g2s ? clocks_[th].next_load : clocks_[th].next_store;
  ct.issued.t = std::max(ct.issued.t, next);
  next = ct.issued.t + (g2s ? c_.load_issue_interval_ns : c_.store_issue_interval_ns);
  ct.duration = g2s ? bytes / c_.engine_load_bytes_per_ns : c_.store_copy_ns + bytes / c_.engine_store_bytes_per_ns;
  if (g2s) {
    const double hit = read_hit(gmem, bytes);
    ct.latency = hit * c_.g2s_l2_latency_ns + (1 - hit) * c_.g2s_latency_ns;
    ct.hbm_bytes = bytes * (1 - hit);
  } else {
    mark_written(gmem, bytes);
    ct.latency = c_.s2g_read_latency_ns;
    ct.hbm_bytes = bytes;
  }
  ct.g2s = g2s;
  ct.block = block;
  engines_[block].open.push_back({copy, ct.issued.t, g2s});
  ++copy_count_;
  copy_bytes_ += bytes;
}

// Places the copy on its engine after the placed copies and the open ones issued before it,
// and folds its read and write times into *read and *write.
void Timer::place(size_t copy, Origin* read, Origin* write) {
  auto it = copies_.find(copy);
  if (it == copies_.end()) return;
  const CopyTime& ct = it->second;
  Engine& e = engines_[ct.block];
  std::vector<std::pair<double, size_t>> ahead;  // the open copies of its direction issued before it
  for (const Engine::Open& o : e.open)
    if (o.copy != copy && o.g2s == ct.g2s && (o.t < ct.issued.t || (o.t == ct.issued.t && o.copy < copy)))
      ahead.emplace_back(o.t, o.copy);
  std::sort(ahead.begin(), ahead.end());
  Calendar& placed = e.of(ct.g2s);
  Calendar tentative;
  Calendar::Pieces pieces, mine;
  for (const auto& [t, other] : ahead) {
    pieces.clear();
    placed.fit(t, copies_.at(other).duration, tentative, pieces);
    for (const auto& [a, b] : pieces) tentative.add(a, b);
  }
  double through = placed.fit(ct.issued.t, ct.duration, tentative, mine);
  for (const auto& [a, b] : mine) placed.insert(a, b);
  auto listed = std::find_if(e.open.begin(), e.open.end(), [&](const Engine::Open& o) { return o.copy == copy; });
  if (listed != e.open.end()) e.open.erase(listed);  // finish() takes them off first
  // Its device-memory bytes from its start through the engine on, beside every other SM's.
  const double start = mine.empty() ? ct.issued.t : mine.front().first;
  through = std::max(through, hbm_.take(start, ct.hbm_bytes, c_.hbm_bytes_per_ns, [](size_t) { return 0.0; }));
  hbm_bytes_ += ct.hbm_bytes;

  Origin o = ct.issued;
  o.t = through + ct.latency;
  if (read != nullptr) keep_max(*read, o);
  if (!ct.g2s) o.t += c_.s2g_write_latency_ns;
  keep_max(*write, o);
  last_write_ = std::max(last_write_, o.t);
  path_.release(ct.issued.node);
  copies_.erase(it);
}

void Timer::copy_lands(size_t copy, const void* bar) { place(copy, nullptr, &mbars_[bar].phase); }

void Timer::store_in_group(int th, size_t copy) { clocks_[th].open.copies.push_back(copy); }

void Timer::fold_group(Group& g) {
  for (size_t copy : g.copies) place(copy, &g.read, &g.write);
  g.copies.clear();
}

void Timer::commit(int th) {
  settle(th);
  advance(th, c_.commit_ns);
  Clock& c = clocks_[th];
  c.groups.push_back(c.open);  // the references move with it
  c.open = Group{};
}

void Timer::bulk_wait(int th, bool reads_only, int except_newest, Site site) {
  settle(th);
  Clock& c = clocks_[th];
  // Groups already written by the thread's time cannot delay it: dropping the oldest of them
  // leaves the groups this wait covers the same, less those.
  while (!c.groups.empty() && c.groups.front().copies.empty() && !(c.groups.front().write.t > c.t)) {
    path_.release(c.groups.front().read.node);
    path_.release(c.groups.front().write.node);
    c.groups.pop_front();
  }
  const size_t keep = static_cast<size_t>(std::max(except_newest, 0));
  const size_t covered = c.groups.size() > keep ? c.groups.size() - keep : 0;
  Origin dep;
  for (size_t g = 0; g < covered; ++g) {
    fold_group(c.groups[g]);
    const Origin& o = reads_only ? c.groups[g].read : c.groups[g].write;
    if (o.t > dep.t) dep = o;  // no reference taken: resolve copies what it keeps
  }
  resolve(th, c.t + c_.wait_group_ns, dep, 0, category(reads_only ? "bulk wait (read)" : "bulk wait", site), nullptr);
  if (!reads_only)
    for (size_t g = 0; g < covered; ++g) {
      path_.release(c.groups.front().read.node);
      path_.release(c.groups.front().write.node);
      c.groups.pop_front();
    }
}

void Timer::exit(int th) {
  settle(th);
  clocks_[th].end = clocks_[th].t;
}

// The lanes of warp role w grouped by the sites they passed; per group, its busiest lane per
// block stands for it (as the busiest lane of the warp does for the role), mean over the blocks
// the group is in.
std::vector<RoleTime::Path> Timer::lane_paths(int w) const {
  struct Sum {
    int lanes = 0, blocks = 0;
    double busy = 0, end = 0;
    std::map<int32_t, double> waits;
  };
  std::map<std::vector<int32_t>, Sum> groups;  // by the sites passed, in a fixed order
  for (int b = 0; b < blocks_; ++b) {
    std::map<std::vector<int32_t>, int> rep;  // this block's busiest lane of each group
    for (int lane = 0; lane < 32 && w * 32 + lane < threads_; ++lane) {
      const int th = b * threads_ + w * 32 + lane;
      ++groups[clocks_[th].sites].lanes;
      auto [it, fresh] = rep.emplace(clocks_[th].sites, th);
      if (!fresh && clocks_[th].busy > clocks_[it->second].busy) it->second = th;
    }
    for (const auto& [sites, th] : rep) {
      Sum& g = groups[sites];
      ++g.blocks;
      g.busy += clocks_[th].busy;
      g.end += clocks_[th].end;
      for (const auto& [what, ns] : clocks_[th].waits) g.waits[what] += ns;
    }
  }
  std::vector<RoleTime::Path> out;
  for (const auto& [sites, g] : groups) {
    RoleTime::Path p;
    p.lanes = g.lanes;
    p.blocks = g.blocks;
    p.busy_ns = g.busy / g.blocks;
    p.end_ns = g.end / g.blocks;
    for (const auto& [what, ns] : g.waits) p.waits.emplace_back(names_[what], ns / g.blocks);
    std::sort(p.waits.begin(), p.waits.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    out.push_back(std::move(p));
  }
  return out;
}

Report Timer::finish() {
  Report r;
  r.kernel = kernel_;
  r.table = table_;
  r.blocks = blocks_;
  r.threads = threads_;
  int last = 0;
  for (size_t th = 0; th < clocks_.size(); ++th)
    if (clocks_[th].end > clocks_[last].end) last = static_cast<int>(th);
  // Copies nothing waited for still take their time: placed in the order of their issue times,
  // each after those issued before it (what place() would fit ahead of each tentatively), so
  // none has another to fit ahead of it (write requests pile up here: a scan of the others per
  // copy would take time quadratic in them).
  for (Engine& e : engines_) {
    std::vector<Engine::Open> pending;
    pending.swap(e.open);
    std::sort(pending.begin(), pending.end(), [](const Engine::Open& a, const Engine::Open& b) {
      return a.t < b.t || (a.t == b.t && a.copy < b.copy);
    });
    for (const Engine::Open& o : pending) {
      Origin read, write;
      place(o.copy, &read, &write);
      set(read, Origin{});
      set(write, Origin{});
    }
  }
  const double end = std::max(clocks_.empty() ? 0 : clocks_[last].end, last_write_);
  r.copies = copy_count_;
  r.copy_bytes = copy_bytes_;
  r.plain[0] = plain_[0];
  r.plain[1] = plain_[1];
  r.chains = chains_;
  r.instructions = instructions_;
  r.spin_instructions = spin_instructions_;
  for (int k = 0; k < 3; ++k) r.reads[k] = reads_[k];
  r.hbm_bytes = hbm_bytes_;
  r.nic_bytes = nic_bytes_;
  r.time_ns = end + c_.launch_ns;

  r.block_end_ns.assign(blocks_, 0);
  for (size_t th = 0; th < clocks_.size(); ++th) {
    double& e = r.block_end_ns[th / threads_];
    e = std::max(e, clocks_[th].end);
  }

  // Per role (warp index), the lane that was busy longest stands for its warp.
  const int warps = (threads_ + 31) / 32;
  for (int w = 0; w < warps; ++w) {
    RoleTime role;
    role.warp = w;
    std::map<int32_t, double> waits;
    for (int b = 0; b < blocks_; ++b) {
      int rep = -1;
      for (int lane = 0; lane < 32 && w * 32 + lane < threads_; ++lane) {
        const int th = b * threads_ + w * 32 + lane;
        if (rep < 0 || clocks_[th].busy > clocks_[rep].busy) rep = th;
      }
      role.busy_ns += clocks_[rep].busy / blocks_;
      role.end_ns += clocks_[rep].end / blocks_;
      for (const auto& [what, ns] : clocks_[rep].waits) waits[what] += ns / blocks_;
    }
    for (const auto& [what, ns] : waits) role.waits.emplace_back(names_[what], ns);
    std::sort(role.waits.begin(), role.waits.end(), [](const auto& a, const auto& b) { return a.second > b.second; });
    role.paths = lane_paths(w);
    r.roles.push_back(std::move(role));
  }

  // The critical path, from the last thread back to the launch's start: a thread's own time
  // between the waits that others decided, and each such hand-off.
  std::map<std::string, double> path;
  if (!clocks_.empty()) {
    double t = clocks_[last].end;
    int32_t at_role = role(last);
    uint32_t n = clocks_[last].node;
    while (n != 0) {
      const PathArena::Node& node = path_.at(n);
      path["warp " + std::to_string(at_role) + ": own work"] += t - node.t_at;
      const std::string from = node.what >= 0 ? names_[node.what] : std::string("?");
      path[from + ", warp " + std::to_string(node.role)] += node.t_at - node.t_from;
      t = node.t_from;
      at_role = node.role;
      n = node.parent;
    }
    path["warp " + std::to_string(at_role) + ": own work"] += t;
  }
  for (const auto& [what, ns] : path)
    if (ns > 0) r.critical_path.emplace_back(what, ns);
  std::sort(r.critical_path.begin(), r.critical_path.end(),
            [](const auto& a, const auto& b) { return a.second > b.second; });

  for (const Engine& e : engines_)  // its busier direction
    r.engine_busy_ns += std::max(e.loads.busy_ns(), e.stores.busy_ns()) / std::max(blocks_, 1);
  return r;
}

}  // namespace hybrid_ep::model::timing
