// What a test injects into the next launch of a kernel (runtime.h): an abort flag raised at a
// scheduling round, as a peer's failure would raise it, and threads held at a hold point, as a
// stalled role would be.
#include <string>

#include "device/model/state.h"

namespace hybrid_ep::model {
namespace detail {
namespace {

// Each thread's own (runtime.h, threads): a test's injection goes to its own thread's launches.
struct Injection {
  uint64_t flag = 0;
  int64_t round = -1;
  std::string kernel;
};
thread_local Injection g_injection;
struct Hold {
  int key = -1;
  std::string kernel;
};
thread_local Hold g_hold;

}  // namespace

void arm_injections(Launch& L) {
  if (g_injection.flag != 0 && g_injection.kernel == L.name) {
    L.inject_flag = reinterpret_cast<int*>(g_injection.flag);
    L.inject_round = g_injection.round;
    g_injection = Injection{};
  }
  if (g_hold.key >= 0 && g_hold.kernel == L.name) {
    L.hold_key = g_hold.key;
    g_hold = Hold{};
  }
}

}  // namespace detail

using namespace detail;

void inject_abort(uint64_t flag, int64_t round, const std::string& kernel) {
  g_injection.flag = flag;
  g_injection.round = round;
  g_injection.kernel = kernel;
}

void hold_at(int key, const std::string& kernel) {
  g_hold.key = key;
  g_hold.kernel = kernel;
}

void hold_point(int key, Site site) {
  Launch& L = launch_state();
  if (key < 0 || key != L.hold_key) return;
  Thread* t = cur();
  t->held = true;
  ++L.held;
  yield_at_poll(t, site);  // the scheduler resumes it once it lets the held go on
}

}  // namespace hybrid_ep::model
