// Faults during a launch: shared memory past its size (a guard page), a fiber's stack overflow
// and any other invalid access (SIGSEGV / SIGBUS) stop the launch with a message naming the
// thread, instead of killing the process.
#include <signal.h>

#include <vector>

#include "device/model/state.h"

namespace hybrid_ep::model::detail {
namespace {

struct sigaction g_old_segv, g_old_bus;               // set and restored by one launch at a time (the model's lock)
thread_local std::vector<unsigned char> g_alt_stack;  // sigaltstack is per thread

void on_fault(int sig, siginfo_t* info, void*) {
  Launch* L = g_launch;
  if (L == nullptr || !L->running) {
    sigaction(sig, sig == SIGSEGV ? &g_old_segv : &g_old_bus, nullptr);
    raise(sig);
    return;
  }
  const void* addr = info->si_addr;
  std::string what = "invalid memory access at " + hex(reinterpret_cast<uint64_t>(addr));
  for (auto& b : L->blocks)
    if (addr >= b->guard && addr < b->guard + page_bytes())
      what = "shared memory accessed past the launch's " + std::to_string(L->smem) +
             " bytes of dynamic shared "
             "memory (" +
             smem_text(b.get(), addr) + ")";
  if (L->current != nullptr) {  // just below the running fiber's stack: it ran past its end
    const auto* a = static_cast<const char*>(addr);
    const auto* low = static_cast<const char*>(L->current->stack.low);
    if (a < low && a + (1 << 20) >= low)
      what = "stack overflow of the thread's fiber (" + std::to_string(kStackBytes) + " bytes)";
  }
  if (L->error.empty()) L->error = where(*L, L->current) + what;
  L->jumped_from_fiber = L->current != nullptr;
  if (L->jumped_from_fiber) before_jump_out_of_fiber(L->scheduler);
  siglongjmp(L->jump, 1);
}

}  // namespace

void install_fault_handlers() {
  if (g_alt_stack.empty()) g_alt_stack.resize(256 * 1024);
  stack_t ss{};
  ss.ss_sp = g_alt_stack.data();
  ss.ss_size = g_alt_stack.size();
  sigaltstack(&ss, nullptr);
  struct sigaction sa{};
  sa.sa_sigaction = on_fault;
  sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGSEGV, &sa, &g_old_segv);
  sigaction(SIGBUS, &sa, &g_old_bus);
}

void remove_fault_handlers() {
  sigaction(SIGSEGV, &g_old_segv, nullptr);
  sigaction(SIGBUS, &g_old_bus, nullptr);
}

}  // namespace hybrid_ep::model::detail
