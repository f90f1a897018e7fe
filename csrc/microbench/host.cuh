// The host side shared by every measurement: the device, its buffers, launching a kernel and
// waiting for it with a deadline, and turning a block's span into the SM clock it ran at.
#pragma once
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "common/params.h"
#include "device/device.cuh"
#include "microbench/cli.h"
#include "microbench/json.h"
#include "microbench/probe.cuh"

namespace hybrid_ep::micro {

// A CUDA call that must work: on failure the program stops with the call and the error (no
// measurement could be trusted after it).
#define MICRO_CHECK(call)                                                                        \
  do {                                                                                           \
    const cudaError_t micro_err = (call);                                                        \
    if (micro_err != cudaSuccess) {                                                              \
      std::fprintf(stderr, "microbench: %s failed: %s\n", #call, cudaGetErrorString(micro_err)); \
      std::exit(3);                                                                              \
    }                                                                                            \
  } while (0)

constexpr int kMaxBlocks = 64;                 // spans kept per launch
constexpr size_t kOutWords = 1 << 16;          // result words a kernel may write
constexpr size_t kBigBytes = size_t(1) << 30;  // each of the two 1 GiB copy buffers

struct Clock {
  double mhz;      // cycles / nanoseconds * 1000 over the span
  double span_us;  // how long the span was: below ~100 us the MHz figure is coarse (M9)
};

inline Clock clock_of(const Span& s) {
  const double ns = static_cast<double>(s.ns1 - s.ns0);
  return Clock{ns > 0 ? static_cast<double>(s.cycles1 - s.cycles0) / ns * 1e3 : std::nan(""), ns / 1e3};
}

class Bench {
 public:
  explicit Bench(const Options& opt) : opt_(opt) {}

  // Selects the device and allocates the buffers; prints the device line.
  void open() {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess || count == 0) {
      std::fprintf(stderr, "microbench: no CUDA device (%s)\n",
                   err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount found none");
      std::exit(3);
    }
    if (opt_.device >= count) {
      std::fprintf(stderr, "microbench: --device %d, but there are %d device(s)\n", opt_.device, count);
      std::exit(2);
    }
    MICRO_CHECK(cudaSetDevice(opt_.device));
    MICRO_CHECK(cudaGetDeviceProperties(&prop_, opt_.device));
    MICRO_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
    MICRO_CHECK(cudaMalloc(&abort_, sizeof(int)));
    MICRO_CHECK(cudaMalloc(&error_, sizeof(ErrorRecord)));
    MICRO_CHECK(cudaMalloc(&spans_, sizeof(Span) * kMaxBlocks));
    MICRO_CHECK(cudaMalloc(&out_, sizeof(uint64_t) * kOutWords));
    MICRO_CHECK(cudaMalloc(&src_, kBigBytes));
    MICRO_CHECK(cudaMalloc(&dst_, kBigBytes));
    flush_bytes_ = std::max<size_t>(size_t(prop_.l2CacheSize) * 4, size_t(256) << 20);
    MICRO_CHECK(cudaMalloc(&flush_, flush_bytes_));
    MICRO_CHECK(cudaMemset(src_, 0x5a, kBigBytes));
    MICRO_CHECK(cudaMemset(dst_, 0, kBigBytes));
    MICRO_CHECK(cudaMemset(abort_, 0, sizeof(int)));
    MICRO_CHECK(cudaMemset(error_, 0, sizeof(ErrorRecord)));
    int driver = 0, runtime = 0, clock_khz = 0, smem_optin = 0;
    cudaDriverGetVersion(&driver);
    cudaRuntimeGetVersion(&runtime);
    cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, opt_.device);
    cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, opt_.device);
    smem_optin_ = smem_optin;
    JsonLine()
        .add("m", "device")
        .add("name", prop_.name)
        .add("cc", std::to_string(prop_.major) + "." + std::to_string(prop_.minor))
        .add("sms", prop_.multiProcessorCount)
        .add("l2_bytes", prop_.l2CacheSize)
        .add("smem_per_block_optin", smem_optin)
        .add("max_clock_mhz_reported", clock_khz / 1000.0)
        .add("driver", driver)
        .add("runtime", runtime)
        .add("timeout_s", opt_.timeout_s)
        .add("quick", opt_.quick)
        .print();
  }

  const Options& options() const { return opt_; }
  const cudaDeviceProp& prop() const { return prop_; }
  int sms() const { return prop_.multiProcessorCount; }
  int smem_optin() const { return smem_optin_; }
  cudaStream_t stream() const { return stream_; }
  uint8_t* src() const { return src_; }
  uint8_t* dst() const { return dst_; }
  uint64_t* out() const { return out_; }
  int failures() const { return failures_; }

  Common common() const { return Common{timeout_ns(), abort_, spans_}; }
  uint64_t timeout_ns() const { return static_cast<uint64_t>(opt_.timeout_s * 1e9); }
  // What the project's mbar_wait reads; nothing else of a LaunchArgs is used.
  LaunchArgs wait_args() const {
    LaunchArgs la{};
    la.timeout_ns = timeout_ns();
    la.abort_flag = reinterpret_cast<uint64_t>(abort_);
    la.error = reinterpret_cast<uint64_t>(error_);
    return la;
  }

