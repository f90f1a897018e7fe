// The one-slot exchange: a refit candidate that changes exactly one slot on each over-loaded
// rank and on a few ranks with room, copy counts kept (tools/balancer_study/NOTES.md, "One slot per
// rank").
// Internal to the planner (refit.cpp).
#pragma once
#include "balancer/packing.h"

namespace hybrid_ep::balancer::detail {

// pk's plan with one slot of every rank above allowed, and of as few ranks with room as the
// search finds, exchanging their copies: every copy stays, every rank ends within allowed, no
// expert twice on a rank. Returns false (out untouched) where it finds no such exchange, e.g.
// where some over-loaded rank cannot shed its excess by trading one copy for a lighter one.
bool one_slot_exchange(const Packing& pk, double allowed, int fewer_than, Slots& out);

}  // namespace hybrid_ep::balancer::detail
