// Small kernels that break one rule of the device layer each, so the tests can show that the
// CPU model catches every class of defect it claims to (tests/model/test_device_model.py). They
// are written against the same device layer as the real kernels and run only on the model.
#include "device/model/selftest.h"

#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "device/device.cuh"
#include "device/model/fiber.h"

namespace hybrid_ep::model {
namespace {

struct Args {
  unsigned char* global;  // 1 KiB, declared to the model
  unsigned char* undeclared;
  int* out;  // results the test reads
  int which;
};

struct Shared {
  uint64_t bar[2];
  volatile int flag;
};

enum Which {
  kClean,
  kMisalignedBulk,
  kBulkSize,
  kBulkPastSmem,
  kBulkOutsideGlobal,
  kTxTooMany,
  kTxTooFew,
  kDoubleWait,
  kMissingWait,
  kExitWithLoadInFlight,
  kSyncwarpLaneExits,
  kShflTwoSites,
  kSyncthreadsAfterExit,
  kSyncthreadsTwoSites,
  kSmemOverflow,
  kDeadlock,
  kTimeout,
  kStackOverflow,
  kSharedWithoutBarrier,
  kTornRow,
  kRelaxedPollUnfenced,
  kAcquireWithoutProxyFence,
  kStaticPlusDynamicSmem,
  kAssumeSharedGlobal,
  kNamedBarrierParticipantExits,
  kNamedBarrierCountMismatch,
};

// Static shared memory that, with the launch's dynamic size for kStaticPlusDynamicSmem, is over
// the block's limit (kSmemPerBlockOptin).
struct BigShared {
  unsigned char bytes[4096];
};
constexpr size_t kNearLimitSmem = kSmemPerBlockOptin - 2048;

// Deep enough to run past a fiber's stack (64 KiB, kStackScale times that under ASan).
__device__ int deep(int n) {
  volatile char frame[4096];
  frame[0] = static_cast<char>(n);
  return n == 0 ? frame[0] : deep(n - 1) + frame[0];
}

__device__ bool wait_bounded(uint64_t* bar, uint32_t parity) {
  const uint64_t start = dev::global_timer_ns();
  while (!dev::mbar_try_wait(bar, parity))
    if (dev::global_timer_ns() - start > 1'000'000'000ull) return false;
  return true;
}

__global__ void selftest_kernel(const Args args) {
  Shared& sh = dev::block_shared<Shared>();
  unsigned char* smem = dev::dynamic_smem<unsigned char>();
  const int tid = threadIdx.x, lane = tid & 31;
  if (tid == 0) {
    dev::mbar_init(&sh.bar[0], 1);
    dev::mbar_init(&sh.bar[1], 1);
    sh.flag = 0;
  }
  __syncthreads();
  switch (args.which) {
    case kClean:
      if (tid == 0) {
        dev::mbar_arrive_expect_tx(&sh.bar[0], 64);
        dev::bulk_g2s(smem, args.global, 64, &sh.bar[0]);
        if (wait_bounded(&sh.bar[0], 0)) args.out[0] = smem[63];
        dev::bulk_s2g(args.global + 64, smem, 64);
        dev::bulk_commit();
        dev::bulk_wait_all();
      }
      break;
    case kMisalignedBulk:
      if (tid == 0) {
        dev::mbar_arrive_expect_tx(&sh.bar[0], 64);
        dev::bulk_g2s(smem, args.global + 8, 64, &sh.bar[0]);
      }
      break;
    case kBulkSize:
      if (tid == 0) {
        dev::mbar_arrive_expect_tx(&sh.bar[0], 24);
        dev::bulk_g2s(smem, args.global, 24, &sh.bar[0]);
      }
      break;
    case kBulkPastSmem:  // the launch has 256 bytes of dynamic shared memory
      if (tid == 0) {
        dev::mbar_arrive_expect_tx(&sh.bar[0], 64);
        dev::bulk_g2s(smem + 224, args.global, 64, &sh.bar[0]);
      }
      break;
    case kBulkOutsideGlobal:
      if (tid == 0) dev::bulk_s2g(args.undeclared, smem, 64);
      break;
    case kTxTooMany:
      if (tid == 0) {
        dev::mbar_arrive_expect_tx(&sh.bar[0], 32);
        dev::bulk_g2s(smem, args.global, 64, &sh.bar[0]);
        wait_bounded(&sh.bar[0], 0);
      }
      break;
    case kTxTooFew:
      if (tid == 0) {
        dev::mbar_arrive_expect_tx(&sh.bar[0], 64);
        dev::bulk_g2s(smem, args.global, 32, &sh.bar[0]);
        args.out[0] = wait_bounded(&sh.bar[0], 0);
      }
      break;
    case kDoubleWait:
      if (tid == 0) {
        dev::mbar_arrive(&sh.bar[0]);
        wait_bounded(&sh.bar[0], 0);
        wait_bounded(&sh.bar[0], 0);  // the same phase again: proves nothing
      }
      break;
    case kMissingWait:  // the data is read before its load completed: garbage, not a model error
      if (tid == 0) {
        dev::mbar_arrive_expect_tx(&sh.bar[0], 64);
        dev::bulk_g2s(smem, args.global, 64, &sh.bar[0]);
        args.out[0] = smem[0];
        wait_bounded(&sh.bar[0], 0);
      }
      break;
    case kExitWithLoadInFlight:
      if (tid == 0) {
        dev::mbar_arrive_expect_tx(&sh.bar[0], 64);
        dev::bulk_g2s(smem, args.global, 64, &sh.bar[0]);
      }
      break;
    case kSyncwarpLaneExits:
      if (tid < 32 && lane != 5) __syncwarp();
      break;
    case kShflTwoSites:
      if (tid < 32) {
        if (lane < 16) args.out[lane] = __shfl_sync(0xffffffffu, lane, 0);
        else args.out[lane] = __shfl_sync(0xffffffffu, lane, 1);
      }
      break;
    case kSyncthreadsAfterExit:
      if (tid == 7) return;
      __syncthreads();
      break;
    case kSyncthreadsTwoSites:
      if (tid < 64) __syncthreads();
      else __syncthreads();
      break;
    case kSmemOverflow:
      if (tid == 0) smem[256] = 1;  // one past the launch's 256 bytes
      break;
    case kDeadlock:
      if (tid < 32 && lane != 0) __syncwarp();  // waits for lane 0, which waits at the block barrier
      __syncthreads();
      break;
    case kTimeout:  // a flag nobody sets: the kernel's own bounded wait gives up on virtual time
      if (tid == 0) {
        const uint64_t start = dev::global_timer_ns();
        while (dev::ld_volatile(const_cast<const int*>(reinterpret_cast<volatile int*>(&sh.flag))) == 0)
          if (dev::global_timer_ns() - start > 5'000'000'000ull) {
            args.out[0] = -1;  // the bounded wait gave up after 5 s of virtual time
            break;
          }
      }
      break;
    case kStackOverflow:
      if (tid == 0) args.out[0] = deep(20 * static_cast<int>(model::kStackScale));
      __syncthreads();  // thread 0 gives way here: its stack is checked
      break;
    case kSharedWithoutBarrier:  // thread 32 reads what thread 0 (another warp) writes, with no
      // barrier between: a data race that only the race check reports (docs/dev/cpu_model.md)
      if (tid == 0) smem[0] = 1;             // both run in the round after the barrier above, in the
      if (tid == 32) args.out[0] = smem[0];  // round's seeded order
      break;
    case kTornRow:  // a reader that polls the row's first word instead of waiting for the load:
      // with torn copies (the default) the row's end may not have landed yet
      if (tid == 0) {
        std::memset(smem, 0xAB, 256);
        dev::mbar_arrive_expect_tx(&sh.bar[0], 256);
        dev::bulk_g2s(smem, args.global, 256, &sh.bar[0]);
        while (dev::ld_volatile(reinterpret_cast<const int*>(smem)) == static_cast<int>(0xABABABABu)) {}
        args.out[0] = smem[255];
        wait_bounded(&sh.bar[0], 0);
      }
      break;
    case kRelaxedPollUnfenced:  // a relaxed poll, then a bulk load of what the flag guards, no fence
      if (tid == 0) {
        (void)dev::ld_relaxed_sys(reinterpret_cast<const uint64_t*>(args.global + 512));
        dev::mbar_arrive_expect_tx(&sh.bar[0], 64);
        dev::bulk_g2s(smem, args.global, 64, &sh.bar[0]);
        wait_bounded(&sh.bar[0], 0);
      }
      break;
    case kAcquireWithoutProxyFence:  // an acquire of a registered word, then a bulk load, no proxy fence
      if (tid == 0) {
        (void)dev::ld_acquire_sys(reinterpret_cast<const uint64_t*>(args.global + 512));
        dev::mbar_arrive_expect_tx(&sh.bar[0], 64);
        dev::bulk_g2s(smem, args.global, 64, &sh.bar[0]);
        wait_bounded(&sh.bar[0], 0);
      }
      break;
    case kStaticPlusDynamicSmem:
      if (tid == 0) dev::block_shared<BigShared>().bytes[0] = 1;
      break;
    case kAssumeSharedGlobal:  // a global pointer said to be shared: the GPU would load it as shared
      dev::assume_shared(smem);
      if (tid == 0) dev::assume_shared(args.global);
      break;
    case kNamedBarrierParticipantExits:              // warp 1 leaves before the named barrier of warps 0-1: warp 0
      if (tid < 32) dev::named_barrier_sync(1, 64);  // waits forever (on a GPU: a hang)
      break;
    case kNamedBarrierCountMismatch:  // warps 0 and 1 meet at barrier 1 but name different counts
      if (tid < 64) dev::named_barrier_sync(1, tid < 32 ? 64 : 96);
      break;
    default: break;
  }
}

const std::map<std::string, int>& names() {
  static const std::map<std::string, int> n = {
      {"clean", kClean},
      {"misaligned_bulk", kMisalignedBulk},
      {"bulk_size", kBulkSize},
      {"bulk_past_smem", kBulkPastSmem},
      {"bulk_outside_global", kBulkOutsideGlobal},
      {"tx_too_many", kTxTooMany},
      {"tx_too_few", kTxTooFew},
      {"double_wait", kDoubleWait},
      {"missing_wait", kMissingWait},
      {"exit_with_load_in_flight", kExitWithLoadInFlight},
      {"syncwarp_lane_exits", kSyncwarpLaneExits},
      {"shfl_two_sites", kShflTwoSites},
      {"syncthreads_after_exit", kSyncthreadsAfterExit},
      {"syncthreads_two_sites", kSyncthreadsTwoSites},
      {"smem_overflow", kSmemOverflow},
      {"deadlock", kDeadlock},
      {"timeout", kTimeout},
      {"stack_overflow", kStackOverflow},
      {"shared_without_barrier", kSharedWithoutBarrier},
      {"torn_row", kTornRow},
      {"relaxed_poll_unfenced", kRelaxedPollUnfenced},
      {"acquire_without_proxy_fence", kAcquireWithoutProxyFence},
      {"static_plus_dynamic_smem", kStaticPlusDynamicSmem},
      {"assume_shared_global", kAssumeSharedGlobal},
      {"named_barrier_participant_exits", kNamedBarrierParticipantExits},
      {"named_barrier_count_mismatch", kNamedBarrierCountMismatch},
  };
  return n;
}

}  // namespace

std::vector<std::string> selftest_names() {
  std::vector<std::string> out;
  for (const auto& [name, _] : names()) out.push_back(name);
  return out;
}

SelftestResult run_selftest(const std::string& name) {
  auto it = names().find(name);
  if (it == names().end()) return {"no such self-test: " + name, {}};
  alignas(16) static unsigned char global[1024];
  alignas(16) static unsigned char undeclared[256];
  for (int i = 0; i < 1024; ++i) global[i] = static_cast<unsigned char>(i * 7 + 3);
  std::vector<int> out(32, 0);
  add_allocation(reinterpret_cast<uint64_t>(global), sizeof(global));
  Args args{global, undeclared, out.data(), it->second};
  const size_t smem = it->second == kStaticPlusDynamicSmem ? kNearLimitSmem : 256;
  const char* err = dev::launch_cooperative(selftest_kernel, 1, 128, smem, 0, args);
  remove_allocation(reinterpret_cast<uint64_t>(global));
  return {err == nullptr ? "" : err, out};
}

}  // namespace hybrid_ep::model
