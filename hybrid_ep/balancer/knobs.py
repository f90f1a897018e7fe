"""The planner's knobs: the two of migration (tolerance, move budget) and the RDMA weight of the
node-aware plan, their defaults and valid values.

Every place that takes them (plan_placement, ExpertBalancer, HybridEPOptions, recipes, the
hybrid-ep-balance CLI) checks them here, so a value one accepts none of the others refuses;
each names the argument its user wrote in its own message.
"""

from __future__ import annotations

import math

from ..checks import is_real

# plan_placement keeps previous slots unless that raises the rank imbalance by more than this.
DEFAULT_TOLERANCE = 1e-2

# The node-aware plan (plan_placement's rdma_weight): imbalance given up per unit of routes
# served off their home node, as a fraction of all routes. 0.5: moving an expert that carries
# 1% of the routes off its node must lower the rank imbalance by more than 0.005 (measured
# against 0.25 and 1: docs/benchmarks/balancer_locality.md).
DEFAULT_RDMA_WEIGHT = 0.5

TOLERANCE_RULE = "a finite number >= 0"
MOVE_BUDGET_RULE = "a fraction of the slots in [0, 1]"
RDMA_WEIGHT_RULE = "a finite number >= 0"


def valid_tolerance(value) -> bool:
    """Rank imbalance a kept placement may add over a fresh plan's (TOLERANCE_RULE)."""
    return is_real(value) and 0.0 <= value < math.inf


def valid_move_budget(value) -> bool:
    """Most slots per layer one call changes, as a fraction of the layer's (MOVE_BUDGET_RULE)."""
    return is_real(value) and 0.0 <= value <= 1.0


def valid_rdma_weight(value) -> bool:
    """Imbalance per fraction of routes served off their home node (RDMA_WEIGHT_RULE)."""
    return is_real(value) and 0.0 <= value < math.inf
