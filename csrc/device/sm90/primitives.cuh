// The device primitives on sm_90 / sm_100: thin PTX wrappers (mbarriers, bulk copies between
// global and shared memory, proxy fences, system-scope acquire / release), the global timer,
// per-block shared storage, and the cheaper waits (suspend-hint try_wait, relaxed poll + one
// fence, elected lane, named barrier, back-off). csrc/device/model/ implements the same names
// on the CPU.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "device/plain_code.h"

namespace hybrid_ep::dev {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// ---- shared storage of a block ---------------------------------------------------------

// One struct of a kernel's static shared variables. Each kernel names its own type, so two
// call sites never alias.
template <typename T>
__device__ __forceinline__ T& block_shared() {
  __shared__ __align__(16) unsigned char storage[sizeof(T)];
  return *reinterpret_cast<T*>(storage);
}

// The launch's dynamic shared memory (its size is the launcher's smem argument).
template <typename T>
__device__ __forceinline__ T* dynamic_smem() {
  extern __shared__ __align__(128) unsigned char hybrid_ep_dynamic_smem[];
  return reinterpret_cast<T*>(hybrid_ep_dynamic_smem);
}

// ---- mbarrier -------------------------------------------------------------------------

__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }

__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)), "r"(bytes) : "memory");
}

__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)) : "memory");
}

// One bounded probe of the barrier's phase; true when the phase with this parity completed.
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done;
  asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(done)
               : "r"(smem_addr(bar)), "r"(parity)
               : "memory");
  return done != 0;
}

// ---- bulk copies (TMA, non-tensor) ----------------------------------------------------

// global -> shared, completion counted in bytes on the mbarrier.
__device__ __forceinline__ void bulk_g2s(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   smem_addr(smem_dst)),
               "l"(gmem_src), "r"(bytes), "r"(smem_addr(bar))
               : "memory");
}

// shared -> global (local or a peer's memory mapped into this address space).
__device__ __forceinline__ void bulk_s2g(void* gmem_dst, const void* smem_src, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(gmem_dst), "r"(smem_addr(smem_src)),
               "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }

// Shared memory of all committed groups but the newest N has been read (their stages may be
// refilled).
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_read_all() { bulk_wait_read<0>(); }

// All committed groups but the newest N have completed their writes.
template <int N>
__device__ __forceinline__ void bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;" ::"n"(N) : "memory");
}
__device__ __forceinline__ void bulk_wait_all() { bulk_wait<0>(); }

// Orders this thread's generic-proxy accesses (a flag acquire, plain stores) with its later
// async-proxy (bulk copy) accesses, and the bulk writes it waited for with its later release.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async;" ::: "memory"); }

// ---- system-scope flags ---------------------------------------------------------------

