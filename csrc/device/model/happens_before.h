// What ThreadSanitizer needs to know about the CPU model's threads and copies, so that a
// plain access of one CUDA thread that no synchronisation orders against another thread's
// access (or a bulk copy's) is reported as a data race. Without ThreadSanitizer every call
// here compiles to nothing.
//
// scripts/sanitize.py --sanitizer thread defines HYBRID_EP_MODEL_TSAN in every translation
// unit and instruments only the kernels' (the scheduler itself is not instrumented: its own
// bookkeeping is shared by all fibers on purpose). Each CUDA thread runs on a ThreadSanitizer
// fiber of its own; switches carry no ordering; the device layer's synchronisation carries
// exactly the ordering CUDA gives it (docs/dev/cpu_model.md, "Data races"):
//   - __syncthreads, warp collectives: every participant's release before every one's acquire;
//   - mbarrier: an arrival (or a bulk load's complete_tx) releases, a wait that sees the
//     phase complete acquires;
//   - a bulk copy acquires what its issuing thread had done when it issued it, runs as the
//     issuing warp's copy engine (its own fiber), and releases to the mbarrier (a load) or
//     to the issuing thread's bulk-group wait (a store);
//   - flags: a release store or reduction releases, an acquire poll that reads the flag
//     acquires; a relaxed poll acquires only at the thread's next fence (sync.cpp,
//     fence_acquire); atomics are acquire-release.
// Sync objects are keyed by address and accumulate every release made on them, so a wait
// may be credited with a later phase's arrivals than CUDA would: the check can miss such a
// race, but never reports an ordered access as one.
#pragma once

#include <cstddef>

#ifdef HYBRID_EP_MODEL_TSAN
#include <sanitizer/tsan_interface.h>
extern "C" void __tsan_read_range(void* addr, unsigned long size);  // the runtime's, not in its header
extern "C" void __tsan_write_range(void* addr, unsigned long size);
extern "C" void __tsan_func_entry(void* call_pc);
extern "C" void __tsan_func_exit();
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#endif

namespace hybrid_ep::model::hb {

#ifdef HYBRID_EP_MODEL_TSAN
inline void release(const void* key) { __tsan_release(const_cast<void*>(key)); }
inline void acquire(const void* key) { __tsan_acquire(const_cast<void*>(key)); }
inline void* current_fiber() { return __tsan_get_current_fiber(); }
inline void* new_fiber() { return __tsan_create_fiber(0); }
// Makes `fiber` the running one for ThreadSanitizer, with no ordering against the one left.
inline void enter(void* fiber) { __tsan_switch_to_fiber(fiber, __tsan_switch_to_fiber_no_sync); }
// A bulk copy's accesses, made by the running fiber (the scheduler is not instrumented, and
// the run ignores accesses inside intercepted calls such as memcpy: they are its bookkeeping).
inline void reads(const void* p, size_t n) { __tsan_read_range(const_cast<void*>(p), n); }
inline void writes(void* p, size_t n) { __tsan_write_range(p, n); }
// Reports name the copy's issue site: its accesses are made inside a frame at that address.
inline void frame_begin(void* pc) { __tsan_func_entry(pc); }
inline void frame_end() { __tsan_func_exit(); }
inline void name(void* fiber, const char* text) { __tsan_set_fiber_name(fiber, text); }
// The model's own bookkeeping done on a fiber's behalf (the timing model's clocks): none of its
// accesses are checked, those of library templates included, whose instrumented copies in the
// kernels' units the linker may have taken for the uninstrumented units too.
inline void ignore_begin() { __tsan_ignore_thread_begin(); }
inline void ignore_end() { __tsan_ignore_thread_end(); }
inline constexpr bool kEnabled = true;
#else
inline void release(const void*) {}
inline void acquire(const void*) {}
inline void* current_fiber() { return nullptr; }
inline void* new_fiber() { return nullptr; }
inline void enter(void*) {}
inline void reads(const void*, size_t) {}
inline void writes(void*, size_t) {}
inline void frame_begin(void*) {}
inline void frame_end() {}
inline void name(void*, const char*) {}
inline void ignore_begin() {}
inline void ignore_end() {}
inline constexpr bool kEnabled = false;
#endif

// A scope whose accesses the race check does not see (ignore_begin / ignore_end).
struct Unobserved {
  Unobserved() { ignore_begin(); }
  ~Unobserved() { ignore_end(); }
  Unobserved(const Unobserved&) = delete;
  Unobserved& operator=(const Unobserved&) = delete;
};

}  // namespace hybrid_ep::model::hb
