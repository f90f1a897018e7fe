// Fibers for the CPU model: one per CUDA thread, switched cooperatively on one OS thread.
//
// A switch saves the callee-saved registers on the current stack and loads another stack
// pointer (x86-64: a few instructions; elsewhere ucontext, correct but slower). Stacks come
// in slabs and are reused across launches. The first 16384 have a guard page below them (an
// overflow faults); beyond those a launch would exceed the kernel's limit on mappings, so
// further stacks have only a canary at their low end, checked whenever the fiber gives way.
#pragma once
#include <cstddef>
#include <vector>

#if defined(__SANITIZE_ADDRESS__)
#define HYBRID_EP_MODEL_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define HYBRID_EP_MODEL_ASAN 1
#endif
#endif

namespace hybrid_ep::model {

#ifdef HYBRID_EP_MODEL_ASAN
inline constexpr size_t kStackScale = 4;  // AddressSanitizer's redzones make frames larger
#else
inline constexpr size_t kStackScale = 1;
#endif

struct FiberStack {
  void* low = nullptr;  // lowest usable address (above the canary)
  void* top = nullptr;  // one past the highest usable address

  // The canary below `low` still holds its pattern (false: the fiber overflowed its stack).
  bool intact() const;
};

// A saved execution context (the stack pointer on x86-64). The stack's bounds are for
// AddressSanitizer, which must be told of every switch between stacks; the scheduler's own
// stack (the OS thread's) is learnt on the first switch away from it.
struct Context {
  void* sp = nullptr;
  void* impl = nullptr;  // ucontext_t on targets without the assembly switch
  const void* stack_bottom = nullptr;
  size_t stack_size = 0;
  void (*entry)(void*) = nullptr;  // what a fiber runs, called from its first frame
  void* arg = nullptr;
  void* fake_stack = nullptr;  // AddressSanitizer's, while switched out
  void* race_fiber = nullptr;  // ThreadSanitizer's (happens_before.h), made current at each switch to it
};

class StackPool {
 public:
  explicit StackPool(size_t stack_bytes) : stack_bytes_(stack_bytes) {}
  ~StackPool();
  FiberStack acquire();
  void release(const FiberStack& s) { free_.push_back(s); }

 private:
  size_t stack_bytes_;
  size_t guarded_ = 0;  // stacks made with a guard page
  std::vector<FiberStack> free_;
  std::vector<std::pair<void*, size_t>> slabs_;
};

// Prepares `ctx` to start entry(arg) on `stack` at its first switch_context to it (ctx must
// stay where it is until then).
void make_context(Context& ctx, const FiberStack& stack, void (*entry)(void*), void* arg);
// Saves the running context into `from` and resumes `to`.
void switch_context(Context& from, Context& to);
void free_context(Context& ctx);
// A fault handler's siglongjmp out of a fiber into `to` leaves the fiber for good: called
// before the jump and, on `to`'s stack, after it lands, they tell AddressSanitizer of that
// switch too (no-ops without it). Untold, it keeps the fiber's stack bounds for `to`'s stack,
// and its next noreturn call (a throw) finds the stack it unpoisons gigabytes long.
void before_jump_out_of_fiber(const Context& to);
void after_jump_out_of_fiber();

}  // namespace hybrid_ep::model
