// The baselines the fresh plan also tries (fresh.cpp): EPLB's plan with its peak, and
// longest-processing-time packing. eplb and greedy themselves are in planner.h.
#pragma once
#include <utility>

#include "balancer/copies.h"

namespace hybrid_ep::balancer::detail {

// EPLB's plan (the better of its two policies) and its peak; (empty, inf) where neither
// peak is below `below`. by_load: the experts heaviest first (heaviest_first of load). The
// fresh plan only wants a baseline that beats its own, so the packing stops as soon as a rank
// passes that: on the timing load neither policy ever beats it, and finishing both took a
// quarter of plan_fresh.
std::pair<Slots, double> eplb_and_peak(const double* load, const std::vector<int>& by_load, int E, int S, int N, int W,
                                       double below);

// Heaviest copy first to the least loaded rank with room that lacks its expert (the least
// loaded with room when all hold it); empty once a rank's load passes `below`.
Slots lpt_packing(const Copies& copies, int E, int W, double below);

}  // namespace hybrid_ep::balancer::detail
