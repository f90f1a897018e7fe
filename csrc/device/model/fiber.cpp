#include "device/model/fiber.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>

#include "device/model/happens_before.h"

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

#ifdef HYBRID_EP_MODEL_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace hybrid_ep::model {

namespace {

constexpr size_t kStacksPerSlab = 256;
constexpr size_t kCanaryBytes = 64;
// Stacks with a guard page below them (two mappings each); beyond this many, canary only,
// so launches of tens of thousands of threads stay within the kernel's limit on mappings.
constexpr size_t kMaxGuardedStacks = 16384;
constexpr uint64_t kCanary = 0x5afe57ac6ca7a7a5ull;

#ifdef HYBRID_EP_MODEL_ASAN
// AddressSanitizer's view of the stack switches (no-ops without it): the stack being left
// and the one arrived on, so its stack checks and the unpoisoning at noreturn calls act on
// the fiber's stack rather than the OS thread's. Each context keeps its own fake stack (used
// with detect_stack_use_after_return) while it is switched out.
thread_local Context* g_leaving = nullptr;

void before_switch(Context& from, const Context& to) {
  g_leaving = &from;
  __sanitizer_start_switch_fiber(&from.fake_stack, to.stack_bottom, to.stack_size);
}

// On the stack arrived on (self: its context, or nullptr in a fiber's first frame); records
// the bounds of the stack left, which is how the scheduler's are learnt.
void after_switch(Context* self) {
  Context* from = g_leaving;
  __sanitizer_finish_switch_fiber(self != nullptr ? self->fake_stack : nullptr, &from->stack_bottom, &from->stack_size);
}

void fresh_stack(const FiberStack& stack) {  // a reused stack may hold an abandoned fiber's redzones
  ASAN_UNPOISON_MEMORY_REGION(stack.low, static_cast<char*>(stack.top) - static_cast<char*>(stack.low));
}

// The fiber is never resumed: its fake stack goes (nullptr), nothing is learnt of its bounds.
void jump_start(const Context& to) { __sanitizer_start_switch_fiber(nullptr, to.stack_bottom, to.stack_size); }
void jump_finish() { __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr); }
#else
void before_switch(Context&, const Context&) {}
void after_switch(Context*) {}
void fresh_stack(const FiberStack&) {}
void jump_start(const Context&) {}
void jump_finish() {}
#endif

// A fiber's first frame: completes the switch that started it, then runs its entry.
void start_fiber(void* context) {
  after_switch(nullptr);
  const Context* ctx = static_cast<const Context*>(context);
  ctx->entry(ctx->arg);
}

void set_start(Context& ctx, const FiberStack& stack, void (*entry)(void*), void* arg) {
  fresh_stack(stack);
  ctx.stack_bottom = stack.low;
  ctx.stack_size = static_cast<size_t>(static_cast<char*>(stack.top) - static_cast<char*>(stack.low));
  ctx.entry = entry;
  ctx.arg = arg;
}

size_t page_bytes() {
  static const size_t p = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  return p;
}

}  // namespace

void before_jump_out_of_fiber(const Context& to) { jump_start(to); }
void after_jump_out_of_fiber() { jump_finish(); }

bool FiberStack::intact() const {
  const auto* words = reinterpret_cast<const uint64_t*>(static_cast<const char*>(low) - kCanaryBytes);
  for (size_t i = 0; i < kCanaryBytes / 8; ++i)
    if (words[i] != kCanary) return false;
  return true;
}

StackPool::~StackPool() {
  for (const auto& [mapping, bytes] : slabs_) munmap(mapping, bytes);
}

FiberStack StackPool::acquire() {
  if (free_.empty()) {
    const size_t page = page_bytes();
    const bool guarded = guarded_ + kStacksPerSlab <= kMaxGuardedStacks;
    const size_t guard = guarded ? page : 0;
    const size_t each = guard + (stack_bytes_ + kCanaryBytes + page - 1) / page * page;
    const size_t bytes = each * kStacksPerSlab;
    void* slab = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (slab == MAP_FAILED) throw std::runtime_error("hybrid_ep model: mmap of a slab of fiber stacks failed");
    slabs_.emplace_back(slab, bytes);
    if (guarded) guarded_ += kStacksPerSlab;
    for (size_t i = kStacksPerSlab; i-- > 0;) {
      char* base = static_cast<char*>(slab) + i * each;
      if (guarded && mprotect(base, guard, PROT_NONE) != 0)
        throw std::runtime_error("hybrid_ep model: mprotect of a fiber stack's guard page failed");
      auto* canary = reinterpret_cast<uint64_t*>(base + guard);
      for (size_t w = 0; w < kCanaryBytes / 8; ++w) canary[w] = kCanary;
      FiberStack s;
      s.low = base + guard + kCanaryBytes;
      s.top = base + each;
      free_.push_back(s);
    }
  }
  FiberStack s = free_.back();
  free_.pop_back();
  return s;
}

