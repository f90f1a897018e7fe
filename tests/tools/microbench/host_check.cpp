// The microbenchmark's host-only parts (csrc/microbench/cli.h, json.h), built by
// tests/tools/test_microbench.py with the host compiler:
//   host_check parse ARG...   one JSON line: the action, the options or the error
//   host_check json           JSON lines holding the values that are hard to write
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>

#include "microbench/cli.h"
#include "microbench/json.h"

using namespace hybrid_ep::micro;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  if (mode == "parse") {
    // argv[1] stands in for the program name
    const Parsed p = parse_args(argc - 1, argv + 1);
    const char* action = p.action == Action::kRun    ? "run"
                         : p.action == Action::kHelp ? "help"
                         : p.action == Action::kList ? "list"
                                                     : "error";
    std::string run;
    for (const std::string& name : p.options.run) run += (run.empty() ? "" : ",") + name;
    JsonLine()
        .add("action", action)
        .add("run", run)
        .add("device", p.options.device)
        .add("timeout_s", p.options.timeout_s)
        .add("quick", p.options.quick)
        .add("error", p.error)
        .print();
    return 0;
  }
  if (mode == "json") {
    JsonLine().add("text", std::string("quote \" backslash \\ newline \n tab \t bell \x07 end")).print();
    JsonLine()
        .add("nan", std::nan(""))
        .add("inf", std::numeric_limits<double>::infinity())
        .add("third", 1.0 / 3)
        .add("big", uint64_t(18446744073709551615ull))
        .add("negative", int64_t(-9223372036854775807ll - 1))
        .add("small", 1.5e-300)
        .add("yes", true)
        .add("list", std::vector<double>{1, 2.5, std::nan("")})
        .add("empty", std::vector<double>{})
        .print();
    return 0;
  }
  std::fprintf(stderr, "usage: host_check parse ARG... | host_check json\n");
  return 2;
}
