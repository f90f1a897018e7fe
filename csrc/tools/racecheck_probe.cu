// racecheck_probe: each synchronisation pattern the kernels use between the warps of a block,
// alone in a tiny kernel, so that `compute-sanitizer --tool racecheck` can be asked about that
// pattern and nothing else. The 2026-11-26 racecheck logs (docs/benchmarks/racecheck.md) name
// shared-memory site pairs in the kernels that the PTX memory model orders (mbarrier arrive has
// release and try_wait acquire semantics at CTA scope, bar.warp.sync orders the lanes of a warp,
// a bulk copy's complete_tx makes its bytes visible to the waits that see the phase complete);
// a case here that racecheck flags although it is ordered shows a limit of the tool, a control
// ordered by __syncthreads must come out clean and a case with no ordering at all must be flagged.
//
// Every case is one block of two warps (warp 0 writes, warp 1 reads) passing kRounds rounds
// through a ring of kStages slots of kWords ints, so slots are reused (read then written again)
// as in the kernels' rings; the reader checks every value it reads. It uses the device layer's
// own PTX wrappers (device/sm90/primitives.cuh), so the instructions are the kernels'. Built by
// scripts/build_racecheck_probe.sh (sm_90a), run per case by `scripts/gpu_check.sh
// racecheck-probe`. `--help` and `--list` make no CUDA call.
#include <cstdio>
#include <cstring>
#include <string>

#include "device/sm90/primitives.cuh"

namespace probe {

namespace dev = hybrid_ep::dev;

constexpr int kRounds = 8, kStages = 2, kWords = 32, kThreads = 64;
constexpr uint64_t kWaitNs = 10ull * 1000 * 1000 * 1000;  // a wait gives up after 10 s (and says so)

// What a launch reports: values read that were not the ones written, and waits that gave up.
struct Report {
  int wrong;
  int gave_up;
  int first_round, first_word, first_value, first_want;
};

struct Ring {
  uint64_t full[kStages], empty[kStages];
  alignas(128) int32_t slot[kStages][kWords];  // 128 bytes: one bulk copy
};

// The value of word i in round k (never 0, the slots' initial value).
__host__ __device__ constexpr int32_t value(int k, int i) { return (k + 1) * 1000 + i; }
__device__ int stage(int k) { return k % kStages; }
__device__ uint32_t parity(int k) { return static_cast<uint32_t>(k / kStages) & 1u; }

__device__ void check(Report* rep, int k, int i, int32_t got, int32_t want) {
  if (got == want) return;
  if (atomicAdd(&rep->wrong, 1) == 0) {
    rep->first_round = k, rep->first_word = i, rep->first_value = got, rep->first_want = want;
  }
}

// Until the phase of `bar` with this parity completed (this thread's acquire), bounded; false
// when it or the other side gave up.
__device__ bool wait(Report* rep, uint64_t* bar, uint32_t par) {
  const uint64_t start = dev::global_timer_ns();
  while (!dev::mbar_try_wait(bar, par)) {
    if (*reinterpret_cast<volatile int*>(&rep->gave_up) != 0) return false;
    if (dev::global_timer_ns() - start > kWaitNs) {
      atomicExch(&rep->gave_up, 1);
      return false;
    }
  }
  return true;
}

// The kernels' whole-warp wait (kernels/segments.cuh warp_consumer_wait, common/state.cuh
// warp_uniform, kernels/pipeline.cuh observe_full / observe_empty): lane 0 waits (bounded),
// the warp agrees through __syncwarp and a shuffle, every other lane observes the completed
// phase itself.
__device__ bool warp_wait(Report* rep, uint64_t* bar, uint32_t par, int lane) {
  bool ok = true;
  if (lane == 0) ok = wait(rep, bar, par);
  __syncwarp();
  if (__shfl_sync(0xffffffffu, static_cast<int>(ok), 0) == 0) return false;
  while (lane != 0 && !dev::mbar_try_wait(bar, par)) {}
  return true;
}

// Zeroed slots and the ring's barriers (full: `full_arrivals` per phase, empty:
// `empty_arrivals`), then a __syncthreads before any case's own ordering starts.
__device__ Ring& setup(uint32_t full_arrivals, uint32_t empty_arrivals) {
  __shared__ Ring ring;
  for (int i = threadIdx.x; i < kStages * kWords; i += blockDim.x) ring.slot[i / kWords][i % kWords] = 0;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      dev::mbar_init(&ring.full[s], full_arrivals);
      dev::mbar_init(&ring.empty[s], empty_arrivals);
    }
    dev::mbar_fence_init();
  }
  __syncthreads();
  return ring;
}

