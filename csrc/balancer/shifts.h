// Count shifts: refit starts that move one copy from a cool replicated expert to a hot one
// (tools/balancer_study/NOTES.md, "Count shifts"). The one-slot exchange
// keeps copy counts; where the counts themselves hold a layer back, one shifted copy lets the
// exchange bring it within with fewer changed slots.
// Internal to the planner (refit.cpp).
#pragma once
#include <cstdint>
#include <vector>

#include "balancer/packing.h"

namespace hybrid_ep::balancer::detail {

// One changed slot: slot `slot`, a copy of an expert with at least 3 copies, becomes a copy of
// `expert`, which has at least 2 copies, one on a rank above allowed.
struct Shift {
  int slot;
  int64_t expert;
};

// The `most` shifts that lower the load above allowed (summed over ranks) the most, best first
// (ties: lower slot, then lower expert). Each takes the least loaded rank holding the cool
// expert but not the hot one.
std::vector<Shift> count_shifts(const Packing& pk, double allowed, size_t most);

}  // namespace hybrid_ep::balancer::detail
