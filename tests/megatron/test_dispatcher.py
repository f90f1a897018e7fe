"""A Megatron MoELayer through hybrid_ep (HybridEPManager under Megatron's flex dispatcher) equals
the stock alltoall dispatcher and a dense single-process float64 reference: output and every gradient (input, router,
expert weights), on 2 and 4 CPU ranks (gloo, fp32)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

pytest.importorskip("megatron.core")

from harness.megatron import te_like, te_stand_in  # noqa: E402
from harness.megatron.moe_layer import dense_moe_layer, run_moe_layer_case  # noqa: E402
from megatron_patches.local.layer import LayerCase  # noqa: E402

pytestmark = pytest.mark.megatron

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
    assert all(r["dispatcher"] == "HybridEPManager" for r in ours)
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
    # What a CUDA graph of moe_preprocess returns and sets again on replay: the routing that
    # dispatch_preprocess leaves for token_dispatch (Megatron's flex dispatcher lists its manager's
    # probs and map, the manager adds its routed counts; alltoall lists its own routing_map too).
    assert all(r["cudagraph_tensors"] == ["_comm_manager.token_probs", "_comm_manager.routing_map",
                                          "_comm_manager.last_routed_per_expert"] for r in ours)
    assert all("routing_map" in r["cudagraph_tensors"] for r in stock)


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
    alias_case = dataclasses.replace(case, static_size_factor=2.0)
    alias = pool_for(world_size).run(run_moe_layer_case, [(alias_case,)] * world_size)
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
    pool = pool_for(world_size)
    tight = pool.run(run_moe_layer_case, [(case, {"moe_expert_rank_capacity_factor": 0.25})] * world_size)
    roomy = pool.run(run_moe_layer_case, [(case, {"moe_expert_rank_capacity_factor": 2.0})] * world_size)
    assert any(r["over_budget"] for r in tight)
    assert [r["over_budget"] for r in roomy] == [False] * world_size
    plain = pool_for(world_size).run(run_moe_layer_case, [(case,)] * world_size)
    assert [r["over_budget"] for r in plain] == [None] * world_size


def _run_calls(pool, case, seqs, overrides, timeout_s=120):
    from harness.megatron.moe_layer import run_moe_layer_calls

    return pool.run(run_moe_layer_calls, [(case, seqs, overrides)] * case.world_size, timeout_s=timeout_s)


def _assert_calls_match(got, want, what):
    for rank, (g_calls, w_calls) in enumerate(zip(got, want)):
        assert len(g_calls) == len(w_calls)
        for c, (g, w) in enumerate(zip(g_calls, w_calls)):
            assert "error" not in g, f"{what}, rank {rank}, call {c}: {g.get('error')}"
            for field in ("out", "grad_x", "grad_router"):
                torch.testing.assert_close(g[field], w[field], **TOL,
                                           msg=lambda m: f"{what}, rank {rank}, call {c}, {field}: {m}")


# Call 2: rank 0 has 12 tokens, rank 1 still 8 (the buffer was sized 8 by call 1).
ONE_RANK_GROWS = [[4, 4], [6, 4], [3, 5]]


@pytest.mark.parametrize("overrides", [
    {"variable_seq_lengths": True},                                          # exact size
    {"moe_expert_rank_capacity_factor": 2.0, "variable_seq_lengths": True},  # static size
], ids=["exact_size", "static_size"])
def test_more_tokens_on_one_rank_grows_the_buffer_on_every_rank(pool_for, overrides):
    """A later micro-batch with more tokens on one rank only, with variable_seq_lengths: the
    token count is agreed on every call, so every rank replaces the buffer by a larger one together and the results
    equal Megatron's alltoall (one rank used to raise alone while its peer blocked in
    dispatch until the process-group timeout)."""
    pool = pool_for(2)
    case = LayerCase(world_size=2, topk=2)
    ours = _run_calls(pool, case, ONE_RANK_GROWS, overrides)
    stock = _run_calls(pool, dataclasses.replace(case, dispatcher="alltoall"),
                       ONE_RANK_GROWS, {k: v for k, v in overrides.items() if k == "variable_seq_lengths"})
    _assert_calls_match(ours, stock, "hybrid_ep vs alltoall")
    for calls in ours:
        assert [c["buffer_tokens"] for c in calls] == [8, 12, 12]  # grows to the group max, never shrinks
        assert [c["buffers"] for c in calls] == [1, 1, 1]  # the smaller buffer was replaced


def test_more_tokens_than_max_tokens_per_rank_fails_on_every_rank(pool_for):
    """With --hybrid-ep-max-tokens-per-rank 10 and variable_seq_lengths, a micro-batch of 12
    tokens on rank 0 only is refused on both ranks, with the same message naming the option, and nothing waits."""
    import megatron_patches

    pool = pool_for(2)
    case = LayerCase(world_size=2, topk=2)
    overrides = {"hybrid_ep_options": megatron_patches.HybridEPOptions(max_tokens_per_rank=10),
                 "variable_seq_lengths": True}
    results = _run_calls(pool, case, ONE_RANK_GROWS, overrides, timeout_s=60)
    errors = [calls[-1].get("error") for calls in results]
    assert [len(calls) for calls in results] == [2, 2]  # call 1 ran, call 2 failed
    assert errors[0] == errors[1]
    assert errors[0].startswith("ValueError: ") and "--hybrid-ep-max-tokens-per-rank" in errors[0]
    assert "12 tokens" in errors[0] and "=10" in errors[0]


def test_drop_and_pad_with_changing_token_counts_keeps_one_buffer(pool_for):
    """Drop-and-pad whose capacity changes every micro-batch (the same token count on every
    rank): one cached buffer at a time, sized for the largest count so far, and the results
    equal Megatron's alltoall (every capacity used to add a full-size buffer to the cache)."""
    pool = pool_for(2)
    case = LayerCase(world_size=2, topk=2)
    seqs = [[s, s] for s in (4, 8, 12, 16, 4)]
    dnp = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    ours = _run_calls(pool, case, seqs, dnp)
    stock = _run_calls(pool, dataclasses.replace(case, dispatcher="alltoall"), seqs, dnp)
    _assert_calls_match(ours, stock, "hybrid_ep vs alltoall")
    for calls in ours:
        assert [c["buffers"] for c in calls] == [1] * len(seqs)
        assert [c["buffer_tokens"] for c in calls] == [8, 16, 24, 32, 32]


