// hybrid_ep_microbench: the GPU constants every kernel design of the project rests on (bulk-copy
// throughput and latency, mbarrier hand-offs, flags, fences, reductions, the timer, the copy
// engine), measured with the device layer the kernels use (csrc/device/). Built by
// scripts/build_microbench.sh, run by `scripts/gpu_check.sh micro`; the runbook and the table of
// constants are in docs/benchmarks/cuda.md. `--help` and `--list` make no CUDA call.
#include <cstdio>
#include <string>

#include "microbench/cli.h"
#include "microbench/host.cuh"
#include "microbench/sweep_copy.cuh"
#include "microbench/sweep_reduce.cuh"
#include "microbench/sweep_sync.cuh"

namespace hybrid_ep::micro {

void run(Bench& b, const std::string& name) {
  progress("running " + name);
  if (name == "timer") measure_timer(b);
  if (name == "handoff") measure_handoff(b);
  if (name == "tma") measure_tma(b);
  if (name == "latency") measure_latency(b);
  if (name == "flags") measure_flags(b);
  if (name == "fences") measure_fences(b);
  if (name == "reduce") measure_reduce(b);
  if (name == "copy-engine") measure_copy_engine(b);
  if (name == "tma-profile") measure_tma_profile(b);
}

}  // namespace hybrid_ep::micro

int main(int argc, char** argv) {
  using namespace hybrid_ep::micro;
  const Parsed parsed = parse_args(argc, argv);
  switch (parsed.action) {
    case Action::kHelp: std::fputs(usage().c_str(), stdout); return 0;
    case Action::kList:
      for (const Measurement& m : measurements()) std::printf("%-12s %-4s %s\n", m.name, m.id, m.what);
      return 0;
    case Action::kError:
      std::fprintf(stderr, "hybrid_ep_microbench: %s\n%s", parsed.error.c_str(), usage().c_str());
      return 2;
    case Action::kRun: break;
  }
  Bench bench(parsed.options);
  bench.open();
  for (const std::string& name : parsed.options.run) run(bench, name);
  if (bench.failures() > 0) {
    std::fprintf(stderr, "microbench: %d measurement(s) had a wait that ran out (their lines say \"ok\": false)\n",
                 bench.failures());
    return 1;
  }
  return 0;
}