// The rounds of a case: warp 0 runs write(k, slot) and warp 1 read(k, slot) for k = 0 ..
// kRounds - 1, each warp leaving at its first false (a wait gave up, or a lane with no part).
template <typename Write, typename Read>
__device__ void rounds(Write write, Read read) {
  const bool writer = threadIdx.x < 32;
  for (int k = 0; k < kRounds; ++k)
    if (!(writer ? write(k, stage(k)) : read(k, stage(k)))) return;
}

// ---- controls -------------------------------------------------------------------------------

// Warp 0's lanes write a slot, __syncthreads, warp 1's lanes read it, __syncthreads: ordered by
// the barrier racecheck knows best; it must report nothing.
__global__ void syncthreads_case(Report* rep, const int32_t*) {
  Ring& r = setup(1, 1);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int k = 0; k < kRounds; ++k) {
    if (warp == 0) r.slot[stage(k)][lane] = value(k, lane);
    __syncthreads();
    if (warp == 1) check(rep, k, lane, r.slot[stage(k)][lane], value(k, lane));
    __syncthreads();
  }
}

// The same without the barriers: a data race racecheck must flag. A read may see any round's
// value or the initial 0, so only that is checked.
__global__ void racy_case(Report* rep, const int32_t*) {
  Ring& r = setup(1, 1);
  const int lane = threadIdx.x & 31;
  rounds(
      [&](int k, int) {
        r.slot[0][lane] = value(k, lane);
        return true;
      },
      [&](int k, int) {
        const int32_t got = r.slot[0][lane];
        const bool some_round = got % 1000 == lane && got / 1000 >= 1 && got / 1000 <= kRounds;
        if (got != 0 && !some_round) check(rep, k, lane, got, value(k, lane));
        return true;
      });
}

// ---- mbarrier rings -------------------------------------------------------------------------

// The whole slot written by one thread, which then arrives on full.
__device__ bool write_slot(Report* rep, Ring& r, int k, int s) {
  if (!wait(rep, &r.empty[s], parity(k) ^ 1u)) return false;
  for (int i = 0; i < kWords; ++i) r.slot[s][i] = value(k, i);
  dev::mbar_arrive(&r.full[s]);
  return true;
}

// The whole slot read by one thread after its own wait for full, which then arrives on empty.
__device__ bool read_slot(Report* rep, Ring& r, int k, int s) {
  if (!wait(rep, &r.full[s], parity(k))) return false;
  for (int i = 0; i < kWords; ++i) check(rep, k, i, r.slot[s][i], value(k, i));
  dev::mbar_arrive(&r.empty[s]);
  return true;
}

// Word `lane` read by every lane of the warp after the whole-warp wait for full, __syncwarp,
// lane 0 arrives on empty: the kernels' reducer warps (kernels/segments.cuh reduce_parts).
__device__ bool read_word_per_lane(Report* rep, Ring& r, int k, int s, int lane) {
  if (!warp_wait(rep, &r.full[s], parity(k), lane)) return false;
  check(rep, k, lane, r.slot[s][lane], value(k, lane));
  __syncwarp();
  if (lane == 0) dev::mbar_arrive(&r.empty[s]);
  return true;
}

// Lane 0 of warp 0 writes the slot and arrives; lane 0 of warp 1 waits, reads and arrives on
// empty; lane 0 of warp 0 waits for empty before the next write. Every access is by a thread
// that itself released or acquired.
__global__ void mbar_lane0_case(Report* rep, const int32_t*) {
  Ring& r = setup(1, 1);
  const int lane = threadIdx.x & 31;
  rounds([&](int k, int s) { return lane == 0 && write_slot(rep, r, k, s); },
         [&](int k, int s) { return lane == 0 && read_slot(rep, r, k, s); });
}

// Every lane of warp 0 writes its word (after the whole-warp wait for empty), __syncwarp, lane
// 0 arrives; lane 0 of warp 1 waits, reads every word, arrives on empty. The other lanes'
// writes reach the reader through __syncwarp, then lane 0's release.
__global__ void mbar_syncwarp_writers_case(Report* rep, const int32_t*) {
  Ring& r = setup(1, 1);
  const int lane = threadIdx.x & 31;
  rounds(
      [&](int k, int s) {
        if (!warp_wait(rep, &r.empty[s], parity(k) ^ 1u, lane)) return false;
        r.slot[s][lane] = value(k, lane);
        __syncwarp();
        if (lane == 0) dev::mbar_arrive(&r.full[s]);
        return true;
      },
      [&](int k, int s) { return lane == 0 && read_slot(rep, r, k, s); });
}

