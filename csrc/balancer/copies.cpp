// Copy lists and the spare-slot rule (copies.h); replica_counts (planner.h).
#include "balancer/copies.h"

#include <algorithm>
#include <limits>
#include <numeric>
#include <utility>

namespace hybrid_ep::balancer {
namespace detail {

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

double copies_bound(const double* load, const Copies& c, int W) {
  const double total = std::accumulate(load, load + c.reps.size(), 0.0);
  return std::max(total / W, c.weight.empty() ? 0.0 : c.weight.front());
}

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

std::vector<int> replicate(const std::vector<double>& load, int slots) {
  return spread_copies(load.data(), static_cast<int>(load.size()), slots, std::numeric_limits<int>::max());
}

}  // namespace detail

std::vector<int> replica_counts(const double* load, int E, int S, int cap) {
  return detail::spread_copies(load, E, S, cap);
}

}  // namespace hybrid_ep::balancer
