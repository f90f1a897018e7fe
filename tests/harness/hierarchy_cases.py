"""Oracle cases of the hierarchical (several-node) path, shared by the CPU-model and GPU tests.

W = N x G virtual ranks: every N in 2..4 and G in {1, 2, 4}, then the features of the
single-node cases (fp8 with scales, static size with overflow, padding, one hot expert,
dropped routes, zero tokens, several chunks per source) on a few topologies.
"""

from __future__ import annotations

import torch

from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.verify.cases import Case


def hierarchy_case(N: int, G: int, hidden: int = 128, **kw) -> Case:
    W = N * G
    tokens = tuple((17, 0, 40, 1, 33, 64, 5, 9)[r % 8] for r in range(W))  # odd, zero, chunk-crossing
    base = dict(world_size=W, ranks_per_node=G, num_experts=2 * W, hidden=hidden, tokens=tokens, topk=min(4, 2 * W),
                dtype=torch.bfloat16, backend="cuda")
    base.update(kw)
    return Case(**base)


def topology_cases(hidden: int = 128) -> list[Case]:
    """Every (nodes, ranks per node) with N in 2..4 and G in {1, 2, 4}, a bf16 wire."""
    return [hierarchy_case(N, G, hidden) for G in (1, 2, 4) for N in (2, 3, 4)]


def feature_cases(hidden: int = 128) -> list[Case]:
    c = hierarchy_case
    return [
        c(2, 2, hidden, dtype=FP8_DTYPE, num_experts=16, topk=8, tokens=(64, 17, 1, 0)),  # fp8 rows and scales
        c(3, 2, hidden, dtype=torch.float32, apply_probs=True, topk=6),
        c(2, 2, hidden, wire_dtype=torch.float32, topk=8, num_experts=16),  # fp32 partials for bf16 rows
        c(2, 2, hidden, dtype=torch.float16, tokens=(33, 64, 0, 17)),
        c(3, 2, hidden, routing="one-expert", tokens=(33,) * 6),  # every token on one expert
        c(2, 4, hidden, routing="zipf", num_experts=32, topk=8),
        c(3, 2, hidden, drop_fraction=0.3, topk=6),  # dropped (-1) routes
        c(2, 2, hidden, num_out_tokens=10, topk=8, num_experts=16, tokens=(64, 17, 0, 5)),  # static size, overflow
        c(2, 2, hidden, num_out_tokens=37, dtype=FP8_DTYPE, topk=8, num_experts=16, tokens=(64, 17, 1, 0)),
        c(3, 2, hidden, num_out_tokens=300, pad_multiple=16),  # static size, trailing zero rows
        c(2, 2, hidden, pad_multiple=16, min_rows_per_expert=16, tokens=(5, 0, 3, 40)),
        c(2, 2, hidden, tokens=(0, 0, 0, 0)),  # nobody sends anything
        c(2, 1, 12288, dtype=torch.float32, tokens=(3, 2)),  # rows over one FIFO stage
        c(2, 2, hidden, tokens=(130, 0, 97, 1), topk=8, num_experts=16),  # several chunks per source
    ]