// Lane 0 of warp 0 writes the slot and arrives; warp 1 waits as a whole warp, every lane reads
// its word, __syncwarp, lane 0 arrives on empty. The other lanes' reads reach the next writer
// through __syncwarp, then lane 0's release.
__global__ void mbar_syncwarp_readers_case(Report* rep, const int32_t*) {
  Ring& r = setup(1, 1);
  const int lane = threadIdx.x & 31;
  rounds([&](int k, int s) { return lane == 0 && write_slot(rep, r, k, s); },
         [&](int k, int s) { return read_word_per_lane(rep, r, k, s, lane); });
}

// Every lane of both warps arrives and waits itself (full and empty count 32 arrivals), and
// lane i reads the word lane i + 1 wrote: no __syncwarp carries an access to the barrier.
__global__ void mbar_every_lane_case(Report* rep, const int32_t*) {
  Ring& r = setup(32, 32);
  const int lane = threadIdx.x & 31;
  rounds(
      [&](int k, int s) {
        if (!wait(rep, &r.empty[s], parity(k) ^ 1u)) return false;
        r.slot[s][lane] = value(k, lane);
        dev::mbar_arrive(&r.full[s]);
        return true;
      },
      [&](int k, int s) {
        if (!wait(rep, &r.full[s], parity(k))) return false;
        const int i = (lane + 1) % kWords;
        check(rep, k, i, r.slot[s][i], value(k, i));
        dev::mbar_arrive(&r.empty[s]);
        return true;
      });
}

// ---- bulk loads (TMA) -----------------------------------------------------------------------

// Lane 0 of warp 0: every round's bulk load into its slot, completing on full (arrive with the
// expected bytes, then the copy), after empty's wait; at the end, even after a wait gave up,
// it waits (bounded) for the last loads it issued: the block never exits with one in flight.
__device__ void tma_producer(Report* rep, Ring& r, const int32_t* src) {
  constexpr uint32_t bytes = kWords * sizeof(int32_t);
  int k = 0;
  for (; k < kRounds; ++k) {
    const int s = stage(k);
    if (!wait(rep, &r.empty[s], parity(k) ^ 1u)) break;
    dev::mbar_arrive_expect_tx(&r.full[s], bytes);
    dev::bulk_g2s(r.slot[s], src + k * kWords, bytes, &r.full[s]);
  }
  for (int j = k > kStages ? k - kStages : 0; j < k; ++j) {
    const uint64_t start = dev::global_timer_ns();
    while (!dev::mbar_try_wait(&r.full[stage(j)], parity(j)) && dev::global_timer_ns() - start < kWaitNs) {}
  }
}

// Lane 0 of warp 0 loads every slot by TMA; warp 1 reads it as the kernels' reducer warps do
// (read_word_per_lane).
__global__ void tma_syncwarp_readers_case(Report* rep, const int32_t* src) {
  Ring& r = setup(1, 1);
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) tma_producer(rep, r, src);
  if (threadIdx.x >= 32)
    rounds([](int, int) { return false; }, [&](int k, int s) { return read_word_per_lane(rep, r, k, s, lane); });
}

// The same, but every lane of warp 1 waits for full and arrives on empty itself (empty counts
// 32 arrivals): the loaded bytes reach each reader through complete_tx and its own wait alone.
__global__ void tma_every_lane_case(Report* rep, const int32_t* src) {
  Ring& r = setup(1, 32);
  const int lane = threadIdx.x & 31;
  if (threadIdx.x == 0) tma_producer(rep, r, src);
  if (threadIdx.x >= 32)
    rounds([](int, int) { return false; },
           [&](int k, int s) {
             if (!wait(rep, &r.full[s], parity(k))) return false;
             check(rep, k, lane, r.slot[s][lane], value(k, lane));
             dev::mbar_arrive(&r.empty[s]);
             return true;
           });
}

// ---- the cases ------------------------------------------------------------------------------

struct Case {
  const char* name;
  void (*kernel)(Report*, const int32_t*);
  bool ordered;         // by the PTX memory model: racecheck is right to report nothing
  bool control;         // racecheck must get this one right, or the probe tells nothing
  const char* how;      // what orders the accesses (or that nothing does)
  const char* kernels;  // the kernels' site pairs of the same pattern (2026-11-26 logs)
};

