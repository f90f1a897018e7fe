// Small kernels with a known critical path, written against the same device layer as the real
// kernels, so that tests/tools/test_timing_model.py can check the timing model's clocks exactly:
//   - handoff_chain: threads 0 and 32 pass the turn n times through two mbarriers;
//   - load_stream: thread 0 bulk-loads n copies of `bytes` into one stage's mbarrier;
//   - store_stream: thread 0 bulk-stores n copies of `bytes`, one group each, then waits;
//   - flag_chain: thread 0 of blocks 0 and 1 pass the turn n times through two global flags;
//   - named_barrier: thread 0 fences n times, all 64 threads meet at a named barrier, then
//     thread 32 fences n times;
//   - plain_pairs: thread 0 converts n bf16 pairs to fp32 and back (2n pairs of plain code);
//   - plain_accesses: thread 0 copies n int4 from global to shared memory through dev::ld /
//     dev::st (each store waits for its load: n global round trips), then loads them back from
//     shared memory, one batch, and ends it with dev::chain() (one shared round trip);
//   - issue_warps: the first `bytes` warps, every lane, widen n bf16 pairs each (dev::bf16x2_to_float2):
//     bound by issue slots, warps w and w + 4 share a scheduler;
//   - spin_beside: warp 0 of block 0 widens n pairs (a __syncwarp every 8), then releases a
//     flag; the warp whose first thread is `bytes` (0: none) polls that flag meanwhile;
//   - diverged_wait: thread 0 fences n times, then arrives on an mbarrier; lane 0 of warp 1 waits
//     for that phase while the warp's other lanes wait at the __syncwarp after it (two paths);
//   - converged_wait: the same, but every lane of warp 1 waits for the phase itself (one path);
//   - requests_then_store: thread 0 stores n words (plain global stores), then bulk-stores `bytes`;
//   - load_and_store: thread 0 bulk-loads n copies of `bytes` and bulk-stores n others, a load
//     then a store (one group each), then waits for both: the engine's two directions.
//   - bounded_vectors: every lane of the first `bytes` warps names n vectors of a bounded loop
//     (dev::PlainCode::kBoundedVector), one plain_code call per vector;
//   - nic_puts: thread 0 of block 0 posts n puts of `bytes` as rank 0 to rank 1 (the first half
//     of global to its second), each with the signal flags[0] := its ordinal + 1, then quiets;
//     thread 0 of block 1 polls flags[0] until n (posted puts only: runtime.h, set_posted_puts).
#include "device/model/timing_selftest.h"

#include <map>
#include <string>
#include <vector>

#include "device/device.cuh"

