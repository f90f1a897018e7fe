// The device primitives of csrc/device/sm90/primitives.cuh, on the CPU model: the same
// names and signatures, implemented by the model's scheduler (runtime.h), which checks each
// use. Fences order nothing here: the model runs one fiber at a time and does not model the
// memory ordering they provide (docs/dev/cpu_model.md lists what the model cannot show); only
// the timing model counts their cost. The flags' release stores are the compiler's atomics,
// which the race check (happens_before.h) pairs with the polls' acquires; the timing model
// is told of each (note_flag_write), so a poll that reads it waits for its writer's time.
#pragma once
#include <cstdint>

#include "device/model/builtins.h"
#include "device/model/runtime.h"

namespace hybrid_ep::dev {

#define HYBRID_EP_SITE const char *file = __builtin_FILE(), int line = __builtin_LINE()

template <typename T>
inline T& block_shared() {
  static const char tag = 0;  // one per T: the block's slot of this type
  return *static_cast<T*>(model::block_shared(&tag, sizeof(T), alignof(T)));
}

template <typename T>
inline T* dynamic_smem() {
  return static_cast<T*>(model::dynamic_smem());
}

inline void mbar_init(uint64_t* bar, uint32_t count, HYBRID_EP_SITE) { model::mbar_init(bar, count, {file, line}); }
inline void mbar_fence_init() {}
inline void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes, HYBRID_EP_SITE) {
  model::mbar_arrive(bar, bytes, {file, line});
}
inline void mbar_arrive(uint64_t* bar, HYBRID_EP_SITE) { model::mbar_arrive(bar, 0, {file, line}); }
inline bool mbar_try_wait(uint64_t* bar, uint32_t parity, HYBRID_EP_SITE) {
  return model::mbar_try_wait(bar, parity, {file, line});
}

inline void bulk_g2s(void* smem_dst, const void* gmem_src, uint32_t bytes, uint64_t* bar, HYBRID_EP_SITE) {
  model::bulk_g2s(smem_dst, gmem_src, bytes, bar, {file, line});
}
inline void bulk_s2g(void* gmem_dst, const void* smem_src, uint32_t bytes, HYBRID_EP_SITE) {
  model::bulk_s2g(gmem_dst, smem_src, bytes, {file, line});
}
inline void bulk_commit(HYBRID_EP_SITE) { model::bulk_commit({file, line}); }
template <int N>
inline void bulk_wait_read(HYBRID_EP_SITE) {
  model::bulk_wait(true, N, {file, line});
}
inline void bulk_wait_read_all(HYBRID_EP_SITE) { model::bulk_wait(true, 0, {file, line}); }
template <int N>
inline void bulk_wait(HYBRID_EP_SITE) {
  model::bulk_wait(false, N, {file, line});
}
inline void bulk_wait_all(HYBRID_EP_SITE) { model::bulk_wait(false, 0, {file, line}); }
inline void fence_proxy_async(HYBRID_EP_SITE) { model::fence_proxy({file, line}); }

inline uint64_t ld_acquire_sys(const uint64_t* p, HYBRID_EP_SITE) { return model::poll(p, 8, {file, line}); }
inline void st_release_sys(uint64_t* p, uint64_t v, HYBRID_EP_SITE) {
  __atomic_store_n(p, v, __ATOMIC_RELEASE);
  model::note_flag_write(p, {file, line});
}
inline void red_add_release_sys(uint64_t* p, uint64_t v, HYBRID_EP_SITE) {
  __atomic_fetch_add(p, v, __ATOMIC_RELEASE);
  model::note_flag_write(p, {file, line});
}
inline int ld_relaxed(const volatile int* p) { return __atomic_load_n(const_cast<const int*>(p), __ATOMIC_RELAXED); }
inline void st_relaxed(volatile int* p, int v, HYBRID_EP_SITE) {
  __atomic_store_n(const_cast<int*>(p), v, __ATOMIC_RELAXED);
  model::note_flag_write(p, {file, line});
}
inline int ld_volatile(const int* p, HYBRID_EP_SITE) {
  return static_cast<int>(model::poll(p, 4, {file, line}, model::PollKind::kVolatile));
}
inline int4 ld_volatile_v4(const void* p) {
  const auto* v = static_cast<const volatile int*>(p);
  return make_int4(v[0], v[1], v[2], v[3]);
}
inline uint64_t global_timer_ns() { return model::timer_ns(); }