const Case kCases[] = {
    {"syncthreads", syncthreads_case, true, true, "__syncthreads between the write and the read", "control"},
    {"racy", racy_case, false, true, "nothing", "control"},
    {"mbar_lane0", mbar_lane0_case, true, false,
     "mbarrier arrive (release) and try_wait (acquire) by the accessing threads themselves",
     "combine.cuh:215/263 out_items, dispatch.cuh:470-471/529,557 table span (never flagged)"},
    {"mbar_syncwarp_writers", mbar_syncwarp_writers_case, true, false,
     "lanes' writes, __syncwarp, lane 0 arrive; the reader's try_wait",
     "dispatch_direct.cuh:124-125/156,158 route table; dispatch.cuh:497/568 expand table"},
    {"mbar_syncwarp_readers", mbar_syncwarp_readers_case, true, false,
     "writer's arrive; each reader lane's try_wait; the lanes' reads, __syncwarp, lane 0 arrive on empty",
     "segments.cuh:163,188/204 a stage's PartItem header"},
    {"mbar_every_lane", mbar_every_lane_case, true, false,
     "every lane arrives and waits itself (32 arrivals per phase), no __syncwarp",
     "none: the two cases above with every lane its own release and acquire"},
    {"tma_syncwarp_readers", tma_syncwarp_readers_case, true, false,
     "bulk load complete_tx; each reader lane's try_wait; the lanes' reads, __syncwarp, lane 0 arrive on empty",
     "primitives.cuh:68 (bulk_g2s)/cuda_bf16.hpp:266, primitives.cuh:195 reducer reads of a stage"},
    {"tma_every_lane", tma_every_lane_case, true, false,
     "bulk load complete_tx; every reader lane waits and arrives on empty itself",
     "none: the case above with every reader lane its own acquire and release"},
};

const Case* find(const char* name) {
  for (const Case& c : kCases)
    if (std::strcmp(c.name, name) == 0) return &c;
  return nullptr;
}

void usage(FILE* to) {
  std::fprintf(to,
               "usage: racecheck_probe --list | all | CASE...\n"
               "  runs each case (one block of two warps, %d rounds through %d slots) and prints one line\n"
               "  per case; exit 0 when every value read was right, 1 otherwise, 3 without a CUDA device.\n"
               "  --list prints, tab-separated: case, ordered|racy, control|probe, what orders it, the\n"
               "  kernels' site pairs of the same pattern.\n",
               kRounds, kStages);
}

// One case: a launch, then its line. False when a value was wrong, a wait gave up or CUDA failed.
bool run(const Case& c, Report* rep, const int32_t* src) {
  cudaMemset(rep, 0, sizeof(Report));
  c.kernel<<<1, kThreads>>>(rep, src);
  cudaError_t err = cudaDeviceSynchronize();
  Report got{};
  if (err == cudaSuccess) err = cudaMemcpy(&got, rep, sizeof(Report), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    std::printf("racecheck_probe: %s: CUDA error %s\n", c.name, cudaGetErrorString(err));
    return false;
  }
  std::printf("racecheck_probe: %s: %s, %d rounds: ", c.name, c.ordered ? "ordered" : "racy", kRounds);
  if (got.gave_up) std::printf("a wait gave up after %.0f s; ", kWaitNs / 1e9);
  if (got.wrong == 0) {
    std::printf("every value read was right\n");
  } else {
    std::printf("%d values wrong (first: round %d word %d read %d, expected %d)\n", got.wrong, got.first_round,
                got.first_word, got.first_value, got.first_want);
  }
  std::fflush(stdout);
  return got.wrong == 0 && got.gave_up == 0;
}

}  // namespace probe

int main(int argc, char** argv) {
  using namespace probe;
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (std::strcmp(argv[1], "--list") == 0) {
    for (const Case& c : kCases)
      std::printf("%s\t%s\t%s\t%s\t%s\n", c.name, c.ordered ? "ordered" : "racy", c.control ? "control" : "probe",
                  c.how, c.kernels);
    return 0;
  }
  const bool all = std::strcmp(argv[1], "all") == 0;
  for (int a = 1; a < argc && !all; ++a)
    if (find(argv[a]) == nullptr) {
      std::fprintf(stderr, "racecheck_probe: unknown case '%s' (--list names them)\n", argv[a]);
      return 2;
    }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "racecheck_probe: no CUDA device\n");
    return 3;
  }
  Report* rep = nullptr;
  int32_t* src = nullptr;
  int32_t host_src[kRounds * kWords];
  for (int k = 0; k < kRounds; ++k)
    for (int i = 0; i < kWords; ++i) host_src[k * kWords + i] = value(k, i);
  if (cudaMalloc(&rep, sizeof(Report)) != cudaSuccess || cudaMalloc(&src, sizeof(host_src)) != cudaSuccess ||
      cudaMemcpy(src, host_src, sizeof(host_src), cudaMemcpyHostToDevice) != cudaSuccess) {
    std::fprintf(stderr, "racecheck_probe: device memory: %s\n", cudaGetErrorString(cudaGetLastError()));
    return 1;
  }
  bool ok = true;
  if (all) {
    for (const Case& c : kCases) ok = run(c, rep, src) && ok;
  } else {
    for (int a = 1; a < argc; ++a) ok = run(*find(argv[a]), rep, src) && ok;
  }
  cudaFree(rep);
  cudaFree(src);
  return ok ? 0 : 1;
}
