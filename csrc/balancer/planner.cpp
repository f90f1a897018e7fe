// Expert placement for one layer (planner.h): packings, swaps, replica moves, EPLB.
#include "balancer/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <utility>

namespace hybrid_ep::balancer {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Indices of w heaviest first, ties by index. The planner sorts a few hundred weights many
// times per layer (copies, EPLB's packings), and a comparison sort of doubles mispredicts
// about every other branch there; from kRadixFrom items on, a stable radix sort of the
// weights' bit patterns (byte by byte, bytes that all weights share skipped) costs less.
constexpr size_t kRadixFrom = 96;

std::vector<int> heaviest_first(const std::vector<double>& w) {
  const size_t n = w.size();
  std::vector<int> order(n);
  std::iota(order.begin(), order.end(), 0);
  if (n < kRadixFrom) {  // weights beside their indices: no indirect loads in the comparisons
    std::vector<std::pair<double, int>> items(n);
    for (size_t i = 0; i < n; ++i) items[i] = {w[i], static_cast<int>(i)};
    std::sort(items.begin(), items.end(), [](const std::pair<double, int>& a, const std::pair<double, int>& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    for (size_t i = 0; i < n; ++i) order[i] = items[i].second;
    return order;
  }
  // ascending key = descending weight: IEEE doubles order as sign-magnitude integers
  std::vector<uint64_t> key(n), key_out(n);
  std::vector<int> order_out(n);
  for (size_t i = 0; i < n; ++i) {
    uint64_t bits;
    const double v = w[i] == 0.0 ? 0.0 : w[i];  // -0.0 ties with 0.0
    std::memcpy(&bits, &v, sizeof bits);
    const uint64_t ascending = bits >> 63 ? ~bits : bits | (uint64_t{1} << 63);
    key[i] = ~ascending;
  }
  for (int shift = 0; shift < 64; shift += 8) {
    size_t start[257] = {};
    for (size_t i = 0; i < n; ++i) start[((key[i] >> shift) & 255) + 1] += 1;
    if (std::find(start + 1, start + 257, n) != start + 257) continue;  // one byte value: order stays
    for (int d = 0; d < 256; ++d) start[d + 1] += start[d];
    for (size_t i = 0; i < n; ++i) {
      const size_t at = start[(key[i] >> shift) & 255]++;
      key_out[at] = key[i];
      order_out[at] = order[i];
    }
    key.swap(key_out);
    order.swap(order_out);
  }
  return order;
}

// A plan being improved: the expert of each slot, its copies and every rank's load, in step.
class Packing {
 public:
  Packing(const double* load, int E, int W, Slots slots)
      : load_(load), E_(E), W_(W), P_(static_cast<int>(slots.size()) / W), slots_(std::move(slots)),
        copies_(E, 0), cw_(E), gw_(E), w_(slots_.size()), rank_(W, 0.0) {
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
      for (int s = 0; s < static_cast<int>(slots_.size()); ++s) held_[static_cast<size_t>(s / P_) * E_ + slots_[s]] += 1;
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
  std::vector<double> cw_, gw_;  // [E] weight of a copy now, and after the expert gains one
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
Swap best_swap(const Packing& pk, int m, double min_drop) {
  const int P = pk.P();
  const double lm = pk.rank_load(m);
  const int64_t* on_m = pk.slots().data() + m * P;
  auto m_holds = [&](int64_t e) { return pk.holds(m, e); };
  Swap best;
  best.pair = std::min(lm - min_drop, lm * (1 - 1e-12));
  for (int b : pk.by_load()) {
    const double lb = pk.rank_load(b);
    if ((lm + lb) / 2 >= best.pair) break;
    if (b == m) continue;
    for (int t = b * P; t < (b + 1) * P; ++t) {
      if (m_holds(pk.expert(t))) continue;
      const double wt = pk.slot_weight(t);
      for (int i = 0; i < P; ++i) {
        const double d = pk.slot_weight(m * P + i) - wt;
        if (d <= 0) continue;
        const double pair = std::max(lm - d, lb + d);
        if (pair < best.pair && !pk.holds(b, on_m[i])) best = {m * P + i, t, pair};
      }
    }
  }
  return best;
}

// Swaps at the peak rank while they lower it by at least kMinDrop of the mean rank load (each
// lowers the sum of squared rank loads, so the loop ends); smaller gains are below the noise
// of the statistics and only lengthen the loop's tail.
constexpr double kMinDrop = 1e-4;

void improve(Packing& pk) {
  const double min_drop = kMinDrop * pk.mean();
  for (int step = 0, cap = 64 * static_cast<int>(pk.slots().size()); step < cap; ++step) {
    const Swap sw = best_swap(pk, pk.peak_rank(), min_drop);
    if (sw.s < 0) return;
    pk.swap(sw.s, sw.t);
  }
}

// Rounds of swaps between the i-th heaviest and the i-th lightest rank, each pair taking the
// swap that leaves its larger load smallest: it lowers many heavy ranks per round, where
// improve lowers one per step, so improve has a shorter tail.
constexpr int kPairRounds = 2;  // more rounds: no fewer swaps left for improve

void pair_exchange(Packing& pk, int rounds) {
  const int P = pk.P(), W = pk.W();
  std::vector<int> order(W);
  for (int round = 0; round < rounds; ++round) {
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(), [&](int a, int b) {
      return pk.rank_load(a) > pk.rank_load(b) || (pk.rank_load(a) == pk.rank_load(b) && a < b);
    });
    bool any = false;
    for (int k = 0; k < W / 2; ++k) {
      const int a = order[k], b = order[W - 1 - k];
      const double la = pk.rank_load(a), lb = pk.rank_load(b);
      Swap best;
      best.pair = la * (1 - 1e-12);
      for (int i = a * P; i < (a + 1) * P; ++i) {
        if (pk.holds(b, pk.expert(i))) continue;
        for (int j = b * P; j < (b + 1) * P; ++j) {
          const double d = pk.slot_weight(i) - pk.slot_weight(j);
          if (d <= 0 || pk.holds(a, pk.expert(j))) continue;
          const double pair = std::max(la - d, lb + d);
          if (pair < best.pair) best = {i, j, pair};
        }
      }
      if (best.s >= 0) pk.swap(best.s, best.t), any = true;
    }
    if (!any) return;
  }
}

// Second copies of an expert on one rank go to the partner slot that keeps the pair's larger
// load smallest, unless every such swap raises the layer's peak.
void separate_copies(Packing& pk) {
  const int P = pk.P(), W = pk.W();
  for (bool changed = true; changed;) {
    changed = false;
    for (int a = 0; a < W; ++a) {
      for (int i = 1; i < P; ++i) {
        const int s = a * P + i;
        const int64_t e = pk.expert(s);
        bool repeat = false;
        for (int k = 0; k < i; ++k) repeat |= pk.expert(a * P + k) == e;
        if (!repeat) continue;
        const double we = pk.weight(e), la = pk.rank_load(a);
        Swap best;
        for (int b = 0; b < W; ++b) {
          if (b == a || pk.holds(b, e)) continue;
          for (int j = 0; j < P; ++j) {
            const int t = b * P + j;
            if (pk.holds(a, pk.expert(t))) continue;
            const double d = we - pk.weight(pk.expert(t));
            const double pair = std::max(la - d, pk.rank_load(b) + d);
            if (pair < best.pair) best = {s, t, pair};
          }
        }
        if (best.s >= 0 && best.pair <= pk.peak()) {
          pk.swap(best.s, best.t);
          changed = true;
        }
      }
    }
  }
}

// Balanced largest differencing (Karmarkar-Karp with P slots per rank) of slots sorted
// heaviest first: P rounds of W form tuples of W parts; the two tuples with the largest
// spread merge, heaviest part of one with the lightest of the other, until one is left.
Slots pack_differencing(const std::vector<int64_t>& experts, const std::vector<double>& weight, int W) {
  const int S = static_cast<int>(experts.size()), P = S / W;
  std::vector<double> load(weight);           // [tuple][part]: tuple t starts as round t
  std::vector<int> part(S), owner(P);          // part of each slot in its tuple; tuple holding each round
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
  std::vector<int> oa(W), ob(W), new_a(W), new_b(W);
  for (int merge = 0; merge + 1 < P; ++merge) {
    int a = -1, b = -1;  // largest two spreads, ties by index
    for (int t = 0; t < P; ++t) {
      if (!alive[t]) continue;
      if (a < 0 || spread[t] > spread[a]) { b = a; a = t; }
      else if (b < 0 || spread[t] > spread[b]) b = t;
    }
    double* la = load.data() + a * W;
    const double* lb = load.data() + b * W;
    std::iota(oa.begin(), oa.end(), 0);
    std::iota(ob.begin(), ob.end(), 0);
    std::sort(oa.begin(), oa.end(), [&](int x, int y) { return la[x] > la[y] || (la[x] == la[y] && x < y); });
    std::sort(ob.begin(), ob.end(), [&](int x, int y) { return lb[x] < lb[y] || (lb[x] == lb[y] && x < y); });
    for (int j = 0; j < W; ++j) {
      tmp[j] = la[oa[j]] + lb[ob[j]];
      new_a[oa[j]] = j;
      new_b[ob[j]] = j;
    }
    std::copy(tmp.begin(), tmp.end(), la);
    for (int k = 0; k < S; ++k) {
      const int t = owner[k / W];
      if (t == a) part[k] = new_a[part[k]];
      else if (t == b) part[k] = new_b[part[k]];
    }
    for (int& t : owner) if (t == b) t = a;
    alive[b] = false;
    spread[a] = tuple_spread(a);
  }
  Slots out(S);
  for (int k = 0; k < S; ++k) out[part[k] * P + k / W] = experts[k];  // round = local slot
  return out;
}

// One entry per copy of every expert, heaviest first (ties: expert id).
struct Copies {
  std::vector<int> reps;  // [E] copies of each expert
  std::vector<int64_t> experts;
  std::vector<double> weight;
};

Copies sorted_copies(const double* load, std::vector<int> reps) {
  Copies out;
  std::vector<int64_t> ids;
  std::vector<double> w;
  for (int e = 0; e < static_cast<int>(reps.size()); ++e)
    for (int c = 0; c < reps[e]; ++c) {
      ids.push_back(e);
      w.push_back(load[e] / reps[e]);
    }
  for (int k : heaviest_first(w)) {
    out.experts.push_back(ids[k]);
    out.weight.push_back(w[k]);
  }
  out.reps = std::move(reps);
  return out;
}

// No placement of these copies has a peak below the mean rank load or their heaviest copy;
// with the copies `replicate` gives (the smallest heaviest copy), no placement of S slots.
double copies_bound(const double* load, const Copies& c, int W) {
  const double total = std::accumulate(load, load + c.reps.size(), 0.0);
  return std::max(total / W, c.weight.empty() ? 0.0 : c.weight.front());
}

// A binary heap of (value, id) whose top is the item `Before` puts first (ids unique, so the
// order is total and the sequence of tops does not depend on the heap's layout). Unlike
// std::push_heap / pop_heap it can replace the top with one sift (the packings' pattern:
// take the lightest pack, put it back heavier).
template <class Before>
class Heap {
 public:
  using Item = std::pair<double, int>;
  explicit Heap(std::vector<Item> items) : h_(std::move(items)) {
    for (size_t i = h_.size() / 2; i-- > 0;) sift_down(i);
  }
  bool empty() const { return h_.empty(); }
  const Item& top() const { return h_.front(); }
  Item pop() {
    const Item out = h_.front();
    h_.front() = h_.back();
    h_.pop_back();
    if (!h_.empty()) sift_down(0);
    return out;
  }
  void push(Item x) {
    size_t i = h_.size();
    h_.push_back(x);
    for (; i > 0 && Before{}(x, h_[(i - 1) / 2]); i = (i - 1) / 2) h_[i] = h_[(i - 1) / 2];
    h_[i] = x;
  }
  void replace_top(Item x) {
    h_.front() = x;
    sift_down(0);
  }

 private:
  void sift_down(size_t i) {
    const Item x = h_[i];
    for (const size_t n = h_.size();;) {
      size_t c = 2 * i + 1;
      if (c >= n) break;
      if (c + 1 < n && Before{}(h_[c + 1], h_[c])) ++c;
      if (!Before{}(h_[c], x)) break;
      h_[i] = h_[c];
      i = c;
    }
    h_[i] = x;
  }
  std::vector<Item> h_;
};

struct LargerFirst {  // larger value first, ties: lower id
  bool operator()(const std::pair<double, int>& a, const std::pair<double, int>& b) const {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  }
};
struct SmallerFirst {  // smaller value first, ties: lower id
  bool operator()(const std::pair<double, int>& a, const std::pair<double, int>& b) const {
    return a.first < b.first || (a.first == b.first && a.second < b.second);
  }
};

// Packs by load, lightest on top (ties: lower pack).
class LightestFirst : public Heap<SmallerFirst> {
 public:
  explicit LightestFirst(int packs) : Heap(empty_packs(packs)) {}

 private:
  static std::vector<Item> empty_packs(int packs) {
    std::vector<Item> out;
    for (int p = 0; p < packs; ++p) out.emplace_back(0.0, p);
    return out;
  }
};

// Copies per item: each spare slot to the largest load / copies while below cap (ties: lower
// id); a heap keeps it O(spare log X).
std::vector<int> spread_copies(const double* load, int X, int slots, int cap) {
  std::vector<int> reps(X, 1);
  auto score = [&](int x) { return reps[x] < cap ? load[x] / reps[x] : -kInf; };
  std::vector<std::pair<double, int>> items;
  items.reserve(X);
  for (int x = 0; x < X; ++x) items.emplace_back(score(x), x);
  Heap<LargerFirst> heap(std::move(items));
  for (int k = X; k < slots; ++k) {
    const int x = heap.top().second;
    reps[x] += 1;
    heap.replace_top({score(x), x});
  }
  return reps;
}

// Each spare slot to the largest load / copies, no cap (EPLB's and the greedy baseline's rule).
std::vector<int> replicate(const std::vector<double>& load, int slots) {
  return spread_copies(load.data(), static_cast<int>(load.size()), slots, std::numeric_limits<int>::max());
}

// Heaviest item first into the lightest pack with room (ties: lower pack); pack and position.
void balanced_packing(const std::vector<double>& w, int packs, std::vector<int>& pack, std::vector<int>& pos) {
  const int I = static_cast<int>(w.size()), room = I / packs;
  std::vector<int> count(packs, 0);
  LightestFirst open(packs);
  pack.assign(I, 0);
  pos.assign(I, 0);
  for (int item : heaviest_first(w)) {
    const auto [load, p] = open.top();
    pack[item] = p;
    pos[item] = count[p]++;
    if (count[p] < room) open.replace_top({load + w[item], p});
    else open.pop();
  }
}

// Ranks reordered so ranks sharing experts sit on one node (a permutation: balance unchanged).
// Node by node, the free rank sharing the most copies seeds it, then the free ranks sharing
// the most experts with the node so far fill it.
Slots group_nodes(const Slots& slots, int E, int N, int W) {
  const int S = static_cast<int>(slots.size()), P = S / W, G = W / N;
  if (N == 1 || G == 1) return slots;
  // the ranks of every copy, grouped by expert (a counting sort: no vector per expert)
  std::vector<int> start(E + 1, 0), ranks(S);
  for (int64_t e : slots) start[e + 1] += 1;
  for (int e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int> fill(start.begin(), start.end() - 1);
  for (int s = 0; s < S; ++s) ranks[fill[slots[s]]++] = s / P;
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

// What losing one copy does to the other ranks holding an expert x: each such rank r rises
// to at most load(r) + copies of x on r * (load_x / (R_x - 1) - load_x / R_x) (copies of the
// gaining expert on r only lower it). The two largest bounds over ranks other than m, with
// their ranks, give the largest bound over all but any one rank in O(1).
struct Rise {
  double first = -kInf, second = -kInf;
  int first_rank = -1, second_rank = -1;
  double excluding(int r) const { return r == first_rank ? second : first; }
  int rank_excluding(int r) const { return r == first_rank ? second_rank : first_rank; }
};

// Rise bounds of the experts a step looks at, each computed on first use.
class Rises {
 public:
  explicit Rises(Packing& pk) : pk_(pk), rise_(pk.copies_size()), done_(pk.copies_size(), 0) {}
  // Forget every bound (the plan changed); m is the peak rank of the step. Call before use.
  void reset(int m) {
    m_ = m;
    if (++epoch_ == 0) std::fill(done_.begin(), done_.end(), 0), epoch_ = 1;
  }
  const Rise& operator[](int64_t x) {
    if (done_[x] != epoch_) compute(x);
    return rise_[x];
  }
  // The largest new_load(r) over the holders r of x other than m and skip.
  template <class F>
  double largest(int64_t x, int skip, F new_load) {
    double out = -kInf;
    for (int t : pk_.slots_of(x))
      if (t / pk_.P() != m_ && t / pk_.P() != skip) out = std::max(out, new_load(t / pk_.P()));
    return out;
  }

 private:
  void compute(int64_t x) {
    done_[x] = epoch_;
    const int P = pk_.P();
    const double delta = pk_.load(x) / (pk_.copies(x) - 1) - pk_.weight(x);
    Rise& rise = rise_[x] = Rise{};
    int last = -1;
    for (int t : pk_.slots_of(x)) {  // ascending slots: a rank's copies are adjacent
      const int r = t / P;
      if (r == m_ || r == last) continue;
      last = r;
      const double v = pk_.rank_load(r) + pk_.count_on(r, x) * delta;
      if (v > rise.first) rise = {v, rise.first, r, rise.first_rank};
      else if (v > rise.second) rise.second = v, rise.second_rank = r;
    }
  }
  Packing& pk_;
  int m_ = -1;
  std::vector<Rise> rise_;
  std::vector<uint32_t> done_;  // epoch of each bound (not vector<bool>: the refit's innermost loop)
  uint32_t epoch_ = 1;
};

// A one-slot change (slot s to expert y) at the peak rank m: the larger of m's new load and
// (bounds on) the new loads of the ranks it raises; ranks it lowers do not count.
double replica_move_peak(const Packing& pk, Rises& rise, int m, int s, int64_t y, double allowed) {
  const int P = pk.P(), rs = s / P;
  const int64_t x = pk.expert(s);
  const double wx = pk.weight(x), wx2 = pk.load(x) / (pk.copies(x) - 1);
  const double wy = pk.weight(y), wy2 = pk.gained_weight(y);
  auto new_load = [&](int r) {
    const int nx = pk.count_on(r, x), ny = pk.count_on(r, y), own = r == rs;
    return pk.rank_load(r) - nx * wx + (nx - own) * wx2 - ny * wy + (ny + own) * wy2;
  };
  double rises = rise[x].excluding(rs);
  // the bound leaves out the drop of a holder of x that also holds y: exact where that matters
  if (rises > allowed && pk.holds(rise[x].rank_excluding(rs), y)) rises = rise.largest(x, rs, new_load);
  double out = std::max(new_load(m), rises);
  if (rs != m) {
    const double l = new_load(rs);
    if (l > pk.rank_load(rs)) out = std::max(out, l);
  }
  return out;
}

}  // namespace

std::vector<int> replica_counts(const double* load, int E, int S, int cap) {
  return spread_copies(load, E, S, cap);
}

double peak_load(const double* load, int E, int W, const Slots& slots) {
  // the sums Packing keeps, in the same order (so the same bits), without its other tables
  std::vector<int> copies(E, 0);
  for (int64_t e : slots) copies[e] += 1;
  const int P = static_cast<int>(slots.size()) / W;
  double out = -kInf;
  for (int r = 0; r < W; ++r) {
    double sum = 0.0;
    for (int s = r * P; s < (r + 1) * P; ++s) sum += load[slots[s]] / copies[slots[s]];
    out = std::max(out, sum);
  }
  return out;
}

Slots eplb_hierarchical(const double* load, int E, int S, int N, int W) {
  const int G = W / N, X = E / N, per_node = S / N;
  std::vector<int> node, pos;
  balanced_packing(std::vector<double>(load, load + E), N, node, pos);
  std::vector<int> node_expert(E);
  for (int e = 0; e < E; ++e) node_expert[node[e] * X + pos[e]] = e;
  Slots out(S);
  for (int n = 0; n < N; ++n) {
    std::vector<double> node_load(X);
    for (int x = 0; x < X; ++x) node_load[x] = load[node_expert[n * X + x]];
    const std::vector<int> reps = replicate(node_load, per_node);
    std::vector<int> copy_local;
    std::vector<double> copy_w;
    for (int x = 0; x < X; ++x)
      for (int c = 0; c < reps[x]; ++c) {
        copy_local.push_back(x);
        copy_w.push_back(node_load[x] / reps[x]);
      }
    std::vector<int> rank, rpos;
    balanced_packing(copy_w, G, rank, rpos);
    for (size_t c = 0; c < copy_local.size(); ++c)
      out[n * per_node + rank[c] * (per_node / G) + rpos[c]] = node_expert[n * X + copy_local[c]];
  }
  return out;
}

namespace {
// EPLB's plan (the better of its two policies) and its peak.
std::pair<Slots, double> eplb_and_peak(const double* load, int E, int S, int N, int W) {
  Slots hier = eplb_hierarchical(load, E, S, N, W);
  const double hier_peak = peak_load(load, E, W, hier);
  if (N == 1) return {std::move(hier), hier_peak};  // one node: the hierarchical policy is the global one
  Slots flat = eplb_hierarchical(load, E, S, 1, W);
  const double flat_peak = peak_load(load, E, W, flat);
  if (flat_peak < hier_peak) return {std::move(flat), flat_peak};
  return {std::move(hier), hier_peak};
}
}  // namespace

Slots eplb(const double* load, int E, int S, int N, int W) { return eplb_and_peak(load, E, S, N, W).first; }

// Heaviest copy first to the least loaded rank with room that lacks its expert (the least
// loaded with room when all hold it).
Slots lpt_packing(const Copies& copies, int E, int W) {
  const int S = static_cast<int>(copies.experts.size()), P = S / W;
  const std::vector<int64_t>& experts = copies.experts;
  const std::vector<double>& weight = copies.weight;
  std::vector<int> count(W, 0);
  std::vector<char> holds(static_cast<size_t>(W) * E, 0);
  LightestFirst open(W);
  std::vector<std::pair<double, int>> skipped;  // lighter ranks that hold the expert already
  Slots out(S);
  for (int k = 0; k < S; ++k) {
    const int64_t e = experts[k];
    skipped.clear();
    auto top = open.pop();
    while (holds[static_cast<size_t>(top.second) * E + e] && !open.empty()) {
      skipped.push_back(top);
      top = open.pop();
    }
    if (holds[static_cast<size_t>(top.second) * E + e]) {  // every rank with room holds it: the lightest
      skipped.push_back(top);
      auto lightest = std::min_element(skipped.begin(), skipped.end());
      top = *lightest;
      skipped.erase(lightest);
    }
    for (const auto& r : skipped) open.push(r);
    const int pick = top.second;
    out[pick * P + count[pick]++] = e;
    holds[static_cast<size_t>(pick) * E + e] = 1;
    if (count[pick] < P) open.push({top.first + weight[k], pick});
  }
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
  auto heavier = [](const Copy& a, const Copy& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
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

Slots greedy(const double* load, int E, int S, int W) {
  return lpt_packing(sorted_copies(load, replicate(std::vector<double>(load, load + E), S)), E, W);
}

double lower_bound(const double* load, int E, int S, int W) {
  return copies_bound(load, sorted_copies(load, replicate(std::vector<double>(load, load + E), S)), W);
}

Slots plan_fresh(const double* load, int E, int S, int N, int W) {
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
  if (best_peak <= copies_bound(load, free, W) * (1 + 1e-12)) return group_nodes(best, E, N, W);
  // copy counts that split only the j heaviest experts, every other expert single: then the
  // singles are the fine filler that evens out ranks of near-equal experts, where a rule that
  // splits every expert alike (EPLB's, and the counts above) leaves only coarse copies; j from
  // the fewest that take all spare slots, doubling, below the count the plan above splits
  if (S > E) {
    const std::vector<int> by_load = heaviest_first(std::vector<double>(load, load + E));
    int replicated = 0;
    for (int r : mine.reps) replicated += r > 1;
    for (int j = std::max(1, (S - E + cap - 2) / (cap - 1)); j < replicated; j *= 2) {
      const Copies c = split_heaviest(load, by_load, S, cap, j, best_peak);
      if (c.weight.empty()) continue;  // no packing of these copies is lower
      Packing pk(load, E, W, pack_differencing(c.experts, c.weight, W));
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
  auto [eplb_plan, eplb_peak] = eplb_and_peak(load, E, S, N, W);
  try_alternative(std::move(eplb_plan), eplb_peak);
  Slots greedy_plan = lpt_packing(free, E, W);
  const double greedy_peak = peak_load(load, E, W, greedy_plan);
  try_alternative(std::move(greedy_plan), greedy_peak);
  return group_nodes(best, E, N, W);
}

namespace {

constexpr size_t kEjectTries = 64;  // first swaps an ejection chain tries

// Copies of each expert changed to want (each change rewrites one slot: a copy of an expert
// with too many becomes one of an expert with too few, heaviest new copy first, on the rank
// that ends lightest and does not hold that expert yet).
void refit_counts(Packing& pk, const std::vector<int>& want) {
  const int E = static_cast<int>(want.size()), S = static_cast<int>(pk.slots().size()), P = pk.P();
  for (;;) {
    int64_t y = -1;
    for (int64_t e = 0; e < E; ++e)
      if (pk.copies(e) < want[e] && (y < 0 || pk.load(e) / want[e] > pk.load(y) / want[y])) y = e;
    if (y < 0) return;
    int best = -1;
    double best_load = kInf;
    for (int s = 0; s < S; ++s) {
      const int64_t x = pk.expert(s);
      if (pk.copies(x) <= want[x] || pk.holds(s / P, y)) continue;
      const double l = pk.rank_load(s / P) - pk.slot_weight(s) + pk.load(y) / want[y];
      if (l < best_load) best_load = l, best = s;
    }
    if (best < 0) return;
    pk.set(best, y);
  }
}

int changed(const Slots& a, const Slots& b) {
  int n = 0;
  for (size_t s = 0; s < a.size(); ++s) n += a[s] != b[s];
  return n;
}

// When no single move lowers the peak rank m: a swap that brings m within the allowed peak
// but pushes its partner b over, followed by b's best swap if that brings b back within
// (an ejection chain of two swaps) that leaves at most max_moves slots changed from previous.
// Tries the first swaps that push b least first.
bool eject(Packing& pk, int m, double allowed_peak, const Slots& previous, int max_moves) {
  const int P = pk.P(), W = pk.W();
  const double lm = pk.rank_load(m);
  std::vector<std::pair<double, std::pair<int, int>>> first;  // (b's new load, (s, t))
  for (int b = 0; b < W; ++b) {
    if (b == m) continue;
    const double lb = pk.rank_load(b);
    for (int i = m * P; i < (m + 1) * P; ++i) {
      if (pk.holds(b, pk.expert(i))) continue;
      for (int t = b * P; t < (b + 1) * P; ++t) {
        const double d = pk.slot_weight(i) - pk.slot_weight(t);
        if (d > 0 && lm - d <= allowed_peak && !pk.holds(m, pk.expert(t))) first.push_back({lb + d, {i, t}});
      }
    }
  }
  const size_t tries = std::min<size_t>(first.size(), kEjectTries);
  std::partial_sort(first.begin(), first.begin() + tries, first.end());
  for (size_t k = 0; k < tries; ++k) {
    const auto [s, t] = first[k].second;
    pk.swap(s, t);
    const Swap back = best_swap(pk, t / P, 0.0);
    if (back.s >= 0 && back.pair <= allowed_peak) {
      pk.swap(back.s, back.t);
      if (changed(pk.slots(), previous) <= max_moves) return true;
      pk.swap(back.s, back.t);
    }
    pk.swap(s, t);  // undo
  }
  return false;
}

// Slot changes along a chain of ranks: slot chain[j] takes the expert of chain[j - 1]; chain[0]
// takes the last one's (a cycle: copies per expert stay) or a new copy of gain (a path: the
// last slot's expert loses that copy instead).
struct Chain {
  std::vector<int> slots;
  int64_t gain = -1;  // -1: a cycle
  int relieved = 0;   // over-loaded ranks it brings within the allowed peak
  // ranks brought within per changed slot, compared without division
  static bool better(long relieved, long changed, long o_relieved, long o_changed) {
    const long a = relieved * o_changed, b = o_relieved * changed;
    return a > b || (a == b && relieved > o_relieved);
  }
};

constexpr int kChainRanks = 8;  // ranks on one chain at most

// Whether expert x can lose the copy in slot s: another copy stays, and every other holder of
// x stays within allowed after its share grows (loads before the chain: a chain only lowers
// the over-loaded ranks it passes).
bool can_drop(Packing& pk, int s, double allowed) {
  const int64_t x = pk.expert(s);
  const int c = pk.copies(x), P = pk.P();
  if (c < 2) return false;
  const double delta = pk.load(x) / (c - 1) - pk.load(x) / c;
  for (int t : pk.slots_of(x)) {
    const int r = t / P;
    if (r != s / P && pk.rank_load(r) + pk.count_on(r, x) * delta > allowed) return false;
  }
  return true;
}

// Chains from the over-loaded rank m: m hands one expert to another over-loaded rank, which
// hands on a copy heavier by at least its own excess (so it ends within), and so on. Two ends:
// a rank with room takes the last expert and hands m one light enough (a cycle: k + 1 changed
// slots bring k ranks within), or m takes a new copy of the lightest expert it lacks and the
// last expert loses its copy where its other holders have room (a path: one changed slot per
// rank brought within). A swap per rank changes two. Each step takes the lightest copy that
// brings the next rank within (the chain must come back down to m). Returns the chain with the
// most ranks brought within per changed slot (relieved 0: none ends), of at most max_slots
// changed slots; no expert twice on a rank. gain: the lightest new copy m lacks (-1: none).
Chain best_chain(Packing& pk, int m, double allowed, int64_t gain, int max_slots) {
  const int P = pk.P(), W = pk.W();
  std::vector<int> over;  // over-loaded ranks other than m
  pk.over_loaded(allowed, over);
  over.erase(std::remove(over.begin(), over.end(), m), over.end());
  Chain best;
  auto beats_best = [&](int relieved, int changed) {
    return Chain::better(relieved, changed, best.relieved, static_cast<long>(best.slots.size()));
  };
  std::vector<char> used(W, 0);
  std::vector<int> chain;
  for (int i = m * P; i < (m + 1) * P; ++i) {
    const double back = pk.slot_weight(i) - (pk.rank_load(m) - allowed);  // m takes at most this
    if (back < 0) continue;
    const bool path = gain >= 0 && pk.gained_weight(gain) <= back;
    for (int s : chain) used[s / P] = 0;
    chain.assign(1, i);
    used[m] = 1;
    for (;;) {
      const int in = chain.back(), k = static_cast<int>(chain.size());
      const int64_t e_in = pk.expert(in);
      const double w_in = pk.slot_weight(in);
      if (k > 1 && k <= max_slots && path && beats_best(k, k) && can_drop(pk, in, allowed))
        best = Chain{chain, gain, k};
      // the rank with the most room first: the first that closes wins, and none closes once
      // the room is below w_in - back
      int close = -1;
      if (k + 1 <= max_slots && beats_best(k, k + 1))
        for (int b : pk.by_load()) {
          const double room = allowed - pk.rank_load(b);
          if (room < w_in - back) break;
          if (used[b] || pk.holds(b, e_in)) continue;
          for (int t = b * P; t < (b + 1) * P && close < 0; ++t) {
            const double wt = pk.slot_weight(t);
            if (wt <= back && wt >= w_in - room && !pk.holds(m, pk.expert(t))) close = t;
          }
          if (close >= 0) break;
        }
      if (close >= 0) {
        best = Chain{chain, -1, k};
        best.slots.push_back(close);
      }
      if (k >= std::min(kChainRanks, max_slots)) break;
      int next = -1;
      for (int r : over) {
        if (used[r] || pk.holds(r, e_in)) continue;
        const double need = w_in + pk.rank_load(r) - allowed;
        for (int t = r * P; t < (r + 1) * P; ++t)
          if (pk.slot_weight(t) >= need && (next < 0 || pk.slot_weight(t) < pk.slot_weight(next))) next = t;
      }
      if (next < 0) break;
      chain.push_back(next);
      used[next / P] = 1;
    }
  }
  return best;
}

void apply_chain(Packing& pk, const Chain& c) {
  const std::vector<int>& s = c.slots;
  if (c.gain < 0) {
    for (size_t j = 1; j < s.size(); ++j) pk.swap(s[0], s[j]);
    return;
  }
  for (size_t j = s.size() - 1; j >= 1; --j) pk.set(s[j], pk.expert(s[j - 1]));
  pk.set(s[0], c.gain);
}

// Cycles from the ranks with the most room, copy counts kept: room rank R gives a light copy to
// an over-loaded rank, which gives one heavier by at least its excess to the next over-loaded
// rank, and so on; R takes the last, heaviest copy, within its room. A cycle through k
// over-loaded ranks changes k + 1 slots and brings all k within. Each round applies the cycle
// through the most over-loaded ranks (ties: the rank with less room) from any slot of the
// kCoverRooms ranks with the most room, each step taking the copy that brings the next rank
// within with the least to spare (room for more steps); it stops where the longest cycle
// brings fewer than two ranks within (a swap is as cheap). The refit search chains from the
// most loaded rank down, up to 8 ranks; on some loads covering from the room up needs fewer
// slots. Returns the over-loaded ranks left.
// Four: eight, finished however many over-loaded ranks are left, won in more layers but cost
// 4.5 ms on the timing load against 1.3 ms (docs/balancer.md, step 3).
constexpr int kCoverRooms = 4;

int cover_cycles(Packing& pk, double allowed) {
  const int P = pk.P(), W = pk.W(), S = W * P;
  std::vector<int> over, chain;
  std::vector<char> used(W, 0), hit(W, 0);
  // the best cycle from each slot, kept until a cycle changes a rank on it (a cycle only takes
  // ranks off the over-loaded list, so the choices of one that misses them stay the same)
  std::vector<std::vector<int>> from(S);
  std::vector<char> known(S, 0);
  auto build = [&](int i, double room) {
    const int R = i / P;
    const double top = pk.slot_weight(i) + room;  // the heaviest copy R can take
    for (int r : over) used[r] = 0;
    chain.assign(1, i);
    std::vector<int>& best = from[i];
    best.clear();
    for (;;) {
      const int64_t e_in = pk.expert(chain.back());
      const double w_in = pk.slot_weight(chain.back());
      int next = -1;
      double spare = kInf;
      for (int r : over) {
        if (used[r] || pk.holds(r, e_in)) continue;
        const double need = w_in + pk.rank_load(r) - allowed;  // r gives at least this
        for (int t = r * P; t < (r + 1) * P; ++t) {
          const double o = pk.slot_weight(t);
          if (o >= need && o <= top && o - need < spare) next = t, spare = o - need;
        }
      }
      if (next < 0) return;
      chain.push_back(next);
      used[next / P] = 1;
      if (pk.expert(next) == pk.expert(i) || !pk.holds(R, pk.expert(next))) best = chain;
    }
  };
  for (;;) {
    pk.over_loaded(allowed, over);
    if (over.empty()) return 0;
    // a cycle through two over-loaded ranks needs room for the two smallest excesses
    double least = kInf, second = kInf;
    for (int r : over) {
      const double ex = pk.rank_load(r) - allowed;
      if (ex < least) second = least, least = ex;
      else if (ex < second) second = ex;
    }
    int pick = -1, rooms = 0;
    double pick_room = 0.0;
    for (int R : pk.by_load()) {
      const double room = allowed - pk.rank_load(R);
      if (room < least + second || rooms++ >= kCoverRooms) break;
      for (int i = R * P; i < (R + 1) * P; ++i) {
        if (!known[i]) build(i, room), known[i] = 1;
        const size_t k = from[i].size(), kp = pick < 0 ? 0 : from[pick].size();
        if (k > kp || (k == kp && k > 0 && room < pick_room)) pick = i, pick_room = room;
      }
    }
    if (pick < 0 || from[pick].size() < 3) return static_cast<int>(over.size());
    const Chain cycle{from[pick], -1, static_cast<int>(from[pick].size()) - 1};
    apply_chain(pk, cycle);
    std::fill(hit.begin(), hit.end(), 0);
    for (int s : cycle.slots) hit[s / P] = 1;
    for (int i = 0; i < S; ++i) {
      bool stale = known[i] && hit[i / P];
      for (size_t j = 0; known[i] && !stale && j < from[i].size(); ++j) stale = hit[from[i][j] / P];
      if (stale) known[i] = 0;
    }
  }
}

// Restarts: where the refit still changes more than kRestartAbove of the slots (twice the 10%
// move target), the search runs again from previous up to kRestarts times, each step fixing one
// of the kRestartRanks most loaded ranks drawn from a seeded generator (plans stay
// deterministic); the fewest changed slots wins. The most-loaded-first search gets stuck or
// costly on some loads where another order is not. Only such layers pay: on the timing load
// (61 x 256 x 64, S 320) a threshold of 0.1 costs about 18 ms more, 0.2 under 1 ms.
constexpr size_t kRestartRanks = 3;
constexpr unsigned kRestarts = 5;
constexpr double kRestartAbove = 0.2;
// Cover cycles (cover_cycles) where the best refit changes more than the 10% move target, the
// search finishing from them where at most kCoverLeft over-loaded ranks are left: with more left
// it wins less often (by 1-4 slots) and the finishing search costs as much as the cycles.
constexpr double kCoverAbove = 0.1;
constexpr int kCoverLeft = 4;

// The over-loaded rank a refit step works on: the most loaded one (order null), or one of the
// kRestartRanks most loaded drawn from order.
int rank_to_fix(const Packing& pk, double allowed_peak, std::minstd_rand* order) {
  const int m = pk.peak_rank();
  if (!order) return m;
  thread_local std::vector<int> top;
  pk.over_loaded(allowed_peak, top, kRestartRanks);
  return top.empty() ? m : top[(*order)() % top.size()];
}

// The refit search from pk's state (see keep_previous); true once the peak is allowed.
bool refit_search(Packing& pk, const Slots& previous, double allowed_peak, int max_moves,
                  std::minstd_rand* order = nullptr) {
  const int E = pk.copies_size(), W = pk.W();
  const int S = static_cast<int>(previous.size()), P = S / W;
  const int cap = std::max(W, (S + E - 1) / E);
  auto differs = [&](int s) { return static_cast<int>(pk.expert(s) != previous[s]); };
  int moved = 0;  // slots that differ from previous
  for (int s = 0; s < S; ++s) moved += differs(s);
  bool ok = false;
  Rises rise(pk);
  struct Spare {  // a slot off m whose expert has several copies, and its rank's load without it
    int s;
    double rest;
  };
  std::vector<Spare> spare;
  spare.reserve(S);
  for (int step = 0; step < 4 * S; ++step) {
    const int m = rank_to_fix(pk, allowed_peak, order);
    const double lm = pk.rank_load(m);
    if (lm <= allowed_peak) {
      ok = true;
      break;
    }
    if (moved >= max_moves) break;
    // Moves at m, each with the larger of m's new load and the loads of the ranks it raises:
    // the best swap (two slots) and the best replica change (one slot). The cheapest move that
    // brings m to the allowed peak without raising another rank above it wins (m is then done);
    // without one, the largest drop of m's load per changed slot.
    const Swap sw = best_swap(pk, m, 0.0);
    double rep_peak = lm * (1 - 1e-12);
    int rs = -1;
    int64_t ry = -1;
    rise.reset(m);
    auto consider = [&](int s, int64_t y) {
      const double p = replica_move_peak(pk, rise, m, s, y, allowed_peak);
      if (p < rep_peak) rep_peak = p, rs = s, ry = y;
    };
    // one of m's replicated experts gives its slot to the lightest copy of an expert m lacks
    int64_t lightest = -1;
    double lightest_w = kInf;
    for (int64_t y = 0; y < E; ++y) {
      const double w = pk.gained_weight(y);
      if (w < lightest_w && pk.copies(y) < cap && !pk.holds(m, y)) lightest = y, lightest_w = w;
    }
    for (int i = 0; i < P && lightest >= 0; ++i)
      if (pk.copies(pk.expert(m * P + i)) >= 2) consider(m * P + i, lightest);
    // an expert of m gains a copy in a slot of a replicated expert elsewhere (m's new load
    // depends on y alone, and the slot's rank ends at least at its load - w_x + y's new weight)
    std::vector<int64_t> gainers(pk.slots().begin() + m * P, pk.slots().begin() + (m + 1) * P);
    auto drop = [&](int64_t y) { return pk.weight(y) - pk.gained_weight(y); };
    std::sort(gainers.begin(), gainers.end(), [&](int64_t a, int64_t b) { return drop(a) > drop(b); });
    double lightest_gain = kInf;  // no slot whose rank ends at or above rep_peak with it can win
    for (int64_t y : gainers)
      if (pk.copies(y) < cap) lightest_gain = std::min(lightest_gain, pk.gained_weight(y));
    spare.clear();
    for (int s = 0; s < S; ++s) {
      const double rest = pk.rank_load(s / P) - pk.slot_weight(s);
      if (s / P != m && rest + lightest_gain < rep_peak && pk.copies(pk.expert(s)) >= 2)
        spare.push_back({s, rest});
    }
    for (int64_t y : gainers) {  // largest drop first: later ones are often cut by the bounds
      if (pk.copies(y) >= cap || lm - drop(y) >= rep_peak) continue;
      const double wy2 = pk.gained_weight(y);
      for (const Spare& sp : spare) {
        const int s = sp.s;
        const int64_t x = pk.expert(s);
        const int r = s / P;
        if (x == y || sp.rest + wy2 >= rep_peak) continue;
        if (pk.holds(r, y)) continue;
        const Rise& rx = rise[x];
        if (rx.excluding(r) >= rep_peak && !pk.holds(rx.rank_excluding(r), y)) continue;
        consider(s, y);
      }
    }
    int kind = 0;  // 1: swap, 2: replica change
    if (rs >= 0 && rep_peak <= allowed_peak) kind = 2;
    else if (const Chain ch = best_chain(pk, m, allowed_peak, lightest, max_moves - moved);
             2 * ch.relieved > static_cast<int>(ch.slots.size())) {
      // fewer changed slots per rank brought within than a swap's two
      for (int s : ch.slots) moved -= differs(s);
      apply_chain(pk, ch);
      for (int s : ch.slots) moved += differs(s);
      continue;
    }
    else if (sw.s >= 0 && sw.pair <= allowed_peak) kind = 1;
    else if (rs >= 0 || sw.s >= 0) kind = rs >= 0 && (sw.s < 0 || lm - rep_peak >= (lm - sw.pair) / 2) ? 2 : 1;
    const int bs = kind == 1 ? sw.s : rs, bt = sw.t;
    const int64_t by = ry;
    if (kind == 0) {
      if (!eject(pk, m, allowed_peak, previous, max_moves)) break;
      moved = 0;
      for (int s = 0; s < S; ++s) moved += differs(s);
      continue;
    }
    const int t = kind == 1 ? bt : bs;
    const int added = kind == 1 ? static_cast<int>(pk.expert(bt) != previous[bs]) +
                                      static_cast<int>(pk.expert(bs) != previous[bt]) - differs(bs) - differs(bt)
                                : static_cast<int>(by != previous[bs]) - differs(bs);
    if (moved + added > max_moves) break;  // the cap holds: the search stops short instead
    moved -= differs(bs) + (t != bs ? differs(t) : 0);
    if (kind == 1) pk.swap(bs, bt);
    else pk.set(bs, by);
    moved += differs(bs) + (t != bs ? differs(t) : 0);
  }
  return ok || pk.peak() <= allowed_peak;
}

// Slots turned back to previous's expert while every rank stays within allowed: a swap with a
// slot of that expert on another rank (turning back one slot, or two where the other slot gets
// its previous expert too), or, where the slot's expert keeps another copy, the slot alone (a
// copy moves from one expert to the other). Most slots turned back first, then the smallest
// largest load of the ranks a move touches. A search that reaches the allowed peak greedily
// often changes slots a later move made unnecessary; a plan within the peak that changes many
// slots (the fresh plan) walks back toward previous the same way.
void walk_back(Packing& pk, const Slots& previous, double allowed) {
  const int S = static_cast<int>(previous.size()), P = pk.P();
  std::vector<int> differ;
  for (;;) {
    differ.clear();
    for (int s = 0; s < S; ++s)
      if (pk.expert(s) != previous[s]) differ.push_back(s);
    int best_s = -1, best_t = -1, best_gain = 0;
    double best_load = kInf;
    auto offer = [&](int s, int t, int gain, double load) {
      if (gain > best_gain || (gain == best_gain && load < best_load))
        best_s = s, best_t = t, best_gain = gain, best_load = load;
    };
    for (int s : differ) {
      const int64_t want = previous[s], cur = pk.expert(s);
      const int rs = s / P;
      if (pk.holds(rs, want)) continue;
      const double ws = pk.slot_weight(s), ww = pk.weight(want);
      for (int t : pk.slots_of(want)) {
        const int rt = t / P;
        if (pk.holds(rt, cur)) continue;
        const int gain = 1 + (previous[t] == cur) - (previous[t] == want);
        if (gain <= 0 || gain < best_gain) continue;
        const double ls = pk.rank_load(rs) - ws + ww, lt = pk.rank_load(rt) - ww + ws;
        if (ls <= allowed && lt <= allowed) offer(s, t, gain, std::max(ls, lt));
      }
      if (best_gain < 2 && pk.copies(cur) >= 2) {  // the slot alone: simulated, then undone
        pk.set(s, want);
        if (pk.peak() <= allowed) offer(s, -1, 1, pk.rank_load(rs));
        pk.set(s, cur);
      }
    }
    if (best_s < 0) return;
    if (best_t >= 0) pk.swap(best_s, best_t);
    else pk.set(best_s, previous[best_s]);
  }
}

}  // namespace

Slots walk_back_to(const double* load, int E, int W, const Slots& previous, const Slots& start,
                   double allowed_peak) {
  Packing pk(load, E, W, start);
  walk_back(pk, previous, allowed_peak);
  return pk.slots();
}

bool keep_previous(const double* load, int E, int W, const Slots& previous, const Slots& fresh,
                   double allowed_peak, int max_moves, Slots& slots) {
  const int S = static_cast<int>(previous.size());
  Packing pk(load, E, W, previous);
  bool reached = refit_search(pk, previous, allowed_peak, max_moves);
  slots = pk.slots();
  int best = reached ? changed(slots, previous) : S + 1;
  auto keep = [&](bool ok, const Packing& p) {
    const int n = ok ? changed(p.slots(), previous) : S + 1;
    // refit_counts alone may change more than max_moves slots, before its search starts
    if (n < best && n <= max_moves) slots = p.slots(), best = n, reached = true;
  };
  if (best > S / 4) {
    // stuck or costly: replica counts changed to the fresh plan's first, then the same search
    std::vector<int> want(E, 0);
    for (int64_t e : fresh) want[e] += 1;
    Packing counted(load, E, W, previous);
    refit_counts(counted, want);
    keep(refit_search(counted, previous, allowed_peak, max_moves), counted);
  }
  // still stuck or above kRestartAbove of the slots: restarts, each stopped once it changes as
  // many slots as the best
  for (unsigned seed = 1; seed <= kRestarts && best > S * kRestartAbove; ++seed) {
    std::minstd_rand order(seed);
    Packing again(load, E, W, previous);
    keep(refit_search(again, previous, allowed_peak, std::min(max_moves, best - 1), &order), again);
  }
  if (best > S * kCoverAbove) {
    Packing covered(load, E, W, previous);
    const int left = cover_cycles(covered, allowed_peak);
    // a slot per rank left, within the move budget
    if (left <= kCoverLeft && changed(covered.slots(), previous) + left < std::min(best, max_moves + 1))
      keep(refit_search(covered, previous, allowed_peak, std::min(max_moves, best - 1)), covered);
  }
  return reached;
}

}  // namespace hybrid_ep::balancer
