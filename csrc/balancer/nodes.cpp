// The node-aware plan (planner.h: plan_local, keep_local): which nodes hold copies of each
// expert, searched against an objective that weighs imbalance against routes served off
// their home node, then every node packed on its own by the single-node planner.
//
// Under the replica choice by locality (hybrid_ep/balancer/slots.py) a route takes the copies
// on its own node, else those on the expert's primary node. Each node's ranks send 1 / N of
// an expert's tokens, so a copy set is a node demand: load / N on every node holding a copy
// (its own routes), plus on the primary the shares of the nodes holding none. A node's slots
// then split its demands among its ranks exactly as one node of S / N slots would (plan_fresh
// with N = 1): the search is over nodes, the packing is the planner's.
//
// Moves at the node level, from the most loaded node h (node load: the larger of its demand
// per rank and its heaviest copy, once its spare slots split its largest demands, plus the
// P - 1 lightest copies for the other slots of that rank; bounds the packing cannot beat):
//   satellite: a copy of an expert whose primary is h on a node m without one; it takes m's
//     own routes (load / N) off h and crosses no link (a route served on its own node);
//     where m has no free slot, m's coldest single-node expert moves to h in the same step;
//   move: a single-node expert's copies to another node, whose routes then cross to it;
//   swap: two single-node experts trade nodes.
// Objective: the 16-norm of the node loads over the mean rank load (a smooth maximum: a move
// that lowers one of several nodes at the peak counts) plus rdma_weight x (routes served
// off their home node, the shares of the nodes without a copy of an expert whose primary
// is not its home) / (all routes), subject to the RDMA budget (below: a move or swap that
// would spend more than it allows is not taken, so without spare slots a permutation moves
// experts off their node only within it). Steepest descent, one move per step: satellites alone
// first (they cost nothing), then every kind; after a satellite, more of the same expert on
// the lightest nodes while each lowers the objective. Then the nodes are packed, and
// single-copy experts of the peak rank swap with lighter ones of other nodes while that
// lowers the objective (polish).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <numeric>
#include <utility>
#include <vector>

#include "balancer/packing.h"
#include "balancer/planner.h"

