// The baselines the planner is measured against and also tries (planner.h, baselines.h):
// DeepSeek's EPLB policies (hierarchical and global) and the greedy plan.
#include "balancer/baselines.h"

#include <algorithm>
#include <vector>

namespace hybrid_ep::balancer {
namespace detail {
namespace {

// Items in `order` (heaviest first) into the lightest pack with room (ties: lower pack); pack
// and position. False, the packing left unfinished, once a pack's load passes `limit` (loads
// only grow).
bool balanced_packing(const std::vector<double>& w, const std::vector<int>& order, int packs, std::vector<int>& pack,
                      std::vector<int>& pos, double limit = kInf) {
  const int I = static_cast<int>(w.size()), room = I / packs;
  std::vector<int> count(packs, 0);
  LightestFirst open(packs);
  pack.assign(I, 0);
  pos.assign(I, 0);
  for (int item : order) {
    const auto [load, p] = open.top();
    if (load + w[item] > limit) return false;
    pack[item] = p;
    pos[item] = count[p]++;
    if (count[p] < room) open.replace_top({load + w[item], p});
    else open.pop();
  }
  return true;
}

// A cutoff at `below`, with room for rounding: a plan's peak sums its rank's copies in slot
// order, a packing in item order, and the two may differ in the last bits.
double cutoff(double below) { return below * (1 + 1e-9); }

// EPLB's hierarchical policy, or false (out unfinished) once its peak cannot be below `below`:
// a node's copies load its G ranks at least by their mean and by the heaviest copy, and a
// rank's load only grows while the ranks are packed. by_load: the experts heaviest first.
bool eplb_hierarchical_below(const double* load, const std::vector<int>& by_load, int E, int S, int N, int W,
                             double below, Slots& out) {
  const int G = W / N, X = E / N, per_node = S / N;
  const double limit = cutoff(below);
  std::vector<int> node_expert(by_load);  // one node: the experts heaviest first
  if (N > 1) {
    std::vector<int> node, pos;
    balanced_packing(std::vector<double>(load, load + E), by_load, N, node, pos);
    for (int e = 0; e < E; ++e) node_expert[node[e] * X + pos[e]] = e;
  }
  out.assign(S, 0);
  std::vector<double> node_load(X), copy_w;
  std::vector<int> copy_local, rank, rpos;
  for (int n = 0; n < N; ++n) {
    for (int x = 0; x < X; ++x) node_load[x] = load[node_expert[n * X + x]];
    const std::vector<int> reps = replicate(node_load, per_node);
    copy_local.clear();
    copy_w.clear();
    double total = 0.0;
    for (int x = 0; x < X; ++x)
      for (int c = 0; c < reps[x]; ++c) {
        copy_local.push_back(x);
        copy_w.push_back(node_load[x] / reps[x]);
        total += copy_w.back();
      }
    if (total / G > limit || *std::max_element(copy_w.begin(), copy_w.end()) > limit) return false;
    if (!balanced_packing(copy_w, heaviest_first(copy_w), G, rank, rpos, limit)) return false;
    for (size_t c = 0; c < copy_local.size(); ++c)
      out[n * per_node + rank[c] * (per_node / G) + rpos[c]] = node_expert[n * X + copy_local[c]];
  }
  return true;
}

}  // namespace

std::pair<Slots, double> eplb_and_peak(const double* load, const std::vector<int>& by_load, int E, int S, int N, int W,
                                       double below) {
  std::pair<Slots, double> out{Slots{}, kInf};
  // the hierarchical policy, then the global one (with one node they are the same)
  const int policies = N == 1 ? 1 : 2;
  for (int k = 0; k < policies; ++k) {
    const int nodes = k == 0 ? N : 1;
    Slots plan;
    if (!eplb_hierarchical_below(load, by_load, E, S, nodes, W, std::min(below, out.second), plan)) continue;
    const double plan_peak = peak_load(load, E, W, plan);
    if (plan_peak < out.second && plan_peak < below) out = {std::move(plan), plan_peak};
  }
  return out;
}

Slots lpt_packing(const Copies& copies, int E, int W, double below) {
  const double limit = cutoff(below);
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
    if (top.first + weight[k] > limit) return {};
    out[pick * P + count[pick]++] = e;
    holds[static_cast<size_t>(pick) * E + e] = 1;
    if (count[pick] < P) open.push({top.first + weight[k], pick});
  }
  return out;
}

}  // namespace detail

using detail::replicate;

Slots eplb_hierarchical(const double* load, int E, int S, int N, int W) {
  Slots out;
  const std::vector<int> by_load = detail::heaviest_first(std::vector<double>(load, load + E));
  detail::eplb_hierarchical_below(load, by_load, E, S, N, W, detail::kInf, out);  // no cutoff: always finishes
  return out;
}

Slots eplb(const double* load, int E, int S, int N, int W) {
  const std::vector<int> by_load = detail::heaviest_first(std::vector<double>(load, load + E));
  return detail::eplb_and_peak(load, by_load, E, S, N, W, detail::kInf).first;
}

Slots greedy(const double* load, int E, int S, int W) {
  return detail::lpt_packing(detail::sorted_copies(load, replicate(std::vector<double>(load, load + E), S)), E, W,
                             detail::kInf);
}

}  // namespace hybrid_ep::balancer
