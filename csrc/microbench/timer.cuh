// M9: %globaltimer, which every bounded wait reads: what one read costs, and how often its
// value changes (the gaps between the changes a thread sees when it reads it back to back).
// The bounded waits check the timer every N turns; a coarse timer makes a short bound coarse.
#pragma once
#include <cstdint>

#include "microbench/probe.cuh"

namespace hybrid_ep::micro {

struct TimerArgs {
  Common c;
  int reads;
  int capacity;    // of gaps
  uint64_t* gaps;  // the first `capacity` nonzero differences between consecutive reads
  uint64_t* out;   // [0] cycles of all reads, [1] changes seen, [2] nanoseconds from first to last read
};

__global__ void __launch_bounds__(32, 1) timer_kernel(const __grid_constant__ TimerArgs a) {
  if (threadIdx.x != 0) return;
  const SpanClock clock = SpanClock::start();
  uint64_t changes = 0;
  const uint64_t first = dev::global_timer_ns();
  uint64_t last = first;
  const uint64_t c0 = cycles();
  for (int i = 0; i < a.reads; ++i) {
    const uint64_t now = dev::global_timer_ns();
    if (now != last) {
      if (changes < static_cast<uint64_t>(a.capacity)) a.gaps[changes] = now - last;
      ++changes;
      last = now;
    }
  }
  a.out[0] = cycles() - c0;
  a.out[1] = changes;
  a.out[2] = last - first;
  clock.stop(a.c);
}

}  // namespace hybrid_ep::micro
