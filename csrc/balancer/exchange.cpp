// The one-slot exchange (exchange.h). With one changed slot per rank and copy counts kept, the
// changed ranks permute the copies they release: rank r releasing a copy of weight w may take
// any copy up to w + slack(r) (slack = allowed - load: negative on over-loaded ranks). Such a
// permutation exists iff, at every weight level t, as many caps as released weights reach t;
// that is, the over-loaded ranks' intervals (w - excess, w] are covered at every level by at
// least as many intervals (w, w + room] of ranks with room. The search picks the slot each
// over-loaded rank releases and covers the demand greedily with as few ranks with room as it
// can; a bipartite matching then pairs the copies with the ranks, skipping any rank that
// already holds the expert. The slots released come from three starts, the one whose cover
// takes the fewest ranks kept: the slots that avoid levels few ranks with room reach, the
// heaviest slots, and a first fit into the ranks with the most room (where an exact solve
// shows the fewest changed slots, the over-loaded ranks release heavy copies and the ranks
// with the most room take them, tools/balancer_study/NOTES.md). One pass of one-rank changes follows
// where that start does not yet beat the refit. Where no start's greedy cover reaches every
// level, a cover that spares the ranks whose other intervals levels ahead need rates them again.
#include "balancer/exchange.h"

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

namespace hybrid_ep::balancer::detail {

namespace {

// An interval of the weight axis in level indices: it covers segments lo .. hi - 1, segment k
// being (level[k], level[k + 1]]; group is its rank's index among the over-loaded ranks or the
// ranks with room, slot the slot whose release it stands for.
struct Span {
  int lo, hi, group, slot;
};

// Passes of one-rank changes, run only where the best start does not beat the refit: a second
// pass, or one on every layer, costs more than the 25 ms limit leaves.
constexpr int kPasses = 1;
// The most changed slots the pass may have to save: a start further above the slots to stay
// under is dropped. Where the exchange won (the quality benchmark's 516 cases and the timing
// load), the pass had to save at most 3; the passes that had to save 5 to 8 all failed, and on
// the timing load they took 0.7 ms of the plan.
constexpr int kPassGain = 4;

class Exchange {
 public:
  Exchange(const Packing& pk, double allowed, int fewer_than) : pk_(pk), allowed_(allowed), fewer_than_(fewer_than) {}

  bool run(Slots& out) {
    if (!build()) return false;
    std::vector<int> choice = least_spill();
    // where the least-spill start demands more than the ranks with room reach at some level, no
    // start found an exchange in any of the 55 such calls on the quality benchmark and the
    // timing load: the other starts are not tried there (0.3 ms of the timing load's plan)
    if (choice.empty()) return false;
    const int over = static_cast<int>(choice.size());
    int cost = greedy(choice, true, miss_, nullptr);
    std::vector<int> others[2] = {heaviest(), first_fit()};
    for (std::vector<int>& other : others) {
      if (other.empty()) continue;
      const int c = greedy(other, true, cost, nullptr);
      if (c < cost) choice.swap(other), cost = c;
    }
    if (cost < miss_) {
      if (over + cost - kPassGain >= fewer_than_) return false;
      for (int pass = 0; pass < kPasses && over + cost >= fewer_than_; ++pass) {
        bool improved = false;
        for (int i = 0; i < over; ++i)
          for (int o = over_at_[i]; o < over_at_[i + 1]; ++o) {
            if (o == choice[i]) continue;
            const int keep = choice[i];
            choice[i] = o;
            const int c = greedy(choice, true, cost, nullptr);
            if (c < cost) cost = c, improved = true;
            else choice[i] = keep;
          }
        if (!improved) break;
      }
    } else {
      // no start's greedy cover reaches every level: the starts rated by the sparing cover, each
      // only as far as it could still beat the refit
      cost = std::min(miss_, fewer_than_ - over);
      std::vector<int>* best = nullptr;
      for (std::vector<int>* start : {&choice, &others[0], &others[1]})
        for (int down = 0; down < 2 && cost > 0 && !start->empty(); ++down) {
          const int c = sparing_cover(*start, down, cost, nullptr);
          if (c < cost) cost = c, best = start;
        }
      if (!best) return false;
      choice.swap(*best);
    }
    if (over + cost >= fewer_than_) return false;
    // the greedy covers of the final choice in both sweeps, fewer ranks with room first, then
    // the sparing ones; the first that pairs
    std::vector<int> rooms[2];
    int taken[2];
    for (int sparing = 0; sparing < 2; ++sparing) {
      for (int down = 0; down < 2; ++down)
        taken[down] = sparing ? sparing_cover(choice, down, std::min(miss_, fewer_than_ - over), &rooms[down])
                              : greedy(choice, down, miss_, &rooms[down]);
      for (int down : taken[1] < taken[0] ? std::vector<int>{1, 0} : std::vector<int>{0, 1})
        if (taken[down] < miss_ && over + taken[down] < fewer_than_ && pair_up(choice, rooms[down], out)) return true;
    }
    return false;
  }

