// The host side of the synchronisation measurements: M1 (hand-off between warps, bar.sync),
// M4 (flags between SMs, one poll), M5 (fences) and M9 (%globaltimer). Each prints one JSON
// line per point.
#pragma once
#include <map>

#include "microbench/fences.cuh"
#include "microbench/flags.cuh"
#include "microbench/handoff.cuh"
#include "microbench/host.cuh"
#include "microbench/timer.cuh"

namespace hybrid_ep::micro {

// Iterations of a latency loop: a short run tells the time per iteration, the real run is
// sized to about `target_ms` (at least `least`, at most `most`). --quick keeps the short one.
inline int sized_iterations(const Bench& b, double ns_per_iteration, int least, int most, double target_ms = 20) {
  if (b.options().quick || !(ns_per_iteration > 0)) return least;
  const double n = target_ms * 1e6 / ns_per_iteration;
  return static_cast<int>(std::max<double>(least, std::min<double>(most, n)));
}

// ---- M1 -------------------------------------------------------------------------------------

struct HandoffCase {
  Wait wait;
  uint32_t hint_ns;
  Agree agree;
  int spinners;
};

inline const char* wait_name(Wait w) { return w == Wait::kBare ? "bare" : w == Wait::kHint ? "hint" : "project"; }
inline const char* agree_name(Agree g) {
  return g == Agree::kLane          ? "lane"
         : g == Agree::kWarpUniform ? "warp_uniform"
         : g == Agree::kElect       ? "elect"
         : g == Agree::kConverged   ? "converged"
                                    : "named";
}

using HandoffKernel = void (*)(HandoffArgs);

template <Wait W>
HandoffKernel handoff_kernel_for(Agree g) {
  return g == Agree::kLane          ? handoff_kernel<W, Agree::kLane>
         : g == Agree::kWarpUniform ? handoff_kernel<W, Agree::kWarpUniform>
         : g == Agree::kElect       ? handoff_kernel<W, Agree::kElect>
         : g == Agree::kConverged   ? handoff_kernel<W, Agree::kConverged>
                                    : handoff_kernel<W, Agree::kNamed>;
}

inline HandoffKernel handoff_kernel_for(Wait w, Agree g) {
  return w == Wait::kBare   ? handoff_kernel_for<Wait::kBare>(g)
         : w == Wait::kHint ? handoff_kernel_for<Wait::kHint>(g)
                            : handoff_kernel_for<Wait::kProject>(g);
}

// One run: the kernel's five result words and the clock.
inline Bench::Result run_handoff(Bench& b, const HandoffCase& c, int iterations) {
  HandoffArgs a{};
  a.la = b.wait_args();
  a.c = b.common();
  a.hint_ns = c.hint_ns;
  a.iterations = iterations;
  a.spinners = c.spinners;
  a.out = b.out();
  const int threads = 32 * ((c.agree == Agree::kNamed ? 1 + kNamedGroupWarps : 2) + c.spinners);
  return b.run(handoff_kernel_for(c.wait, c.agree), 1, threads, 0, a, 8, "handoff");
}

inline void measure_handoff(Bench& b) {
  const bool quick = b.options().quick;
  std::vector<HandoffCase> cases;
  const std::vector<std::pair<Wait, uint32_t>> waits =
      quick ? std::vector<std::pair<Wait, uint32_t>>{{Wait::kBare, 0}, {Wait::kHint, 1000}, {Wait::kProject, 0}}
            : std::vector<std::pair<Wait, uint32_t>>{{Wait::kBare, 0},
                                                     {Wait::kHint, 1000},
                                                     {Wait::kHint, 10000},
                                                     {Wait::kHint, 100000},
                                                     {Wait::kProject, 0}};
  for (int spinners : quick ? std::vector<int>{0, 8} : std::vector<int>{0, 2, 8})
    for (const auto& [w, hint] : waits) cases.push_back({w, hint, Agree::kLane, spinners});
  for (Agree g : {Agree::kWarpUniform, Agree::kElect, Agree::kConverged, Agree::kNamed})
    for (const auto& [w, hint] : {std::pair<Wait, uint32_t>{Wait::kBare, 0}, {Wait::kHint, 1000}, {Wait::kProject, 0}})
      cases.push_back({w, hint, g, 0});
  for (const HandoffCase& c : cases) {
    Bench::Result r = run_handoff(b, c, 1000);
    const int iterations = r.ok ? sized_iterations(b, static_cast<double>(r.out[3]) / 1000, 1000, 100000) : 1000;
    if (iterations != 1000) r = run_handoff(b, c, iterations);
    const std::vector<uint64_t>& out = r.out;
    const double n = static_cast<double>(iterations);
    const double one_way_cycles = static_cast<double>(out[0]) / n;
    JsonLine line;
    line.add("m", "M1")
        .add("test", "handoff")
        .add("wait", wait_name(c.wait))
        .add("hint_ns", c.hint_ns)
        .add("agree", agree_name(c.agree))
        .add("spinners", c.spinners)
        .add("iterations", iterations)
        .add("one_way_cycles", one_way_cycles)
        .add("one_way_min_cycles", static_cast<double>(out[1]))
        .add("one_way_ns", one_way_cycles / r.clock.mhz * 1e3)
        .add("round_trip_cycles", static_cast<double>(out[2]) / n)
        .add("round_trip_ns", static_cast<double>(out[3]) / n);
    add_clock(line, r.clock).add("ok", r.ok).print();
  }
  for (int warps : {2, 3, 4}) {
    const int iterations = quick ? 1000 : 100000;
    BarrierArgs a{};
    a.c = b.common();
    a.iterations = iterations;
    a.out = b.out();
    const Bench::Result r = b.run(named_barrier_kernel, 1, 32 * warps, 0, a, 2, "bar.sync");
    JsonLine line;
    line.add("m", "M1")
        .add("test", "bar.sync")
        .add("warps", warps)
        .add("iterations", iterations)
        .add("cycles", static_cast<double>(r.out[0]) / iterations)
        .add("ns", static_cast<double>(r.out[1]) / iterations);
    add_clock(line, r.clock).add("ok", r.ok).print();
  }
}

// ---- M4 -------------------------------------------------------------------------------------

// Two lines of their own, away from the result words.
inline uint64_t* flag_words(const Bench& b) { return b.out() + 1024; }

inline Bench::Result run_flags(Bench& b, bool acquire, bool add, uint32_t backoff, int iterations) {
  FlagArgs a{};
  a.c = b.common();
  a.iterations = iterations;
  a.backoff_ns = backoff;
  a.add = add;
  a.flags = flag_words(b);
  a.out = b.out();
  // the whole opt-in shared memory each: the two blocks cannot share an SM
  return b.run(acquire ? flag_kernel<true> : flag_kernel<false>, 2, 32, b.smem_optin(), a, 1024 + 2 * kFlagStride,
               "flags");
}

inline void measure_flags(Bench& b) {
  const bool quick = b.options().quick;
  uint64_t* flags = flag_words(b);
  for (bool acquire : {true, false})
    for (bool add : quick ? std::vector<bool>{false} : std::vector<bool>{false, true})
      for (uint32_t backoff : quick ? std::vector<uint32_t>{0} : std::vector<uint32_t>{0, 64, 256}) {
        Bench::Result r = run_flags(b, acquire, add, backoff, 1000);
        const int iterations = r.ok ? sized_iterations(b, static_cast<double>(r.out[1]) / 1000, 1000, 20000) : 1000;
        if (iterations != 1000) r = run_flags(b, acquire, add, backoff, iterations);
        const std::vector<uint64_t>& out = r.out;
        const double rt_ns = static_cast<double>(out[1]) / iterations;
        JsonLine line;
        line.add("m", "M4")
            .add("test", "flag")
            .add("poll", acquire ? "ld.acquire.sys" : "ld.relaxed.sys+fence.acq_rel.sys")
            .add("signal", add ? "red.release.sys.add" : "st.release.sys")
            .add("backoff_ns", backoff)
            .add("iterations", iterations)
            .add("round_trip_ns", rt_ns)
            .add("one_way_ns", rt_ns / 2)
            .add("round_trip_cycles", static_cast<double>(out[0]) / iterations)
            .add("sm_a", out[2])
            .add("sm_b", out[3])
            .add("two_sms", out[2] != out[3]);
        add_clock(line, r.clock).add("ok", r.ok).print();
      }
  for (bool acquire : {true, false}) {
    const int polls = quick ? 1000 : 100000;
    PollArgs a{};
    a.c = b.common();
    a.polls = polls;
    a.flag = flags;
    a.out = b.out();
    const Bench::Result r =
        b.run(acquire ? poll_kernel<true> : poll_kernel<false>, 1, 32, 0, a, 1024 + 2 * kFlagStride, "poll");
    const double per_poll = static_cast<double>(r.out[0]) / polls;
    JsonLine line;
    line.add("m", "M4")
        .add("test", "poll")
        .add("poll", acquire ? "ld.acquire.sys" : "ld.relaxed.sys")
        .add("polls", polls)
        .add("cycles", per_poll)
        .add("ns", per_poll / r.clock.mhz * 1e3);
    add_clock(line, r.clock).add("ok", r.ok).print();
  }
}

// ---- M5 -------------------------------------------------------------------------------------

inline const char* fence_name(Fence f) {
  switch (f) {
    case Fence::kSystem: return "__threadfence_system";
    case Fence::kAcqRelSys: return "fence.acq_rel.sys";
    case Fence::kProxyAsync: return "fence.proxy.async";
    default: return "wait_group 0 after 8 bulk stores";
  }
}

inline void measure_fences(Bench& b) {
  struct Case {
    Fence fence;
    int stores;
    int threads;
  };
  const std::vector<Case> cases = {
      {Fence::kSystem, 0, 32},     {Fence::kSystem, 16, 32},     {Fence::kSystem, 256, 32}, {Fence::kAcqRelSys, 0, 32},
      {Fence::kProxyAsync, 0, 32}, {Fence::kProxyAsync, 0, 128}, {Fence::kBulkWait, 0, 32}};
  constexpr uint32_t kCopyBytes = 16 * 1024;
  for (const Case& c : cases) {
    const int reps = b.options().quick ? 50 : c.fence == Fence::kBulkWait ? 200 : 1000;
    FenceArgs a{};
    a.c = b.common();
    a.kind = static_cast<int>(c.fence);
    a.stores = c.stores;
    a.reps = reps;
    a.scratch = reinterpret_cast<uint64_t*>(b.dst());
    a.scratch_lines = 4096;
    a.dst = b.dst();
    a.dst_rows = 4096;  // 64 MiB of 16 KiB rows
    a.copy_bytes = kCopyBytes;
    a.out = b.out();
    const Bench::Result r =
        b.run(fence_kernel, 1, c.threads, std::max<size_t>(kCopyBytes, 4 * c.threads), a, 2, "fences");
    const double timed = static_cast<double>(r.out[0]) / reps;
    JsonLine line;
    line.add("m", "M5")
        .add("test", "fence")
        .add("fence", fence_name(c.fence))
        .add("stores_before", c.fence == Fence::kBulkWait ? kFenceBulkStores : c.stores)
        .add("store_bytes", c.fence == Fence::kBulkWait ? kCopyBytes : 8u)
        .add("threads", c.threads)
        .add("reps", reps)
        .add("cycles", timed)
        .add("ns", timed / r.clock.mhz * 1e3)
        .add("issue_cycles", static_cast<double>(r.out[1]) / reps);
    add_clock(line, r.clock).add("ok", r.ok).print();
  }
}

// ---- M9 -------------------------------------------------------------------------------------

inline void measure_timer(Bench& b) {
  const int reads = b.options().quick ? 10000 : 1 << 20;
  constexpr int kCapacity = 4096;
  uint64_t* gaps = b.out() + 16;
  TimerArgs a{};
  a.c = b.common();
  a.reads = reads;
  a.capacity = kCapacity;
  a.gaps = gaps;
  a.out = b.out();
  const Bench::Result r = b.run(timer_kernel, 1, 32, 0, a, 16 + kCapacity, "timer");
  const std::vector<uint64_t>& out = r.out;
  const uint64_t changes = out[1];
  std::map<uint64_t, uint64_t> histogram;
  std::vector<double> seen;
  for (uint64_t i = 0; i < std::min<uint64_t>(changes, kCapacity); ++i) {
    ++histogram[out[16 + i]];
    seen.push_back(static_cast<double>(out[16 + i]));
  }
  std::vector<std::pair<uint64_t, uint64_t>> common(histogram.begin(), histogram.end());
  std::sort(common.begin(), common.end(), [](const auto& x, const auto& y) { return x.second > y.second; });
  if (common.size() > 8) common.resize(8);
  std::vector<double> values, counts;
  for (const auto& [gap, count] : common) {
    values.push_back(static_cast<double>(gap));
    counts.push_back(static_cast<double>(count));
  }
  const double per_read = static_cast<double>(out[0]) / reads;
  JsonLine line;
  line.add("m", "M9")
      .add("test", "globaltimer")
      .add("reads", reads)
      .add("read_cycles", per_read)
      .add("read_ns", per_read / r.clock.mhz * 1e3)
      .add("changes", changes)
      .add("gap_min_ns", seen.empty() ? std::nan("") : *std::min_element(seen.begin(), seen.end()))
      .add("gap_median_ns", median(seen))
      .add("gap_values_ns", values)
      .add("gap_counts", counts);
  add_clock(line, r.clock).add("ok", r.ok).print();
}

}  // namespace hybrid_ep::micro
