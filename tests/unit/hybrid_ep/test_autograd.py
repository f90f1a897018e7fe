"""Gradients through dispatch -> per-expert function -> combine equal a dense float64 oracle."""

from __future__ import annotations

import pytest
import torch

from hybrid_ep.verify import Case, dispatch_oracle, make_rank_inputs
from hybrid_ep.verify.cases import dense_autograd_oracle, run_autograd_on_rank

pytestmark = pytest.mark.unit

CASES = [
    (Case(4, 2, 8, 32, (6, 0, 9, 4), 2, seed=21), True),
    (Case(4, 2, 8, 32, (6, 3, 9, 4), 3, drop_fraction=0.2, pad_multiple=8, seed=22), False),
    (Case(3, 1, 6, 32, (5, 7, 0), 2, routing_map=True, seed=23), True),
    (Case(3, 3, 6, 32, (5, 7, 2), 4, routing_map=True, pad_multiple=4, seed=24), False),
    (Case(4, 2, 8, 32, (12, 12, 12, 12), 2, num_out_tokens=9, seed=25), True),
    (Case(4, 2, 8, 32, (6, 0, 9, 4), 2, num_out_tokens=40, pad_multiple=4, seed=27), False),  # trailing zero rows
    (Case(2, 1, 4, 32, (8, 8), 1, routing="one-expert", seed=26), False),
    # 16 local experts, rows of 8 fp32: on the way back a row's values take two rows of their own.
    (Case(4, 2, 64, 8, (6, 3, 9, 4), 3, seed=28), True),
]


@pytest.mark.parametrize("case,probs_in_expert", CASES,
                         ids=[f"{c}-{'probs_in_expert' if p else 'apply_probs'}" for c, p in CASES])
def test_gradients_match_dense_oracle(pool_for, case, probs_in_expert):
    gen = torch.Generator().manual_seed(case.seed + 1000)
    inputs = make_rank_inputs(case)
    weights = torch.randn(case.num_experts, case.hidden, case.hidden, generator=gen) / case.hidden**0.5
    grad_ys = [torch.randn(i["x"].shape, generator=gen) for i in inputs]
    run = dispatch_oracle(case.config, [i["x"] for i in inputs], [i["topk_idx"] for i in inputs],
                          [i["topk_weights"] for i in inputs], None, case.num_out_tokens)
    want = dense_autograd_oracle(case, inputs, weights, grad_ys, run.row_of_route)
    got = pool_for(case.world_size).run(
        run_autograd_on_rank,
        [(case, inputs[r], weights, grad_ys[r], probs_in_expert) for r in range(case.world_size)],
    )
    if case.num_out_tokens is not None and case.num_out_tokens < 20:  # the case that drops
        assert sum(int((r < 0).sum() - (i["topk_idx"] < 0).sum()) for r, i in zip(run.row_of_route, inputs)) > 0
    for s, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g["y"].double(), w["y"], rtol=1e-5, atol=1e-6, msg=f"rank {s} y")
        torch.testing.assert_close(g["grad_x"].double(), w["grad_x"], rtol=1e-5, atol=1e-6, msg=f"rank {s} grad x")
        grad_w = w["grad_weights"]
        if case.routing_map:
            # Megatron's probs are [T, E]: the slot gradients land in the routed columns.
            idx = inputs[s]["topk_idx"]
            dense = torch.zeros(idx.shape[0], case.num_experts + 1, dtype=torch.float64)
            dense.scatter_(1, torch.where(idx >= 0, idx, case.num_experts), grad_w)
            grad_w = dense[:, :-1]
        else:
            grad_w = torch.where(inputs[s]["topk_idx"] >= 0, grad_w, 0.0)
        assert g["grad_weights"] is not None, f"rank {s}: no gradient reached the routing weights"
        torch.testing.assert_close(g["grad_weights"].double(), grad_w, rtol=1e-5, atol=1e-6,
                                   msg=f"rank {s} grad routing weights")
        if inputs[s]["x"].shape[0] > 0:
            assert float(g["grad_x"].abs().sum()) > 0
