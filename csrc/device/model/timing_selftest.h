// Kernels whose time the timing model must predict exactly (timing_selftest.cpp).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

namespace hybrid_ep::model {

std::vector<std::string> timing_selftest_names();
// Runs one on `blocks` blocks of `threads` with parameters n (hand-offs, copies or pairs) and
// bytes (per copy; for issue_warps the warps that work, for spin_beside the spinner's first thread);
// "" when the launch passed the model's checks, else its message. The time is in the
// launch's timing report (timing.h), when timing is on.
std::string run_timing_selftest(const std::string& name, int blocks, int n, uint32_t bytes, int threads = 64);

}  // namespace hybrid_ep::model
