// Launches on the CPU model: every block of the grid runs at once as fibers (the model's
// "cooperative launch"), to completion, inside the call. Same names as
// csrc/device/sm90/launch.cuh.
#pragma once
#include <cstddef>
#include <cstdint>

#include "device/model/runtime.h"

namespace hybrid_ep::dev {

// `name`: the kernel's, as fault injection (model::inject_abort) and the messages call it;
// by default the caller's function name without "launch_".
template <typename Args>
const char* launch_cooperative(void (*kernel)(Args), int blocks, int threads, size_t smem, uint64_t /*stream*/,
                               const Args& args, const char* name = __builtin_FUNCTION()) {
  struct Call {
    void (*kernel)(Args);
    const Args* args;
    static void run(const void* self) {
      const auto* c = static_cast<const Call*>(self);
      c->kernel(*c->args);
    }
  } call{kernel, &args};
  return model::launch(&Call::run, &call, blocks, threads, smem, name);
}

template <typename Args>
int max_active_blocks(void (*)(Args), int threads, size_t smem) {
  return model::max_active_blocks(threads, smem);
}

}  // namespace hybrid_ep::dev