 private:
  // The intervals in level indices. False where no exchange can exist: an over-loaded rank
  // with no slot light enough to take back any copy, or no rank with room.
  bool build() {
    const int P = pk_.P(), W = pk_.W(), S = W * P;
    double lightest = kInf;
    for (int s = 0; s < S; ++s) lightest = std::min(lightest, pk_.slot_weight(s));
    std::vector<double> ends;  // both ends of every interval, level indices once sorted
    std::vector<Span> rooms;
    over_at_.assign(1, 0);
    for (int r = 0; r < W; ++r) {
      const double slack = allowed_ - pk_.rank_load(r);
      if (slack == 0) continue;
      const int group = slack < 0 ? static_cast<int>(over_at_.size()) - 1 : room_count_;
      for (int s = r * P; s < (r + 1) * P; ++s) {
        const double w = pk_.slot_weight(s);
        if (slack < 0 && w + slack < lightest) continue;  // could take back no copy
        const int id = static_cast<int>(ends.size());
        ends.push_back(std::min(w, w + slack)), ends.push_back(std::max(w, w + slack));
        (slack < 0 ? over_opt_ : rooms).push_back({id, id + 1, group, s});
      }
      if (slack > 0) room_count_ += 1;
      else if (static_cast<int>(over_opt_.size()) == over_at_.back()) return false;
      else over_at_.push_back(static_cast<int>(over_opt_.size()));
    }
    if (over_opt_.empty() || room_count_ == 0) return false;
    miss_ = room_count_ + 1;
    // ends to levels: equal weights share a level (heaviest_first: a radix sort at this size)
    const std::vector<int> order = heaviest_first(ends);
    std::vector<int> level(ends.size());
    n_ = -1;
    for (size_t j = order.size(); j-- > 0;) {
      if (j + 1 == order.size() || ends[order[j]] != ends[order[j + 1]]) n_ += 1;
      level[order[j]] = n_;
    }
    for (Span& x : over_opt_) x.lo = level[x.lo], x.hi = level[x.hi];
    for (Span& x : rooms) x.lo = level[x.lo], x.hi = level[x.hi];
    // per sweep, the rooms' intervals reaching furthest first (a counting sort by reach); the
    // down sweep mirrors the levels
    for (int down = 0; down < 2; ++down) {
      std::vector<int> at(n_ + 2, 0);
      auto reach = [&](const Span& x) { return down ? n_ - x.lo : x.hi; };
      for (const Span& x : rooms) at[n_ + 1 - reach(x)] += 1;
      for (int k = 1; k <= n_ + 1; ++k) at[k] += at[k - 1];
      std::vector<Span>& by = by_reach_[down];
      by.resize(rooms.size());
      for (const Span& x : rooms) {
        const int k = n_ - reach(x);
        by[at[k]++] = down ? Span{n_ - x.hi, n_ - x.lo, x.group, x.slot} : x;
      }
    }
    // per sweep, by_reach_'s indices grouped by rank, each rank's reaching furthest first, and
    // by interval start (counting sorts)
    of_rank_at_.assign(room_count_ + 1, 0);
    for (const Span& x : rooms) of_rank_at_[x.group + 1] += 1;
    for (int g = 0; g < room_count_; ++g) of_rank_at_[g + 1] += of_rank_at_[g];
    for (int down = 0; down < 2; ++down) {
      const std::vector<Span>& by = by_reach_[down];
      const int count = static_cast<int>(by.size());
      std::vector<int> fill(of_rank_at_.begin(), of_rank_at_.end() - 1);
      of_rank_[down].resize(count);
      for (int i = 0; i < count; ++i) of_rank_[down][fill[by[i].group]++] = i;
      std::vector<int> at(n_ + 2, 0);
      for (const Span& x : by) at[x.lo + 1] += 1;
      for (int k = 1; k <= n_ + 1; ++k) at[k] += at[k - 1];
      by_start_[down].resize(count);
      for (int i = 0; i < count; ++i) by_start_[down][at[by[i].lo]++] = i;
    }
    return true;
  }

