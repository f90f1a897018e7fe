// Fibers for the CPU model: one per CUDA thread, switched cooperatively on one OS thread.
//
// A switch saves the callee-saved registers on the current stack and loads another stack
// pointer (x86-64: a few instructions; elsewhere ucontext, correct but slower). Stacks are
// mmap'd with a guard page below them, so an overflow faults instead of corrupting a
// neighbour, and are reused across launches.
#pragma once
#include <cstddef>
#include <vector>

namespace hybrid_ep::model {

struct FiberStack {
  void* mapping = nullptr;  // guard page + usable stack
  size_t mapping_bytes = 0;
  void* low = nullptr;  // lowest usable address (just above the guard page)
  void* top = nullptr;  // one past the highest usable address

  bool contains_guard(const void* p) const;
};

// A saved execution context (the stack pointer on x86-64).
struct Context {
  void* sp = nullptr;
  void* impl = nullptr;  // ucontext_t on targets without the assembly switch
};

class StackPool {
 public:
  explicit StackPool(size_t stack_bytes) : stack_bytes_(stack_bytes) {}
  ~StackPool();
  FiberStack acquire();
  void release(const FiberStack& s) { free_.push_back(s); }
  const std::vector<FiberStack>& all() const { return all_; }

 private:
  size_t stack_bytes_;
  std::vector<FiberStack> free_;
  std::vector<FiberStack> all_;
};

// Prepares `ctx` to start entry(arg) on `stack` at its first switch_to.
void make_context(Context& ctx, const FiberStack& stack, void (*entry)(void*), void* arg);
// Saves the running context into `from` and resumes `to`.
void switch_context(Context& from, Context& to);
void free_context(Context& ctx);

}  // namespace hybrid_ep::model
