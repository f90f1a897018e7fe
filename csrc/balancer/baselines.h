// The baselines the fresh plan also tries (fresh.cpp): EPLB's plan with its peak, and
// longest-processing-time packing. eplb and greedy themselves are in planner.h.
#pragma once
#include <utility>

#include "balancer/copies.h"

namespace hybrid_ep::balancer::detail {

// EPLB's plan (the better of its two policies) and its peak.
std::pair<Slots, double> eplb_and_peak(const double* load, int E, int S, int N, int W);

// Heaviest copy first to the least loaded rank with room that lacks its expert (the least
// loaded with room when all hold it).
Slots lpt_packing(const Copies& copies, int E, int W);

}  // namespace hybrid_ep::balancer::detail
