"""What a result is checked against, on every backend: the dense fp64 oracle, the comparisons
and their rounding bounds, and the cases that run a buffer against them (the benchmarks check
the kernels with these before they time them; the tests' harnesses in tests/harness/ too)."""

from .cases import Case, check_case, make_rank_inputs
from .compare import assert_combine_close, assert_combine_within, assert_dispatch_matches, combine_tolerance
from .oracle import CombineBounds, OracleDispatch, OracleRun, combine_hops_oracle, combine_oracle, dispatch_oracle

__all__ = [
    "Case",
    "CombineBounds",
    "OracleDispatch",
    "OracleRun",
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
