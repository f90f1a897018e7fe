"""The planner's knobs: the two of migration (tolerance, move budget) and the RDMA weight of the
node-aware plan, their defaults and valid values.

Every place that takes them (plan_placement, ExpertBalancer, HybridEPOptions, recipes, the
hybrid-ep-balance CLI) checks them here, so a value one accepts none of the others refuses;
each names the argument its user wrote in its own message.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable

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


# name (as plan_placement and ExpertBalancer take it) -> (valid, the rule a value breaks)
KNOBS: dict[str, tuple[Callable[[object], bool], str]] = {
    "tolerance": (valid_tolerance, TOLERANCE_RULE),
    "move_budget": (valid_move_budget, MOVE_BUDGET_RULE),
    "rdma_weight": (valid_rdma_weight, RDMA_WEIGHT_RULE),
}


def knob_problem(name: str, value, none: str | None = "None") -> str | None:
    """None where `value` is a valid knob `name` (or None, where its user writes it as `none`:
    "None", "null"; none=None: a value is required), else "must be <rule>..., got <value>"."""
    valid, rule = KNOBS[name]
    if (value is None and none is not None) or (value is not None and valid(value)):
        return None
    return f"must be {rule}" + (f" or {none}" if none is not None else "") + f", got {value!r}"


def check_knobs(prefix: str = "", required: tuple[str, ...] = (), **values) -> None:
    """ValueError "<prefix><name> must be ..." for the first knob of `values` that is not valid;
    a knob in `required` may not be None."""
    for name, value in values.items():
        problem = knob_problem(name, value, None if name in required else "None")
        if problem is not None:
            raise ValueError(f"{prefix}{name} {problem}")


def knob_type(name: str) -> Callable[[str], float]:
    """The argparse type of a CLI flag for knob `name`: argparse's message then names the flag."""
    valid, rule = KNOBS[name]

    def parse(text: str) -> float:
        value = float(text)
        if not valid(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    parse.__name__ = name  # argparse names the type in "invalid <name> value"
    return parse
