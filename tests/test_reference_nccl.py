"""The reference backend over NCCL (CUDA tensors): same oracle, same cases as on gloo."""

from __future__ import annotations

import pytest
import torch

from hybrid_ep.spawn import ProcessGroupPool
from hybrid_ep.testing import Case, check_case

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn


def _cases(world_size):
    G = world_size
    tokens = tuple((5 * r + 3) % 9 for r in range(world_size))
    return [
        Case(world_size, G, 2 * world_size, 256, tokens, 2, torch.bfloat16, drop_fraction=0.2, seed=1),
        Case(world_size, G, 2 * world_size, 256, tokens, 2, FP8, pad_multiple=16, seed=2),
        Case(world_size, G, 2 * world_size, 256, tokens, 1, torch.float32, num_out_tokens=4, seed=3),
    ]


@pytest.mark.gpu
def test_one_gpu_matches_oracle():
    with ProcessGroupPool(1, backend="nccl") as pool:
        for case in _cases(1):
            check_case(pool, case)


@pytest.mark.multigpu
def test_two_gpus_match_oracle():
    with ProcessGroupPool(2, backend="nccl") as pool:
        for case in _cases(2):
            check_case(pool, case)