def _token_count_alone(rank_that_asks):
    import os
    import time

    import torch.distributed as dist

    from megatron_patches import buffers

    if dist.get_rank() != rank_that_asks:
        return "idle"
    os.environ["HYBRID_EP_TIMEOUT_S"] = "2"
    start = time.monotonic()
    try:
        buffers.group_max_tokens(dist.group.WORLD, 5, torch.device("cpu"))
    except RuntimeError as err:
        return (time.monotonic() - start, str(err))
    return "no error"


def test_token_count_agreement_is_bounded_by_the_timeout(pool_for):
    """The per-dispatch agreement on the token count (variable_seq_lengths) waits at most
    HYBRID_EP_TIMEOUT_S for a peer that never dispatches, like every hybrid_ep collective."""
    pool = pool_for(2)
    (elapsed, message), idle = pool.run(_token_count_alone, [(0,), (0,)])
    assert idle == "idle" and 1.5 < elapsed < 30
    assert "EP rank 0 waited more than 2 s (HYBRID_EP_TIMEOUT_S) for the group's token count" in message
    pool.close()  # the group is unusable after a timeout; the fixture starts a fresh one


def test_the_dispatchers_buffer_has_no_arena_to_size(pool_for):
    """The buffer Megatron's dispatcher makes holds bounded memory with nothing sized by hand:
    no arena (its outputs come from PyTorch's allocator)."""
    pool = pool_for(2)
    case = LayerCase(world_size=2, topk=2)
    for calls in _run_calls(pool, case, [[4, 4]], {}):
        [c] = calls
        assert c["buffer_tokens"] == 8 and c["buffer_arena"] is None


# Experts and option -> whether the forward combine reads the experts' output in place
# (megatron_patches.expert_out): on Transformer Engine's op fuser through Megatron's output_buffer
# (te_op_fuser: TEGroupedMLP._fused_forward on TE stood in), on TE's GroupedLinear module where
# fc2 allocates it with torch.empty (te_like), and only with the option on.
_TE_LIKE = {"experts": te_like.EXPERTS}
EXPERT_OUT_CASES = {
    "sequential": ({"experts": "sequential"}, True, False),  # SequentialMLP: per-expert outputs concatenated
    "grouped": ({"experts": "grouped"}, True, False),  # TorchGroupedLinear: output allocated in torch._grouped_mm
    "te_like": (_TE_LIKE, True, True),
    "te_like_option_off": (_TE_LIKE, False, False),
    "te_op_fuser": (te_stand_in.OP_FUSER_CASE, True, True),
    "te_op_fuser_option_off": (te_stand_in.OP_FUSER_CASE, False, False),
}