namespace hybrid_ep::balancer {

using namespace detail;

namespace {

constexpr int kExpertsTried = 8;  // of the peak node, per kind of move
constexpr int kTargetsTried = 4;  // lightest nodes a step moves load to
// Steps with every expert and node once the lists above stop: on the locality study's 8 x 8
// rows with a spare slot per rank, 2 took the largest node from 1.026 to 1.016 of the mean
// (zipf 0.8) and 1.018 to 1.014 (the training statistics) for 1-2 ms of the 61-layer plan;
// more cost 1 ms each and did not lower those further.
constexpr int kWideSteps = 2;
constexpr double kMinGain = 1e-12;  // relative: below it a step is rounding

// The RDMA budget (planner.h: plan_local): routes served off their home node, less
// kSatelliteCredit x the routes satellites serve on their own node, at most kOffHomeBudget of
// all routes. An off-home route adds at most one RDMA row (none where its token reaches that
// node anyway) and a satellite's route saves one where its token needs its home node for no
// other route. A token of the DeepSeek-V3-like layer of docs/benchmarks/balancer_locality.md
// sends 3.5 RDMA rows for its 8 routes on 8 nodes (2.3 on 4), so an off-home share f adds at
// most 2.3 f (8 x 8) to 3.4 f (4 x 8) of its bytes; measured, 0.9-1.9 f (the moved experts'
// tokens mostly reach their new node anyway), and satellites saved 0.4-0.7x their share: at
// 1% that layer's plans stayed within 1.017x the home placement's bytes. 0.8% (1.012x) left
// three of its eight rows without spare slots more imbalanced than the node-agnostic plan.
constexpr double kOffHomeBudget = 0.01;
constexpr double kSatelliteCredit = 0.3;

double pow16(double x) {  // the smooth maximum's power
  x *= x;
  x *= x;
  x *= x;
  return x * x;
}

// Which nodes hold copies of each expert, and its primary node.
struct NodePlacement {
  int E = 0, N = 0;
  std::vector<int> primary;     // [E]
  std::vector<uint8_t> holds;   // [E][N]
  std::vector<int> nodes_held;  // [E]
  bool at(int e, int n) const { return holds[static_cast<size_t>(e) * N + n] != 0; }
};

int home_of(int e, int E, int N) { return e / (E / N); }

NodePlacement home_placement(int E, int N) {
  NodePlacement l{E, N, std::vector<int>(E), std::vector<uint8_t>(static_cast<size_t>(E) * N, 0),
                  std::vector<int>(E, 1)};
  for (int e = 0; e < E; ++e) {
    l.primary[e] = home_of(e, E, N);
    l.holds[static_cast<size_t>(e) * N + l.primary[e]] = 1;
  }
  return l;
}

// The node placement of a slot placement: copies per node, primary by placement.primary_nodes' rule.
NodePlacement node_placement_of(const int64_t* slots, int E, int S, int N) {
  NodePlacement l{E, N, std::vector<int>(E), std::vector<uint8_t>(static_cast<size_t>(E) * N, 0),
                  std::vector<int>(E, 0)};
  std::vector<int> count(static_cast<size_t>(E) * N, 0);
  for (int s = 0; s < S; ++s) count[static_cast<size_t>(slots[s]) * N + s / (S / N)] += 1;
  for (int e = 0; e < E; ++e) {
    const int* c = count.data() + static_cast<size_t>(e) * N;
    const int home = home_of(e, E, N);
    l.primary[e] = c[home] > 0 ? home : static_cast<int>(std::max_element(c, c + N) - c);
    for (int n = 0; n < N; ++n)
      if (c[n] > 0) l.holds[static_cast<size_t>(e) * N + n] = 1, l.nodes_held[e] += 1;
  }
  return l;
}

// Routes of e served off its home node: the shares of the nodes without a copy, where they go
// to a primary that is not its home.
double off_home(const double* load, const NodePlacement& l, int e) {
  const int N = l.N;
  return l.primary[e] == home_of(e, l.E, N) ? 0.0 : load[e] * (N - l.nodes_held[e]) / N;
}

// Routes of e its satellites serve on their own nodes.
double satellite_routes(const double* load, const NodePlacement& l, int e) {
  return load[e] * (l.nodes_held[e] - 1) / l.N;
}

// The budget's measure of a plan's added RDMA rows, a fraction of all routes.
double rdma_spend(double off, double satellites, double total) {
  return total > 0 ? (off - kSatelliteCredit * satellites) / total : 0.0;
}

// Node demand of e on n.
double demand(const double* load, const NodePlacement& l, int e, int n) {
  if (!l.at(e, n)) return 0.0;
  const double share = load[e] / l.N;
  return n == l.primary[e] ? share * (l.N - l.nodes_held[e] + 1) : share;
}

class NodeSearch {
 public:
  NodeSearch(const double* load, int E, int N, int G, int C, double weight, NodePlacement start)
      : load_(load), E_(E), N_(N), G_(G), C_(C), weight_(weight), l_(std::move(start)), items_(N), demand_(N, 0.0),
        sorted_(N), lb_(N), term_(N) {
    total_ = std::accumulate(load, load + E, 0.0);
    mean_ = total_ / (static_cast<double>(N) * G);
    for (int e = 0; e < E_; ++e) {
      for (int n = 0; n < N_; ++n)
        if (l_.at(e, n)) items_[n].push_back(e);
      off_ += off_home(load_, l_, e);
      sat_ += satellite_routes(load_, l_, e);
    }
    for (int n = 0; n < N_; ++n) refresh(n);
  }

  const NodePlacement& placement() const { return l_; }

  // Satellites first (they cross no link), then every kind of move: a move sheds more in one
  // step, so a search that takes the largest step first moves experts a satellite would relieve.
  void run(int max_steps, bool wide = true) {
    if (total_ <= 0 || N_ == 1) return;
    int steps = 0;
    for (bool moves : {false, true}) {
      moves_ = moves;
      while (steps < max_steps && step()) ++steps;
    }
    // then kWideSteps steps with every expert of the peak node to every node: the short lists
    // stop where the step that evens the last nodes needs a lighter expert or a node further up
    experts_tried_ = E_, targets_tried_ = N_;
    for (int k = 0; wide && k < kWideSteps && steps < max_steps && step(); ++k) ++steps;
  }

 private:
  struct Candidate {
    double key;
    int kind, e, m, f;  // kind 0: satellite (f: evicted to h, or -1); 1: move; 2: swap e <-> f
  };

  // node bound: demand per rank, and the heaviest copy once the spare slots go to the largest
  // demand per copy (at most G copies of one expert: one per rank), as plan_fresh spreads them,
  // with the P - 1 other slots of its rank at least the P - 1 lightest copies
  double bound(double demand, double heaviest) const { return std::max(demand / G_, heaviest); }

