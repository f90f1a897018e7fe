"""A fit of two timing constants to measured kernel times.

Every other constant keeps its value. The two are searched in log space: a 3 x 3 grid around
the current values (each CPU-model run times all nine tables at once, since timing does not
change the schedule), a quadratic fitted to the score of the nine, its minimum within the
grid the next centre, and a narrower grid around it, span by span. The score is the root
mean square of log(predicted / measured) over the points, so that 2x too slow and 2x too fast
weigh the same.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np


def score(predicted_ms: dict, measured_ms: dict) -> float:
    """RMS of log(predicted / measured) over the measured points."""
    logs = [math.log(predicted_ms[k] / measured_ms[k]) for k in measured_ms]
    return math.sqrt(sum(v * v for v in logs) / len(logs))


@dataclasses.dataclass(frozen=True)
class FitResult:
    values: dict          # name -> fitted value
    score: float          # at the fitted values
    predicted_ms: dict    # point key -> ms at the fitted values
    steps: list           # (span, centre, best score on the grid) per span


def _grid_minimum(logs_a: list[float], logs_b: list[float], scores: list[float]) -> tuple[float, float]:
    """The minimum, within the grid's box, of a quadratic in (log a, log b) fitted to the scores."""
    A = np.array([[1, x, y, x * x, x * y, y * y] for x, y in zip(logs_a, logs_b)])
    coef, *_ = np.linalg.lstsq(A, np.array(scores), rcond=None)
    xs = np.linspace(min(logs_a), max(logs_a), 41)
    ys = np.linspace(min(logs_b), max(logs_b), 41)
    best = min(((coef @ [1, x, y, x * x, x * y, y * y], x, y) for x in xs for y in ys))
    return best[1], best[2]


def fit_two(evaluate, names: tuple[str, str], start: dict, measured_ms: dict,
            spans: tuple[float, ...] = (4.0, 2.0, 1.25)) -> FitResult:
    """evaluate([{name: value}, ...]) -> [{point: predicted ms}, ...] (one per table)."""
    a, b = names
    centre = (math.log(start[a]), math.log(start[b]))
    steps = []
    for span in spans:
        d = math.log(span)
        grid = [(centre[0] + i * d, centre[1] + j * d) for i, j in itertools.product((-1, 0, 1), repeat=2)]
        results = evaluate([{a: math.exp(x), b: math.exp(y)} for x, y in grid])
        scores = [score(r, measured_ms) for r in results]
        best = min(range(len(grid)), key=scores.__getitem__)
        steps.append((span, {a: math.exp(centre[0]), b: math.exp(centre[1])}, scores[best]))
        centre = _grid_minimum([g[0] for g in grid], [g[1] for g in grid], scores)
    values = {a: math.exp(centre[0]), b: math.exp(centre[1])}
    final = evaluate([values])[0]
    return FitResult(values, score(final, measured_ms), final, steps)
