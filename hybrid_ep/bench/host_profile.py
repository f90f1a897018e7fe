"""Where a call pair's host time goes, by function: cProfile over a few pairs, the top
entries by own time. The GPU bench records it beside the host time per pair, so a GPU run
that misses the host target says which Python functions (or which calls into torch and the
extension) took the time: on the CPU model the launches are stubbed and DLPack tensors,
stream events and launches cost what a GPU makes them cost only on a GPU."""

from __future__ import annotations

import cProfile
import os
import pstats
from typing import Callable

PROFILED_PAIRS = 20
TOP_FUNCTIONS = 15


def _where(key: tuple[str, int, str]) -> str:
    path, line, name = key
    if path == "~":  # a built-in: "{method 'x' of 'y' objects}"
        return name
    parts = path.replace(os.sep, "/").split("/")
    short = "/".join(parts[parts.index("hybrid_ep"):]) if "hybrid_ep" in parts else parts[-1]
    return f"{short}:{line}({name})"


def top_functions(stats: pstats.Stats, pairs: int, top: int = TOP_FUNCTIONS) -> list[dict]:
    """The `top` functions by own time: {"function", "calls_per_pair", "own_us_per_pair",
    "cumulative_us_per_pair"}, microseconds per pair (cProfile's overhead included)."""
    if pairs < 1:
        raise ValueError(f"pairs must be >= 1, got {pairs}")
    rows = []
    for key, (_, calls, own_s, cum_s, _) in stats.stats.items():
        rows.append({"function": _where(key), "calls_per_pair": calls / pairs, "own_us_per_pair": own_s * 1e6 / pairs,
                     "cumulative_us_per_pair": cum_s * 1e6 / pairs})
    rows.sort(key=lambda r: -r["own_us_per_pair"])
    return rows[:top]


def profile_pairs(pair: Callable[[], object], pairs: int = PROFILED_PAIRS, top: int = TOP_FUNCTIONS) -> list[dict]:
    """top_functions of `pairs` calls of `pair` (one dispatch + combine pair each) under cProfile."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        for _ in range(pairs):
            pair()
    finally:
        profiler.disable()
    return top_functions(pstats.Stats(profiler), pairs, top)
