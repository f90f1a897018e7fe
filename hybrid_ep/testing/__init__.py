"""Test support shared by every backend: the dense oracle, comparisons, cases, process pools."""

from ..spawn import ProcessGroupPool
from .cases import Case, check_case, make_rank_inputs
from .compare import assert_combine_close, assert_combine_within, assert_dispatch_matches, combine_tolerance
from .oracle import CombineBounds, OracleDispatch, OracleRun, combine_hops_oracle, combine_oracle, dispatch_oracle

__all__ = [
    "Case",
    "CombineBounds",
    "OracleDispatch",
    "OracleRun",
    "ProcessGroupPool",
    "assert_combine_close",
    "assert_combine_within",
    "assert_dispatch_matches",
    "check_case",
    "combine_hops_oracle",
    "combine_oracle",
    "combine_tolerance",
    "dispatch_oracle",
    "make_rank_inputs",
]
