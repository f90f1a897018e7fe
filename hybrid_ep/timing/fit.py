"""A fit of a few timing constants (at most three) to measured kernel times.

Every other constant keeps its value. The fitted ones are searched in log space: a grid of
3 values each around the current values (each CPU-model run times all the grid's tables at
once, since timing does not change the schedule), a quadratic fitted to the grid's scores,
its minimum within the grid the next centre, and a narrower grid around it, span by span.
The score is the root mean square of log(predicted / measured) over the points, so that 2x
too slow and 2x too fast weigh the same.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

MAX_FITTED = 3


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


def _quadratic_terms(x: np.ndarray) -> np.ndarray:
    k = len(x)
    return np.concatenate([[1.0], x, [x[i] * x[j] for i in range(k) for j in range(i, k)]])


def _grid_minimum(points: list[tuple[float, ...]], scores: list[float]) -> tuple[float, ...]:
    """The minimum, within the grid's box, of a quadratic in the log values fitted to the scores."""
    A = np.array([_quadratic_terms(np.array(p)) for p in points])
    coef, *_ = np.linalg.lstsq(A, np.array(scores), rcond=None)
    axes = [np.linspace(min(p[i] for p in points), max(p[i] for p in points), 21) for i in range(len(points[0]))]
    return min(itertools.product(*axes), key=lambda x: float(coef @ _quadratic_terms(np.array(x))))


def fit(evaluate, names: tuple[str, ...], start: dict, measured_ms: dict,
        spans: tuple[float, ...] = (4.0, 2.0, 1.25)) -> FitResult:
    """evaluate([{name: value}, ...]) -> [{point: predicted ms}, ...] (one per table)."""
    if not 1 <= len(names) <= MAX_FITTED:
        raise ValueError(f"fit 1 to {MAX_FITTED} constants, got {len(names)}: {names}")
    centre = tuple(math.log(start[n]) for n in names)
    steps = []
    for span in spans:
        d = math.log(span)
        grid = [tuple(c + i * d for c, i in zip(centre, offsets))
                for offsets in itertools.product((-1, 0, 1), repeat=len(names))]
        results = evaluate([{n: math.exp(x) for n, x in zip(names, p)} for p in grid])
        scores = [score(r, measured_ms) for r in results]
        steps.append((span, {n: math.exp(x) for n, x in zip(names, centre)}, min(scores)))
        centre = _grid_minimum(grid, scores)
    values = {n: math.exp(x) for n, x in zip(names, centre)}
    final = evaluate([values])[0]
    return FitResult(values, score(final, measured_ms), final, steps)
