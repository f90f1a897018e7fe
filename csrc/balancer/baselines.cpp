// The baselines the planner is measured against and also tries (planner.h, baselines.h):
// DeepSeek's EPLB policies (hierarchical and global) and the greedy plan.
#include "balancer/baselines.h"

#include <algorithm>
#include <vector>

namespace hybrid_ep::balancer {
namespace detail {
namespace {

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

}  // namespace

std::pair<Slots, double> eplb_and_peak(const double* load, int E, int S, int N, int W) {
  Slots hier = eplb_hierarchical(load, E, S, N, W);
  const double hier_peak = peak_load(load, E, W, hier);
  if (N == 1) return {std::move(hier), hier_peak};  // one node: the hierarchical policy is the global one
  Slots flat = eplb_hierarchical(load, E, S, 1, W);
  const double flat_peak = peak_load(load, E, W, flat);
  if (flat_peak < hier_peak) return {std::move(flat), flat_peak};
  return {std::move(hier), hier_peak};
}

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

}  // namespace detail

using detail::balanced_packing;
using detail::replicate;

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

Slots eplb(const double* load, int E, int S, int N, int W) { return detail::eplb_and_peak(load, E, S, N, W).first; }

Slots greedy(const double* load, int E, int S, int W) {
  return detail::lpt_packing(detail::sorted_copies(load, replicate(std::vector<double>(load, load + E), S)), E, W);
}

}  // namespace hybrid_ep::balancer
