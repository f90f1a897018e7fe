// Expert placement for one MoE layer: which expert each slot holds, so that the most loaded
// rank carries as few tokens as possible (hybrid_ep/balancer/planner.py, docs/balancer.md).
//
// Plain C++, one layer at a time except keep_previous, whose layers share one budget of
// exchanges: the planner is a local search (swaps and replica changes at the most loaded
// rank), sequential by nature, and a Python loop over it costs about a thousand times more
// than the search itself.
//
// A slot holding expert e weighs load[e] / copies(e); rank r owns slots r*P .. r*P + P - 1.
// Legend: E experts, S slots, W ranks, N nodes, G = W / N, P = S / W.
//
// Where each part lives: fresh.cpp (plan_fresh, lower_bound), nodes.cpp (plan_local,
// keep_local), refit.cpp (keep_previous, walk_back_to), exchange.cpp (the refit's one-slot exchange), shifts.cpp (its
// count shifts), baselines.cpp (eplb, eplb_hierarchical, greedy), copies.cpp (replica_counts), packing.cpp (peak_load);
// packing.h and copies.h hold what they share.
#pragma once
#include <cstdint>
#include <vector>

namespace hybrid_ep::balancer {

using Slots = std::vector<int64_t>;  // [S] expert of each slot

// Copies per expert: each spare slot to the largest load / copies, at most cap copies
// (ties: lower expert id).
std::vector<int> replica_counts(const double* load, int E, int S, int cap);

// The fresh plan: the best (smallest largest rank) of balanced differencing (of the capped
// copies, and of copies that split only the few heaviest experts), EPLB's plan and greedy
// longest-processing-time packing, each followed by swaps at the most loaded rank;
// then (onto_nodes) ranks ordered onto nodes so an expert's copies share nodes (group_nodes).
// alternatives=false: balanced differencing and its swaps only (the node-aware plan packs
// every node of every layer this way: the alternatives cost more than they gain there).
Slots plan_fresh(const double* load, int E, int S, int N, int W, bool onto_nodes = true, bool alternatives = true);

// Ranks reordered so ranks sharing experts sit on one node: a permutation of whole ranks,
// so every rank's load and the peak keep their bits. The refit needs only the fresh plan's
// copies and peak, and orders ranks onto nodes only where it matches the plan onto previous.
Slots group_nodes(const Slots& slots, int E, int N, int W);

// previous re-fitted to load with few changed slots, layer by layer (load [L, E], previous,
// fresh and slots [L, S], allowed_peak and reached [L]): swaps and one-slot replica changes at
// the most loaded rank until it carries at most allowed_peak tokens; where that gets stuck
// or changes more than a quarter of the slots, also from previous with its copies per
// expert first changed to fresh's; where the best still changes more than a fifth, restarts
// that fix one of the three most loaded ranks, drawn from a seeded generator, at each step.
// Then, within a budget of one-slot exchanges per call (layers over the move target first,
// nearest to it first): where a layer changes more than 9%, the two best rated count shifts
// (one copy moved from a cool replicated expert to a hot one, shifts.h), each followed by the
// exchange below; where it changes more than a tenth, one slot exchanged on every
// over-loaded rank and on a few ranks with room, copy counts kept (exchange.h; the fewest
// changed slots wins). reached[l] is false (slots then hold the best reached) when none gets
// there: no move lowers that rank any more, or the next would change more than max_moves
// slots. A layer's slots never differ from previous in more than max_moves slots (the move
// budget's candidates rely on it). searches=false: the search from previous and from fresh's
// copy counts only, no restarts, count shifts or exchanges (keep_local's node refits, one
// call per node, where those searches cost more than the whole plan may take).
void keep_previous(const double* load, int L, int E, int W, int S, const int64_t* previous, const int64_t* fresh,
                   const double* allowed_peak, int max_moves, int64_t* slots, bool* reached, bool searches = true);

// start (a plan within allowed_peak) turned back toward previous slot by slot, every rank
// staying within allowed_peak: swaps with a copy of previous's expert on another rank, or a
// slot alone where its expert keeps another copy; the most slots turned back first. Never
// changes more slots than start does.
Slots walk_back_to(const double* load, int E, int W, const Slots& previous, const Slots& start, double allowed_peak);

// The node-aware plan for the replica choice by locality (hybrid_ep/balancer/slots.py: a
// route takes the copies on its own node, else its expert's primary node's): per expert, the
// nodes holding copies and the primary (its home node e / (E / N) unless moving it pays for
// itself), searched against the node loads plus rdma_weight x the routes served off their
// home node as a fraction of all, within an RDMA budget (off-home routes less a credit for
// the routes satellites keep on their node: at most 1% of all routes, nodes.cpp); then each
// node's S / N slots packed by plan_fresh (N = 1), and swaps of single-copy experts between
// the peak rank and other nodes within the same budget (nodes.cpp).
Slots plan_local(const double* load, int E, int S, int N, int W, double rdma_weight);

// A plan's two terms under the replica choice by locality: rank imbalance (max - mean) / mean
// and the share of all routes served off their home node (hybrid_ep/balancer/metrics.py's
// rank_loads with nodes=N and off_home, for the planner's own comparisons).
void local_terms(const double* load, int E, int W, int N, const Slots& slots, double* imbalance, double* off);

// previous re-fitted node by node (load [L, E], previous, target and slots [L, S],
// allowed_peak and reached [L]): a node placement (which nodes hold each expert) that of target
// where given (not null), else previous's searched on as plan_local searches from the home
// placement (kept as it is with keep_layout); then each node's slots re-fitted by keep_previous
// from previous's slots of that node toward allowed_peak, at most max_moves changed slots per
// node. reached[l]: every node of layer l got there.
void keep_local(const double* load, int L, int E, int W, int N, int S, const int64_t* previous, const int64_t* target,
                double rdma_weight, bool keep_layout, const double* allowed_peak, int max_moves, int64_t* slots,
                bool* reached);

// plan with the ranks of each node and the slots of each rank permuted to match previous
// (every expert stays on its node, so the node-aware plan's copies keep serving their nodes):
// ranks of a node matched greedily by the copies they share, then each expert the old rank
// held put back in its old slot. The balance is unchanged (a permutation within nodes).
Slots align_within_nodes(const Slots& plan, const Slots& previous, int E, int N, int W);

// EPLB's hierarchical policy (one expert per group; N = 1 is its global policy).
Slots eplb_hierarchical(const double* load, int E, int S, int N, int W);
// Per layer the better of EPLB's hierarchical and global plans.
Slots eplb(const double* load, int E, int S, int N, int W);
// Replicate the largest load / copies, then longest-processing-time packing.
Slots greedy(const double* load, int E, int S, int W);

// No placement of S slots has a peak below the mean rank load or below the largest copy
// weight of the copies that minimise it (each spare slot to the largest load / copies).
double lower_bound(const double* load, int E, int S, int W);

// Largest rank load of a plan.
double peak_load(const double* load, int E, int W, const Slots& slots);

}  // namespace hybrid_ep::balancer