  // The over-loaded ranks' indices, the most excess first (ties: rank order).
  std::vector<int> most_excess_first() const {
    const int over = static_cast<int>(over_at_.size()) - 1;
    std::vector<int> order(over);
    for (int i = 0; i < over; ++i) order[i] = i;
    auto excess = [&](int i) { return pk_.rank_load(over_opt_[over_at_[i]].slot / pk_.P()) - allowed_; };
    std::stable_sort(order.begin(), order.end(), [&](int x, int y) { return excess(x) > excess(y); });
    return order;
  }

  // The j-th interval of the ranks with room grouped by rank (of_rank_at_), in the up sweep.
  const Span& room_span(int j) const { return by_reach_[0][of_rank_[0][j]]; }

  // Each rank with room's intervals merged, in the up sweep's levels, flat: rank g's are
  // merged_[merged_at_[g] .. merged_at_[g + 1]). Built on first use.
  void merge_reach() {
    if (!merged_at_.empty()) return;
    merged_at_.assign(room_count_ + 1, 0);
    merged_.clear();
    std::vector<std::pair<int, int>> iv;  // one rank's intervals
    for (int g = 0; g < room_count_; ++g) {
      iv.clear();
      for (int j = of_rank_at_[g]; j < of_rank_at_[g + 1]; ++j) iv.push_back({room_span(j).lo, room_span(j).hi});
      std::sort(iv.begin(), iv.end());
      merged_.push_back(iv[0]);
      for (const auto& [a, b] : iv)
        if (a <= merged_.back().second) merged_.back().second = std::max(merged_.back().second, b);
        else merged_.push_back({a, b});
      merged_at_[g + 1] = static_cast<int>(merged_.size());
    }
  }

  // The over-loaded ranks with the most excess first, each releasing the slot whose interval
  // overflows least what the ranks with room reach there (a rank counted once per level, its
  // intervals merged). Empty where one still overflows.
  std::vector<int> least_spill() {
    std::vector<int> supply(n_ + 1, 0), demand(n_, 0);
    merge_reach();
    for (const auto& [a, b] : merged_) supply[a] += 1, supply[b] -= 1;
    for (int k = 1; k <= n_; ++k) supply[k] += supply[k - 1];
    const int over = static_cast<int>(over_at_.size()) - 1;
    const std::vector<int> order = most_excess_first();
    std::vector<int> choice(over);
    for (int i : order) {
      int pick = -1;
      long pick_over = 0;
      for (int o = over_at_[i]; o < over_at_[i + 1]; ++o) {
        const Span& x = over_opt_[o];
        long spill = 0;
        for (int k = x.lo; k < x.hi; ++k) spill += std::max(0, demand[k] + 1 - supply[k]);
        if (pick < 0 || spill < pick_over ||
            (spill == pick_over && pk_.slot_weight(x.slot) < pk_.slot_weight(over_opt_[pick].slot)))
          pick = o, pick_over = spill;
      }
      if (pick_over > 0) return {};
      choice[i] = pick;
      for (int k = over_opt_[pick].lo; k < over_opt_[pick].hi; ++k) demand[k] += 1;
    }
    return choice;
  }

