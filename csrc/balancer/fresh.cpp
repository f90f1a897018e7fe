// The fresh plan (planner.h: plan_fresh): replica counts, balanced differencing, swaps, the
// baselines where they end lower, ranks onto nodes; and the lower bound it stops at.
#include <algorithm>
#include <numeric>
#include <vector>

#include "balancer/baselines.h"
#include "balancer/copies.h"
#include "balancer/packing.h"
#include "balancer/planner.h"

namespace hybrid_ep::balancer {

using namespace detail;  // the planner's internals (packing.h, copies.h)

namespace {

// Balanced largest differencing (Karmarkar-Karp with P slots per rank) of slots sorted
// heaviest first: P rounds of W form tuples of W parts; the two tuples with the largest
// spread merge, heaviest part of one with the lightest of the other, until one is left.
Slots pack_differencing(const std::vector<int64_t>& experts, const std::vector<double>& weight, int W,
                        double* peak = nullptr) {
  const int S = static_cast<int>(experts.size()), P = S / W;
  std::vector<double> load(weight);    // [tuple][part]: tuple t starts as round t
  std::vector<int> part(S), owner(P);  // part of each slot in its tuple; tuple holding each round
  for (int k = 0; k < S; ++k) part[k] = k % W;
  std::iota(owner.begin(), owner.end(), 0);
  std::vector<bool> alive(P, true);
  std::vector<double> spread(P);
  auto tuple_spread = [&](int t) {
    auto [lo, hi] = std::minmax_element(load.begin() + t * W, load.begin() + (t + 1) * W);
    return *hi - *lo;
  };
  for (int t = 0; t < P; ++t) spread[t] = tuple_spread(t);
  std::vector<double> tmp(W);
  using LoadPart = std::pair<double, int>;  // (load, part): LargerFirst / SmallerFirst order
  std::vector<LoadPart> va(W), vb(W);
  std::vector<int> new_a(W), new_b(W);
  for (int merge = 0; merge + 1 < P; ++merge) {
    int a = -1, b = -1;  // largest two spreads, ties by index
    for (int t = 0; t < P; ++t) {
      if (!alive[t]) continue;
      if (a < 0 || spread[t] > spread[a]) {
        b = a;
        a = t;
      } else if (b < 0 || spread[t] > spread[b]) b = t;
    }
    double* la = load.data() + a * W;
    const double* lb = load.data() + b * W;
    // parts beside their loads, so the comparisons load nothing indirectly (3% of the fresh
    // plan's C++ call on the 61-layer loads against sorting part indices by their loads)
    for (int j = 0; j < W; ++j) va[j] = {la[j], j}, vb[j] = {lb[j], j};
    std::sort(va.begin(), va.end(), LargerFirst{});
    std::sort(vb.begin(), vb.end(), SmallerFirst{});
    for (int j = 0; j < W; ++j) {
      tmp[j] = va[j].first + vb[j].first;
      new_a[va[j].second] = j;
      new_b[vb[j].second] = j;
    }
    std::copy(tmp.begin(), tmp.end(), la);
    // only the rounds of tuples a and b change parts, so only they are remapped, round by
    // round (a division by W per slot over all rounds cost up to 0.8 ms of a 61-layer plan)
    for (int round = 0; round < P; ++round) {
      if (owner[round] != a && owner[round] != b) continue;
      const std::vector<int>& to = owner[round] == a ? new_a : new_b;
      for (int k = round * W; k < (round + 1) * W; ++k) part[k] = to[part[k]];
      owner[round] = a;
    }
    alive[b] = false;
    spread[a] = tuple_spread(a);
  }
  if (peak) {  // the merged tuple's parts are the ranks (its sums in merge order)
    const int t = owner[0];
    *peak = *std::max_element(load.begin() + t * W, load.begin() + (t + 1) * W);
  }
  Slots out(S);
  for (int k = 0; k < S; ++k) out[part[k] * P + k / W] = experts[k];  // round = local slot
  return out;
}

// The copies (heaviest first, ties: expert id) when the j heaviest experts (by_load: experts
// heaviest first) share every spare slot, at most cap copies each, and the rest keep one;
// none (empty) when the heaviest copy is not below `below` (no packing of them would be).
Copies split_heaviest(const double* load, const std::vector<int>& by_load, int S, int cap, int j, double below) {
  const int E = static_cast<int>(by_load.size());
  std::vector<double> top(j);
  for (int k = 0; k < j; ++k) top[k] = load[by_load[k]];
  const std::vector<int> top_reps = spread_copies(top.data(), j, S - E + j, cap);
  double heaviest = j < E ? load[by_load[j]] : -kInf;
  for (int k = 0; k < j; ++k) heaviest = std::max(heaviest, top[k] / top_reps[k]);
  if (heaviest >= below) return {};
  using Copy = std::pair<double, int64_t>;  // (weight, expert)
  auto heavier = [](const Copy& a, const Copy& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  std::vector<Copy> all;
  all.reserve(S);
  for (int k = 0; k < j; ++k)
    for (int c = 0; c < top_reps[k]; ++c) all.emplace_back(top[k] / top_reps[k], by_load[k]);
  std::sort(all.begin(), all.end(), heavier);
  const size_t split = all.size();
  for (int k = j; k < E; ++k) all.emplace_back(load[by_load[k]], by_load[k]);  // already in order
  std::inplace_merge(all.begin(), all.begin() + split, all.end(), heavier);
  Copies out;
  out.reps.assign(E, 1);
  for (int k = 0; k < j; ++k) out.reps[by_load[k]] = top_reps[k];
  for (const Copy& c : all) {
    out.experts.push_back(c.second);
    out.weight.push_back(c.first);
  }
  return out;
}

}  // namespace

// Node by node, the free rank sharing the most copies seeds it, then the free ranks sharing
// the most experts with the node so far fill it.
Slots group_nodes(const Slots& slots, int E, int N, int W) {
  const int S = static_cast<int>(slots.size()), P = S / W, G = W / N;
  if (N == 1 || G == 1) return slots;
  // the ranks of every copy, grouped by expert
  const SlotsByExpert of = slots_by_expert(slots, E);
  const std::vector<int>& start = of.at;
  std::vector<int> ranks(S);
  for (int i = 0; i < S; ++i) ranks[i] = of.slots[i] / P;
  // share[a][b]: pairs of copies of one expert on ranks a and b; row[a]: its sum over b
  std::vector<int> share(static_cast<size_t>(W) * W, 0), row(W, 0);
  for (int e = 0; e < E; ++e)
    for (int i = start[e]; i < start[e + 1]; ++i) {
      row[ranks[i]] += start[e + 1] - start[e];
      for (int j = start[e]; j < start[e + 1]; ++j) share[static_cast<size_t>(ranks[i]) * W + ranks[j]] += 1;
    }
  std::vector<char> free(W, 1);
  std::vector<int> order(W);
  for (int n = 0; n < N; ++n) {
    std::vector<int> node_share(W, 0);
    for (int g = 0; g < G; ++g) {
      const std::vector<int>& score = g ? node_share : row;
      // the lowest free rank first (one is free: n * G + g < W ranks are taken)
      int best = static_cast<int>(std::find(free.begin(), free.end(), 1) - free.begin());
      for (int r = best + 1; r < W; ++r)
        if (free[r] && score[r] > score[best]) best = r;
      order[n * G + g] = best;
      free[best] = 0;
      for (int r = 0; r < W; ++r) node_share[r] += share[static_cast<size_t>(best) * W + r];
    }
  }
  Slots out(S);
  for (int k = 0; k < W; ++k)
    std::copy_n(slots.begin() + static_cast<long>(order[k]) * P, P, out.begin() + static_cast<long>(k) * P);
  return out;
}

double lower_bound(const double* load, int E, int S, int W) {
  return copies_bound(load, sorted_copies(load, replicate(std::vector<double>(load, load + E), S)), W);
}

Slots plan_fresh(const double* load, int E, int S, int N, int W, bool onto_nodes, bool alternatives) {
  // the uncapped copies (each spare slot to the largest load / copies) give the lower bound and
  // the greedy plan; the plan itself keeps at most cap copies (one per rank)
  const int cap = std::max(W, (S + E - 1) / E);
  const Copies free = sorted_copies(load, replicate(std::vector<double>(load, load + E), S));
  const bool fits = *std::max_element(free.reps.begin(), free.reps.end()) <= cap;  // then both agree
  const Copies capped = fits ? Copies{} : sorted_copies(load, replica_counts(load, E, S, cap));
  const Copies& mine = fits ? free : capped;
  Packing main(load, E, W, pack_differencing(mine.experts, mine.weight, W));
  separate_copies(main);
  pair_exchange(main, kPairRounds);
  improve(main);
  // EPLB's and the greedy plan, improved by swaps, where they end lower: never worse than either
  // (swaps only lower a plan's peak, so an alternative is improved only when it starts lower;
  // none is tried when the plan meets the lower bound every placement of S slots obeys)
  Slots best = main.slots();
  double best_peak = main.peak();
  auto finish = [&](Slots&& plan) { return onto_nodes ? group_nodes(plan, E, N, W) : std::move(plan); };
  if (!alternatives || best_peak <= copies_bound(load, free, W) * (1 + 1e-12)) return finish(std::move(best));
  // copy counts that split only the j heaviest experts, every other expert single: then the
  // singles are the fine filler that evens out ranks of near-equal experts, where a rule that
  // splits every expert alike (EPLB's, and the counts above) leaves only coarse copies; j from
  // the fewest that take all spare slots, doubling, below the count the plan above splits
  const std::vector<int> by_load = heaviest_first(std::vector<double>(load, load + E));
  if (S > E) {
    int replicated = 0;
    for (int r : mine.reps) replicated += r > 1;
    for (int j = std::max(1, (S - E + cap - 2) / (cap - 1)); j < replicated; j *= 2) {
      const Copies c = split_heaviest(load, by_load, S, cap, j, best_peak);
      if (c.weight.empty()) continue;  // no packing of these copies is lower
      double packed_peak;
      Slots packed = pack_differencing(c.experts, c.weight, W, &packed_peak);
      // the packing's own peak, summed in another order, differs by rounding only: a margin far
      // above it skips building the Packing where it cannot be lower
      if (packed_peak >= best_peak * (1 + 1e-9)) continue;
      Packing pk(load, E, W, std::move(packed));
      if (pk.peak() >= best_peak) continue;  // improving rarely overturns the differencing's order
      separate_copies(pk);
      pair_exchange(pk, kPairRounds);
      improve(pk);
      if (pk.peak() < best_peak) {
        best_peak = pk.peak();
        best = pk.slots();
      }
    }
  }
  auto try_alternative = [&](Slots alt, double alt_peak) {
    if (alt_peak >= best_peak) return;
    Packing pk(load, E, W, std::move(alt));
    improve(pk);
    if (pk.peak() < best_peak) {
      best_peak = pk.peak();
      best = pk.slots();
    }
  };
  auto [eplb_plan, eplb_peak] = detail::eplb_and_peak(load, by_load, E, S, N, W, best_peak);
  try_alternative(std::move(eplb_plan), eplb_peak);
  Slots greedy_plan = detail::lpt_packing(free, E, W, best_peak);
  if (!greedy_plan.empty()) {
    const double greedy_peak = peak_load(load, E, W, greedy_plan);
    try_alternative(std::move(greedy_plan), greedy_peak);
  }
  return finish(std::move(best));
}

}  // namespace hybrid_ep::balancer
