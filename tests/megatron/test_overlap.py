"""Megatron's EP-communication overlap (overlap_moe_expert_parallel_comm: the combined 1F1B
schedule) and shared-expert overlap with hybrid_ep, on CPU gloo ranks: a tiny MoE GPTModel
(2 layers, bf16, EP 2; PP 1, and PP 2 with a virtual pipeline) trained one step through
Megatron's own schedules gives exactly the losses and gradients of the non-overlapped run."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("megatron.core")

from harness.megatron.overlap import GPTCase, train_step  # noqa: E402

pytestmark = pytest.mark.megatron


def run(pool_for, case: GPTCase) -> list[dict]:
    return pool_for(case.world_size).run(train_step, [(case,)] * case.world_size)


def assert_same_step(got: list[dict], want: list[dict]) -> None:
    for rank, (g, w) in enumerate(zip(got, want)):
        assert g["losses"] == w["losses"], f"rank {rank}: {g['losses']} != {w['losses']}"
        assert g["grads"].keys() == w["grads"].keys()
        for name, grad in w["grads"].items():
            assert torch.equal(g["grads"][name], grad), f"rank {rank}, {name}: max diff " \
                f"{(g['grads'][name] - grad).abs().max()}"


def assert_trained(results: list[dict]) -> None:
    """The step really ran: 3 finite losses, expert and router gradients that are not zero."""
    for r in results:
        assert len(r["losses"]) == 3 and all(0 < x < 10 for x in r["losses"])
        experts = [g for n, g in r["grads"].items() if "local_experts" in n]
        router = [g for n, g in r["grads"].items() if "router" in n]
        assert len(experts) == 2 * 2 * 4 and len(router) == 2  # 2 layers x 4 local experts x fc1/fc2
        assert all(torch.count_nonzero(g) > 0 for g in router)
        assert sum(torch.count_nonzero(g) for g in experts) > 0


def test_ep_overlap_equals_plain_schedule(pool_for):
    plain = run(pool_for, GPTCase())
    overlapped = run(pool_for, GPTCase(overlap_ep_comm=True))
    assert {r["dispatcher"] for r in overlapped} == {"HybridEPManager"}
    # The overlapped run really went through the combined 1F1B schedule plans.
    assert [r["schedule_plans"] for r in overlapped] == [3, 3] and [r["schedule_plans"] for r in plain] == [0, 0]
    assert_trained(plain)
    assert_same_step(overlapped, plain)


def test_ep_overlap_with_pipeline_parallel_equals_plain_schedule(pool_for):
    """PP 2 (one layer per stage; Megatron requires a virtual pipeline size with PP > 1, here 1)
    on 4 ranks, EP 2: the interleaved combined 1F1B schedule equals the interleaved plain one."""
    case = GPTCase(world_size=4, pipeline=2, virtual_pipeline=1, micro_batches=4)
    plain = run(pool_for, case)
    overlapped = run(pool_for, dataclasses.replace(case, overlap_ep_comm=True))
    assert [len(r["losses"]) for r in plain] == [0, 0, 4, 4]  # losses on the last stage
    assert all(r["schedule_plans"] == 4 for r in overlapped)
    assert all(len(r["grads"]) >= 17 for r in plain)
    assert_same_step(overlapped, plain)


def test_ep_overlap_with_shared_expert_equals_plain_schedule(pool_for):
    plain = run(pool_for, GPTCase(shared_expert=True))
    overlapped = run(pool_for, GPTCase(shared_expert=True, overlap_ep_comm=True))
    assert any("shared_experts" in n for n in plain[0]["grads"])
    assert_same_step(overlapped, plain)


def test_shared_expert_overlap_equals_plain_in_fp32(pool_for):
    """Shared-expert overlap computes the same step (fp32: equal up to the order in which
    autograd sums the three gradients of the layernorm output, router / dispatch / shared)."""
    plain = run(pool_for, GPTCase(shared_expert=True, bf16=False))
    overlapped = run(pool_for, GPTCase(shared_expert=True, shared_expert_overlap=True, bf16=False))
    assert_trained(overlapped)
    for g, w in zip(overlapped, plain):
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(w["losses"]), rtol=1e-6, atol=0)
        for name, grad in w["grads"].items():
            torch.testing.assert_close(g["grads"][name], grad, rtol=1e-5, atol=1e-7)


def test_shared_expert_overlap_equals_alltoall_bitwise(pool_for):
    """In bf16 the overlapped shared expert changes that summation order for Megatron's alltoall
    dispatcher as well; hybrid_ep reproduces the alltoall run bit for bit."""
    ours = run(pool_for, GPTCase(shared_expert=True, shared_expert_overlap=True))
    stock = run(pool_for, GPTCase(shared_expert=True, shared_expert_overlap=True, dispatcher="alltoall"))
    assert_same_step(ours, stock)
    # a CUDA graph of moe_preprocess returns the manager's routing (Megatron's flex dispatcher
    # caches the shared experts' input only in token_dispatch, outside that graph; alltoall in
    # dispatch_preprocess, inside it)
    for r in ours:
        assert r["cudagraph_attrs"] == ["_comm_manager.token_probs", "_comm_manager.routing_map",
                                        "_comm_manager.last_routed_per_expert"]
    assert all("shared_experts.cached_fc1_input" in r["cudagraph_attrs"] for r in stock)


def test_overlap_matches_alltoall(pool_for):
    """The same step through Megatron's alltoall dispatcher, overlapped as well (bf16 model,
    fp32 accumulation in combine: equal to bf16 rounding)."""
    ours = run(pool_for, GPTCase(overlap_ep_comm=True))
    stock = run(pool_for, GPTCase(overlap_ep_comm=True, dispatcher="alltoall"))
    for g, w in zip(ours, stock):
        torch.testing.assert_close(torch.tensor(g["losses"]), torch.tensor(w["losses"]), rtol=1e-3, atol=1e-3)
        for name, grad in w["grads"].items():
            torch.testing.assert_close(g["grads"][name], grad, rtol=2e-2, atol=2e-3)
