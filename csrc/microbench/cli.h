// The microbenchmark's command line: which measurements to run and the few settings they
// share. Host code only (no CUDA): the program parses its arguments before any CUDA call, so
// --help, --list and a bad argument work on a machine without a GPU, and a test builds this
// header with the host compiler.
#pragma once
#include <cerrno>
#include <cstdlib>
#include <string>
#include <vector>

namespace hybrid_ep::micro {

struct Measurement {
  const char* name;  // the subcommand
  const char* id;    // docs/benchmarks/cuda.md's label
  const char* what;
};

// `all` runs them in this order; tma-profile is left out of it (it exists for ncu).
inline const std::vector<Measurement>& measurements() {
  static const std::vector<Measurement> table = {
      {"timer", "M9", "%globaltimer: read cost and update granularity"},
      {"handoff", "M1", "mbarrier hand-off between two warps of one SM; bar.sync; group agreement"},
      {"tma", "M2", "bulk-copy (TMA) throughput per SM and for 1-32 SMs"},
      {"latency", "M3", "bulk-copy latency, alone and behind 8 queued copies"},
      {"flags", "M4", "flag latency between blocks on two SMs; cost of one poll"},
      {"fences", "M5", "fences: system, proxy.async, acq_rel.sys, wait_group 0"},
      {"reduce", "M6", "1-8 warps summing K bf16 rows of 16 KiB from shared memory in fp32"},
      {"copy-engine", "M10", "cudaMemcpyAsync device to device, alone and beside busy SMs"},
      {"tma-profile", "M8", "one store-only and one load + 2 stores TMA run, to profile with ncu"},
  };
  return table;
}

inline const Measurement* find_measurement(const std::string& name) {
  for (const Measurement& m : measurements())
    if (name == m.name) return &m;
  return nullptr;
}

struct Options {
  std::vector<std::string> run;  // measurement names, in the order given, `all` expanded
  int device = 0;
  double timeout_s = 2.0;  // bound of every wait inside a measurement kernel
  bool quick = false;      // smaller sweeps (a smoke run)
};

enum class Action { kRun, kHelp, kList, kError };

struct Parsed {
  Action action = Action::kRun;
  Options options;
  std::string error;  // Action::kError: names the argument and what it takes
};

inline std::string usage() {
  std::string text =
      "usage: hybrid_ep_microbench [--device N] [--timeout-s S] [--quick] MEASUREMENT...\n"
      "       hybrid_ep_microbench --list | --help\n"
      "Prints one JSON object per line on stdout (the first describes the device), progress on\n"
      "stderr. MEASUREMENT is `all` or one of:\n";
  for (const Measurement& m : measurements()) text += "  " + std::string(m.name) + " (" + m.id + "): " + m.what + "\n";
  text +=
      "--device N     CUDA device index (default 0)\n"
      "--timeout-s S  bound of every wait inside a kernel, seconds (default 2): a measurement\n"
      "               whose wait runs out is reported failed, and the exit status is 1\n"
      "--quick        a few points of each sweep\n";
  return text;
}

inline bool parse_int(const std::string& text, int* out) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const long v = std::strtol(text.c_str(), &end, 10);
  if (errno != 0 || *end != '\0' || v < -2147483647L - 1 || v > 2147483647L) return false;
  *out = static_cast<int>(v);
  return true;
}

inline bool parse_double(const std::string& text, double* out) {
  if (text.empty()) return false;
  char* end = nullptr;
  errno = 0;
  const double v = std::strtod(text.c_str(), &end);
  if (errno != 0 || *end != '\0') return false;
  *out = v;
  return true;
}

inline Parsed parse_args(int argc, const char* const* argv) {
  Parsed p;
  auto fail = [&p](const std::string& why) {
    p.action = Action::kError;
    p.error = why;
    return p;
  };
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    if (arg == "--help" || arg == "-h") {
      p.action = Action::kHelp;
      return p;
    }
    if (arg == "--list") {
      p.action = Action::kList;
      return p;
    }
    if (arg == "--quick") {
      p.options.quick = true;
    } else if (arg == "--device" || arg == "--timeout-s") {
      if (i + 1 >= argc) return fail(arg + " needs a value");
      const std::string value = argv[++i];
      if (arg == "--device") {
        if (!parse_int(value, &p.options.device) || p.options.device < 0)
          return fail("--device must be a CUDA device index (an integer >= 0), got '" + value + "'");
      } else if (!parse_double(value, &p.options.timeout_s) || !(p.options.timeout_s > 0) ||
                 p.options.timeout_s > 600) {
        return fail("--timeout-s must be a number of seconds in (0, 600], got '" + value + "'");
      }
    } else if (!arg.empty() && arg[0] == '-') {
      return fail("unknown option '" + arg + "' (--help lists them)");
    } else if (arg == "all") {
      for (const Measurement& m : measurements())
        if (std::string(m.name) != "tma-profile") p.options.run.push_back(m.name);
    } else if (find_measurement(arg) != nullptr) {
      p.options.run.push_back(arg);
    } else {
      return fail("unknown measurement '" + arg + "' (--list names them)");
    }
  }
  if (p.options.run.empty()) return fail("name a measurement, or `all` (--list names them)");
  for (size_t i = 0; i < p.options.run.size(); ++i)
    for (size_t j = 0; j < i; ++j)
      if (p.options.run[i] == p.options.run[j]) return fail("measurement '" + p.options.run[i] + "' named twice");
  return p;
}

}  // namespace hybrid_ep::micro
