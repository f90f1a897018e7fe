"""A fit of a few timing constants (at most three) to measured kernel times.

Every other constant keeps its value. A predicted time is piecewise linear in the constants
(the clocks add costs and take maxima; the copy engine's rate enters as its inverse, INVERSE),
so near a table it is nearly linear: one CPU-model run
times a grid of 3 values per fitted constant around the start (every table at once, since
timing does not change the schedule), each point's predicted time is fitted as a linear
function of the constants over the grid, the score is minimised on that surrogate over a box
wider than the grid, and the next round's grid is centred on the minimum with a narrower span.
A last run at the result gives the score reported. The score is the root mean square of
log(predicted / measured) over the points, so 2x too slow and 2x too fast weigh the same.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

MAX_FITTED = 3
# Constants that enter the clocks as their inverse (a copy takes bytes / engine_*_bytes_per_ns):
# the per-point lines are through their inverse, in which the times are piecewise linear.
INVERSE = frozenset({"engine_load_bytes_per_ns", "engine_store_bytes_per_ns"})


def _feature(name: str, value: float) -> float:
    return 1.0 / value if name in INVERSE else value


def score(predicted_ms: dict, measured_ms: dict) -> float:
    """RMS of log(predicted / measured) over the measured points."""
    logs = [math.log(predicted_ms[k] / measured_ms[k]) for k in measured_ms]
    return math.sqrt(sum(v * v for v in logs) / len(logs))


@dataclasses.dataclass(frozen=True)
class FitResult:
    values: dict          # name -> fitted value
    score: float          # at the fitted values, from a run of the model
    predicted_ms: dict    # point key -> ms at the fitted values
    steps: list           # (span, grid centre, best score on the grid, surrogate's minimum) per round


def linear_surrogate(grid: list[dict], results: list[dict], names: tuple[str, ...], keys) -> tuple[dict, float]:
    """Per point, the least-squares line (intercept, one slope per constant) through the grid's
    predictions; and its largest relative residual on the grid (how far from linear they are)."""
    X = np.array([[1.0] + [_feature(n, g[n]) for n in names] for g in grid])
    coef, worst = {}, 0.0
    for k in keys:
        y = np.array([r[k] for r in results])
        coef[k] = np.linalg.lstsq(X, y, rcond=None)[0]
        worst = max(worst, float(np.max(np.abs(X @ coef[k] - y) / y)))
    return coef, worst


def surrogate_at(coef: dict, names: tuple[str, ...], values: dict) -> dict:
    """Each point's value on its line at `values`."""
    x = np.array([1.0] + [_feature(n, values[n]) for n in names])
    return {k: float(c @ x) for k, c in coef.items()}


def surrogate_minimum(grid: list[dict], results: list[dict], measured_ms: dict, names: tuple[str, ...],
                      box: float, fixed: dict | None = None) -> tuple[dict, float]:
    """The values within `box` times the grid's centre (log-spaced search) that minimise the
    score of the per-point linear fit to the grid's predictions; and that score. Constants in
    `fixed` (varied by the grid, not fitted) stay at their given values."""
    fixed = fixed or {}
    coef, _ = linear_surrogate(grid, results, names, measured_ms)
    centre = grid[len(grid) // 2]
    axes = [np.array([fixed[n]]) if n in fixed else
            np.exp(np.linspace(math.log(centre[n] / box), math.log(centre[n] * box), 41)) for n in names]
    best, best_score = None, math.inf
    for values in itertools.product(*axes):
        x = np.array([1.0] + [_feature(n, v) for n, v in zip(names, values)])
        pred = {k: float(c @ x) for k, c in coef.items()}
        if min(pred.values()) <= 0:
            continue
        s = score(pred, measured_ms)
        if s < best_score:
            best, best_score = dict(zip(names, values)), s
    return best, best_score


def fit(evaluate, names: tuple[str, ...], start: dict, measured_ms: dict,
        spans: tuple[float, ...] = (3.0, 1.5)) -> FitResult:
    """evaluate([{name: value}, ...]) -> [{point: predicted ms}, ...] (one per table)."""
    if not 1 <= len(names) <= MAX_FITTED:
        raise ValueError(f"fit 1 to {MAX_FITTED} constants, got {len(names)}: {names}")
    centre = {n: float(start[n]) for n in names}
    steps = []
    for span in spans:
        grid = [{n: centre[n] * span ** i for n, i in zip(names, offsets)}
                for offsets in itertools.product((-1, 0, 1), repeat=len(names))]
        results = evaluate(grid)
        best_grid = min(score(r, measured_ms) for r in results)
        centre, predicted = surrogate_minimum(grid, results, measured_ms, names, span * span)
        steps.append((span, grid[len(grid) // 2], best_grid, predicted))
    final = evaluate([centre])[0]
    return FitResult(centre, score(final, measured_ms), final, steps)
