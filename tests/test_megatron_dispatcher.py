"""A Megatron MoELayer through HybridEPTokenDispatcher equals the stock alltoall dispatcher
and a dense single-process float64 reference: output and every gradient (input, router,
expert weights), on 2 and 4 CPU ranks (gloo, fp32)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron_patches.testing import LayerCase, dense_moe_layer, run_moe_layer_case  # noqa: E402

FIELDS = ("out", "grad_x", "grad_router", "grad_fc1", "grad_fc2")
TOL = dict(atol=1e-5, rtol=1e-5)

CASES = {
    "top2": dict(topk=2),
    "top1": dict(topk=1),
    "top4": dict(topk=4),
    "cold_expert": dict(topk=2, cold_experts=(1,)),
    "pad4": dict(topk=2, pad_multiple=4),
    "cold_expert_pad3": dict(topk=3, pad_multiple=3, cold_experts=(0, 5)),
    "static_size": dict(topk=2, pad_multiple=2, static_size_factor=2.0),
}


def run_case(pool, case: LayerCase) -> list[dict]:
    return pool.run(run_moe_layer_case, [(case,)] * case.world_size)


def assert_matches(got: list[dict], want: list[dict], what: str) -> None:
    for rank, (g, w) in enumerate(zip(got, want)):
        for field in FIELDS:
            torch.testing.assert_close(
                g[field].double(), w[field].double(), **TOL, msg=lambda m: f"{what}, rank {rank}, {field}: {m}"
            )


@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("name", list(CASES))
def test_moe_layer_matches_alltoall_and_dense(pool_for, world_size, name):
    pool = pool_for(world_size)
    case = LayerCase(world_size=world_size, **CASES[name])
    ours = run_case(pool, case)
    assert all(r["dispatcher"] == "HybridEPTokenDispatcher" for r in ours)
    stock = run_case(pool, LayerCase(world_size=world_size, **dict(CASES[name], dispatcher="alltoall")))
    assert all(r["dispatcher"] == "MoEAlltoAllTokenDispatcher" for r in stock)
    dense = dense_moe_layer(case)
    assert_matches(ours, dense, "hybrid_ep vs dense")
    assert_matches(stock, dense, "alltoall vs dense")
    assert_matches(ours, stock, "hybrid_ep vs alltoall")
    # The routing really is the intended one: counts per expert match the dense top-k.
    routed = sum(r["routed_per_expert"] for r in ours)
    want = sum(d["routed_per_expert"] for d in dense)
    assert torch.equal(routed.long(), want.long())
    assert int(routed.sum()) == world_size * case.num_tokens * case.topk
    for e in case.cold_experts:
        assert int(routed[e]) == 0
        rank, j = divmod(e, case.num_experts // world_size)
        # A cold expert's weight gradients are exactly zero.
        assert torch.count_nonzero(ours[rank]["grad_fc1"][j]) == 0
        assert torch.count_nonzero(ours[rank]["grad_fc2"][j]) == 0


def test_whole_rank_without_tokens(pool_for):
    """Every expert of the last rank is cold: that rank receives no rows at all."""
    world_size = 4
    pool = pool_for(world_size)
    case = LayerCase(world_size=world_size, topk=2, cold_experts=(6, 7), pad_multiple=2)
    ours = run_case(pool, case)
    dense = dense_moe_layer(case)
    assert_matches(ours, dense, "hybrid_ep vs dense")
    assert torch.count_nonzero(ours[3]["grad_fc1"]) == 0
    assert torch.count_nonzero(ours[3]["grad_fc2"]) == 0
    assert torch.count_nonzero(ours[3]["grad_x"]) > 0  # its own tokens still went elsewhere


def test_grouped_flag_with_sequential_experts_adds_no_padding(pool_for):
    """moe_grouped_gemm=True with the local spec builds SequentialMLP, which needs no aligned
    rows: the dispatcher pads nothing (it used to pad to 8 from the flag alone)."""
    world_size = 2
    case = LayerCase(world_size=world_size, topk=2, cold_experts=(2,))
    ours = pool_for(world_size).run(run_moe_layer_case, [(case, {"moe_grouped_gemm": True})] * world_size)
    assert [r["pad_multiple"] for r in ours] == [1] * world_size
    assert_matches(ours, dense_moe_layer(case), "hybrid_ep (grouped flag) vs dense")
    assert torch.count_nonzero(ours[0]["grad_fc1"][2]) == 0


def test_megatron_rank_capacity_factor_sets_the_static_size(pool_for):
    """moe_expert_rank_capacity_factor is the static output size (num_out_tokens), exactly as
    its alias --hybrid-ep-static-size-factor: ceil(f x tokens x topk) rows plus the padding
    bound, rounded to the padding multiple; results equal the dense reference."""
    world_size = 2
    case = LayerCase(world_size=world_size, topk=2, pad_multiple=2)
    ours = pool_for(world_size).run(run_moe_layer_case, [(case, {"moe_expert_rank_capacity_factor": 2.0})] * world_size)
    alias = pool_for(world_size).run(run_moe_layer_case, [(dataclasses.replace(case, static_size_factor=2.0),)] * world_size)
    L = case.num_experts // world_size
    expected = math.ceil(2.0 * case.num_tokens * case.topk) + L * (2 - 1)
    expected += expected % 2
    assert [r["rows"] for r in ours] == [expected] * world_size == [r["rows"] for r in alias]
    assert [r["static_size_factor"] for r in ours] == [2.0] * world_size
    assert_matches(ours, dense_moe_layer(case), "hybrid_ep (rank capacity factor) vs dense")


def test_rank_capacity_overflow_is_flagged_as_over_budget(pool_for):
    """A budget too small for the routed rows drops some of them; check_over_budget() says so,
    as Megatron's flex dispatcher does, and a budget with room does not."""
    world_size = 2
    case = LayerCase(world_size=world_size, topk=2)
    tight = pool_for(world_size).run(run_moe_layer_case, [(case, {"moe_expert_rank_capacity_factor": 0.25})] * world_size)
    roomy = pool_for(world_size).run(run_moe_layer_case, [(case, {"moe_expert_rank_capacity_factor": 2.0})] * world_size)
    assert any(r["over_budget"] for r in tight)
    assert [r["over_budget"] for r in roomy] == [False] * world_size
    plain = pool_for(world_size).run(run_moe_layer_case, [(case,)] * world_size)
    assert [r["over_budget"] for r in plain] == [None] * world_size
