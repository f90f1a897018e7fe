// hybrid_ep._planner: the expert placement planner (csrc/balancer/planner.h) over the layers
// of a [L, E] float64 load. hybrid_ep/balancer/planner.py checks every argument first.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstring>
#include <optional>
#include <string>

#include "balancer/planner.h"

namespace py = pybind11;
namespace hb = hybrid_ep::balancer;

namespace {

using Load = py::array_t<double, py::array::c_style | py::array::forcecast>;
using Plan = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

void require(bool ok, const std::string& what) {
  if (!ok) throw py::value_error("hybrid_ep._planner: " + what);
}

// The sizes every planner function needs (a wrong one would index out of bounds).
void check_sizes(const Load& load, int S, int N, int W) {
  require(load.ndim() == 2 && load.shape(1) > 0, "load must be [layers, num_experts]");
  const auto E = load.shape(1);
  require(W >= 1 && N >= 1 && W % N == 0, "num_ranks must be a positive multiple of num_nodes");
  require(S >= E && S % W == 0, "num_slots must be >= num_experts and a multiple of num_ranks");
  require(E % N == 0, "num_nodes must divide num_experts");
}

// Every expert id of plan in [0, E). The message is built once: built for every slot it cost
// about 1 ms per refit call on the timing load.
void check_ids(const Plan& plan, int64_t E, const char* name) {
  const int64_t* p = plan.data();
  const bool inside = std::all_of(p, p + plan.size(), [E](int64_t e) { return e >= 0 && e < E; });
  require(inside, std::string(name) + " holds an expert id outside [0, num_experts)");
}

void check_plan(const Plan& plan, const Load& load, const char* name) {
  require(plan.ndim() == 2 && plan.shape(0) == load.shape(0), std::string(name) + " must be [layers, num_slots]");
  check_ids(plan, load.shape(1), name);
}

// [L, S] int64 from one function of (layer load pointer) per layer.
template <class F>
Plan per_layer(const Load& load, int S, F plan) {
  const auto L = load.shape(0), E = load.shape(1);
  Plan out({L, static_cast<py::ssize_t>(S)});
  auto* dst = out.mutable_data();
  const double* src = load.data();
  {
    py::gil_scoped_release release;
    for (py::ssize_t l = 0; l < L; ++l) {
      const hb::Slots slots = plan(src + l * E, static_cast<int>(E));
      std::memcpy(dst + l * S, slots.data(), sizeof(int64_t) * S);
    }
  }
  return out;
}

py::tuple keep_previous(const Load& load, const Plan& previous, const Plan& fresh, const Load& allowed_peak, int W,
                        int max_moves) {
  check_sizes(load, static_cast<int>(previous.shape(1)), 1, W);
  check_plan(previous, load, "previous");
  check_plan(fresh, load, "fresh");
  require(fresh.shape(1) == previous.shape(1), "fresh and previous must have the same slots");
  require(allowed_peak.ndim() == 1 && allowed_peak.shape(0) == load.shape(0), "allowed_peak must be [layers]");
  const auto L = load.shape(0), E = load.shape(1), S = previous.shape(1);
  Plan out({L, S});
  py::array_t<bool> ok(L);
  auto* dst = out.mutable_data();
  auto* ok_dst = ok.mutable_data();
  {
    py::gil_scoped_release release;
    hb::keep_previous(load.data(), static_cast<int>(L), static_cast<int>(E), W, static_cast<int>(S), previous.data(),
                      fresh.data(), allowed_peak.data(), max_moves, dst, ok_dst);
  }
  return py::make_tuple(out, ok);
}

Plan walk_back(const Load& load, const Plan& previous, const Plan& start, const Load& allowed_peak, int W) {
  check_sizes(load, static_cast<int>(previous.shape(1)), 1, W);
  check_plan(previous, load, "previous");
  check_plan(start, load, "start");
  require(start.shape(1) == previous.shape(1), "start and previous must have the same slots");
  require(allowed_peak.ndim() == 1 && allowed_peak.shape(0) == load.shape(0), "allowed_peak must be [layers]");
  const auto S = previous.shape(1);
  const int64_t* prev = previous.data();
  const int64_t* from = start.data();
  const double* allowed = allowed_peak.data();
  return per_layer(load, static_cast<int>(S), [&](const double* l, int E) {
    const py::ssize_t layer = (l - load.data()) / E;
    return hb::walk_back_to(l, E, W, hb::Slots(prev + layer * S, prev + (layer + 1) * S),
                            hb::Slots(from + layer * S, from + (layer + 1) * S), allowed[layer]);
  });
}

py::tuple keep_local(const Load& load, const Plan& previous, const std::optional<Plan>& target, int N, int W,
                     double rdma_weight, bool keep_layout, const Load& allowed_peak, int max_moves) {
  const int S = static_cast<int>(previous.shape(1));
  check_sizes(load, S, N, W);
  check_plan(previous, load, "previous");
  if (target) {
    check_plan(*target, load, "target");
    require(target->shape(1) == S, "target and previous must have the same slots");
  }
  require(allowed_peak.ndim() == 1 && allowed_peak.shape(0) == load.shape(0), "allowed_peak must be [layers]");
  const auto L = load.shape(0), E = load.shape(1);
  Plan out({L, static_cast<py::ssize_t>(S)});
  py::array_t<bool> ok(L);
  auto* dst = out.mutable_data();
  auto* ok_dst = ok.mutable_data();
  {
    py::gil_scoped_release release;
    hb::keep_local(load.data(), static_cast<int>(L), static_cast<int>(E), W, N, S, previous.data(),
                   target ? target->data() : nullptr, rdma_weight, keep_layout, allowed_peak.data(), max_moves, dst,
                   ok_dst);
  }
  return py::make_tuple(out, ok);
}

}  // namespace

