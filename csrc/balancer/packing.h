// A plan being improved (Packing) and the swaps that lower its most loaded rank: the state
// every stage of the planner works on (fresh.cpp, refit.cpp). Internal to the planner.
#pragma once
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>
#include <vector>

#include "balancer/planner.h"

namespace hybrid_ep::balancer::detail {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Indices of w heaviest first, ties by index. The planner sorts a few hundred weights many
// times per layer (copies, EPLB's packings), and a comparison sort of doubles mispredicts
// about every other branch there; from kRadixFrom items on, a stable radix sort of the
// weights' bit patterns (byte by byte, bytes that all weights share skipped) costs less.
std::vector<int> heaviest_first(const std::vector<double>& w);

// A plan's slots grouped by expert, flat (a counting sort: a vector per expert costs an
// allocation each): expert e's slots, ascending, are slots[at[e] .. at[e + 1]).
struct SlotsByExpert {
  std::vector<int> at, slots;
};
SlotsByExpert slots_by_expert(const Slots& plan, int E);

// A plan being improved: the expert of each slot, its copies and every rank's load, in step.
class Packing {
 public:
  Packing(const double* load, int E, int W, Slots slots)
      : load_(load), E_(E), W_(W), P_(static_cast<int>(slots.size()) / W), slots_(std::move(slots)), copies_(E, 0),
        cw_(E), gw_(E), w_(slots_.size()), rank_(W, 0.0) {
    for (int64_t e : slots_) copies_[e] += 1;
    for (int64_t e = 0; e < E_; ++e) reweigh(e);
    for (int r = 0; r < W_; ++r) refresh(r);
    by_load_.resize(W_);
    std::iota(by_load_.begin(), by_load_.end(), 0);
    std::sort(by_load_.begin(), by_load_.end(), [&](int a, int b) { return lighter(a, b); });
  }

  int P() const { return P_; }
  int W() const { return W_; }
  const Slots& slots() const { return slots_; }
  int64_t expert(int s) const { return slots_[s]; }
  int copies(int64_t e) const { return copies_[e]; }
  int copies_size() const { return E_; }
  // Slots holding e (built on first use: only replica moves need it).
  const std::vector<int>& slots_of(int64_t e) {
    if (slots_of_.empty()) {
      slots_of_.resize(E_);
      for (int s = 0; s < static_cast<int>(slots_.size()); ++s) slots_of_[slots_[s]].push_back(s);
    }
    return slots_of_[e];
  }
  double weight(int64_t e) const { return cw_[e]; }
  // weight of each copy of e after it gains one
  double gained_weight(int64_t e) const { return gw_[e]; }
  double slot_weight(int s) const { return w_[s]; }
  double load(int64_t e) const { return load_[e]; }
  double rank_load(int r) const { return rank_[r]; }
  const std::vector<int>& by_load() const { return by_load_; }
  // Ranks above allowed, most loaded first, into out (at most `most`).
  void over_loaded(double allowed, std::vector<int>& out, size_t most = SIZE_MAX) const {
    out.clear();
    for (auto it = by_load_.rbegin(); it != by_load_.rend() && out.size() < most && rank_[*it] > allowed; ++it)
      out.push_back(*it);
  }
  // The most loaded rank (ties: the highest rank).
  int peak_rank() const { return by_load_.back(); }
  double peak() const { return rank_[by_load_.back()]; }
  double mean() const { return std::accumulate(rank_.begin(), rank_.end(), 0.0) / W_; }
  int count_on(int r, int64_t e) const {
    if (held_.empty()) {  // built on first use: plans only compared by their peak never need it
      held_.assign(static_cast<size_t>(W_) * E_, 0);
      for (int s = 0; s < static_cast<int>(slots_.size()); ++s)
        held_[static_cast<size_t>(s / P_) * E_ + slots_[s]] += 1;
    }
    return held_[static_cast<size_t>(r) * E_ + e];
  }
  bool holds(int r, int64_t e) const { return count_on(r, e) > 0; }