  // Writes a buffer larger than L2, so that the next kernel reads its sources from HBM.
  void flush_l2() { MICRO_CHECK(cudaMemsetAsync(flush_, 0, flush_bytes_, stream_)); }

  void zero_out(size_t words = kOutWords) { MICRO_CHECK(cudaMemsetAsync(out_, 0, words * sizeof(uint64_t), stream_)); }

  template <typename Args>
  void launch(void (*kernel)(Args), int blocks, int threads, size_t smem, const Args& args, const char* what) {
    if (blocks > kMaxBlocks) {
      std::fprintf(stderr, "microbench: %s: %d blocks, at most %d\n", what, blocks, kMaxBlocks);
      std::exit(3);
    }
    const char* err = dev::launch_cooperative(kernel, blocks, threads, smem, reinterpret_cast<uint64_t>(stream_), args);
    if (err != nullptr) {
      std::fprintf(stderr, "microbench: launching %s failed: %s\n", what, err);
      std::exit(3);
    }
  }

  // Waits for the stream, bounded: every wait inside a kernel is bounded by the timeout, so a
  // stream still busy long after it means a hung kernel, which no later measurement survives.
  // Returns false (and counts a failure) when a wait inside the kernel ran out.
  bool finish(const char* what) {
    const double deadline_s = 4 * opt_.timeout_s + 30;
    const auto start = std::chrono::steady_clock::now();
    for (;;) {
      const cudaError_t q = cudaStreamQuery(stream_);
      if (q == cudaSuccess) break;
      if (q != cudaErrorNotReady) {
        std::fprintf(stderr, "microbench: %s failed on the device: %s\n", what, cudaGetErrorString(q));
        std::exit(3);
      }
      if (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > deadline_s) {
        std::fprintf(stderr, "microbench: %s still running after %.0f s: stopping\n", what, deadline_s);
        std::exit(4);
      }
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    int aborted = 0;
    MICRO_CHECK(cudaMemcpy(&aborted, abort_, sizeof(int), cudaMemcpyDeviceToHost));
    if (aborted == 0) return true;
    ++failures_;
    std::fprintf(stderr, "microbench: %s: a wait ran out after %.1f s (flag %d)\n", what, opt_.timeout_s, aborted);
    MICRO_CHECK(cudaMemset(abort_, 0, sizeof(int)));
    MICRO_CHECK(cudaMemset(error_, 0, sizeof(ErrorRecord)));
    return false;
  }

  // One launch with the first `words` result words zeroed before and read after, and the
  // clock of block 0.
  struct Result {
    bool ok;
    std::vector<uint64_t> out;
    Clock clock;
  };
  template <typename Args>
  Result run(void (*kernel)(Args), int blocks, int threads, size_t smem, const Args& args, size_t words,
             const char* what) {
    zero_out(words);
    launch(kernel, blocks, threads, smem, args, what);
    Result r;
    r.ok = finish(what);
    r.out = read_out(words);
    r.clock = clock_of(read_spans(1)[0]);
    return r;
  }

  std::vector<uint64_t> read_out(size_t words) const {
    std::vector<uint64_t> v(words);
    MICRO_CHECK(cudaMemcpy(v.data(), out_, words * sizeof(uint64_t), cudaMemcpyDeviceToHost));
    return v;
  }

  std::vector<Span> read_spans(int blocks) const {
    std::vector<Span> v(static_cast<size_t>(blocks));
    MICRO_CHECK(cudaMemcpy(v.data(), spans_, v.size() * sizeof(Span), cudaMemcpyDeviceToHost));
    return v;
  }

 private:
  Options opt_;
  cudaDeviceProp prop_{};
  int smem_optin_ = 0;
  cudaStream_t stream_ = nullptr;
  int* abort_ = nullptr;
  ErrorRecord* error_ = nullptr;
  Span* spans_ = nullptr;
  uint64_t* out_ = nullptr;
  uint8_t* src_ = nullptr;
  uint8_t* dst_ = nullptr;
  uint8_t* flush_ = nullptr;
  size_t flush_bytes_ = 0;
  int failures_ = 0;
};

// The SM clock and span fields every line carries.
inline JsonLine& add_clock(JsonLine& line, const Clock& c) {
  return line.add("clock_mhz", c.mhz).add("clock_span_us", c.span_us);
}

inline double median(std::vector<double> v) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// The q-quantile (0..1) by the nearest rank.
inline double quantile(std::vector<double> v, double q) {
  if (v.empty()) return std::nan("");
  std::sort(v.begin(), v.end());
  const size_t i = static_cast<size_t>(q * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

// Progress on stderr: stdout carries only JSON lines.
inline void progress(const std::string& text) {
  std::fprintf(stderr, "microbench: %s\n", text.c_str());
  std::fflush(stderr);
}

}  // namespace hybrid_ep::micro