  // Each over-loaded rank releasing its heaviest copy.
  std::vector<int> heaviest() const {
    const int over = static_cast<int>(over_at_.size()) - 1;
    std::vector<int> choice(over);
    for (int i = 0; i < over; ++i) {
      int b = over_at_[i];
      for (int o = b + 1; o < over_at_[i + 1]; ++o)
        if (pk_.slot_weight(over_opt_[o].slot) > pk_.slot_weight(over_opt_[b].slot)) b = o;
      choice[i] = b;
    }
    return choice;
  }

  // First fit, the over-loaded ranks with the most excess first: each releases its heaviest
  // slot whose interval the ranks with room taken so far still cover; where none is, the rank
  // with the most room whose slot makes one covered is taken, at the slot that also holds the
  // most intervals of the ranks still to come, or, where no one rank does (an excess above
  // every room), the fewest ranks that together do. Empty where that fails.
  std::vector<int> first_fit() {
    const int over = static_cast<int>(over_at_.size()) - 1;
    const std::vector<int> order = most_excess_first();
    std::vector<int> spare(n_, 0);  // cover minus demand per segment
    auto fits = [&](const Span& x) {
      for (int k = x.lo; k < x.hi; ++k)
        if (spare[k] < 1) return false;
      return true;
    };
    auto add = [&](const Span& x, int d) {
      for (int k = x.lo; k < x.hi; ++k) spare[k] += d;
    };
    // the ranks with room, most room first
    std::vector<double> room(room_count_, 0);
    for (const Span& x : by_reach_[0]) room[x.group] = allowed_ - pk_.rank_load(x.slot / pk_.P());
    std::vector<int> by_room(room_count_);
    for (int g = 0; g < room_count_; ++g) by_room[g] = g;
    std::stable_sort(by_room.begin(), by_room.end(), [&](int a, int b) { return room[a] > room[b]; });
    std::vector<char> taken(room_count_, 0);
    std::vector<int> choice(over, -1);
    auto heaviest_fit = [&](int i) {
      int pick = -1;
      for (int o = over_at_[i]; o < over_at_[i + 1]; ++o)
        if (fits(over_opt_[o]) && (pick < 0 || over_opt_[o].hi > over_opt_[pick].hi)) pick = o;
      return pick;
    };
    for (int n = 0; n < over; ++n) {
      const int i = order[n];
      int pick = heaviest_fit(i);
      if (pick < 0) {
        // per option, the segments left uncovered: a new interval must span them all
        short_.clear();
        for (int o = over_at_[i]; o < over_at_[i + 1]; ++o) {
          int lo = -1, hi = -1;
          for (int k = over_opt_[o].lo; k < over_opt_[o].hi; ++k)
            if (spare[k] < 1) hi = k + 1, lo = lo < 0 ? k : lo;
          short_.push_back({lo, hi});
        }
        for (int g : by_room) {
          if (taken[g]) continue;
          const Span* best = nullptr;
          int best_score = -1;
          for (int j = of_rank_at_[g]; j < of_rank_at_[g + 1]; ++j) {
            const Span* x = &room_span(j);
            bool ok = false;
            for (const auto& [lo, hi] : short_) ok = ok || (x->lo <= lo && hi <= x->hi);
            if (!ok) continue;
            int score = 0;
            for (int m = n + 1; m < over; ++m)
              for (int o = over_at_[order[m]]; o < over_at_[order[m] + 1]; ++o)
                score += over_opt_[o].lo >= x->lo && over_opt_[o].hi <= x->hi;
            if (score > best_score) best = x, best_score = score;
          }
          if (best) {
            taken[g] = 1;
            add(*best, 1);
            pick = heaviest_fit(i);
            break;
          }
        }
        if (pick < 0) {
          // the slot whose short segments the fewest intervals cover, each the untaken one
          // reaching furthest from the first segment still short
          std::vector<const Span*> best_set, set;
          for (int o = over_at_[i]; o < over_at_[i + 1]; ++o) {
            set.clear();
            std::vector<char> used(taken);
            const Span& u = over_opt_[o];
            int k = u.lo;
            bool ok = true;
            while (ok) {
              while (k < u.hi && spare[k] >= 1) ++k;
              if (k >= u.hi) break;
              const Span* far = nullptr;
              for (const Span& x : by_reach_[0]) {
                if (x.hi <= k) break;
                if (x.lo <= k && !used[x.group]) {
                  far = &x;
                  break;
                }
              }
              if (!far) ok = false;
              else set.push_back(far), used[far->group] = 1, k = far->hi;
            }
            if (ok && (best_set.empty() || set.size() < best_set.size())) best_set = set;
          }
          for (const Span* x : best_set) taken[x->group] = 1, add(*x, 1);
          pick = heaviest_fit(i);
        }
        if (pick < 0) return {};
      }
      choice[i] = pick;
      add(over_opt_[pick], -1);
    }
    return choice;
  }

