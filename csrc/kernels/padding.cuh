// Zero rows of a dispatch output: after each local expert's real rows up to its padded size
// (pad_multiple, min_rows_per_expert), and after the whole layout up to the output's size.
// Both dispatch kernels run it on the destination, on warps of their own.
//
// Call: anything with a (RankArgs), info and il (the layout), b / nb (block, blocks per rank),
// L, row_bytes and scale_cols.
#pragma once
#include "common/params.h"
#include "device/device.cuh"

namespace hybrid_ep {

// Warp pw of npw padding warps per block.
template <typename Call>
__device__ void zero_padding(const Call& d, int pw, int npw, int lane) {
  const int64_t R = d.a.num_out_rows;
  auto* out = reinterpret_cast<uint8_t*>(d.a.out);
  auto* out_scales = reinterpret_cast<float*>(d.a.out_scales);
  auto* out_probs = reinterpret_cast<float*>(d.a.out_probs);
  const int64_t* info = d.info;
  const int64_t gw = static_cast<int64_t>(d.b) * npw + pw, nw = static_cast<int64_t>(d.nb) * npw;
  const int64_t needed = info[d.il.needed];
  for (int j = 0; j <= d.L; ++j) {
    int64_t lo, hi;
    if (j < d.L) {
      const int64_t start = info[d.il.expert_start + j];
      lo = start + info[d.il.expert_rows + j];
      hi = j + 1 < d.L ? info[d.il.expert_start + j + 1] : needed;
    } else {
      lo = needed;
      hi = R;
    }
    hi = min(hi, R);
    for (int64_t r = lo + gw; r < hi; r += nw) {
      int4* dst = reinterpret_cast<int4*>(out + r * d.row_bytes);
      for (uint32_t v = lane; v < d.row_bytes / 16; v += 32) dev::st(dst + v, make_int4(0, 0, 0, 0));
      for (int i = lane; i < d.scale_cols; i += 32) out_scales[r * d.scale_cols + i] = 0.f;
      if (lane == 0) out_probs[r] = 0.f;
    }
  }
}

}  // namespace hybrid_ep