#if defined(__x86_64__)

// hybrid_ep_model_switch(void** save_sp, void* new_sp): callee-saved registers, MXCSR and the
// x87 control word are pushed on the current stack, its pointer stored, the other loaded.
asm(R"(
.text
.globl hybrid_ep_model_switch
.type hybrid_ep_model_switch,@function
hybrid_ep_model_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size hybrid_ep_model_switch, .-hybrid_ep_model_switch

.globl hybrid_ep_model_trampoline
.type hybrid_ep_model_trampoline,@function
hybrid_ep_model_trampoline:
    movq %r12, %rdi
    callq *%r13
    ud2
.size hybrid_ep_model_trampoline, .-hybrid_ep_model_trampoline
)");

extern "C" void hybrid_ep_model_switch(void** save_sp, void* new_sp);
extern "C" void hybrid_ep_model_trampoline();

void make_context(Context& ctx, const FiberStack& stack, void (*entry)(void*), void* arg) {
  set_start(ctx, stack, entry, arg);
  // Frame popped by the first switch: [mxcsr | fpcw] r15 r14 r13 r12 rbx rbp ret. After the
  // ret into the trampoline the stack pointer must be 16-byte aligned for its call.
  auto top = reinterpret_cast<uintptr_t>(stack.top) & ~static_cast<uintptr_t>(15);
  auto* frame = reinterpret_cast<uint64_t*>(top - 128);
  uint32_t mxcsr = 0;
  uint16_t fpcw = 0;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(fpcw));
  std::memset(frame, 0, 128);
  std::memcpy(reinterpret_cast<char*>(frame), &mxcsr, 4);
  std::memcpy(reinterpret_cast<char*>(frame) + 4, &fpcw, 2);
  frame[1] = 0;                                                        // r15
  frame[2] = 0;                                                        // r14
  frame[3] = reinterpret_cast<uint64_t>(&start_fiber);                 // r13
  frame[4] = reinterpret_cast<uint64_t>(&ctx);                         // r12
  frame[5] = 0;                                                        // rbx
  frame[6] = 0;                                                        // rbp
  frame[7] = reinterpret_cast<uint64_t>(&hybrid_ep_model_trampoline);  // ret
  ctx.sp = frame;
}

void switch_context(Context& from, Context& to) {
  before_switch(from, to);
  if (to.race_fiber != nullptr) hb::enter(to.race_fiber);
  hybrid_ep_model_switch(&from.sp, to.sp);
  after_switch(&from);
}

void free_context(Context&) {}

#else  // ucontext: portable, one system call per switch

void make_context(Context& ctx, const FiberStack& stack, void (*entry)(void*), void* arg) {
  set_start(ctx, stack, entry, arg);
  auto* uc = static_cast<ucontext_t*>(ctx.impl);
  if (uc == nullptr) ctx.impl = uc = new ucontext_t;
  getcontext(uc);
  uc->uc_stack.ss_sp = stack.low;
  uc->uc_stack.ss_size = static_cast<char*>(stack.top) - static_cast<char*>(stack.low);
  uc->uc_link = nullptr;
  // makecontext passes int arguments: split the pointers.
  const auto e = reinterpret_cast<uintptr_t>(&start_fiber), a = reinterpret_cast<uintptr_t>(&ctx);
  makecontext(uc, reinterpret_cast<void (*)()>(+[](unsigned e_hi, unsigned e_lo, unsigned a_hi, unsigned a_lo) {
                const auto fn = reinterpret_cast<void (*)(void*)>((uintptr_t(e_hi) << 32) | e_lo);
                fn(reinterpret_cast<void*>((uintptr_t(a_hi) << 32) | a_lo));
              }),
              4, unsigned(e >> 32), unsigned(e), unsigned(a >> 32), unsigned(a));
}

void switch_context(Context& from, Context& to) {
  if (from.impl == nullptr) from.impl = new ucontext_t;
  before_switch(from, to);
  if (to.race_fiber != nullptr) hb::enter(to.race_fiber);
  swapcontext(static_cast<ucontext_t*>(from.impl), static_cast<ucontext_t*>(to.impl));
  after_switch(&from);
}

void free_context(Context& ctx) {
  delete static_cast<ucontext_t*>(ctx.impl);
  ctx.impl = nullptr;
}

#endif

}  // namespace hybrid_ep::model