@pytest.mark.parametrize("name", list(EXPERT_OUT_CASES))
def test_cuda_backend_with_a_process_per_rank_goes_direct_from_the_second_call(pool_for, name):
    """--hybrid-ep-backend cuda, one process per rank on one node, no peer_memory_bytes: the buffer's
    startup line names the direct path and the peer memory it holds (none yet); the first
    forward dispatch grows the peer memory and takes the receive path, every later one goes
    direct; the results equal Megatron's alltoall. The cuda backend's host code runs as in a
    job (peer memory between the processes, the agreement on each call's path, the engine);
    its kernels are faked (harness.faked_kernels: a direct call's rows move through
    each process's mappings of its peers' memory). Where fc2 allocates its output with
    torch.empty (te_like, as Transformer Engine's GroupedLinear), or the experts run on TE's op
    fuser (te_op_fuser), and the option is on, fc2 writes it into the expert-out block and the
    forward combine copies nothing."""
    import megatron_patches
    from harness.megatron.moe_layer import run_moe_layer_calls_on_faked_cuda

    experts, option, in_place = EXPERT_OUT_CASES[name]
    pool = pool_for(2)
    case = LayerCase(world_size=2, topk=2, **experts)
    seqs = [[4, 4]] * 3
    overrides = {"hybrid_ep_options": megatron_patches.HybridEPOptions(backend="cuda", expert_out_in_place=option)}
    ours = pool.run(run_moe_layer_calls_on_faked_cuda, [(case, seqs, overrides)] * 2, timeout_s=180)
    stock = _run_calls(pool, dataclasses.replace(case, dispatcher="alltoall"), seqs, {})
    _assert_calls_match([r["calls"] for r in ours], stock, "hybrid_ep (cuda, faked kernels) vs alltoall")
    for rank, got in enumerate(ours):
        calls = got["calls"]
        assert [c["data_path"] for c in calls] == ["receive", "direct", "direct"], rank
        assert [c["buffer_arena"] for c in calls] == [None] * 3
        # the first call grew it by one chunk (2 MiB), which holds every later call's block
        assert [c["peer_memory"] for c in calls] == [2 << 20] * 3
        # A direct step copies into the expert-out block the dispatched rows' gradient [rows, hidden]
        # and the routing weights' gradients [rows, experts] (backward: made inside autograd), and,
        # where the experts write their output outside peer memory, that output [rows, hidden]
        # (forward combine), each in its dtype (fp32 here); the block holds the largest call's rows
        copied = [c["expert_out_copied"] for c in calls]
        H, E = case.hidden, case.num_experts
        per_row = (0 if in_place else H * 4) + H * 4 + E * 4
        for before, after, call in zip(copied, copied[1:], calls[1:]):
            assert call["rows"] > 0 and after - before == call["rows"] * per_row, (copied, call["rows"])
        # fc2 wrote its output in place in each direct call's forward, and only there
        assert [c["expert_out_views"] for c in calls] == ([0, 1, 2] if in_place else [None] * 3), calls
        block = [c["expert_out_block"] for c in calls]  # sized by each call's row bound: its routes
        assert all(c["rows"] * H * 4 <= b for c, b in zip(calls, block)) and block == sorted(block), block
        [launched] = got["launched"]
        assert launched["dispatch_receive"] == 1
        assert launched["dispatch_direct"] >= 2 and launched["combine_direct"] >= 2
    [line] = ours[0]["startup"]
    said = "expert output in place" if in_place else "expert output copied"
    assert line.startswith("hybrid_ep dispatcher: cuda buffer for EP 2 (1 node x 2), 8 tokens/rank, direct path, "
                           f"peer memory 0 B now, {said}, holds "), line
    assert ours[1]["startup"] == []  # rank 0 logs it


def test_retired_arena_flags_stop_the_parse_with_the_reason(capsys):
    """--hybrid-ep-arena-layers and --hybrid-ep-arena-imbalance no longer exist: a job script
    that still passes them is told why and what to do, not just "unrecognized arguments"."""
    import argparse

    import megatron_patches
    from megatron_patches.options import RETIRED_FLAGS, add_arguments

    for flag, value in (("--hybrid-ep-arena-layers", "5"), ("--hybrid-ep-arena-imbalance", "1.25")):
        parser = add_arguments(argparse.ArgumentParser(prog="pretrain_gpt.py"))
        with pytest.raises(SystemExit) as stop:
            parser.parse_args([flag, value])
        assert stop.value.code == 2
        err = capsys.readouterr().err
        assert f"{flag} was retired: {RETIRED_FLAGS[flag]}" in err and "drop the flag" in err
    with pytest.raises(TypeError, match="arena_layers"):
        megatron_patches.HybridEPOptions(arena_layers=5)
    assert "--hybrid-ep-arena-layers" not in add_arguments(argparse.ArgumentParser()).format_help()
