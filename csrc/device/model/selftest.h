// Self-test kernels of the CPU model (selftest.cpp): one broken rule each.
#pragma once
#include <string>
#include <vector>

namespace hybrid_ep::model {

struct SelftestResult {
  std::string error;     // the model's message, "" when the launch passed its checks
  std::vector<int> out;  // what the kernel wrote for the test to read
};

std::vector<std::string> selftest_names();
SelftestResult run_selftest(const std::string& name);

}  // namespace hybrid_ep::model