  // Cover of the demand of choice, sweeping the levels up (taking, where short, the unused
  // interval reaching highest) or down (mirrored), each rank with room at most once: the ranks
  // taken plus miss_ per unit left short, or bound as soon as it reaches bound. The sweep
  // stops only where coverage can fall short: where a demand interval starts or a taken one
  // ends. rooms: the slots taken.
  int greedy(const std::vector<int>& choice, int down, int bound, std::vector<int>* rooms) {
    events_.clear();  // 2 * level, + 1 where a demand interval starts (+1) rather than ends (-1)
    for (int o : choice) {
      const Span& x = over_opt_[o];
      events_.push_back(2 * (down ? n_ - x.hi : x.lo) + 1);
      events_.push_back(2 * (down ? n_ - x.lo : x.hi));
    }
    std::sort(events_.begin(), events_.end());
    const std::vector<Span>& spans = by_reach_[down];
    const std::vector<int>& by_start = by_start_[down];
    const std::vector<int>& of_rank = of_rank_[down];
    // the intervals started at or below the level whose rank is unused, one bit each in reach
    // order: the first bit set is the pick, where it reaches past the level
    open_.assign((spans.size() + 63) / 64, 0);
    size_t started = 0;
    used_.assign(room_count_, 0);
    ends_.clear();  // min-heap (negated) of the ends of the intervals taken
    if (rooms) rooms->clear();
    int need = 0, cov = 0, cost = 0;
    size_t e = 0;
    while (e < events_.size()) {
      int k = events_[e] / 2;
      if (!ends_.empty()) k = std::min(k, -ends_.front());
      for (; e < events_.size() && events_[e] / 2 == k; ++e) need += events_[e] % 2 ? 1 : -1;
      for (; !ends_.empty() && -ends_.front() == k; ends_.pop_back(), cov -= 1)
        std::pop_heap(ends_.begin(), ends_.end());
      for (; started < by_start.size() && spans[by_start[started]].lo <= k; ++started) {
        const int i = by_start[started];
        if (!used_[spans[i].group]) open_[i / 64] |= uint64_t{1} << (i % 64);
      }
      while (cov < need) {
        const Span* pick = nullptr;
        for (size_t w = 0; w < open_.size(); ++w)
          if (open_[w]) {
            const Span& x = spans[w * 64 + __builtin_ctzll(open_[w])];
            if (x.hi > k) pick = &x;
            break;
          }
        if (!pick) {
          cost += miss_ * (need - cov);
          break;
        }
        used_[pick->group] = 1;
        for (int j = of_rank_at_[pick->group]; j < of_rank_at_[pick->group + 1]; ++j)
          open_[of_rank[j] / 64] &= ~(uint64_t{1} << (of_rank[j] % 64));
        cov += 1, cost += 1;
        ends_.push_back(-pick->hi);
        std::push_heap(ends_.begin(), ends_.end());
        if (rooms) rooms->push_back(pick->slot);
      }
      if (cost >= bound) return bound;
    }
    return cost;
  }

