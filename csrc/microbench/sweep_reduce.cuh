// The host side of M6 (reduction): warps x rows x shared-load width x loop form, one JSON line
// each, with the result row checked against the exact sum.
#pragma once
#include "microbench/host.cuh"
#include "microbench/reduce.cuh"

namespace hybrid_ep::micro {

constexpr uint32_t kReduceRowBytes = 16384;  // an 8192-column bf16 row

using ReduceKernel = void (*)(ReduceArgs);

// The instantiations: 16-byte loads with every K unrolled or bounded at run time; 8 and 4-byte
// loads with K = 8 unrolled or bounded at run time.
inline ReduceKernel reduce_kernel_for(int vec_bytes, bool unrolled, int k) {
  if (!unrolled)
    return vec_bytes == 16 ? reduce_kernel<16, 0> : vec_bytes == 8 ? reduce_kernel<8, 0> : reduce_kernel<4, 0>;
  if (vec_bytes == 8 && k == 8) return reduce_kernel<8, 8>;
  if (vec_bytes == 4 && k == 8) return reduce_kernel<4, 8>;
  if (vec_bytes != 16) return nullptr;
  switch (k) {
    case 1: return reduce_kernel<16, 1>;
    case 2: return reduce_kernel<16, 2>;
    case 3: return reduce_kernel<16, 3>;
    case 4: return reduce_kernel<16, 4>;
    case 5: return reduce_kernel<16, 5>;
    case 6: return reduce_kernel<16, 6>;
    case 7: return reduce_kernel<16, 7>;
    case 8: return reduce_kernel<16, 8>;
    default: return nullptr;
  }
}

// The exact result of element e (the rows hold (q + e) % 8, the weights are 1): a small integer,
// so its bf16 bits are the top half of its fp32 bits.
inline uint16_t reduce_expected(int k, uint32_t e) {
  float sum = 0;
  for (int q = 0; q < k; ++q) sum += static_cast<float>((static_cast<uint32_t>(q) + e) % 8);
  uint32_t bits;
  std::memcpy(&bits, &sum, 4);
  return static_cast<uint16_t>(bits >> 16);
}

inline void measure_reduce(Bench& b) {
  struct Case {
    int vec_bytes;
    bool unrolled;
    int k;
    int warps;
  };
  const bool quick = b.options().quick;
  std::vector<Case> cases;
  for (int warps : {1, 2, 4, 8})
    for (int k = 1; k <= kReduceMaxRows; ++k)
      if (!quick || ((k == 1 || k == 8) && (warps == 1 || warps == 8))) cases.push_back({16, true, k, warps});
  for (int vec : {4, 8, 16})
    for (bool unrolled : {true, false})
      for (int warps : {1, 4})
        if (!quick || warps == 4) cases.push_back({vec, unrolled, 8, warps});
  uint16_t* result = reinterpret_cast<uint16_t*>(b.out());
  for (const Case& c : cases) {
    const ReduceKernel kernel = reduce_kernel_for(c.vec_bytes, c.unrolled, c.k);
    ReduceArgs a{};
    a.c = b.common();
    a.rows = c.k;
    a.reps = quick ? 16 : 4096 / c.k;
    a.row_bytes = kReduceRowBytes;
    for (float& w : a.weight) w = 1.0f;
    a.result = result;
    const size_t smem = static_cast<size_t>(c.k + 1) * kReduceRowBytes + kReduceMaxRows * sizeof(float);
    const Bench::Result r = b.run(kernel, 1, 32 * c.warps, smem, a, kReduceRowBytes / 8, "reduce");
    const Span span = b.read_spans(1)[0];
    std::vector<uint16_t> row(kReduceRowBytes / 2);
    std::memcpy(row.data(), r.out.data(), kReduceRowBytes);
    uint32_t wrong = 0;
    for (uint32_t e = 0; e < row.size(); ++e) wrong += row[e] != reduce_expected(c.k, e);
    const double ns = static_cast<double>(span.ns1 - span.ns0) / a.reps;
    const double cycles = static_cast<double>(span.cycles1 - span.cycles0) / a.reps;
    const double in_bytes = static_cast<double>(c.k) * kReduceRowBytes;
    JsonLine line;
    line.add("m", "M6")
        .add("test", "reduce")
        .add("vec_bytes", c.vec_bytes)
        .add("loop", c.unrolled ? "unrolled" : "runtime")
        .add("rows", c.k)
        .add("warps", c.warps)
        .add("row_bytes", kReduceRowBytes)
        .add("reps", a.reps)
        .add("ns_per_row", ns)
        .add("cycles_per_row", cycles)
        .add("input_gbps", in_bytes / ns)
        .add("input_bytes_per_clk", in_bytes / cycles)
        .add("wrong_elements", wrong);
    add_clock(line, r.clock).add("ok", r.ok && wrong == 0).print();
  }
}

}  // namespace hybrid_ep::micro