  void swap(int s, int t) {
    if (!slots_of_.empty()) {
      relabel(s, slots_[s], slots_[t]);
      relabel(t, slots_[t], slots_[s]);
    }
    move_held(s, slots_[s], slots_[t]);
    move_held(t, slots_[t], slots_[s]);
    std::swap(slots_[s], slots_[t]);
    refresh(s / P_);
    refresh(t / P_);
  }

  // Slot s now holds e: copies change, so every rank holding either expert is refreshed.
  void set(int s, int64_t e) {
    const int64_t old = slots_[s];
    copies_[old] -= 1;
    copies_[e] += 1;
    reweigh(old);
    reweigh(e);
    slots_of(e);  // built before the change
    relabel(s, old, e);
    move_held(s, old, e);
    slots_[s] = e;
    for (int64_t x : {old, e})
      for (int t : slots_of_[x]) refresh(t / P_);
    refresh(s / P_);
  }

 private:
  void reweigh(int64_t e) {
    cw_[e] = copies_[e] ? load_[e] / copies_[e] : 0.0;
    gw_[e] = load_[e] / (copies_[e] + 1);
  }
  void move_held(int s, int64_t from, int64_t to) {
    if (held_.empty()) return;
    held_[static_cast<size_t>(s / P_) * E_ + from] -= 1;
    held_[static_cast<size_t>(s / P_) * E_ + to] += 1;
  }
  void relabel(int s, int64_t from, int64_t to) {
    auto& v = slots_of_[from];
    v.erase(std::find(v.begin(), v.end(), s));
    auto& w = slots_of_[to];
    w.insert(std::upper_bound(w.begin(), w.end(), s), s);  // kept ascending
  }
  bool lighter(int a, int b) const { return rank_[a] < rank_[b] || (rank_[a] == rank_[b] && a < b); }
  void refresh(int r) {
    double sum = 0.0;
    for (int s = r * P_; s < (r + 1) * P_; ++s) sum += w_[s] = weight(slots_[s]);
    rank_[r] = sum;
    if (by_load_.empty()) return;
    auto at = std::find(by_load_.begin(), by_load_.end(), r);
    for (; at != by_load_.begin() && lighter(r, *(at - 1)); --at) *at = *(at - 1);
    for (; at + 1 != by_load_.end() && lighter(*(at + 1), r); ++at) *at = *(at + 1);
    *at = r;
  }

  const double* load_;
  int E_, W_, P_;
  Slots slots_;
  std::vector<int> copies_;
  std::vector<double> cw_, gw_;         // [E] weight of a copy now, and after the expert gains one
  mutable std::vector<uint16_t> held_;  // [W][E] copies of each expert on each rank
  std::vector<std::vector<int>> slots_of_;
  std::vector<double> w_;  // [S] weight of each slot's copy
  std::vector<double> rank_;
  std::vector<int> by_load_;  // ranks, lightest first (ties: lower rank)
};

// A swap between the peak rank m and another: slots (s, t) and the larger of the two new loads.
struct Swap {
  int s = -1, t = -1;
  double pair = kInf;
};

// The swap that leaves the larger of (m, partner) smallest, below lm - min_drop; no expert
// twice on a rank. A partner b can reach no pair below (lm + lb) / 2, so partners go lightest
// first until that bound passes the best pair.
Swap best_swap(const Packing& pk, int m, double min_drop);

// Swaps at the peak rank while they lower it by at least kMinDrop of the mean rank load (each
// lowers the sum of squared rank loads, so the loop ends); smaller gains are below the noise
// of the statistics and only lengthen the loop's tail.
void improve(Packing& pk);

// Rounds of swaps between the i-th heaviest and the i-th lightest rank, each pair taking the
// swap that leaves its larger load smallest: it lowers many heavy ranks per round, where
// improve lowers one per step, so improve has a shorter tail.
constexpr int kPairRounds = 2;  // more rounds: no fewer swaps left for improve
void pair_exchange(Packing& pk, int rounds);

// Second copies of an expert on one rank go to the partner slot that keeps the pair's larger
// load smallest, unless every such swap raises the layer's peak.
void separate_copies(Packing& pk);

}  // namespace hybrid_ep::balancer::detail
