// The microbenchmark's kernels (csrc/microbench/) on the CPU model of the device layer, at tiny
// sizes: built by tests/tools/test_microbench.py with the host compiler and the model's runtime. Each
// case prints one JSON line: the model's error (null when the launch passed its checks), the
// abort flag (a wait that ran out), the kernel's result words, and for copies the rows that
// differ from what they should hold. The model checks every mbarrier phase, bulk copy and
// barrier on the way, so a kernel that deadlocks, waits on a stale phase or copies out of
// bounds fails here rather than on the rare GPU.
//
//   model_check CASE...   (handoff barrier tma tma_deadlock latency flags poll fences reduce timer)
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "microbench/fences.cuh"
#include "microbench/flags.cuh"
#include "microbench/handoff.cuh"
#include "microbench/json.h"
#include "microbench/latency.cuh"
#include "microbench/reduce.cuh"
#include "microbench/timer.cuh"
#include "microbench/tma.cuh"

using namespace hybrid_ep;
using namespace hybrid_ep::micro;

namespace {

constexpr uint64_t kTimeoutNs = 200'000'000;  // virtual time: idle rounds advance it 10 ms each

struct Env {
  int abort = 0;
  ErrorRecord error{};
  Span spans[8]{};
  std::vector<uint64_t> out = std::vector<uint64_t>(1 << 14, 0);