namespace hybrid_ep::model {
namespace {

constexpr int kGlobalBytes = 64 * 1024;

struct Args {
  unsigned char* global;  // kGlobalBytes, declared to the model
  uint64_t* flags;        // two flags, zero before the launch
  int which;
  int n;
  uint32_t bytes;
};

struct Shared {
  uint64_t bar[2];
};

enum Which {
  kHandoffChain,
  kLoadStream,
  kStoreStream,
  kFlagChain,
  kNamedBarrier,
  kPlainPairs,
  kPlainAccesses,
  kIssueWarps,
  kSpinBeside,
  kDivergedWait,
  kConvergedWait,
  kRequestsThenStore,
  kLoadAndStore,
  kNicPuts,
  kBoundedVectors
};

// n pairs widened by one thread; the sum keeps them.
__device__ float widen_pairs(int n, bool sync_every_8) {
  float sum = 0;
  for (int i = 0; i < n; ++i) {
    const float2 f = dev::bf16x2_to_float2(0x3f803f80u + static_cast<uint32_t>(i));
    sum += f.x + f.y;
    if (sync_every_8 && i % 8 == 7) __syncwarp();
  }
  return sum;
}

__device__ void wait_phase(uint64_t* bar, uint32_t parity) {
  while (!dev::mbar_try_wait(bar, parity)) {}
}

__global__ void timing_kernel(const Args a) {
  Shared& sh = dev::block_shared<Shared>();
  unsigned char* smem = dev::dynamic_smem<unsigned char>();
  const int tid = threadIdx.x;
  if (tid == 0) {
    dev::mbar_init(&sh.bar[0], 1);
    dev::mbar_init(&sh.bar[1], 1);
  }
  __syncthreads();
  switch (a.which) {
    case kHandoffChain:  // hand-off k: even k thread 0 -> thread 32 on bar[0], odd k back on bar[1]
      for (int k = 0; k < a.n; ++k) {
        const bool to_b = k % 2 == 0;
        const uint32_t parity = static_cast<uint32_t>(k / 2) & 1u;
        if (tid == (to_b ? 0 : 32)) dev::mbar_arrive(&sh.bar[to_b ? 0 : 1]);
        if (tid == (to_b ? 32 : 0)) wait_phase(&sh.bar[to_b ? 0 : 1], parity);
      }
      break;
    case kLoadStream:
      if (tid == 0) {
        dev::mbar_arrive_expect_tx(&sh.bar[0], static_cast<uint32_t>(a.n) * a.bytes);
        for (int i = 0; i < a.n; ++i) dev::bulk_g2s(smem + i * a.bytes, a.global + i * a.bytes, a.bytes, &sh.bar[0]);
        wait_phase(&sh.bar[0], 0);
      }
      break;
    case kStoreStream:
      if (tid == 0) {
        for (int i = 0; i < a.n; ++i) {
          dev::bulk_s2g(a.global + i * a.bytes, smem + i * a.bytes, a.bytes);
          dev::bulk_commit();
        }
        dev::bulk_wait_read_all();
        dev::bulk_wait_all();
      }
      break;
    case kFlagChain:  // hand-off k: even k block 0 -> block 1 on flags[0], odd k back on flags[1]
      if (tid == 0 && blockIdx.x < 2)
        for (int k = 0; k < a.n; ++k) {
          const bool to_b = k % 2 == 0;
          const uint64_t value = static_cast<uint64_t>(k / 2) + 1;
          uint64_t* flag = &a.flags[to_b ? 0 : 1];
          if (static_cast<int>(blockIdx.x) == (to_b ? 0 : 1)) dev::st_release_sys(flag, value);
          if (static_cast<int>(blockIdx.x) == (to_b ? 1 : 0))
            while (dev::ld_acquire_sys(flag) < value) {}
        }
      break;
    case kNamedBarrier:
      for (int i = 0; tid == 0 && i < a.n; ++i) __threadfence();
      dev::named_barrier_sync(1, 64);
      for (int i = 0; tid == 32 && i < a.n; ++i) __threadfence();
      break;
    case kPlainPairs:
      if (tid == 0) {
        auto* v = reinterpret_cast<__nv_bfloat162*>(a.global);
        for (int i = 0; i < a.n; ++i) {
          const float2 f = __bfloat1622float2(v[i]);
          v[i] = __float22bfloat162_rn(make_float2(f.x * 2.0f, f.y));
        }
      }
      break;
    case kPlainAccesses:
      if (tid == 0) {
        const auto* from = reinterpret_cast<const int4*>(a.global);
        auto* to = reinterpret_cast<int4*>(smem);
        for (int i = 0; i < a.n; ++i) dev::st(to + i, dev::ld(from + i));
        int sum = 0;
        for (int i = 0; i < a.n; ++i) sum += dev::ld(to + i).x;
        dev::chain();
        if (sum == 0x7fffffff) a.flags[0] = 1;  // keeps the loads
      }
      break;
    case kIssueWarps:
      if (tid < static_cast<int>(a.bytes) * 32 && widen_pairs(a.n, false) == -1.0f) a.flags[1] = 1;
      break;
    case kSpinBeside: {
      const int global_tid = static_cast<int>(blockIdx.x * blockDim.x) + tid;
      if (blockIdx.x == 0 && tid < 32) {
        if (widen_pairs(a.n, true) == -1.0f) a.flags[1] = 1;
        __syncwarp();
        if (tid == 0) dev::st_release_sys(&a.flags[0], 1);
      } else if (a.bytes != 0 && global_tid / 32 == static_cast<int>(a.bytes) / 32) {
        while (dev::ld_acquire_sys(&a.flags[0]) == 0) {}
      }
      break;
    }
    case kDivergedWait:
      if (tid == 0) {
        for (int i = 0; i < a.n; ++i) __threadfence();
        dev::mbar_arrive(&sh.bar[0]);
      }
      if (tid >= 32 && tid < 64) {
        if (tid == 32) wait_phase(&sh.bar[0], 0);
        __syncwarp();
      }
      break;
    case kConvergedWait:
      if (tid == 0) {
        for (int i = 0; i < a.n; ++i) __threadfence();
        dev::mbar_arrive(&sh.bar[0]);
      }
      if (tid >= 32 && tid < 64) {
        wait_phase(&sh.bar[0], 0);
        __syncwarp();
      }
      break;
    case kRequestsThenStore:  // n plain global stores (write requests of one lane), then a bulk store
      if (tid == 0) {
        auto* words = reinterpret_cast<int*>(a.global);
        for (int i = 0; i < a.n; ++i) dev::st(words + i, i);
        dev::bulk_s2g(a.global + kGlobalBytes / 2, smem, a.bytes);
        dev::bulk_commit();
        dev::bulk_wait_all();
      }
      break;
    case kLoadAndStore:  // loads into the first half of the stages, stores from the second
      if (tid == 0) {
        dev::mbar_arrive_expect_tx(&sh.bar[0], static_cast<uint32_t>(a.n) * a.bytes);
        for (int i = 0; i < a.n; ++i) {
          dev::bulk_g2s(smem + i * a.bytes, a.global + i * a.bytes, a.bytes, &sh.bar[0]);
          dev::bulk_s2g(a.global + kGlobalBytes / 2 + i * a.bytes, smem + (a.n + i) * a.bytes, a.bytes);
          dev::bulk_commit();
        }
        wait_phase(&sh.bar[0], 0);
        dev::bulk_wait_all();
      }
      break;
    case kBoundedVectors:
      if (tid < static_cast<int>(a.bytes) * 32)
        for (int i = 0; i < a.n; ++i) dev::plain_code(dev::PlainRun{dev::PlainCode::kBoundedVector, 1});
      break;
    case kNicPuts:
      if (!dev::remote_deferred() || tid != 0) break;  // run_timing_selftest refuses it without posted puts
      if (blockIdx.x == 0) {
        for (int i = 0; i < a.n; ++i)
          dev::remote_put(0, 1, a.global + kGlobalBytes / 2 + i * a.bytes, a.global + i * a.bytes, a.bytes, &a.flags[0],
                          static_cast<uint64_t>(i) + 1);
        dev::remote_quiet();
      } else if (blockIdx.x == 1) {
        while (dev::ld_acquire_sys(&a.flags[0]) < static_cast<uint64_t>(a.n)) {}
      }
      break;
    default: break;
  }
}

const std::map<std::string, int>& names() {
  static const std::map<std::string, int> n = {
      {"handoff_chain", kHandoffChain},     {"load_stream", kLoadStream},
      {"store_stream", kStoreStream},       {"flag_chain", kFlagChain},
      {"named_barrier", kNamedBarrier},     {"plain_pairs", kPlainPairs},
      {"plain_accesses", kPlainAccesses},   {"issue_warps", kIssueWarps},
      {"spin_beside", kSpinBeside},         {"diverged_wait", kDivergedWait},
      {"converged_wait", kConvergedWait},   {"requests_then_store", kRequestsThenStore},
      {"load_and_store", kLoadAndStore},    {"nic_puts", kNicPuts},
      {"bounded_vectors", kBoundedVectors},
  };
  return n;
}

}  // namespace

std::vector<std::string> timing_selftest_names() {
  std::vector<std::string> out;
  for (const auto& [name, _] : names()) out.push_back(name);
  return out;
}

std::string run_timing_selftest(const std::string& name, int blocks, int n, uint32_t bytes, int threads) {
  auto it = names().find(name);
  if (it == names().end()) return "no such timing self-test: " + name;
  // bytes is no size there
  const bool counts = it->second == kIssueWarps || it->second == kSpinBeside || it->second == kBoundedVectors;
  // load_and_store: loads and stores, half each; nic_puts: sources and destinations
  const uint64_t copies = it->second == kLoadAndStore || it->second == kNicPuts ? 2 : 1;
  if (it->second == kNicPuts && !posted_puts()) return "nic_puts needs posted puts (set_posted_puts)";
  if (n < 0 || (!counts && copies * n * bytes > kGlobalBytes))
    return "n x bytes must be within " + std::to_string(kGlobalBytes / copies);
  if (threads < 64 || threads > 1024 || threads % 32 != 0) return "threads must be a multiple of 32 in [64, 1024]";
  alignas(128) static unsigned char global[kGlobalBytes];  // whole 128-byte lines (L2 classes)
  alignas(8) static uint64_t flags[2];
  flags[0] = flags[1] = 0;
  add_allocation(reinterpret_cast<uint64_t>(global), sizeof(global));
  add_allocation(reinterpret_cast<uint64_t>(flags), sizeof(flags));  // a signal word of nic_puts
  Args args{global, flags, it->second, n, bytes};
  const size_t smem = counts ? 16 : std::max<size_t>(copies * n * bytes, 16);
  const char* err = dev::launch_cooperative(timing_kernel, blocks, threads, smem, 0, args);
  remove_allocation(reinterpret_cast<uint64_t>(global));
  remove_allocation(reinterpret_cast<uint64_t>(flags));
  return err == nullptr ? "" : err;
}

}  // namespace hybrid_ep::model