#undef HYBRID_EP_SITE

}  // namespace hybrid_ep::dev

// ---- the cheaper waits of sm90/primitives.cuh (suspend-hint try_wait, relaxed poll + one
// fence, elected lane, named barrier, back-off) -------------------------------------------
namespace hybrid_ep::dev {

// The model's try_wait never suspends: with a hint it is the same probe.
inline bool mbar_try_wait_hint(uint64_t* bar, uint32_t parity, uint32_t /*suspend_ns*/,
                               const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return model::mbar_try_wait(bar, parity, {file, line});
}
// A poll that orders nothing: the thread's next fence acquires what it read (the race check's
// edge), and a bulk copy or remote put the thread issues before that fence is an error
// (runtime.h, fence_acquire).
inline uint64_t ld_relaxed_sys(const uint64_t* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  return model::poll(p, 8, {file, line}, model::PollKind::kRelaxed);
}
inline void fence_acq_rel_sys(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  model::fence_acquire(model::Fence::kSystem, {file, line});
}

// A warp collective over `mask`; the lowest lane is the one elected.
inline bool elect_one(uint32_t mask = 0xffffffffu, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  const uint64_t lanes = model::collective(model::Collective::kBallot, mask, 1, 0, {file, line});
  return (threadIdx.x & 31u) == static_cast<unsigned>(__builtin_ctzll(lanes));
}

// Counted per thread (every thread of the participating warps calls it, as on the GPU). The
// counts live in the block's static shared memory, set up by the first caller of the launch;
// each arrival releases and the waiters acquire through the generation word (the race check's
// happens-before edges).
inline void named_barrier_sync(uint32_t id, uint32_t threads, const char* file = __builtin_FILE(),
                               int line = __builtin_LINE()) {
  struct NamedBarriers {
    uint64_t launch;  // which launch set the counts up (the model fills fresh shared memory with 0xCD)
    uint32_t arrived[16];
    uint32_t generation[16];
    uint32_t stamp[16][2];  // the timing model's word of a generation's arrivals, by its parity
    uint32_t threads[16];   // the count the generation's first arrival named
  };
  NamedBarriers& b = block_shared<NamedBarriers>();
  const uint64_t launch = 0x6e616d6564626172ull ^ model::launch_serial();
  if (__atomic_load_n(&b.launch, __ATOMIC_RELAXED) != launch) {
    for (int i = 0; i < 16; ++i) {
      __atomic_store_n(&b.arrived[i], 0u, __ATOMIC_RELAXED);
      __atomic_store_n(&b.generation[i], 0u, __ATOMIC_RELAXED);
    }
    __atomic_store_n(&b.launch, launch, __ATOMIC_RELAXED);
  }
  id &= 15u;
  const uint32_t generation = __atomic_load_n(&b.generation[id], __ATOMIC_RELAXED);
  // The timing model: each arrival stamps its generation's word, so every thread runs on after
  // the latest arrival of its generation, whichever the schedule brought last, plus the
  // barrier's cost (barrier_ns: micro M1's bar.sync among 4 warps). A word per
  // parity: a thread that passed may arrive at the next generation before a waiter of this one
  // sees it pass, and that arrival is not this generation's; none arrives at the one after
  // before every waiter of this one went on.
  const uint32_t* stamp = &b.stamp[id][generation & 1u];
  model::note_flag_write(stamp, {file, line});
  if (__atomic_load_n(&b.arrived[id], __ATOMIC_RELAXED) == 0) {
    __atomic_store_n(&b.threads[id], threads, __ATOMIC_RELAXED);
  } else if (__atomic_load_n(&b.threads[id], __ATOMIC_RELAXED) != threads) {
    model::named_barrier_mismatch(id, __atomic_load_n(&b.threads[id], __ATOMIC_RELAXED), threads, {file, line});
  }
  const uint32_t arrived = __atomic_add_fetch(&b.arrived[id], 1u, __ATOMIC_ACQ_REL);
  if (arrived == threads) {
    __atomic_store_n(&b.arrived[id], 0u, __ATOMIC_RELAXED);
    __atomic_store_n(&b.generation[id], generation + 1u, __ATOMIC_RELEASE);
    model::note_named_barrier(stamp, {file, line});
    return;
  }
  const uint64_t since = model::timer_ns();
  while (static_cast<uint32_t>(model::poll(&b.generation[id], 4, {file, line})) == generation)
    if (model::timer_ns() - since > model::kNamedBarrierBoundNs)
      model::named_barrier_stuck(id, __atomic_load_n(&b.arrived[id], __ATOMIC_RELAXED), threads, {file, line});
  model::note_named_barrier(stamp, {file, line});
}

inline void sleep_ns(uint32_t) {}  // polls give way to the other threads anyway

// The loopback transport on the model (transport/loopback.cuh): puts and signals queued and
// delivered late, out of order (runtime.h, remote_put), while the weakening is on; posted, as a
// NIC's, while the timing model prices a cluster (runtime.h, set_posted_puts).
inline bool remote_deferred() { return model::remote_deferred(); }
inline void remote_put(int src_rank, int dst_rank, void* dst, const void* src, uint64_t bytes, uint64_t* sig,
                       uint64_t value, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  model::remote_put(src_rank, dst_rank, dst, src, bytes, sig, value, {file, line});
}
// The same without the putting rank, as the kernels of older commits call it (the timing
// model's calibration builds, tools/timing/builds.py): their posted puts share one NIC.
inline void remote_put(int dst_rank, void* dst, const void* src, uint64_t bytes, uint64_t* sig, uint64_t value,
                       const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  model::remote_put(-1, dst_rank, dst, src, bytes, sig, value, {file, line});
}
inline void remote_fence(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  model::remote_fence({file, line});
}
inline void remote_quiet(const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  model::remote_quiet({file, line});
}

// A point where a test may hold the calling thread, as a stalled warp (runtime.h, hold_at).
inline void hold_point(int key, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  model::hold_point(key, {file, line});
}

// ---- plain accesses of the hot loops (sm90/primitives.cuh) -------------------------------------
// What the GPU's compiler is told (that p points into the block's shared memory), checked.
inline void assume_shared(const void* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
  model::check_shared(p, {file, line});
}
// The same plain access as on the GPU (the race check sees it as before), counted by the timing
// model by memory class and bytes when timing is on (timing.h says what it costs).
template <typename T>
inline T ld(const T* p) {
  const T v = *p;
  model::note_access(p, sizeof(T), true);
  return v;
}
template <typename T>
inline void st(T* p, const T& v) {
  *p = v;
  model::note_access(p, sizeof(T), false);
}
inline void chain() { model::note_chain(); }
// Blocks of plain code the kernel ran (device/plain_code.h, sm90/primitives.cuh): one issue of
// their instructions, the timing model's constants; the count written out (older kernels).
template <typename... Runs>
inline void plain_code(const Runs&... runs) {
  const PlainRun all[] = {runs...};
  model::note_plain_code(all, static_cast<int>(sizeof...(Runs)));
}
inline void plain_instructions(int warp_instructions) { model::note_instructions(warp_instructions); }
// The GPU's shift and mask (sm90/primitives.cuh); the timing model counts one pair of plain code.
inline float2 bf16x2_to_float2(uint32_t bits) {
  model::note_plain_pair(model::Pair::kWidenShift);
  return {model::bits_float(bits << 16), model::bits_float(bits & 0xffff0000u)};
}

}  // namespace hybrid_ep::dev
