// Which received chunks a block handles: the (source, chunk) pairs in chunk-major order
// (chunk 0 of every source, then chunk 1, ...; a source with fewer chunks drops out), strided
// over the rank's blocks. Dispatch's expansion and combine's expert-host side walk the same
// pairs, so a block reduces in combine the chunks it expanded in dispatch.
//
// Chunk-major because every source sends its chunks in order to all ranks at once, and in
// combine a source sums a chunk only when every expert host has stored its partial: walked
// source by source, the hosts reached the last source's chunks only at the end of the call,
// so that source's whole reduction waited for the end. Chunks forwarded from other nodes come
// in chunk order too, a bounded lag behind the forwarder's own (SendUnits,
// kernels/dispatch_receive.cuh). With bounded receive rings the walk must be monotone in
// the chunk index: a writer waits for a slot's previous chunk to be read before it writes the
// next (kernels/peer_ring.cuh).
#pragma once
#include <cstdint>

namespace hybrid_ep {

// Call: anything with W (ranks), b / nb (this block, blocks per rank) and source_chunks(s).
template <typename Call>
struct ReceivedChunks {
  const Call& call;
  int chunks = 0;  // the most chunks any source has
  int s = -1, c = 0;
  bool started = false, done = false;

  __device__ explicit ReceivedChunks(const Call& cl) : call(cl) {
    for (int i = 0; i < call.W; ++i) chunks = max(chunks, call.source_chunks(i));
  }
  __device__ bool next(int& source, int& chunk) {
    const int steps = started ? call.nb : call.b + 1;
    started = true;
    for (int i = 0; i < steps && !done; ++i) done = !step();
    if (done) return false;
    source = s;
    chunk = c;
    return true;
  }

 private:
  // To the next pair that exists.
  __device__ bool step() {
    for (;;) {
      if (++s == call.W) {
        s = 0;
        if (++c >= chunks) return false;
      }
      if (c < call.source_chunks(s)) return true;
    }
  }
};

}  // namespace hybrid_ep
