"""What every backend's ranks time with, shared by worker.py (hybrid-ep's backends) and
deepep.py (the baseline): the routings and inputs of a rank, drawn from the bench's seed so that
every backend moves the same tokens; the traffic's fields as results hold them; and rank 0's
progress line.

Legend: T tokens on this rank, K routes per token, H hidden.
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from ..fp8 import quantize_fp8
from ..synthetic import derived_seed, iter_rank_routings, random_weights
from .spec import BenchSpec


def rank_routings(spec: BenchSpec, count: int) -> list[torch.Tensor]:
    """topk_idx [T, K] of ranks 0 .. count - 1: routings of all ranks come from one generator
    in rank order (Zipf popularity drawn once, shared by all ranks), as `python -m
    hybrid_ep.traffic` draws them for the same seed."""
    groups = (dict(num_groups=spec.num_nodes, topk_groups=spec.topk_groups)
              if spec.routing == "group-limited" else {})
    return list(iter_rank_routings(spec.routing, [spec.tokens] * count, spec.experts, spec.topk, spec.seed,
                                   spec.zipf_exponent, **groups))


def make_inputs(spec: BenchSpec, rank: int, device: torch.device):
    """x [T, H], fp8 scales [T, H/128] or None, topk_idx [T, K] (rank_routings), topk_weights [T, K]."""
    topk_idx = rank_routings(spec, rank + 1)[rank]
    own = torch.Generator().manual_seed(derived_seed(spec.seed * 1_000_003 + rank + 1))
    topk_weights = random_weights(topk_idx, own)
    x = torch.randn(spec.tokens, spec.hidden, generator=own)
    scales = None
    if spec.dtype == "fp8":
        x, scales = quantize_fp8(x)
        scales = scales.to(device)
    else:
        x = x.to(spec.torch_dtype)
    return x.to(device), scales, topk_idx.to(device), topk_weights.to(device)


class Progress:
    """Rank 0's progress on stderr: overwritten in place on a terminal, a few lines otherwise."""

    def __init__(self, enabled: bool, label: str, total: int):
        self.enabled, self.label, self.total = enabled, label, total
        self.tty = enabled and sys.stderr.isatty()
        self.step = max(1, total // 4)

    def update(self, phase: str, i: int, n: int) -> None:
        if not self.enabled:
            return
        line = f"[bench] {self.label}: {phase} {i}/{n}"
        if self.tty:
            print("\r" + line.ljust(72), end="" if i < n or phase != "timed" else "\n", file=sys.stderr, flush=True)
        elif i == n or i % self.step == 0:
            print(line, file=sys.stderr, flush=True)


def traffic_fields(t) -> dict:
    """A Traffic as the results' dict: its fields and its algorithm bytes."""
    return dataclasses.asdict(t) | {"algorithm_bytes": t.algorithm_bytes}