  // The greedy cover, sparing ranks with room: where short, the unused interval reaching
  // furthest whose rank's other intervals no level ahead needs (every level ahead that all
  // unused ranks could still cover stays so), else the one reaching furthest. Where scarce
  // reaches lie at the far end of the sweep, the plain greedy spends them early and falls
  // short there (uniform-noise at W 128, S 384: no start's plain cover reaches every level,
  // the sparing one takes 34 ranks with room). Same cost and arguments as greedy.
  int sparing_cover(const std::vector<int>& choice, int down, int bound, std::vector<int>* rooms) {
    merge_reach();
    // merged interval j in this sweep's levels
    auto reach = [&](int j) {
      const auto [a, b] = merged_[j];
      return down ? std::pair<int, int>{n_ - b, n_ - a} : std::pair<int, int>{a, b};
    };
    // margin: cover taken + unused ranks reaching the level - demand; short: demand - cover taken
    margin_.assign(n_ + 1, 0);
    short_by_.assign(n_ + 1, 0);
    for (size_t j = 0; j < merged_.size(); ++j) {
      const auto [a, b] = reach(static_cast<int>(j));
      margin_[a] += 1, margin_[b] -= 1;
    }
    for (int o : choice) {
      const Span& x = over_opt_[o];
      const int lo = down ? n_ - x.hi : x.lo, hi = down ? n_ - x.lo : x.hi;
      margin_[lo] -= 1, margin_[hi] += 1, short_by_[lo] += 1, short_by_[hi] -= 1;
    }
    for (int k = 1; k <= n_; ++k) margin_[k] += margin_[k - 1], short_by_[k] += short_by_[k - 1];
    // no cover where all ranks with room fall short of a level, none within bound where a level
    // needs bound ranks or more
    for (int k = 0; k < n_; ++k)
      if (margin_[k] < 0 || short_by_[k] >= bound) return bound;
    // the tight segments (margin below 1), counted by a Fenwick tree: a candidate is checked
    // against each of its rank's merged intervals in O(log n)
    tight_.assign(n_ + 1, 0);
    auto mark = [&](int j) {
      for (++j; j <= n_; j += j & -j) tight_[j] += 1;
    };
    auto tight_before = [&](int j) {  // tight segments below j
      int c = 0;
      for (; j > 0; j -= j & -j) c += tight_[j];
      return c;
    };
    for (int j = 0; j < n_; ++j)
      if (margin_[j] < 1) mark(j);
    // taking x leaves margin as it is on x and lowers it by one on the rest of x's rank's reach
    auto spares = [&](const Span& x, int k) {
      for (int j = merged_at_[x.group]; j < merged_at_[x.group + 1]; ++j) {
        const auto [a, b] = reach(j);
        const int lo = std::max(a, k);
        if (lo >= b) continue;
        int c = tight_before(b) - tight_before(lo);
        const int in_lo = std::max(lo, x.lo), in_hi = std::min(b, x.hi);
        if (in_lo < in_hi) c -= tight_before(in_hi) - tight_before(in_lo);
        if (c > 0) return false;
      }
      return true;
    };
    used_.assign(room_count_, 0);
    if (rooms) rooms->clear();
    int cost = 0;
    for (int k = 0; k < n_; ++k) {
      while (short_by_[k] > 0) {
        const Span* pick = nullptr;
        const Span* furthest = nullptr;
        for (const Span& x : by_reach_[down]) {
          if (x.hi <= k) break;
          if (x.lo > k || used_[x.group]) continue;
          if (!furthest) furthest = &x;
          if (spares(x, k)) {
            pick = &x;
            break;
          }
        }
        if (!pick) pick = furthest;
        if (!pick) {
          cost += miss_ * short_by_[k];
          break;
        }
        used_[pick->group] = 1;
        cost += 1;
        for (int j = pick->lo; j < pick->hi; ++j) short_by_[j] -= 1;
        for (int i = merged_at_[pick->group]; i < merged_at_[pick->group + 1]; ++i) {
          const auto [a, b] = reach(i);
          for (int j = a; j < b; ++j)
            if ((j < pick->lo || j >= pick->hi) && --margin_[j] == 0) mark(j);
        }
        if (rooms) rooms->push_back(pick->slot);
      }
      if (cost >= bound) return bound;
    }
    return cost;
  }

