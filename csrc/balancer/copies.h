// Copy lists (one entry per copy of every expert, heaviest first), the rule that spreads spare
// slots over experts, and the heaps the packings take their lightest pack from. Internal to the
// planner (fresh.cpp, baselines.cpp).
#pragma once
#include <cstdint>
#include <utility>
#include <vector>

#include "balancer/packing.h"

namespace hybrid_ep::balancer::detail {

// One entry per copy of every expert, heaviest first (ties: expert id).
struct Copies {
  std::vector<int> reps;  // [E] copies of each expert
  std::vector<int64_t> experts;
  std::vector<double> weight;
};

Copies sorted_copies(const double* load, std::vector<int> reps);

// No placement of these copies has a peak below the mean rank load or their heaviest copy;
// with the copies `replicate` gives (the smallest heaviest copy), no placement of S slots.
double copies_bound(const double* load, const Copies& c, int W);

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
std::vector<int> spread_copies(const double* load, int X, int slots, int cap);

// Each spare slot to the largest load / copies, no cap (EPLB's and the greedy baseline's rule).
std::vector<int> replicate(const std::vector<double>& load, int slots);

}  // namespace hybrid_ep::balancer::detail