  Common common() { return Common{kTimeoutNs, &abort, spans}; }
  LaunchArgs wait_args() {
    LaunchArgs la{};
    la.timeout_ns = kTimeoutNs;
    la.abort_flag = reinterpret_cast<uint64_t>(&abort);
    la.error = reinterpret_cast<uint64_t>(&error);
    return la;
  }
};

// Global memory a bulk copy may touch: 16-byte aligned and declared to the model.
struct Buffer {
  uint8_t* p;
  size_t bytes;
  explicit Buffer(size_t n) : p(static_cast<uint8_t*>(std::aligned_alloc(128, n))), bytes(n) {
    std::memset(p, 0, n);
    model::add_allocation(reinterpret_cast<uint64_t>(p), n);
  }
  ~Buffer() {
    model::remove_allocation(reinterpret_cast<uint64_t>(p));
    std::free(p);
  }
};

JsonLine report(const std::string& name, const char* error, const Env& env) {
  JsonLine line;
  line.add("case", name).add("error", error == nullptr ? std::string() : std::string(error)).add("abort", env.abort);
  return line;
}

std::vector<double> words(const Env& env, int n) { return std::vector<double>(env.out.begin(), env.out.begin() + n); }

template <Wait W, Agree G>
void handoff(const char* name, uint32_t hint, int spinners) {
  Env env;
  HandoffArgs a{};
  a.la = env.wait_args();
  a.c = env.common();
  a.hint_ns = hint;
  a.iterations = 20;
  a.spinners = spinners;
  a.out = env.out.data();
  const int receivers = G == Agree::kNamed ? kNamedGroupWarps : 1;  // B's warps
  const char* err = dev::launch_cooperative(handoff_kernel<W, G>, 1, 32 * (1 + receivers + spinners), 0, 0, a);
  report(name, err, env).add("out", words(env, 5)).print();
}

void run_handoff() {
  handoff<Wait::kBare, Agree::kLane>("handoff bare lane", 0, 2);
  handoff<Wait::kHint, Agree::kLane>("handoff hint lane", 1000, 8);
  handoff<Wait::kProject, Agree::kLane>("handoff project lane", 0, 2);
  handoff<Wait::kProject, Agree::kWarpUniform>("handoff project warp_uniform", 0, 0);
  handoff<Wait::kBare, Agree::kWarpUniform>("handoff bare warp_uniform", 0, 0);
  handoff<Wait::kBare, Agree::kElect>("handoff bare elect", 0, 0);
  handoff<Wait::kHint, Agree::kElect>("handoff hint elect", 1000, 2);
  handoff<Wait::kProject, Agree::kConverged>("handoff project converged", 0, 0);
  handoff<Wait::kProject, Agree::kNamed>("handoff project named", 0, 2);
}

void run_barrier() {
  for (int warps : {2, 3, 4}) {
    Env env;
    BarrierArgs a{};
    a.c = env.common();
    a.iterations = 10;
    a.out = env.out.data();
    const char* err = dev::launch_cooperative(named_barrier_kernel, 1, 32 * warps, 0, 0, a);
    report("bar.sync " + std::to_string(warps) + " warps", err, env).add("out", words(env, 2)).print();
  }
}

// One TMA run at a model's size: 256-byte copies, rows numbered in their first word.
void tma(const std::string& name, TmaMode mode, int fanout, int blocks, int pipelines, int stages, int depth,
         bool random, int store_threads = 1, bool table = false, int parts = 1, int part_lanes = 1) {
  constexpr uint32_t kBytes = 256;
  constexpr uint64_t kRows = 64;  // per block and region, a power of two
  Env env;
  Buffer src(kBytes * kRows * blocks), dst(kBytes * kRows * blocks * fanout);
  for (uint64_t r = 0; r < kRows * blocks; ++r)
    for (uint32_t w = 0; w < kBytes / 4; ++w)
      reinterpret_cast<uint32_t*>(src.p + r * kBytes)[w] = uint32_t(r * 1000 + w + 1);
  TmaArgs a{};
  a.la = env.wait_args();
  a.c = env.common();
  a.mode = static_cast<int>(mode);
  a.fanout = fanout;
  a.pipelines = pipelines;
  a.stages = stages;
  a.depth = depth;
  a.store_threads = store_threads;
  a.table = table ? 1 : 0;
  a.parts = parts;
  a.part_lanes = part_lanes;
  a.random_rows = random;
  a.copy_bytes = kBytes;
  a.copies = 12;
  a.src = src.p;
  a.src_rows = kRows;
  a.dst = dst.p;
  a.dst_rows = kRows;
  const int threads = 32 * pipelines * (mode == TmaMode::kMix ? 1 + store_threads : 1);
  const char* err = dev::launch_cooperative(tma_kernel, blocks, threads, size_t(pipelines) * stages * kBytes, 0, a);
  // Every destination row holds its source row (kMix), its stage's words (kStore), or nothing.
  uint64_t written = 0, wrong = 0;
  for (int b = 0; b < blocks; ++b)
    for (int j = 0; j < fanout; ++j)
      for (uint64_t r = 0; r < kRows; ++r) {
        const uint32_t* got =
            reinterpret_cast<const uint32_t*>(dst.p + ((uint64_t(b) * fanout + j) * kRows + r) * kBytes);
        if (got[0] == 0) continue;  // a row no copy wrote
        ++written;
        if (mode == TmaMode::kMix) {
          wrong += std::memcmp(got, src.p + (uint64_t(b) * kRows + r) * kBytes, kBytes) != 0;
        } else {  // a stage's words: their offsets in shared memory + 1
          for (uint32_t w = 1; w < kBytes / 4; ++w) wrong += got[w] != got[0] + w;
          wrong += got[0] % (kBytes / 4) != 1;
        }
      }
  report(name, err, env).add("written", written).add("wrong", wrong).print();
}

void run_tma() {
  tma("tma load", TmaMode::kLoad, 1, 2, 1, 4, 0, false);
  tma("tma load 4 pipelines random", TmaMode::kLoad, 1, 1, 4, 2, 0, true);
  // the direct combine's token stage: 8 parts a stage under one arrival, from lane 0 or from 8 lanes
  tma("tma gather 8 parts, 1 lane", TmaMode::kLoad, 1, 2, 2, 3, 0, false, 1, false, 8, 1);
  tma("tma gather 8 parts, 8 lanes, random", TmaMode::kLoad, 1, 1, 2, 3, 0, true, 1, false, 8, 8);
  tma("tma store depth 0", TmaMode::kStore, 1, 1, 1, 4, 0, false);
  tma("tma store depth 7, 2 pipelines", TmaMode::kStore, 1, 2, 2, 3, 7, false);
  tma("tma mix k=1 depth 3", TmaMode::kMix, 1, 1, 1, 4, 3, false);
  tma("tma mix k=2 depth 0", TmaMode::kMix, 2, 2, 1, 2, 0, false);
  tma("tma mix k=4 depth 1 random, 2 pipelines", TmaMode::kMix, 4, 1, 2, 2, 1, true);
  tma("tma mix k=2 depth 7, 4 pipelines", TmaMode::kMix, 2, 1, 4, 8, 7, false);
  // the direct dispatch's store side: two store threads on alternate stages, the route table
  tma("tma mix k=8 depth 1, 2 store threads", TmaMode::kMix, 8, 1, 1, 5, 1, false, 2, false);
  tma("tma mix k=8 depth 1, route table", TmaMode::kMix, 8, 2, 1, 3, 1, false, 1, true);
  tma("tma mix k=8 depth 1, 2 store threads, route table", TmaMode::kMix, 8, 1, 1, 5, 1, true, 2, true);
}

// depth = stages: the store thread never releases the stage the next load needs.
void run_tma_deadlock() { tma("tma mix depth = stages", TmaMode::kMix, 1, 1, 1, 3, 3, false); }

void run_latency() {
  struct Named {
    const char* name;
    LatencyCase c;
  };
  constexpr uint32_t kBytes = 512;
  constexpr int kSamples = 4;
  for (const Named& n : {Named{"latency load hot", {CopyKind::kLoad, kBytes, false, Queue::kNone}},
                         Named{"latency load cold behind loads", {CopyKind::kLoad, kBytes, true, Queue::kLoads}},
                         Named{"latency load cold behind stores", {CopyKind::kLoad, kBytes, true, Queue::kStores}},
                         Named{"latency store", {CopyKind::kStore, kBytes, false, Queue::kNone}},
                         Named{"latency store behind stores", {CopyKind::kStore, kBytes, false, Queue::kStores}}}) {
    Env env;
    Buffer src(kBytes * 64), dst(kBytes * 64);
    const LatencyArgs a = latency_args(env.common(), n.c, kSamples, src.p, dst.p, 64, env.out.data());
    const char* err = dev::launch_cooperative(latency_kernel, 1, 32, latency_smem(a), 0, a);
    report(n.name, err, env).add("out", words(env, 2 * kSamples)).print();
  }
}

void run_flags() {
  for (bool acquire : {true, false})
    for (int add : {0, 1})
      for (uint32_t backoff : {0u, 64u}) {
        Env env;
        FlagArgs a{};
        a.c = env.common();
        a.iterations = 10;
        a.backoff_ns = backoff;
        a.add = add;
        a.flags = env.out.data() + 64;
        a.out = env.out.data();
        const char* err = acquire ? dev::launch_cooperative(flag_kernel<true>, 2, 32, 1024, 0, a)
                                  : dev::launch_cooperative(flag_kernel<false>, 2, 32, 1024, 0, a);
        const std::string name = std::string("flags ") + (acquire ? "acquire" : "relaxed+fence") +
                                 (add ? " add" : " store") + " backoff " + std::to_string(backoff);
        report(name, err, env)
            .add("flags", std::vector<double>{double(a.flags[0]), double(a.flags[kFlagStride])})
            .add("out", words(env, 4))
            .print();
      }
}

void run_poll() {
  for (bool acquire : {true, false}) {
    Env env;
    PollArgs a{};
    a.c = env.common();
    a.polls = 10;
    a.flag = env.out.data() + 64;
    a.out = env.out.data();
    const char* err = acquire ? dev::launch_cooperative(poll_kernel<true>, 1, 32, 0, 0, a)
                              : dev::launch_cooperative(poll_kernel<false>, 1, 32, 0, 0, a);
    report(acquire ? "poll acquire" : "poll relaxed", err, env).add("out", words(env, 2)).print();
  }
}

void run_fences() {
  constexpr uint32_t kBytes = 256;
  for (Fence f : {Fence::kSystem, Fence::kAcqRelSys, Fence::kProxyAsync, Fence::kBulkWait}) {
    Env env;
    Buffer dst(kBytes * 64);
    std::vector<uint64_t> scratch(16 * 64);
    FenceArgs a{};
    a.c = env.common();
    a.kind = static_cast<int>(f);
    a.stores = f == Fence::kSystem ? 16 : 0;
    a.reps = 3;
    a.scratch = scratch.data();
    a.scratch_lines = 64;
    a.dst = dst.p;
    a.dst_rows = 64;
    a.copy_bytes = kBytes;
    a.out = env.out.data();
    const int threads = f == Fence::kProxyAsync ? 128 : 32;
    const char* err = dev::launch_cooperative(fence_kernel, 1, threads, std::max<size_t>(kBytes, 4 * threads), 0, a);
    report("fences " + std::to_string(static_cast<int>(f)), err, env).add("out", words(env, 2)).print();
  }
}

template <int kVec, int kFixedK>
void reduce(int k, int warps) {
  constexpr uint32_t kRowBytes = 1024;
  Env env;
  std::vector<uint16_t> result(kRowBytes / 2, 0);
  ReduceArgs a{};
  a.c = env.common();
  a.rows = k;
  a.reps = 2;
  a.row_bytes = kRowBytes;
  for (int q = 0; q < kReduceMaxRows; ++q) a.weight[q] = 1.0f + q;  // sums stay exact small integers
  a.result = result.data();
  const size_t smem = size_t(k + 1) * kRowBytes + kReduceMaxRows * sizeof(float);
  const char* err = dev::launch_cooperative(reduce_kernel<kVec, kFixedK>, 1, 32 * warps, smem, 0, a);
  uint64_t wrong = 0;
  for (uint32_t e = 0; e < kRowBytes / 2; ++e) {
    float sum = 0;
    for (int q = 0; q < k; ++q) sum += (1.0f + q) * float((q + e) % 8);
    wrong += result[e] != model::float_to_bf16_rn(sum);
  }
  report("reduce vec " + std::to_string(kVec) + " k " + std::to_string(k) + (kFixedK ? " unrolled" : " runtime") +
             " warps " + std::to_string(warps),
         err, env)
      .add("wrong", wrong)
      .print();
}

void run_reduce() {
  reduce<16, 8>(8, 2);
  reduce<16, 1>(1, 1);
  reduce<16, 0>(3, 2);
  reduce<8, 8>(8, 1);
  reduce<8, 0>(5, 1);
  reduce<4, 8>(8, 2);
  reduce<4, 0>(2, 1);
}

void run_timer() {
  Env env;
  std::vector<uint64_t> gaps(16, 0);
  TimerArgs a{};
  a.c = env.common();
  a.reads = 100;
  a.capacity = 16;
  a.gaps = gaps.data();
  a.out = env.out.data();
  const char* err = dev::launch_cooperative(timer_kernel, 1, 32, 0, 0, a);
  report("timer", err, env).add("out", words(env, 3)).print();
}

}  // namespace

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    const std::string c = argv[i];
    if (c == "handoff") run_handoff();
    else if (c == "barrier") run_barrier();
    else if (c == "tma") run_tma();
    else if (c == "tma_deadlock") run_tma_deadlock();
    else if (c == "latency") run_latency();
    else if (c == "flags") run_flags();
    else if (c == "poll") run_poll();
    else if (c == "fences") run_fences();
    else if (c == "reduce") run_reduce();
    else if (c == "timer") run_timer();
    else {
      std::fprintf(stderr, "model_check: unknown case '%s'\n", c.c_str());
      return 2;
    }
  }
  return 0;
}