PYBIND11_MODULE(_planner, m) {
  m.doc() = "Expert placement planner over the layers of a [L, E] load (hybrid_ep.balancer.planner).";
  m.def(
      "plan_fresh",
      [](const Load& load, int S, int N, int W, bool onto_nodes) {
        check_sizes(load, S, N, W);
        return per_layer(load, S, [&](const double* l, int E) { return hb::plan_fresh(l, E, S, N, W, onto_nodes); });
      },
      py::arg("load"), py::arg("num_slots"), py::arg("num_nodes"), py::arg("num_ranks"), py::arg("onto_nodes") = true);
  m.def(
      "plan_local",
      [](const Load& load, int S, int N, int W, double rdma_weight) {
        check_sizes(load, S, N, W);
        return per_layer(load, S, [&](const double* l, int E) { return hb::plan_local(l, E, S, N, W, rdma_weight); });
      },
      py::arg("load"), py::arg("num_slots"), py::arg("num_nodes"), py::arg("num_ranks"), py::arg("rdma_weight"),
      "[L, S]: the node-aware plan for the replica choice by locality (planner.h)");
  m.def(
      "local_terms",
      [](const Load& load, const Plan& plan, int N, int W) {
        const int S = static_cast<int>(plan.shape(1));
        check_sizes(load, S, N, W);
        check_plan(plan, load, "plan");
        const auto L = load.shape(0), E = load.shape(1);
        py::array_t<double> imbalance(L), off(L);
        const int64_t* p = plan.data();
        for (py::ssize_t l = 0; l < L; ++l)
          hb::local_terms(load.data() + l * E, static_cast<int>(E), W, N, hb::Slots(p + l * S, p + (l + 1) * S),
                          imbalance.mutable_data() + l, off.mutable_data() + l);
        return py::make_tuple(imbalance, off);
      },
      py::arg("load"), py::arg("plan"), py::arg("num_nodes"), py::arg("num_ranks"),
      "([L] rank imbalance, [L] share of routes off their home node) under the replica choice by locality");
  m.def("keep_local", &keep_local, py::arg("load"), py::arg("previous"), py::arg("target"), py::arg("num_nodes"),
        py::arg("num_ranks"), py::arg("rdma_weight"), py::arg("keep_layout"), py::arg("allowed_peak"),
        py::arg("max_moves"),
        "(slots [L, S], reached [L]): previous re-fitted node by node toward allowed_peak (planner.h)");
  m.def(
      "align_within_nodes",
      [](const Plan& plan, const Plan& previous, int E, int N, int W) {
        require(plan.ndim() == 2 && previous.ndim() == 2 && plan.shape(0) == previous.shape(0) &&
                    plan.shape(1) == previous.shape(1) && E >= 1,
                "plan and previous must be [layers, num_slots] alike and num_experts >= 1");
        const auto L = plan.shape(0), S = plan.shape(1);
        require(W >= 1 && N >= 1 && W % N == 0 && S % W == 0,
                "num_ranks must divide the slots and be a multiple of num_nodes");
        check_ids(plan, E, "plan");
        check_ids(previous, E, "previous");
        const int64_t* p = plan.data();
        const int64_t* q = previous.data();
        Plan out({L, S});
        {
          py::gil_scoped_release release;
          for (py::ssize_t l = 0; l < L; ++l) {
            const hb::Slots aligned = hb::align_within_nodes(hb::Slots(p + l * S, p + (l + 1) * S),
                                                             hb::Slots(q + l * S, q + (l + 1) * S), E, N, W);
            std::memcpy(out.mutable_data() + l * S, aligned.data(), sizeof(int64_t) * S);
          }
        }
        return out;
      },
      py::arg("plan"), py::arg("previous"), py::arg("num_experts"), py::arg("num_nodes"), py::arg("num_ranks"),
      "[L, S]: plan with ranks within each node and slots within each rank matched onto previous (planner.h)");
  m.def(
      "group_nodes",
      [](const Plan& plan, int E, int N, int W) {
        require(plan.ndim() == 2 && E >= 1, "plan must be [layers, num_slots] and num_experts >= 1");
        const auto L = plan.shape(0), S = plan.shape(1);
        require(W >= 1 && N >= 1 && W % N == 0 && S % W == 0,
                "num_ranks must divide the slots and be a multiple of num_nodes");
        check_ids(plan, E, "plan");
        const int64_t* p = plan.data();
        Plan out({L, S});
        for (py::ssize_t l = 0; l < L; ++l) {
          const hb::Slots grouped = hb::group_nodes(hb::Slots(p + l * S, p + (l + 1) * S), E, N, W);
          std::memcpy(out.mutable_data() + l * S, grouped.data(), sizeof(int64_t) * S);
        }
        return out;
      },
      py::arg("plan"), py::arg("num_experts"), py::arg("num_nodes"), py::arg("num_ranks"),
      "[L, S]: ranks reordered onto nodes so ranks sharing experts share a node (plan_fresh's last step)");
  m.def("walk_back", &walk_back, py::arg("load"), py::arg("previous"), py::arg("start"), py::arg("allowed_peak"),
        py::arg("num_ranks"), "[L, S]: start turned back toward previous while every rank stays within allowed_peak");
  m.def("keep_previous", &keep_previous, py::arg("load"), py::arg("previous"), py::arg("fresh"),
        py::arg("allowed_peak"), py::arg("num_ranks"), py::arg("max_moves"),
        "(slots [L, S], reached [L]): previous re-fitted with few changed slots until its peak is allowed");
  m.def(
      "lower_bound",
      [](const Load& load, int S, int W) {
        check_sizes(load, S, 1, W);
        const auto L = load.shape(0), E = load.shape(1);
        py::array_t<double> out(L);
        for (py::ssize_t l = 0; l < L; ++l)
          out.mutable_data()[l] = hb::lower_bound(load.data() + l * E, static_cast<int>(E), S, W);
        return out;
      },
      py::arg("load"), py::arg("num_slots"), py::arg("num_ranks"), "[L] peak no placement goes below");
  m.def(
      "eplb",
      [](const Load& load, int S, int N, int W) {
        check_sizes(load, S, N, W);
        return per_layer(load, S, [&](const double* l, int E) { return hb::eplb(l, E, S, N, W); });
      },
      py::arg("load"), py::arg("num_slots"), py::arg("num_nodes"), py::arg("num_ranks"));
  m.def(
      "greedy",
      [](const Load& load, int S, int W) {
        check_sizes(load, S, 1, W);
        return per_layer(load, S, [&](const double* l, int E) { return hb::greedy(l, E, S, W); });
      },
      py::arg("load"), py::arg("num_slots"), py::arg("num_ranks"));
}
