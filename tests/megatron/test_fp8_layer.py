"""fp8 on the wire in one Megatron MoELayer (2 CPU ranks, hidden 128) and under Megatron's
EP-overlap schedule: hybrid_ep's dispatcher with --hybrid-ep-dispatch-fp8 and
--hybrid-ep-combine-grad-fp8 equals the alltoall dispatcher whose experts quantize their input
rows and their output's gradient alike, with static sizes, drop-and-pad, router padding for
quantization and the balancer's expert slots; the overlapped schedule equals the plain one.
MXFP8 rows reach Megatron's TEGroupedMLP on Transformer Engine's op fuser (TE stood in) as TE's
GroupedTensor where TE takes one, and dequantized in every run where TE or Megatron would refuse it."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from harness.megatron.moe_layer import run_moe_layer_case  # noqa: E402
from harness.megatron.overlap import GPTCase, train_step  # noqa: E402
from harness.megatron.wire_fp8 import run_fp8_layer_on_op_fuser, run_fp8_layer_with_slots  # noqa: E402
from megatron_patches.local.layer import LayerCase  # noqa: E402
from megatron_patches.options import HybridEPOptions  # noqa: E402

pytestmark = pytest.mark.megatron

FIELDS = ("out", "grad_x", "grad_router", "grad_fc1", "grad_fc2")
FP8 = dict(dispatch_fp8=True, combine_grad_fp8=True)
DROP_AND_PAD = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}

CASES = {
    "top2": (dict(topk=2), {}, {}),
    "static_size": (dict(topk=2), dict(pad_multiple=2, static_size_factor=2.0), {}),
    "drop_and_pad": (dict(topk=2), {}, DROP_AND_PAD),
    "router_padding_for_quantization": (dict(topk=3), {}, {"moe_router_padding_for_quantization": True,
                                                            "fp8": "e4m3"}),
    "balancer_slots": (dict(topk=2), dict(balancer_interval=1), {}),
    "mxfp8": (dict(topk=2), {}, {"fp8_recipe": "mxfp8"}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_fp8_wire_layer_equals_alltoall_with_quantizing_experts(pool_for, name):
    shape, options, overrides = CASES[name]
    case = LayerCase(world_size=2, hidden=128, ffn=32, **shape)
    pool = pool_for(2)
    ours_overrides = {"fp8_recipe": "blockwise", "hybrid_ep_options": HybridEPOptions(**FP8, **options),
                      **overrides}
    run = run_fp8_layer_with_slots if options.get("balancer_interval") else run_moe_layer_case
    ours = pool.run(run, [(case, ours_overrides)] * 2)
    stock = pool.run(run_moe_layer_case, [(LayerCase(world_size=2, hidden=128, ffn=32, dispatcher="alltoall",
                                                     **shape), {"fp8_recipe": "blockwise", **overrides}, True)] * 2)
    plain = pool.run(run, [(case, {**ours_overrides, "hybrid_ep_options": HybridEPOptions(**options)})]
                     * 2)
    for rank, (g, w, p) in enumerate(zip(ours, stock, plain)):
        assert g["dispatcher"] == "HybridEPManager" and w["dispatcher"] == "MoEAlltoAllTokenDispatcher"
        for field in FIELDS:
            torch.testing.assert_close(g[field], w[field], atol=1e-6, rtol=1e-5,
                                       msg=lambda m: f"{name}, rank {rank}, {field}: {m}")
        # fp8 rows really travelled: the output differs from the same layer's without fp8
        assert not torch.equal(g["out"], p["out"]), f"{name}, rank {rank}"


def test_fp8_wire_under_the_ep_overlap_schedule_equals_the_plain_schedule(pool_for):
    pool = pool_for(2)
    plain = pool.run(train_step, [(GPTCase(hidden=128, fp8_wire=True),)] * 2)
    overlapped = pool.run(train_step, [(GPTCase(hidden=128, fp8_wire=True, overlap_ep_comm=True),)] * 2)
    without = pool.run(train_step, [(GPTCase(hidden=128),)] * 2)
    assert [r["schedule_plans"] for r in overlapped] == [3, 3]
    for rank, (o, p, w) in enumerate(zip(overlapped, plain, without)):
        assert o["losses"] == p["losses"], f"rank {rank}"
        assert o["grads"].keys() == p["grads"].keys()
        for key, grad in p["grads"].items():
            assert torch.equal(o["grads"][key], grad), f"rank {rank}, {key}"
        assert o["losses"] != w["losses"]  # the fp8 rows made a difference
        assert all(0 < x < 10 for x in o["losses"])


OP_FUSER_CASE = LayerCase(world_size=2, hidden=128, ffn=32, topk=2)
MXFP8_WIRE = {"hybrid_ep_options": HybridEPOptions(**FP8)}


def test_mxfp8_rows_reach_tes_op_fuser_as_grouped_tensor_and_equal_the_dequantized_run(pool_for):
    """Megatron's TEGroupedMLP on Transformer Engine's op fuser (its _fused_forward; TE stood
    in: harness.megatron.te_stand_in) takes the received MXFP8 rows as TE's GroupedTensor
    forward (fc1's input) and backward (fc2's output gradient) under TE's MXFP8 autocast on a
    Blackwell GPU; on Hopper TE's path predicate says no and they come dequantized. The layer's
    output and every gradient are equal, bit for bit."""
    pool = pool_for(2)
    grouped = pool.run(run_fp8_layer_on_op_fuser, [(OP_FUSER_CASE, MXFP8_WIRE)] * 2)
    hopper = pool.run(run_fp8_layer_on_op_fuser, [(OP_FUSER_CASE, MXFP8_WIRE, (9, 0))] * 2)
    for rank, (g, d) in enumerate(zip(grouped, hopper)):
        assert "error" not in g and "error" not in d, (g.get("error"), d.get("error"))
        assert (g["inputs"], g["grads"]) == (["GroupedTensor"], ["GroupedTensor"]), f"rank {rank}"
        assert (d["inputs"], d["grads"]) == (["Tensor"], ["Tensor"]), f"rank {rank}"
        for field in FIELDS:
            assert torch.equal(g[field], d[field]), f"rank {rank}, {field}"


# Runs the hand-off crashed in (a TE or Megatron refusal of the GroupedTensor, before the fix:
# "GroupedTensor only supports view(-1)"), now run with the rows dequantized: config fields
FALLBACKS = {
    # Megatron's get_fp8_context gives the first and last layers no fp8 autocast: TE reshapes its input
    "first_last_layers_bf16": {"first_last_layers_bf16": True, "num_layers_at_start_in_bf16": 1},
    # MoELayer wraps the experts' input in _RecordExpertDgradCompletion (view_as)
    "overlap_dispatch_backward_with_experts_wgrad": {"overlap_dispatch_backward_with_experts_wgrad": True},
    # TEGroupedMLP starts the offload group on the experts' input (an identity Function: view_as)
    "offload_fused_group_mlp": {"fine_grained_activation_offloading": True, "offload_modules": ["fused_group_mlp"]},
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_runs_the_hand_off_cannot_serve_get_dequantized_rows_and_equal_the_grouped_run(pool_for, name):
    pool = pool_for(2)
    fallback = pool.run(run_fp8_layer_on_op_fuser, [(OP_FUSER_CASE, {**MXFP8_WIRE, **FALLBACKS[name]})] * 2)
    grouped = pool.run(run_fp8_layer_on_op_fuser, [(OP_FUSER_CASE, MXFP8_WIRE)] * 2)
    for rank, (f, g) in enumerate(zip(fallback, grouped)):
        assert "error" not in f, f"{name}, rank {rank}: {f['error']}"
        assert (f["inputs"], f["grads"]) == (["Tensor"], ["Tensor"]), f"{name}, rank {rank}"
        for field in FIELDS:
            assert torch.equal(f[field], g[field]), f"{name}, rank {rank}, {field}"