  // That heaviest copy's rank bound for node n with one change: `skip`'s demand replaced by
  // `replaced` (< 0: removed) and an item of demand `added` (< 0: none) joined; spare slots
  // left. Only the spare + 1 largest demands can end heaviest (at most `spare` are split).
  double split(int n, int skip, double replaced, double added, int spare) const {
    if (spare < 0) return kInf;
    const auto& v = sorted_[n];
    const size_t k = static_cast<size_t>(spare) + 1;
    // the P - 1 lightest items left (the list is heaviest first), lightest first
    const size_t others = static_cast<size_t>(C_ / G_ - 1);
    light_.clear();
    for (size_t i = v.size(); i-- > 0 && light_.size() < others;)
      if (v[i].second != skip) light_.push_back(v[i].first);
    auto lighter = [&](double d) {  // d among the lightest, in place
      if (others == 0 || (light_.size() == others && d >= light_.back())) return;
      if (light_.size() == others) light_.pop_back();
      light_.insert(std::upper_bound(light_.begin(), light_.end(), d), d);
    };
    buf_.clear();
    for (size_t i = 0; i < v.size() && buf_.size() < k; ++i)
      if (v[i].second != skip) buf_.push_back(v[i].first);
    for (double d : {replaced, added}) {  // into place, heaviest first, at most k kept
      if (d < 0) continue;
      lighter(d);
      if (buf_.size() == k && d <= buf_.back()) continue;
      if (buf_.size() == k) buf_.pop_back();
      buf_.insert(std::upper_bound(buf_.begin(), buf_.end(), d, std::greater<>()), d);
    }
    if (buf_.empty()) return 0.0;
    double heaviest;
    if (static_cast<size_t>(spare) >= (G_ - 1) * buf_.size()) {  // every one of them split G ways
      heaviest = buf_.front() / G_;
      lighter(buf_.back() / G_);
    } else {
      // each spare slot to the largest demand per copy (a heap of (per copy, item))
      copies_.assign(buf_.size(), 1);
      heap_.clear();
      for (size_t i = 0; i < buf_.size(); ++i) heap_.emplace_back(buf_[i], static_cast<int>(i));
      std::make_heap(heap_.begin(), heap_.end());
      for (int left = spare; left > 0 && !heap_.empty(); --left) {
        std::pop_heap(heap_.begin(), heap_.end());
        const int i = heap_.back().second;
        copies_[i] += 1;
        if (copies_[i] < G_) heap_.back() = {buf_[i] / copies_[i], i}, std::push_heap(heap_.begin(), heap_.end());
        else heap_.pop_back();
      }
      heaviest = 0.0;
      for (size_t i = 0; i < buf_.size(); ++i) {
        heaviest = std::max(heaviest, buf_[i] / copies_[i]);
        if (copies_[i] > 1) lighter(buf_[i] / copies_[i]);
      }
    }
    return heaviest + std::accumulate(light_.begin(), light_.end(), 0.0);
  }

  double term(double lb) const { return pow16(lb / mean_); }
  double key(double sum_terms, double off) const {  // the 16th root as four square roots
    return std::sqrt(std::sqrt(std::sqrt(std::sqrt(sum_terms / N_)))) + weight_ * off / total_;
  }
  // key(sum_terms, off) >= k, without the roots (the candidates' pre-checks, many per step)
  bool not_below(double sum_terms, double off, double k) const {
    const double norm = k - weight_ * off / total_;
    return norm <= 0 || sum_terms / N_ >= pow16(norm);
  }

