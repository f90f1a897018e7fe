// The host side of the copy measurements: M2 (bulk-copy throughput), its two ncu targets
// (tma-profile, for M8), M3 (bulk-copy latency) and M10 (the copy engine). Each prints one
// JSON line per point.
#pragma once
#include <chrono>
#include <thread>

#include "microbench/busy.cuh"
#include "microbench/host.cuh"
#include "microbench/latency.cuh"
#include "microbench/tma.cuh"

namespace hybrid_ep::micro {

// ---- M2 -------------------------------------------------------------------------------------

constexpr size_t kTmaBytesPerBlock = size_t(32) << 20;  // loads + stores of one block per run
constexpr size_t kL2SourceBytes = size_t(256) << 10;    // a block's source when it is to stay in L2

struct TmaCase {
  const char* sweep;  // which sweep the point belongs to (the post-processor's grouping)
  TmaMode mode;
  int fanout;  // kMix
  int blocks;
  uint32_t copy_bytes;
  int stages;
  int depth;
  int pipelines;
  bool random_rows;
  bool l2_source;
  int store_threads = 1;  // kMix: store threads taking alternate stages (1 or 2)
  bool table = false;     // kMix: destinations read from a route table in shared memory
  int parts = 1;          // kLoad: copies per stage under one arrival
  int part_lanes = 1;     // kLoad with parts > 1: the lanes issuing them
};

inline const char* tma_mode_name(TmaMode m) {
  return m == TmaMode::kLoad ? "load" : m == TmaMode::kStore ? "store" : "mix";
}

inline uint64_t floor_pow2(uint64_t v) {
  uint64_t p = 1;
  while (p * 2 <= v) p *= 2;
  return p;
}

inline TmaArgs tma_args(const Bench& b, const TmaCase& c) {
  TmaArgs a{};
  a.la = b.wait_args();
  a.c = b.common();
  a.mode = static_cast<int>(c.mode);
  a.fanout = c.mode == TmaMode::kMix ? c.fanout : 1;
  a.pipelines = c.pipelines;
  a.stages = c.stages;
  a.depth = c.depth;
  a.store_threads = c.store_threads;
  a.table = c.table ? 1 : 0;
  a.parts = c.parts;
  a.part_lanes = c.part_lanes;
  a.random_rows = c.random_rows;
  a.copy_bytes = c.copy_bytes;
  const size_t per_copy = static_cast<size_t>(c.copy_bytes) * (c.mode == TmaMode::kMix ? 1 + c.fanout : 1);
  a.copies = static_cast<uint32_t>(std::max<size_t>(1, kTmaBytesPerBlock / per_copy / c.pipelines));
  a.src = b.src();
  a.src_rows = floor_pow2((c.l2_source ? kL2SourceBytes : kBigBytes / c.blocks) / c.copy_bytes);
  a.dst = b.dst();
  a.dst_rows = floor_pow2(kBigBytes / c.copy_bytes / (static_cast<size_t>(c.blocks) * a.fanout));
  return a;
}

inline size_t tma_smem(const TmaCase& c) { return static_cast<size_t>(c.pipelines) * c.stages * c.copy_bytes; }

inline int tma_threads(const TmaCase& c) {
  return 32 * c.pipelines * (c.mode == TmaMode::kMix ? 1 + c.store_threads : 1);
}

struct TmaRun {
  bool ok;
  double kernel_ms;  // first block start to last block end (%globaltimer)
  double event_ms;   // CUDA events around the launch
  double cycles;     // median over blocks of a block's cycles
  Clock clock;       // block 0's
};

// One launch; `flush`: write L2 over first, so the sources come from HBM.
inline TmaRun run_tma(Bench& b, const TmaCase& c, const TmaArgs& a, cudaEvent_t e0, cudaEvent_t e1, bool flush) {
  if (flush) b.flush_l2();
  MICRO_CHECK(cudaEventRecord(e0, b.stream()));
  b.launch(tma_kernel, c.blocks, tma_threads(c), tma_smem(c), a, "tma");
  MICRO_CHECK(cudaEventRecord(e1, b.stream()));
  TmaRun r{};
  r.ok = b.finish("tma");
  float ms = 0;
  MICRO_CHECK(cudaEventElapsedTime(&ms, e0, e1));
  r.event_ms = ms;
  const std::vector<Span> spans = b.read_spans(c.blocks);
  uint64_t first = ~0ull, last = 0;
  std::vector<double> cycles;
  for (const Span& s : spans) {
    first = std::min(first, s.ns0);
    last = std::max(last, s.ns1);
    cycles.push_back(static_cast<double>(s.cycles1 - s.cycles0));
  }
  r.kernel_ms = static_cast<double>(last - first) / 1e6;
  r.cycles = median(cycles);
  r.clock = clock_of(spans[0]);
  return r;
}

inline void print_tma(const TmaCase& c, const TmaArgs& a, const TmaRun& r, int reps, const char* test) {
  const double loads = c.mode == TmaMode::kStore ? 0.0 : static_cast<double>(a.copies) * c.pipelines * c.copy_bytes;
  const double stores =
      c.mode == TmaMode::kLoad ? 0.0 : static_cast<double>(a.copies) * c.pipelines * c.copy_bytes * a.fanout;
  const double per_block = loads + stores, s = r.kernel_ms / 1e3;
  JsonLine line;
  line.add("m", "M2")
      .add("test", test)
      .add("sweep", c.sweep)
      .add("mode", tma_mode_name(c.mode))
      .add("fanout", a.fanout)
      .add("sms", c.blocks)
      .add("copy_bytes", c.copy_bytes)
      .add("stages", c.stages)
      .add("depth", c.mode == TmaMode::kLoad ? -1 : c.depth)
      .add("pipelines", c.pipelines)
      .add("store_threads", c.store_threads)
      .add("table", c.table)
      .add("parts", c.parts)
      .add("part_lanes", c.part_lanes)
      .add("rows", c.random_rows ? "random" : "sequential")
      .add("source", c.l2_source ? "l2" : "hbm")
      .add("copies_per_pipeline", a.copies)
      .add("reps", reps)
      .add("ms", r.kernel_ms)
      .add("event_ms", r.event_ms)
      .add("gbps", per_block * c.blocks / s / 1e9)
      .add("gbps_per_sm", per_block / s / 1e9)
      .add("load_gbps_per_sm", loads / s / 1e9)
      .add("store_gbps_per_sm", stores / s / 1e9)
      .add("bytes_per_clk_per_sm", per_block / r.cycles);
  add_clock(line, r.clock).add("ok", r.ok).print();
}

// A warm-up launch, then `reps` timed ones (L2 flushed before each); the median by kernel time.
inline void measure_tma_case(Bench& b, const TmaCase& c, int reps, const char* test, cudaEvent_t e0, cudaEvent_t e1) {
  const TmaArgs a = tma_args(b, c);
  run_tma(b, c, a, e0, e1, true);
  std::vector<TmaRun> runs;
  for (int i = 0; i < reps; ++i) runs.push_back(run_tma(b, c, a, e0, e1, true));
  std::sort(runs.begin(), runs.end(), [](const TmaRun& x, const TmaRun& y) { return x.kernel_ms < y.kernel_ms; });
  TmaRun mid = runs[runs.size() / 2];
  for (const TmaRun& r : runs) mid.ok = mid.ok && r.ok;
  print_tma(c, a, mid, reps, test);
}

// The sweeps of docs/benchmarks/cuda.md's M2, around one base point: 16 KiB copies, 8 stages,
// 4 store groups reading, one pipeline, sequential rows from HBM, one SM.
inline std::vector<TmaCase> tma_cases(const Bench& b) {
  const bool quick = b.options().quick;
  const size_t budget = static_cast<size_t>(b.smem_optin()) - 2048;  // the block's static barriers aside
  const TmaCase base{"", TmaMode::kLoad, 1, 1, 16384, 8, 4, 1, false, false};
  struct Kind {
    TmaMode mode;
    int fanout;
  };
  const std::vector<Kind> all = {{TmaMode::kLoad, 1}, {TmaMode::kStore, 1}, {TmaMode::kMix, 1},
                                 {TmaMode::kMix, 2},  {TmaMode::kMix, 4},   {TmaMode::kMix, 8}};
  const std::vector<Kind> few = {{TmaMode::kLoad, 1}, {TmaMode::kStore, 1}, {TmaMode::kMix, 1}, {TmaMode::kMix, 4}};
  std::vector<TmaCase> cases;
  auto with = [&](const char* sweep, Kind k) {
    TmaCase c = base;
    c.sweep = sweep;
    c.mode = k.mode;
    c.fanout = k.fanout;
    return c;
  };
  const int max_sms = std::min(32, b.sms());
  for (const Kind& k : quick ? few : all)
    for (int sms : {1, 2, 4, 8, 16, 32}) {
      if (sms > max_sms || (quick && sms != 1 && sms != max_sms)) continue;
      TmaCase c = with("sms", k);
      c.blocks = sms;
      cases.push_back(c);
    }
  for (const Kind& k : few)
    for (uint32_t kib : {2u, 4u, 8u, 16u, 32u}) {
      if (quick && kib != 4 && kib != 32) continue;
      TmaCase c = with("copy_bytes", k);
      c.copy_bytes = kib * 1024;
      c.stages = static_cast<int>(std::min<size_t>(8, budget / c.copy_bytes));
      cases.push_back(c);
    }
  for (const Kind& k : {Kind{TmaMode::kLoad, 1}, Kind{TmaMode::kMix, 1}, Kind{TmaMode::kMix, 4}})
    for (int stages : {2, 3, 4, 6, 8, 10, 12}) {
      if (quick && stages != 2 && stages != 12) continue;
      TmaCase c = with("stages", k);
      c.stages = stages;
      c.depth = std::min(4, stages - 1);
      cases.push_back(c);
    }
  for (const Kind& k : {Kind{TmaMode::kStore, 1}, Kind{TmaMode::kMix, 1}, Kind{TmaMode::kMix, 4}})
    for (int depth = 0; depth <= 7; ++depth) {
      if (quick && depth != 0 && depth != 7) continue;
      TmaCase c = with("depth", k);
      c.stages = 12;
      c.depth = depth;
      cases.push_back(c);
    }
  for (const Kind& k : few)
    for (int pipelines : {1, 2, 4}) {
      if (quick && pipelines == 2) continue;
      TmaCase c = with("pipelines", k);
      c.pipelines = pipelines;
      c.stages = 12 / pipelines;  // the same shared memory in all
      c.depth = std::min(4, c.stages - 1);
      cases.push_back(c);
    }
  for (const Kind& k : {Kind{TmaMode::kLoad, 1}, Kind{TmaMode::kStore, 1}, Kind{TmaMode::kMix, 1}})
    for (int sms : {1, max_sms})
      for (bool random : {false, true}) {
        TmaCase c = with("rows", k);
        c.blocks = sms;
        c.random_rows = random;
        cases.push_back(c);
      }
  for (const Kind& k : {Kind{TmaMode::kLoad, 1}, Kind{TmaMode::kMix, 1}})
    for (bool l2 : {false, true}) {
      TmaCase c = with("source", k);
      c.l2_source = l2;
      cases.push_back(c);
    }
  // The direct dispatch's store side (kernels/dispatch_direct.cuh): one load and eight stores per
  // stage on its 12 stages (an even count: alternate stages give each stage one store thread),
  // one group left reading per store thread; one store thread or two taking alternate stages,
  // destinations computed or read from a route table in shared memory (docs/dev/request_path.md:
  // which of these costs the kernel its stores' rate). Then fp8's rows (8 KiB copies) with the
  // route table, one store thread and two: the copy-size sweep's stores of 8 KiB and less take
  // one thread 147.6 ns a copy whatever their bytes (H200), and whether two store threads share
  // that time or each has its own decides what fp8's dispatch can reach.
  for (uint32_t kib : {16u, 8u})
    for (int threads : {1, 2})
      for (bool table : {false, true}) {
        if (kib != 16 && !table) continue;
        TmaCase c = with("kernel", Kind{TmaMode::kMix, 8});
        c.copy_bytes = kib * 1024;
        c.stages = static_cast<int>(std::min<size_t>(12, budget / c.copy_bytes / 2 * 2));
        c.depth = 1;
        c.store_threads = threads;
        c.table = table;
        cases.push_back(c);
      }
  // The direct combine's token stage (HYBRID_EP_COMBINE_STAGE=token): a stage of 32 KiB holds
  // a token's 8 parts of 4 KiB (top-8, 2048 bf16 columns), loaded under one expected-bytes
  // arrival, on 2 pipelines of 3 stages (the H200's shared memory), issued by one lane or by
  // 8: whether a thread's time per copy (the copy-size sweep: 2-32 KiB loads each took one
  // thread about 211 ns) binds the parts, and whether lanes of one warp each have their own.
  for (int lanes : {1, 8}) {
    TmaCase c = with("gather", Kind{TmaMode::kLoad, 1});
    c.copy_bytes = 32768;
    c.stages = 3;
    c.pipelines = 2;
    c.parts = 8;
    c.part_lanes = lanes;
    cases.push_back(c);
  }
  return cases;
}

inline void measure_tma(Bench& b) {
  cudaEvent_t e0, e1;
  MICRO_CHECK(cudaEventCreate(&e0));
  MICRO_CHECK(cudaEventCreate(&e1));
  for (const TmaCase& c : tma_cases(b)) measure_tma_case(b, c, b.options().quick ? 1 : 5, "tma", e0, e1);
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

// For ncu (M8, `gpu_check.sh ncu-l1tex`): single launches of the base point, store-only, one load with two stores
// and one load with eight stores per stage (the direct dispatch's pattern at top-8), and that pattern as the direct
// dispatch's store side runs it (C_direct_2_table), with nothing else launched (no warm-up, no L2 flush kernel).
inline void measure_tma_profile(Bench& b) {
  cudaEvent_t e0, e1;
  MICRO_CHECK(cudaEventCreate(&e0));
  MICRO_CHECK(cudaEventCreate(&e1));
  for (const TmaCase& c : {TmaCase{"profile", TmaMode::kStore, 1, 1, 16384, 8, 4, 1, false, false},
                           TmaCase{"profile", TmaMode::kMix, 2, 1, 16384, 8, 4, 1, false, false},
                           TmaCase{"profile", TmaMode::kMix, 8, 1, 16384, 8, 4, 1, false, false},
                           TmaCase{"profile", TmaMode::kMix, 8, 1, 16384, 12, 1, 1, false, false, 2, true}}) {
    const TmaArgs a = tma_args(b, c);
    const TmaRun r = run_tma(b, c, a, e0, e1, false);
    print_tma(c, a, r, 1, "tma-profile");
  }
  cudaEventDestroy(e0);
  cudaEventDestroy(e1);
}

// ---- M3 -------------------------------------------------------------------------------------

inline void measure_latency(Bench& b) {
  const std::vector<LatencyCase> cases = {
      {CopyKind::kLoad, 4096, false, Queue::kNone},    {CopyKind::kLoad, 4096, true, Queue::kNone},
      {CopyKind::kLoad, 16384, false, Queue::kNone},   {CopyKind::kLoad, 16384, true, Queue::kNone},
      {CopyKind::kLoad, 16384, true, Queue::kLoads},   {CopyKind::kLoad, 16384, true, Queue::kStores},
      {CopyKind::kStore, 4096, false, Queue::kNone},   {CopyKind::kStore, 16384, false, Queue::kNone},
      {CopyKind::kStore, 16384, false, Queue::kStores}};
  const int samples = b.options().quick ? 16 : 256;
  for (const LatencyCase& c : cases) {
    const LatencyArgs a = latency_args(b.common(), c, samples, b.src(), b.dst(), kBigBytes / c.copy_bytes, b.out());
    b.flush_l2();
    const Bench::Result r = b.run(latency_kernel, 1, 32, latency_smem(a), a, 2 * samples, "latency");
    std::vector<double> first_ns, second_ns;
    for (int s = 0; s < samples; ++s) {
      first_ns.push_back(static_cast<double>(r.out[2 * s]) / r.clock.mhz * 1e3);
      second_ns.push_back(static_cast<double>(r.out[2 * s + 1]) / r.clock.mhz * 1e3);
    }
    JsonLine line;
    line.add("m", "M3")
        .add("test", "latency")
        .add("copy", c.kind == CopyKind::kLoad ? "load" : "store")
        .add("copy_bytes", c.copy_bytes)
        .add("source", c.kind == CopyKind::kStore ? "smem"
                       : c.cold                   ? "hbm"
                                                  : "l2")
        .add("queue", c.queue == Queue::kNone    ? "none"
                      : c.queue == Queue::kLoads ? "loads"
                                                 : "stores")
        .add("queued", a.queued)
        .add("samples", samples);
    const char* first = c.kind == CopyKind::kLoad ? "complete" : "read";
    const std::string f = first;
    line.add((f + "_ns_median").c_str(), median(first_ns))
        .add((f + "_ns_p10").c_str(), quantile(first_ns, 0.1))
        .add((f + "_ns_p90").c_str(), quantile(first_ns, 0.9))
        .add((f + "_ns_min").c_str(), quantile(first_ns, 0.0));
    if (c.kind == CopyKind::kStore)
      line.add("write_ns_median", median(second_ns))
          .add("write_ns_p10", quantile(second_ns, 0.1))
          .add("write_ns_p90", quantile(second_ns, 0.9))
          .add("write_ns_min", quantile(second_ns, 0.0));
    add_clock(line, r.clock).add("ok", r.ok).print();
  }
}

// ---- M10 ------------------------------------------------------------------------------------

inline void measure_copy_engine(Bench& b) {
  const size_t bytes = size_t(256) << 20;
  const int reps = b.options().quick ? 1 : 5;
  cudaStream_t side;
  MICRO_CHECK(cudaStreamCreateWithFlags(&side, cudaStreamNonBlocking));
  cudaEvent_t base, c0, c1, k1;
  for (cudaEvent_t* e : {&base, &c0, &c1, &k1}) MICRO_CHECK(cudaEventCreate(e));
  float* sink = nullptr;
  MICRO_CHECK(cudaMalloc(&sink, 1024 * sizeof(float)));
  // the copy: the first 256 MiB of src to dst; the memory neighbour: the next 256 MiB of each
  auto copy_once = [&]() {
    MICRO_CHECK(cudaEventRecord(c0, b.stream()));
    MICRO_CHECK(cudaMemcpyAsync(b.dst(), b.src(), bytes, cudaMemcpyDeviceToDevice, b.stream()));
    MICRO_CHECK(cudaEventRecord(c1, b.stream()));
  };
  double alone_ms = 0;
  for (const char* neighbour : {"none", "compute", "memory"}) {
    std::vector<double> copy_ms, kernel_ms, copy_end, kernel_end;
    Clock clock{std::nan(""), 0.0};
    bool ok = true;
    for (int r = 0; r <= reps; ++r) {  // the first is a warm-up
      MICRO_CHECK(cudaDeviceSynchronize());
      const bool busy = std::string(neighbour) != "none";
      MICRO_CHECK(cudaEventRecord(base, busy ? side : b.stream()));
      if (busy) {
        BusyArgs a{};
        a.duration_ns = static_cast<uint64_t>(std::max(20.0, 4 * alone_ms) * 1e6);
        a.src = reinterpret_cast<const int4*>(b.src() + bytes);
        a.dst = reinterpret_cast<int4*>(b.dst() + bytes);
        a.words = bytes / sizeof(int4);
        a.sink = sink;
        a.passes = b.out();
        a.c = b.common();
        if (std::string(neighbour) == "compute") {
          busy_compute_kernel<<<2 * b.sms(), 1024, 0, side>>>(a);
        } else {
          busy_memory_kernel<<<2 * b.sms(), 1024, 0, side>>>(a);
        }
        MICRO_CHECK(cudaGetLastError());
        MICRO_CHECK(cudaEventRecord(k1, side));
        std::this_thread::sleep_for(std::chrono::milliseconds(2));  // the neighbour holds the SMs first
      }
      copy_once();
      ok = b.finish("copy-engine") && ok;
      MICRO_CHECK(cudaStreamSynchronize(side));
      if (r == 0) continue;
      float t_start = 0, t_end = 0, t_kernel = 0;
      MICRO_CHECK(cudaEventElapsedTime(&t_start, base, c0));
      MICRO_CHECK(cudaEventElapsedTime(&t_end, base, c1));
      copy_ms.push_back(t_end - t_start);
      copy_end.push_back(t_end);
      if (busy) {
        MICRO_CHECK(cudaEventElapsedTime(&t_kernel, base, k1));
        kernel_end.push_back(t_kernel);
        clock = clock_of(b.read_spans(1)[0]);
      }
    }
    const double ms = median(copy_ms);
    if (std::string(neighbour) == "none") alone_ms = ms;
    JsonLine line;
    line.add("m", "M10")
        .add("test", "copy_engine")
        .add("neighbour", neighbour)
        .add("bytes", static_cast<uint64_t>(bytes))
        .add("reps", reps)
        .add("copy_ms", ms)
        .add("copy_gbps", bytes / (ms / 1e3) / 1e9)
        .add("copy_rw_gbps", 2.0 * bytes / (ms / 1e3) / 1e9)
        .add("copy_end_ms", median(copy_end))
        .add("neighbour_end_ms", median(kernel_end))
        .add("overlapped", !kernel_end.empty() && median(copy_end) < median(kernel_end));
    add_clock(line, clock).add("ok", ok).print();
  }
  cudaFree(sink);
  for (cudaEvent_t e : {base, c0, c1, k1}) cudaEventDestroy(e);
  cudaStreamDestroy(side);
}

}  // namespace hybrid_ep::micro
