"""Megatron's token-dispatcher contracts (asserted as Megatron-LM's test_token_dispatcher.py
asserts them) for hybrid_ep, with Megatron's alltoall dispatcher as the control, on CPU gloo
ranks: dropless restore through permute/unpermute and its gradient, tokens_per_expert within
capacity x EP x TP, drop-and-pad shapes; EP 2 and 4, fp32 and bf16, SequentialMLP and grouped
experts (TEGroupedMLP on torch._grouped_mm)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.transformer.moe.moe_utils import get_capacity  # noqa: E402

from harness.megatron import contracts as ct  # noqa: E402

pytestmark = pytest.mark.megatron

DISPATCHERS = ("hybrid_ep", "alltoall")


def run(pool_for, fn, case):
    return pool_for(case.world_size).run(fn, [(case,)] * case.world_size)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("world_size, dtype, grouped", [
    (2, "fp32", False), (2, "bf16", True), (4, "bf16", False), (4, "fp32", True),
])
def test_dropless_restores_input_and_gradient(pool_for, dispatcher, world_size, dtype, grouped):
    case = ct.ContractCase(world_size, dispatcher, dtype=dtype, grouped=grouped)
    for r in run(pool_for, ct.dropless, case):
        torch.testing.assert_close(r["restored"], r["x"])
        torch.testing.assert_close(r["grad"], r["x"])
        assert r["experts"] == ("TEGroupedMLP" if grouped else "SequentialMLP")
        # No padding at all: the rows are the routed (token, expert) pairs, nothing more.
        assert sum(r["tokens_per_expert"]) == r["rows"]
        if dispatcher == "hybrid_ep":
            assert r["pad_multiple"] == 1


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("world_size, dtype, grouped, flag", [
    (2, "fp32", False, True),   # the grouped-GEMM flag with SequentialMLP experts (the reported case)
    (2, "bf16", True, True),    # grouped experts on torch._grouped_mm
    (4, "fp32", False, False),
    (4, "bf16", True, True),
])
def test_capacity_bound_and_restore(pool_for, dispatcher, world_size, dtype, grouped, flag):
    case = ct.ContractCase(world_size, dispatcher, dtype=dtype, grouped=grouped, moe_grouped_gemm=flag,
                           capacity_factor=0.5)
    results = run(pool_for, ct.capacity, case)
    cap = get_capacity(16 * case.topk, case.num_experts, 0.5)
    for r in results:
        assert all(n <= cap * case.ep * case.tp for n in r["tokens_per_expert"]), r["tokens_per_expert"]
        torch.testing.assert_close(r["restored"], r["answer"])
        torch.testing.assert_close(r["grad"], r["answer"])
    # The bound is tight where it matters: some expert is full, and rows are real tokens only.
    L = case.num_experts // case.ep
    routed = sum(r["routed_per_expert"] for r in results).view(case.ep, L)
    for rank, r in enumerate(results):
        assert r["tokens_per_expert"] == routed[rank].tolist()


def test_capacity_counts_equal_alltoall_at_ep2_grouped(pool_for):
    """The case Megatron's check used to fail: capacity factor 0.5, moe_grouped_gemm=True, EP 2."""
    counts = {}
    for dispatcher in DISPATCHERS:
        case = ct.ContractCase(2, dispatcher, moe_grouped_gemm=True, capacity_factor=0.5)
        counts[dispatcher] = [r["tokens_per_expert"] for r in run(pool_for, ct.capacity, case)]
    assert counts["hybrid_ep"] == counts["alltoall"]
    assert max(max(c) for c in counts["hybrid_ep"]) == get_capacity(32, 8, 0.5) * 2


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("world_size, dtype, grouped", [(2, "fp32", False), (4, "bf16", True)])
def test_drop_and_pad_shapes_and_equality(pool_for, dispatcher, world_size, dtype, grouped):
    case = ct.ContractCase(world_size, dispatcher, dtype=dtype, grouped=grouped, capacity_factor=1.0)
    cap = get_capacity(16 * case.topk, case.num_experts, 1.0)
    L = case.num_experts // case.ep
    for r in run(pool_for, ct.drop_and_pad, case):
        padded, plain = r[True], r[False]
        assert padded["tokens_per_expert"] == [cap * case.ep * case.tp] * L
        assert padded["rows"] == L * cap * case.ep * case.tp
        torch.testing.assert_close(padded["restored"], plain["restored"])
        torch.testing.assert_close(padded["grad"], plain["grad"])


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
@pytest.mark.parametrize("tp, etp", [(1, 2), (2, 1)])
def test_dropless_with_tensor_parallel(pool_for, dispatcher, tp, etp):
    """ETP 2 (restored = ETP x input, as Megatron's test scales it) and TP 2 with sequence parallel."""
    case = ct.ContractCase(4, dispatcher, tp=tp, etp=etp)
    for r in run(pool_for, ct.dropless, case):
        torch.testing.assert_close(r["restored"], r["x"])
        torch.testing.assert_close(r["grad"], r["x"])


@pytest.mark.parametrize("tp, etp", [(1, 2), (2, 1), (2, 2)])
def test_moe_layer_with_tensor_parallel_matches_alltoall(pool_for, tp, etp):
    """ETP 2 (EP 2), TP 2 + sequence parallel (EP 2, ETP 1) and both: a whole MoELayer's output,
    input gradient and every parameter gradient equal the alltoall dispatcher's within 1e-5."""
    got = {d: run(pool_for, ct.layer_forward_backward, ct.ContractCase(4, d, tp=tp, etp=etp)) for d in DISPATCHERS}
    for rank, (ours, stock) in enumerate(zip(got["hybrid_ep"], got["alltoall"])):
        torch.testing.assert_close(ours["out"], stock["out"], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours["grad_x"], stock["grad_x"], atol=1e-5, rtol=1e-5)
        assert ours["grads"].keys() == stock["grads"].keys() and len(ours["grads"]) >= 3
        for name in stock["grads"]:
            torch.testing.assert_close(ours["grads"][name], stock["grads"][name], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"rank {rank}, {name}: {m}")