__device__ __forceinline__ uint64_t ld_acquire_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void st_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void red_add_release_sys(uint64_t* p, uint64_t v) {
  asm volatile("red.release.sys.global.add.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// A shared-memory flag that several threads of a block raise and poll (the abort flag): morally
// strong relaxed accesses (volatile: never cached in a register nor merged), publishing nothing.
__device__ __forceinline__ int ld_relaxed(const volatile int* p) { return *p; }
__device__ __forceinline__ void st_relaxed(volatile int* p, int v) { *p = v; }

__device__ __forceinline__ int ld_volatile(const int* p) {
  int v;
  asm volatile("ld.volatile.global.s32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
  return v;
}

// 16 bytes written by a peer in this call: bypass L1 so an earlier call's value is never seen.
__device__ __forceinline__ int4 ld_volatile_v4(const void* p) {
  int4 v;
  asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// ---- cheaper waits and group agreement (measured by csrc/microbench/ before the kernels
// adopt them) ----------------------------------------------------------------------------

// try_wait that may suspend the thread until the phase completes or about `suspend_ns` pass
// (the hardware may cap the hint), instead of returning at once: a waiter that sleeps takes no
// issue slots from the warps doing the work.
__device__ __forceinline__ bool mbar_try_wait_hint(uint64_t* bar, uint32_t parity, uint32_t suspend_ns) {
  uint32_t done;
  asm volatile(
      "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2, %3;\n selp.u32 %0, 1, 0, p;\n}"
      : "=r"(done)
      : "r"(smem_addr(bar)), "r"(parity), "r"(suspend_ns)
      : "memory");
  return done != 0;
}

// A poll that orders nothing (no L1 invalidate per poll, unlike ld_acquire_sys); once the
// value is seen, one fence_acq_rel_sys() gives the acquire.
__device__ __forceinline__ uint64_t ld_relaxed_sys(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

__device__ __forceinline__ void fence_acq_rel_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// True in one lane of `mask` (the same lane for the same mask); every lane of the mask calls it.
__device__ __forceinline__ bool elect_one(uint32_t mask = 0xffffffffu) {
  uint32_t elected;
  asm volatile("{\n .reg .pred p;\n .reg .b32 leader;\n elect.sync leader|p, %1;\n selp.u32 %0, 1, 0, p;\n}"
               : "=r"(elected)
               : "r"(mask)
               : "memory");
  return elected != 0;
}

// Named barrier `id` (1-15; 0 is __syncthreads') among `threads` threads, a multiple of 32:
// every thread of each participating warp calls it.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Back-off between polls.
__device__ __forceinline__ void sleep_ns(uint32_t ns) { __nanosleep(ns); }

// A test hook of the CPU model (model/runtime.h, hold_at): nothing on a GPU.
__device__ __forceinline__ void hold_point(int /*key*/) {}

// The CPU model's queued remote operations (model/runtime.h, remote_put): never on a GPU, where
// the loopback transport stores at once.
__device__ __forceinline__ constexpr bool remote_deferred() { return false; }
__device__ __forceinline__ void remote_put(int, int, void*, const void*, uint64_t, uint64_t*, uint64_t) {}
__device__ __forceinline__ void remote_fence() {}
__device__ __forceinline__ void remote_quiet() {}

// ---- plain accesses of the hot loops ----------------------------------------------------------
// That p points into the block's shared memory: where a pointer reaches a loop through a struct
// the compiler keeps in local memory, it no longer knows the address space and loads through
// the generic path (LD.E, not LDS); said here, it does. The CPU model checks it.
__device__ __forceinline__ void assume_shared(const void* p) { __builtin_assume(__isShared(p)); }
// ld / st are the plain load and store they wrap (the compiler sees the same access, so the
// code generated is the one of `*p` and `*p = v`); chain() is nothing. On the CPU model
// (device/model/primitives.h) they tell the timing model what plain code the loops run: each
// access is counted by memory class (shared or global) with its bytes, and chain() says that
// the loads after it depend on those before it (an address or a branch read from them).
template <typename T>
__device__ __forceinline__ T ld(const T* p) {
  return *p;
}
template <typename T>
__device__ __forceinline__ void st(T* p, const T& v) {
  *p = v;
}
__device__ __forceinline__ void chain() {}
// Plain code the model cannot see through the accessors (a loop of compares, integer division,
// ballots and their bookkeeping): the kernel names the blocks that ran and how many times
// (device/plain_code.h), the same for every lane of the warp (the warp issues them once); their
// instruction counts are the timing model's. Nothing on the GPU; on the CPU model the timing
// model issues them on the warp's scheduler.
template <typename... Runs>
__device__ __forceinline__ void plain_code(const Runs&... /*runs*/) {}
// The same with the count of warp instructions written out: kept for the kernels of the commits
// measured before the counts moved to the timing model, which its calibration builds
// (tools/timing/builds.py) compile against this device layer, and for its accessor patches.
__device__ __forceinline__ void plain_instructions(int /*warp_instructions*/) {}

// A bf16 pair held as its 32 bits (element 0 in the low half) widened to fp32: a bf16 is the top
// half of an fp32, so a shift and a mask, exact as __bfloat1622float2 is (which converts each
// half with a cvt, 3 instructions a pair). The model counts it as a pair of plain code.
__device__ __forceinline__ float2 bf16x2_to_float2(uint32_t bits) {
  return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
}

}  // namespace hybrid_ep::dev
