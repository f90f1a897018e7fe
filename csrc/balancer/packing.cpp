// Packing's swaps (packing.h) and the largest rank load of a plan (planner.h).
#include "balancer/packing.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <utility>

namespace hybrid_ep::balancer {
namespace detail {

// From kRadixFrom weights on, heaviest_first radix-sorts their bit patterns.
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

SlotsByExpert slots_by_expert(const Slots& plan, int E) {
  const int S = static_cast<int>(plan.size());
  SlotsByExpert out{std::vector<int>(E + 1, 0), std::vector<int>(S)};
  for (int64_t e : plan) out.at[e + 1] += 1;
  for (int e = 0; e < E; ++e) out.at[e + 1] += out.at[e];
  std::vector<int> fill(out.at.begin(), out.at.end() - 1);
  for (int s = 0; s < S; ++s) out.slots[fill[plan[s]]++] = s;
  return out;
}

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

constexpr double kMinDrop = 1e-4;

void improve(Packing& pk) {
  const double min_drop = kMinDrop * pk.mean();
  for (int step = 0, cap = 64 * static_cast<int>(pk.slots().size()); step < cap; ++step) {
    const Swap sw = best_swap(pk, pk.peak_rank(), min_drop);
    if (sw.s < 0) return;
    pk.swap(sw.s, sw.t);
  }
}

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

}  // namespace detail

double peak_load(const double* load, int E, int W, const Slots& slots) {
  // the sums Packing keeps, in the same order (so the same bits), without its other tables
  std::vector<int> copies(E, 0);
  for (int64_t e : slots) copies[e] += 1;
  const int P = static_cast<int>(slots.size()) / W;
  double out = -detail::kInf;
  for (int r = 0; r < W; ++r) {
    double sum = 0.0;
    for (int s = r * P; s < (r + 1) * P; ++s) sum += load[slots[s]] / copies[slots[s]];
    out = std::max(out, sum);
  }
  return out;
}

}  // namespace hybrid_ep::balancer