  // The exchange itself: each released copy to a changed rank it fits within allowed that does
  // not hold its expert in another slot (augmenting paths, heaviest copy first, tightest rank
  // first). False where no such pairing exists.
  bool pair_up(const std::vector<int>& choice, const std::vector<int>& rooms, Slots& out) const {
    const int P = pk_.P();
    std::vector<int> slot;  // the changed slot of each changed rank
    for (int o : choice) slot.push_back(over_opt_[o].slot);
    slot.insert(slot.end(), rooms.begin(), rooms.end());
    const int k = static_cast<int>(slot.size());
    auto fits = [&](int item, int to) {  // the copy in slot item into slot `to`
      const int r = to / P;
      const int64_t e = pk_.expert(item);
      if (e != pk_.expert(to) && pk_.holds(r, e)) return false;
      return pk_.rank_load(r) - pk_.slot_weight(to) + pk_.slot_weight(item) <= allowed_;
    };
    auto cap = [&](int i) { return pk_.slot_weight(slot[i]) + allowed_ - pk_.rank_load(slot[i] / P); };
    std::vector<int> takers(k), items(k);
    for (int i = 0; i < k; ++i) takers[i] = items[i] = i;
    std::sort(takers.begin(), takers.end(), [&](int x, int y) { return cap(x) < cap(y); });
    std::sort(items.begin(), items.end(),
              [&](int x, int y) { return pk_.slot_weight(slot[x]) > pk_.slot_weight(slot[y]); });
    std::vector<int> owner(k, -1);  // taker -> item (both indices into slot)
    std::vector<char> seen(k);
    auto augment = [&](auto&& self, int item) -> bool {
      for (int t : takers) {
        if (seen[t] || !fits(slot[item], slot[t])) continue;
        seen[t] = 1;
        if (owner[t] < 0 || self(self, owner[t])) {
          owner[t] = item;
          return true;
        }
      }
      return false;
    };
    for (int item : items) {
      std::fill(seen.begin(), seen.end(), 0);
      if (!augment(augment, item)) return false;
    }
    out = pk_.slots();
    for (int t = 0; t < k; ++t) out[slot[t]] = pk_.expert(slot[owner[t]]);
    return true;
  }

  const Packing& pk_;
  const double allowed_;
  const int fewer_than_;                     // changed slots the exchange must stay under
  int n_ = 0;                                // segments between the levels
  int room_count_ = 0;                       // ranks with room
  int miss_ = 0;                             // cost of one uncovered unit of demand: more than every rank with room
  std::vector<Span> over_opt_;               // the over-loaded ranks' slots that may be released, by rank
  std::vector<int> over_at_;                 // [over-loaded ranks + 1] where each rank's slots start
  std::vector<Span> by_reach_[2];            // the rooms' intervals reaching furthest first, per sweep
  std::vector<int> of_rank_[2];              // by_reach_ indices grouped by rank, per sweep (build)
  std::vector<int> of_rank_at_;              // [ranks with room + 1] where each rank's start
  std::vector<std::pair<int, int>> merged_;  // merge_reach: each rank with room's intervals merged
  std::vector<int> merged_at_;
  std::vector<int> margin_, short_by_, tight_;  // sparing_cover's per-segment counts
  std::vector<int> by_start_[2];                // greedy: by_reach_ indices by interval start, per sweep
  std::vector<uint64_t> open_;                  // greedy: the intervals it may take, one bit each
  std::vector<int> events_;
  std::vector<std::pair<int, int>> short_;  // first_fit: per slot, the segments a new interval must span
  std::vector<int> ends_;
  std::vector<char> used_;
};

}  // namespace

bool one_slot_exchange(const Packing& pk, double allowed, int fewer_than, Slots& out) {
  return Exchange(pk, allowed, fewer_than).run(out);
}

}  // namespace hybrid_ep::balancer::detail
