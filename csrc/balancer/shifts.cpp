// Count shifts (shifts.h), rated by their exact effect on every rank they touch.
#include "balancer/shifts.h"

#include <algorithm>
#include <tuple>

namespace hybrid_ep::balancer::detail {

std::vector<Shift> count_shifts(const Packing& pk, double allowed, size_t most) {
  const int E = pk.copies_size(), W = pk.W(), P = pk.P(), S = W * P;
  auto above = [&](double l) { return std::max(0.0, l - allowed); };
  // the slots of every expert, flat (the Packing's own lists cost an allocation per expert),
  // and their ranks, divided once
  const SlotsByExpert of = slots_by_expert(pk.slots(), E);
  const std::vector<int>& at = of.at;
  const std::vector<int>& slots_of = of.slots;
  std::vector<int> rank_of(S);
  for (int j = 0; j < S; ++j) rank_of[j] = slots_of[j] / P;
  std::vector<int64_t> hot, cool;
  for (int64_t e = 0; e < E; ++e) {
    if (pk.copies(e) < 2) continue;
    if (pk.copies(e) >= 3) cool.push_back(e);
    for (int j = at[e]; j < at[e + 1]; ++j)
      if (pk.rank_load(rank_of[j]) > allowed) {
        hot.push_back(e);
        break;
      }
  }
  // per pair, each touched rank's new load: copies of a lighten, copies of b weigh more, and
  // slot `to` turns from b to a
  std::vector<int> na(W, 0), nb(W, 0);  // copies of a and of b per rank (zero outside a pair)
  std::vector<int> rated_in(W, 0);      // the last pair that rated each rank
  int pair = 0;
  auto add = [&](int64_t e, std::vector<int>& n, int d) {
    for (int j = at[e]; j < at[e + 1]; ++j) n[rank_of[j]] += d;
  };
  std::vector<std::tuple<double, int, int64_t>> rated;  // (change of the load above allowed, slot, expert)
  for (int64_t a : hot) {
    add(a, na, 1);
    const double wa = pk.weight(a), wa_more = pk.gained_weight(a);
    for (int64_t b : cool) {
      if (b == a) continue;
      int to = -1;  // the least loaded holder of b lacking a (an index into b's slots)
      for (int j = at[b]; j < at[b + 1]; ++j)
        if (na[rank_of[j]] == 0 && (to < 0 || pk.rank_load(rank_of[j]) < pk.rank_load(rank_of[to]))) to = j;
      if (to < 0) continue;
      const int to_rank = rank_of[to];
      add(b, nb, 1);
      const double wb = pk.weight(b), wb_less = pk.load(b) / (pk.copies(b) - 1);
      double change = 0.0;
      ++pair;
      for (int64_t e : {a, b})
        for (int j = at[e]; j < at[e + 1]; ++j) {
          const int r = rank_of[j];
          if (rated_in[r] == pair) continue;
          rated_in[r] = pair;
          double l = pk.rank_load(r) + na[r] * (wa_more - wa) + nb[r] * (wb_less - wb);
          if (r == to_rank) l += wa_more - wb_less;
          change += above(l) - above(pk.rank_load(r));
        }
      add(b, nb, -1);
      if (change < 0) rated.emplace_back(change, slots_of[to], a);
    }
    add(a, na, -1);
  }
  most = std::min(most, rated.size());
  std::partial_sort(rated.begin(), rated.begin() + most, rated.end());
  std::vector<Shift> out;
  for (size_t i = 0; i < most; ++i) out.push_back({std::get<1>(rated[i]), std::get<2>(rated[i])});
  return out;
}

}  // namespace hybrid_ep::balancer::detail
