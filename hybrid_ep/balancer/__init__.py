"""Training-time expert balancer: load statistics, placement planner, slot routing, migration.

    from hybrid_ep.balancer import plan_placement, ExpertBalancer
    p = plan_placement(load_LE, num_slots, num_nodes, num_ranks)   # docs/balancer.md, Planner

The modules, in the order a step meets them: `stats` (tokens per expert, counted on the
device), `slots` (router expert ids -> slot ids: the spreading rule, or the replica choice by
locality for node-aware plans), `state` (what a slot holds: weights,
master weights, optimizer state), `migration` (moving slots between ranks, summing replicas'
gradients), `placement` (the Placement type: which expert each slot holds), `planner`
(statistics -> placement), `metrics` and `report` (imbalance, heatmaps, statistics files),
`balancer` (the loop), `cli` (offline planning from saved statistics). `knobs` holds the
planner's tolerance, move budget and RDMA weight (plan_placement's rdma_weight: the
node-aware plan that keeps node-limited routing's RDMA savings).
Megatron-Core hooks live in megatron_patches.balancer. See docs/balancer.md.
"""

from __future__ import annotations

from .balancer import BalancedLayer, ExpertBalancer, native_placement
from .migration import plan_transfers
from .slots import SlotTable, route_to_slots, route_topk_to_slots
from .state import MegatronOptimizerView, OptimizerView, TorchOptimizerView, slot_parameters
from .stats import LoadStatistics


def __getattr__(name):
    # The planner, metrics and reports import lazily: the training path needs them only
    # at a rebalance.
    if name == "plan_placement":
        from . import planner

        return planner.plan_placement
    if name == "Placement":
        from . import placement

        return placement.Placement
    if name in ("imbalance_ratio", "rank_loads", "slot_loads", "summarize"):
        from . import metrics

        return getattr(metrics, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BalancedLayer", "ExpertBalancer", "LoadStatistics", "MegatronOptimizerView", "OptimizerView",
    "Placement", "SlotTable", "TorchOptimizerView", "imbalance_ratio", "native_placement",
    "plan_placement", "plan_transfers", "rank_loads", "route_to_slots", "route_topk_to_slots",
    "slot_loads", "slot_parameters", "summarize",
]