  void refresh(int n) {
    // the list as it was, its demands updated, the experts gone dropped and the new ones (the
    // last of items_[n]: a node's experts are only erased or appended) added, then put in
    // order by insertion: a step changes a few demands, so the list is nearly in order
    auto& v = sorted_[n];
    size_t kept = 0;
    for (const auto& [x, e] : v)
      if (l_.at(e, n)) v[kept++] = {demand(load_, l_, e, n), e};
    v.resize(kept);
    for (size_t i = kept; i < items_[n].size(); ++i) v.emplace_back(demand(load_, l_, items_[n][i], n), items_[n][i]);
    auto before = [](const std::pair<double, int>& a, const std::pair<double, int>& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    for (size_t i = 1; i < v.size(); ++i)
      for (size_t j = i; j > 0 && before(v[j], v[j - 1]); --j) std::swap(v[j], v[j - 1]);
    double d = 0.0;
    for (const auto& item : v) d += item.first;
    demand_[n] = d;
    const int spare = C_ - static_cast<int>(items_[n].size());
    lb_[n] = bound(d, split(n, -1, -1.0, -1.0, spare));
    term_[n] = term(lb_[n]);
  }

  double sum_terms() const { return std::accumulate(term_.begin(), term_.end(), 0.0); }

  // the evictable expert of m for a satellite: its coldest single-node expert with primary m
  int coldest(int m) const {
    int best = -1;
    for (int f : items_[m])
      if (l_.nodes_held[f] == 1 && (best < 0 || load_[f] < load_[best])) best = f;
    return best;
  }

  double off_change(int e, int from, int to) const {  // a single-node expert moving nodes
    const int home = home_of(e, E_, N_);
    const double moved = load_[e] * (N_ - 1) / N_;
    return (to == home ? -moved : 0.0) + (from == home ? moved : 0.0);
  }

  bool step() {
    const int h = static_cast<int>(std::max_element(lb_.begin(), lb_.end()) - lb_.begin());
    std::vector<int> targets(N_);
    std::iota(targets.begin(), targets.end(), 0);
    std::stable_sort(targets.begin(), targets.end(), [&](int a, int b) { return lb_[a] < lb_[b]; });
    targets.erase(std::remove(targets.begin(), targets.end(), h), targets.end());
    if (static_cast<int>(targets.size()) > targets_tried_) targets.resize(targets_tried_);
    // experts with primary h: heaviest demand on h first (satellites shed from these), the
    // first experts_tried_ of each kind from h's list by demand
    std::vector<int> own, single;
    const size_t tried = static_cast<size_t>(experts_tried_);
    for (const auto& [d, e] : sorted_[h]) {
      if (l_.primary[e] != h) continue;
      if (own.size() < tried) own.push_back(e);
      if (l_.nodes_held[e] == 1 && single.size() < tried) single.push_back(e);
      if (own.size() == tried && single.size() == tried) break;
    }
    const double base_terms = sum_terms();
    const double base = key(base_terms, off_);
    Candidate best{base * (1 - kMinGain), -1, -1, -1, -1};
    // within the RDMA budget, or lowering what is spent where a start is over it
    const double spent = rdma_spend(off_, sat_, total_);
    auto affordable = [&](double off, double sat) {
      const double after = rdma_spend(off, sat, total_);
      return after <= kOffHomeBudget || after <= spent;
    };
    auto consider = [&](int kind, int e, int m, int f, double lb_h, double lb_m, double off) {
      const double terms = base_terms - term_[h] - term_[m] + term(lb_h) + term(lb_m);
      if (not_below(terms, off, best.key) || !affordable(off, sat_ + (kind == 0 ? load_[e] / N_ : 0.0))) return;
      const double k = key(terms, off);
      if (k < best.key) best = {k, kind, e, m, f};
    };
    // a move that only adds load to m cannot beat the best with m's bound where it is now
    auto hopeless = [&](int m, double lb_h, double off) {
      return not_below(base_terms - term_[h] + term(lb_h), off, best.key);
    };
    // nor one whose new demands per rank alone (each a lower bound of its node's bound) do not
    // beat it, nor one the budget refuses: both checked before the bounds' spare-slot splits
    auto out = [&](int m, double lb_h, double demand_m, double off, double sat) {
      return not_below(base_terms - term_[h] - term_[m] + term(lb_h) + term(demand_m / G_), off, best.key) ||
             !affordable(off, sat);
    };
    const int items_h = static_cast<int>(items_[h].size());
    // h's side of a satellite and of a move does not depend on the target: once per expert,
    // on first use (a candidate whose demands alone cannot beat the best never needs it)
    std::vector<double> sat_h(own.size(), -1.0), move_h(single.size(), -1.0);
    auto sat_side = [&](size_t i) {
      if (sat_h[i] < 0) {
        const int e = own[i];
        const double share = load_[e] / N_;
        sat_h[i] = bound(demand_[h] - share, split(h, e, demand(load_, l_, e, h) - share, -1.0, C_ - items_h));
      }
      return sat_h[i];
    };
    auto move_side = [&](size_t i) {
      if (move_h[i] < 0)
        move_h[i] = bound(demand_[h] - load_[single[i]], split(h, single[i], -1.0, -1.0, C_ - items_h + 1));
      return move_h[i];
    };
    std::vector<std::pair<double, int>> partners;
    for (int m : targets) {
      const int items_m = static_cast<int>(items_[m].size());
      const int evict = items_m >= C_ ? coldest(m) : -1;
      partners.clear();  // m's single-node experts by load (their demand), lightest first, for swaps
      if (moves_)
        for (auto it = sorted_[m].rbegin(); it != sorted_[m].rend(); ++it)
          if (l_.nodes_held[it->second] == 1) partners.emplace_back(load_[it->second], it->second);
      for (size_t i = 0; i < own.size(); ++i) {  // satellites
        const int e = own[i];
        // of experts at home only: the replica choice takes an expert's primary by its copies
        // (home, else the node with most), which for a moved expert with satellites can be
        // another node than the search's
        if (l_.at(e, m) || h != home_of(e, E_, N_)) continue;
        const double share = load_[e] / N_;
        const double off = off_ - (l_.primary[e] == home_of(e, E_, N_) ? 0.0 : share);
        if (items_m < C_) {
          if (out(m, (demand_[h] - share) / G_, demand_[m] + share, off, sat_ + share) ||
              hopeless(m, sat_side(i), off) || out(m, sat_side(i), demand_[m] + share, off, sat_ + share))
            continue;
          consider(0, e, m, -1, sat_side(i), bound(demand_[m] + share, split(m, -1, -1.0, share, C_ - items_m - 1)),
                   off);
        } else if (evict >= 0 && items_h < C_) {  // m's coldest single-node expert goes to h
          const double lf = load_[evict];
          if (out(m, (demand_[h] - share + lf) / G_, demand_[m] - lf + share, off + off_change(evict, m, h),
                  sat_ + share))
            continue;
          const double lb_h =
              bound(demand_[h] - share + lf, split(h, e, demand(load_, l_, e, h) - share, lf, C_ - items_h - 1));
          consider(0, e, m, evict, lb_h, bound(demand_[m] - lf + share, split(m, evict, -1.0, share, C_ - items_m)),
                   off + off_change(evict, m, h));
        }
      }
      for (size_t i = 0; i < single.size() && moves_; ++i) {  // moves and swaps of single-node experts
        const int e = single[i];
        const double le = load_[e];
        const double moved_off = off_ + off_change(e, h, m);
        if (items_m < C_ && items_h > 1 && !out(m, (demand_[h] - le) / G_, demand_[m] + le, moved_off, sat_) &&
            !hopeless(m, move_side(i), moved_off) && !out(m, move_side(i), demand_[m] + le, moved_off, sat_))
          consider(1, e, m, -1, move_side(i), bound(demand_[m] + le, split(m, -1, -1.0, le, C_ - items_m - 1)),
                   off_ + off_change(e, h, m));
        // swap partner: the single-node expert of m lighter than e closest to what evens the pair
        const double want = le - (demand_[h] - demand_[m]) / 2;
        const auto below = std::lower_bound(partners.begin(), partners.end(), std::make_pair(le, -1));
        auto near = std::lower_bound(partners.begin(), below, std::make_pair(want, -1));
        if (near == below || (near != partners.begin() && want - (near - 1)->first <= near->first - want)) {
          if (near == partners.begin()) continue;
          --near;
        }
        const int f = near->second;
        const double lf = load_[f];
        if (out(m, (demand_[h] - le + lf) / G_, demand_[m] - lf + le, off_ + off_change(e, h, m) + off_change(f, m, h),
                sat_))
          continue;
        consider(2, e, m, f, bound(demand_[h] - le + lf, split(h, e, -1.0, lf, C_ - items_h)),
                 bound(demand_[m] - lf + le, split(m, f, -1.0, le, C_ - items_m)),
                 off_ + off_change(e, h, m) + off_change(f, m, h));
      }
    }
    if (best.kind < 0) return false;
    apply(best, h);
    if (best.kind == 0 && best.f < 0) more_satellites(best.e, h);
    return true;
  }

  // After a satellite of e, more of e on the lightest nodes with a free slot while each lowers
  // the objective (the step that chose e would most often choose it again, at full cost).
  void more_satellites(int e, int h) {
    for (;;) {
      if (l_.primary[e] != h) return;
      int m = -1;
      for (int n = 0; n < N_; ++n)
        if (!l_.at(e, n) && static_cast<int>(items_[n].size()) < C_ && (m < 0 || lb_[n] < lb_[m])) m = n;
      if (m < 0) return;
      const double share = load_[e] / N_;
      const int items_h = static_cast<int>(items_[h].size()), items_m = static_cast<int>(items_[m].size());
      const double lb_h = bound(demand_[h] - share, split(h, e, demand(load_, l_, e, h) - share, -1.0, C_ - items_h));
      const double lb_m = bound(demand_[m] + share, split(m, -1, -1.0, share, C_ - items_m - 1));
      const double terms = sum_terms();
      const double off = off_ - (l_.primary[e] == home_of(e, E_, N_) ? 0.0 : share);
      if (key(terms - term_[h] - term_[m] + term(lb_h) + term(lb_m), off) >= key(terms, off_) * (1 - kMinGain)) return;
      apply({0.0, 0, e, m, -1}, h);
    }
  }

  void move_single(int e, int from, int to) {
    off_ -= off_home(load_, l_, e);
    l_.holds[static_cast<size_t>(e) * N_ + from] = 0;
    l_.holds[static_cast<size_t>(e) * N_ + to] = 1;
    l_.primary[e] = to;
    items_[from].erase(std::find(items_[from].begin(), items_[from].end(), e));
    items_[to].push_back(e);
    off_ += off_home(load_, l_, e);
  }

  void apply(const Candidate& c, int h) {
    if (c.kind == 0) {
      if (c.f >= 0) move_single(c.f, c.m, h);
      off_ -= off_home(load_, l_, c.e);
      sat_ -= satellite_routes(load_, l_, c.e);
      l_.holds[static_cast<size_t>(c.e) * N_ + c.m] = 1;
      l_.nodes_held[c.e] += 1;
      items_[c.m].push_back(c.e);
      off_ += off_home(load_, l_, c.e);
      sat_ += satellite_routes(load_, l_, c.e);
    } else {
      move_single(c.e, h, c.m);
      if (c.kind == 2) move_single(c.f, c.m, h);
    }
    refresh(h);
    refresh(c.m);
  }

  const double* load_;
  int E_, N_, G_, C_;
  double weight_, total_ = 0.0, mean_ = 0.0, off_ = 0.0;
  double sat_ = 0.0;   // routes satellites serve on their own nodes
  bool moves_ = true;  // moves and swaps tried too, besides satellites
  int experts_tried_ = kExpertsTried, targets_tried_ = kTargetsTried;
  NodePlacement l_;
  std::vector<std::vector<int>> items_;                      // [N] experts with a copy on each node
  std::vector<double> demand_;                               // [N]
  std::vector<std::vector<std::pair<double, int>>> sorted_;  // [N] (demand, expert), heaviest first
  mutable std::vector<double> buf_, light_;                  // split's scratch
  mutable std::vector<int> copies_;
  mutable std::vector<std::pair<double, int>> heap_;
  std::vector<double> lb_, term_;  // [N] node bound, its term of the norm
};

// The experts with a copy on node n, ascending, and their demands there.
void node_items(const double* load, const NodePlacement& l, int n, std::vector<int>& experts, std::vector<double>& d) {
  experts.clear(), d.clear();
  for (int e = 0; e < l.E; ++e)
    if (l.at(e, n)) experts.push_back(e), d.push_back(demand(load, l, e, n));
}

// Every node packed on its own: its experts' demands over its C slots and G ranks.
Slots pack_nodes(const double* load, const NodePlacement& l, int S, int W) {
  const int N = l.N, C = S / N, G = W / N;
  Slots out(S);
  std::vector<int> experts;
  std::vector<double> d;
  for (int n = 0; n < N; ++n) {
    node_items(load, l, n, experts, d);
    const Slots local = plan_fresh(d.data(), static_cast<int>(experts.size()), C, 1, G, false, false);
    for (int j = 0; j < C; ++j) out[static_cast<size_t>(n) * C + j] = experts[local[j]];
  }
  return out;
}

// Rank loads of a plan under the replica choice by locality (metrics.slot_loads, nodes=N).
std::vector<double> rank_loads(const double* load, const NodePlacement& l, const Slots& slots, int W) {
  const int S = static_cast<int>(slots.size()), N = l.N, C = S / N, P = S / W;
  std::vector<int> copies(static_cast<size_t>(l.E) * N, 0);
  for (int s = 0; s < S; ++s) copies[static_cast<size_t>(slots[s]) * N + s / C] += 1;
  std::vector<double> out(W, 0.0);
  for (int s = 0; s < S; ++s) {
    const int e = static_cast<int>(slots[s]), n = s / C;
    out[s / P] += demand(load, l, e, n) / copies[static_cast<size_t>(e) * N + n];
  }
  return out;
}

// Swaps of single-copy experts between the peak rank and ranks of other nodes while they lower
// the objective (largest rank over the mean + weight x off-home routes / all routes): where a
// node's ranks are even but its peak rank's lightest experts are heavier than other nodes'.
void polish(const double* load, NodePlacement& l, Slots& slots, int W, double weight) {
  const int S = static_cast<int>(slots.size()), N = l.N, C = S / N, P = S / W, E = l.E;
  const double total = std::accumulate(load, load + E, 0.0);
  if (N == 1 || total <= 0) return;
  const double mean = total / W;
  std::vector<int> copies(E, 0);
  for (int64_t e : slots) copies[e] += 1;
  std::vector<double> rank = rank_loads(load, l, slots, W);
  double away = 0.0, sat = 0.0;  // off-home and satellite routes (the swaps keep the satellites)
  for (int e = 0; e < E; ++e) away += off_home(load, l, e), sat += satellite_routes(load, l, e);
  std::vector<int> order(W);
  for (int step = 0; step < S; ++step) {
    std::iota(order.begin(), order.end(), 0);
    const int top = std::min(W, 3);
    std::partial_sort(order.begin(), order.begin() + top, order.end(),
                      [&](int a, int b) { return rank[a] > rank[b] || (rank[a] == rank[b] && a < b); });
    const int p = order[0];
    double best_gain = kMinGain, best_off = 0.0;
    int bs = -1, bt = -1;
    for (int s = p * P; s < (p + 1) * P; ++s) {
      const int e = static_cast<int>(slots[s]);
      if (copies[e] != 1) continue;
      const int he = home_of(e, E, N);
      for (int t = 0; t < S; ++t) {
        const int f = static_cast<int>(slots[t]), q = t / P;
        if (t / C == s / C || copies[f] != 1 || load[f] >= load[e]) continue;
        double rest = 0.0;  // the largest rank but p and q
        for (int i = 1; i < top; ++i)
          if (order[i] != q) {
            rest = rank[order[i]];
            break;
          }
        const double after = std::max({rank[p] - load[e] + load[f], rank[q] - load[f] + load[e], rest});
        const int hf = home_of(f, E, N);
        const double off = ((s / C == he) - (t / C == he)) * load[e] * (N - 1) / N +
                           ((t / C == hf) - (s / C == hf)) * load[f] * (N - 1) / N;
        const double gain = (rank[p] - after) / mean - weight * off / total;
        if (gain > best_gain && (off <= 0 || rdma_spend(away + off, sat, total) <= kOffHomeBudget))
          best_gain = gain, bs = s, bt = t, best_off = off;
      }
    }
    if (bs < 0) return;
    away += best_off;
    const int e = static_cast<int>(slots[bs]), f = static_cast<int>(slots[bt]);
    const int p2 = bs / P, q = bt / P;
    rank[p2] += load[f] - load[e];
    rank[q] += load[e] - load[f];
    std::swap(slots[bs], slots[bt]);
    for (auto [x, to] : {std::pair{e, bt / C}, std::pair{f, bs / C}}) {
      for (int n = 0; n < N; ++n) l.holds[static_cast<size_t>(x) * N + n] = n == to;
      l.primary[x] = to;
    }
  }
}

Slots local_plan(const double* load, int E, int S, int N, int W, double weight) {
  const int G = W / N;
  NodeSearch search(load, E, N, G, S / N, weight, home_placement(E, N));
  search.run(4 * E);
  NodePlacement l = search.placement();
  Slots slots = pack_nodes(load, l, S, W);
  polish(load, l, slots, W, weight);
  return slots;
}

// A start for node n's refit: previous's slots of the node, each expert not in `experts` (the
// node's experts now) replaced by one of them without a slot, then by a second copy of the
// one with the heaviest demand per copy; experts still without a slot take the slot of a copy
// of the one with the lightest demand per copy. Local expert indices.
Slots node_start(const int64_t* previous, int C, const std::vector<int>& experts, const std::vector<double>& d) {
  const int k = static_cast<int>(experts.size());
  std::vector<int> local(previous, previous + C);
  std::vector<int> copies(k, 0);
  for (int& x : local) {
    const auto it = std::lower_bound(experts.begin(), experts.end(), x);
    x = it != experts.end() && *it == x ? static_cast<int>(it - experts.begin()) : -1;
    if (x >= 0) copies[x] += 1;
  }
  auto per_copy = [&](int j) { return copies[j] ? d[j] / copies[j] : kInf; };
  int missing = 0;
  for (int& x : local) {
    if (x >= 0) continue;
    while (missing < k && copies[missing] > 0) ++missing;
    if (missing < k) {
      x = missing;
    } else {
      x = 0;
      for (int j = 1; j < k; ++j)
        if (d[j] / (copies[j] + 1) > d[x] / (copies[x] + 1)) x = j;
    }
    copies[x] += 1;
  }
  for (int j = 0; j < k; ++j) {
    if (copies[j] > 0) continue;
    int give = -1;  // a slot of the expert with most copies to spare, lightest per copy
    for (int s = 0; s < C; ++s)
      if (copies[local[s]] > 1 && (give < 0 || per_copy(local[s]) < per_copy(local[give]))) give = s;
    copies[local[give]] -= 1;
    local[give] = j;
    copies[j] = 1;
  }
  return Slots(local.begin(), local.end());
}

}  // namespace

void local_terms(const double* load, int E, int W, int N, const Slots& slots, double* imbalance, double* off) {
  const NodePlacement l = node_placement_of(slots.data(), E, static_cast<int>(slots.size()), N);
  const std::vector<double> rank = rank_loads(load, l, slots, W);
  const double total = std::accumulate(load, load + E, 0.0);
  const double peak = *std::max_element(rank.begin(), rank.end()), mean = total / W;
  *imbalance = mean > 0 ? (peak - mean) / mean : 0.0;
  double away = 0.0;
  for (int e = 0; e < E; ++e) away += off_home(load, l, e);
  *off = total > 0 ? away / total : 0.0;
}

Slots plan_local(const double* load, int E, int S, int N, int W, double rdma_weight) {
  return local_plan(load, E, S, N, W, rdma_weight);
}

void keep_local(const double* load, int L, int E, int W, int N, int S, const int64_t* previous, const int64_t* target,
                double rdma_weight, bool keep_layout, const double* allowed_peak, int max_moves, int64_t* slots,
                bool* reached) {
  const int C = S / N, G = W / N;
  for (int layer = 0; layer < L; ++layer) {
    const double* ld = load + static_cast<size_t>(layer) * E;
    const int64_t* prev = previous + static_cast<size_t>(layer) * S;
    NodePlacement l = node_placement_of(target ? target + static_cast<size_t>(layer) * S : prev, E, S, N);
    if (!keep_layout && !target) {  // the refit's own node placement: the short lists only (fewer changes)
      NodeSearch search(ld, E, N, G, C, rdma_weight, std::move(l));
      search.run(4 * E, false);
      l = search.placement();
    }
    bool ok = true;
    std::vector<int> experts;
    std::vector<double> d;
    for (int n = 0; n < N; ++n) {
      node_items(ld, l, n, experts, d);
      const int k = static_cast<int>(experts.size());
      const Slots start = node_start(prev + static_cast<size_t>(n) * C, C, experts, d);
      // the refit takes only the copy counts of its `fresh` (where it falls back to them):
      // replica_counts' own, at a small part of a fresh plan's cost
      const std::vector<int> counts = replica_counts(d.data(), k, C, std::max(G, (C + k - 1) / k));
      Slots fresh;
      fresh.reserve(C);
      for (int j = 0; j < k; ++j) fresh.insert(fresh.end(), counts[j], j);
      Slots local(C);
      bool node_ok = false;
      keep_previous(d.data(), 1, k, G, C, start.data(), fresh.data(), allowed_peak + layer, max_moves, local.data(),
                    &node_ok, false);
      ok = ok && node_ok;
      for (int j = 0; j < C; ++j)
        slots[static_cast<size_t>(layer) * S + static_cast<size_t>(n) * C + j] = experts[local[j]];
    }
    reached[layer] = ok;
  }
}

Slots align_within_nodes(const Slots& plan, const Slots& previous, int E, int N, int W) {
  const int S = static_cast<int>(plan.size()), P = S / W, G = W / N;
  // overlap[a][b] of the ranks a (plan) and b (previous) of one node: pairs of copies of one
  // expert on them; greedy matching, the largest entry first (ties: lowest a, then b)
  const SlotsByExpert old = slots_by_expert(previous, E);
  std::vector<int> overlap(static_cast<size_t>(G) * G), dest(W);
  std::vector<char> row_free(G), col_free(G);
  for (int n = 0; n < N; ++n) {
    std::fill(overlap.begin(), overlap.end(), 0);
    for (int a = 0; a < G; ++a)
      for (int s = (n * G + a) * P; s < (n * G + a + 1) * P; ++s)
        for (int i = old.at[plan[s]]; i < old.at[plan[s] + 1]; ++i) {
          const int b = old.slots[i] / P - n * G;
          if (b >= 0 && b < G) overlap[static_cast<size_t>(a) * G + b] += 1;
        }
    std::fill(row_free.begin(), row_free.end(), 1);
    std::fill(col_free.begin(), col_free.end(), 1);
    for (int k = 0; k < G; ++k) {
      int best = -1;
      for (int a = 0; a < G; ++a)
        for (int b = 0; b < G; ++b)
          if (row_free[a] && col_free[b] && (best < 0 || overlap[static_cast<size_t>(a) * G + b] > overlap[best]))
            best = a * G + b;
      row_free[best / G] = col_free[best % G] = 0;
      dest[n * G + best / G] = n * G + best % G;
    }
  }
  // within each matched rank, every expert the old rank held in its old slot, the rest in
  // order into the free slots in order
  Slots out(S, -1);
  std::vector<char> used(P);
  for (int r = 0; r < W; ++r) {
    const int64_t* from = plan.data() + static_cast<size_t>(r) * P;
    const int to = dest[r];
    int64_t* into = out.data() + static_cast<size_t>(to) * P;
    const int64_t* was = previous.data() + static_cast<size_t>(to) * P;
    std::fill(used.begin(), used.end(), 0);
    for (int j = 0; j < P; ++j)
      for (int i = 0; i < P; ++i)
        if (!used[i] && from[i] == was[j]) {
          into[j] = from[i], used[i] = 1;
          break;
        }
    int j = 0;
    for (int i = 0; i < P; ++i) {
      if (used[i]) continue;
      while (into[j] >= 0) ++j;
      into[j] = from[i];
    }
  }
  return out;
}

}  // namespace hybrid_ep::balancer
