// Which received chunks a block handles: every source's chunks in source order, strided over
// the rank's blocks. Dispatch's expansion and combine's expert-host side walk the same pairs,
// so a block reduces in combine the chunks it expanded in dispatch.
#pragma once
#include <cstdint>

namespace hybrid_ep {

// Call: anything with W (ranks), b / nb (this block, blocks per rank) and source_chunks(s).
template <typename Call>
struct ReceivedChunks {
  const Call& call;
  int s = 0;
  int64_t base = 0;  // index of source s's chunk 0 in the enumeration
  int64_t u;

  __device__ explicit ReceivedChunks(const Call& c) : call(c), u(c.b) {}
  __device__ bool next(int& source, int& chunk) {
    while (s < call.W && u >= base + call.source_chunks(s)) base += call.source_chunks(s++);
    if (s >= call.W) return false;
    source = s;
    chunk = static_cast<int>(u - base);
    u += call.nb;
    return true;
  }
};

}  // namespace hybrid_ep
