"""Padding rows only where the experts need them (megatron_patches.expert_rows): the decision
per expert module and precision (TEGroupedMLP skips its own padding copy after hybrid_ep aligned
the rows: Megatron's own answer for the flex dispatcher's hybridep backend, tests/megatron/
test_selection.py), and Megatron's router-padding-for-fp8 contract through the dispatcher."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.enums import Fp8Recipe  # noqa: E402
from megatron.core.transformer.moe import experts as experts_module  # noqa: E402

from harness.megatron import contracts as ct  # noqa: E402
from megatron_patches import expert_rows  # noqa: E402
from megatron_patches.grouped_gemm import TorchGroupedLinear  # noqa: E402

pytestmark = pytest.mark.megatron


def _config(dispatcher="hybrid_ep", fp8=None, recipe=Fp8Recipe.tensorwise, fp4=None, fuser=False, grouped=True):
    return types.SimpleNamespace(moe_token_dispatcher_type=dispatcher, fp8=fp8, fp8_recipe=recipe, fp4=fp4,
                                 fp4_recipe=None, use_transformer_engine_op_fuser=fuser, moe_grouped_gemm=grouped,
                                 moe_router_padding_for_quantization=False,
                                 moe_use_grouped_tensor=False)  # Megatron-Core main reads it


def _te_grouped(fc1=None, fused=False):
    """A TEGroupedMLP as far as the padding decision looks at it (no Transformer Engine here)."""
    module = object.__new__(experts_module.TEGroupedMLP)
    module.__dict__["linear_fc1"] = fc1
    module.__dict__["_with_fused_impl"] = fused
    return module


@pytest.mark.parametrize("experts, config, pad", [
    (object.__new__(experts_module.SequentialMLP), _config(fp8="e4m3"), 1),
    (object.__new__(experts_module.SequentialMLP), _config(), 1),
    (_te_grouped(), _config(), 1),                                  # bf16/fp32 grouped GEMM: no alignment
    (_te_grouped(), _config(fp8="e4m3"), 16),
    (_te_grouped(), _config(fp8="e4m3", recipe=Fp8Recipe.mxfp8), 32),
    (_te_grouped(fused=True), _config(fp8="e4m3", fuser=True), 256),
    (_te_grouped(fused=True), _config(fuser=True), 256),             # the op fuser's groups, in any precision
    (_te_grouped(object.__new__(TorchGroupedLinear)), _config(fp8="e4m3"), 1),  # grouped_mm aligns inside
    (None, _config(fp8="e4m3"), 16),                                # not built yet: from the config
    (None, _config(), 1),
])
def test_pad_multiple_follows_the_experts_built(experts, config, pad):
    assert expert_rows.pad_multiple_for(experts, config)[0] == pad


@pytest.mark.parametrize("dispatcher", ["hybrid_ep", "alltoall"])
def test_router_padding_for_fp8(pool_for, dispatcher):
    """Megatron's dispatcher_router_padding_for_fp8_test: with moe_router_padding_for_quantization
    (fp8 config) every expert's count is a multiple of 16, they sum to the rows, and the restored
    output and gradient equal the unpadded run."""
    case = ct.ContractCase(2, dispatcher, num_experts=8, topk=4)
    for r in pool_for(2).run(ct.router_padding_for_fp8, [(case,)] * 2):
        padded, plain = r[True], r[False]
        assert sum(padded["tokens_per_expert"]) == padded["rows"]
        assert all(n % 16 == 0 for n in padded["tokens_per_expert"]), padded["tokens_per_expert"]
        assert sum(plain["tokens_per_expert"]) == plain["rows"]
        assert padded["rows"] > plain["rows"]  # the padding is really there
        torch.testing.assert_close(padded["restored"], plain["restored"])
        torch.testing.assert_close(padded["grad"], plain["grad"])


def _roundup(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@pytest.mark.parametrize("world_size, pad", [(2, 3), (2, 8), (4, 3)])
def test_drop_and_pad_with_padding_that_does_not_divide_capacity_x_ep(pool_for, world_size, pad):
    """Drop-and-pad with --hybrid-ep-pad-multiple not dividing capacity x EP: every local
    expert holds roundup(capacity x EP, pad) rows (the buffer's blocks, the experts' splits
    and the static size agree), and output and every gradient equal Megatron's alltoall.
    (The experts used to be told capacity x EP rows while the buffer laid out padded blocks
    and the output was cut short: rows of the last experts were lost.)"""
    from megatron.core.transformer.moe.moe_utils import get_capacity

    from harness.megatron.moe_layer import run_moe_layer_case
    from megatron_patches.local.layer import LayerCase

    dnp = {"moe_expert_capacity_factor": 0.5, "moe_pad_expert_input_to_capacity": True}
    case = LayerCase(world_size=world_size, topk=2, pad_multiple=pad)
    pool = pool_for(world_size)
    ours = pool.run(run_moe_layer_case, [(case, dnp)] * world_size)
    stock_case = LayerCase(world_size=world_size, topk=2, dispatcher="alltoall")
    stock = pool.run(run_moe_layer_case, [(stock_case, dnp)] * world_size)
    capacity = get_capacity(case.num_tokens * case.topk, case.num_experts, 0.5)
    rows_per_expert = _roundup(capacity * world_size, pad)
    assert rows_per_expert != capacity * world_size  # the case this test is about
    L = case.num_experts // world_size
    for rank, (got, want) in enumerate(zip(ours, stock)):
        assert got["rows"] == L * rows_per_expert
        for field in ("out", "grad_x", "grad_router", "grad_fc1", "grad_fc2"):
            torch.testing.assert_close(got[field], want[field], atol=1e-5, rtol=1e-5,
                                       msg=lambda m: f"rank {rank}, {field}: {m}")


def test_drop_and_pad_with_fp8_row_alignment(pool_for):
    """Drop-and-pad plus the fp8 alignment (16) where capacity x EP is 8: each expert gets 16
    rows, none dropped, and the restored tokens and gradient equal drop-and-pad alone."""
    case = ct.ContractCase(2, "hybrid_ep", capacity_factor=1.0)
    for r in pool_for(2).run(ct.drop_and_pad_quantization_alignment, [(case,)] * 2):
        aligned, plain = r[True], r[False]
        assert plain["tokens_per_expert"] == [8] * 4
        assert aligned["tokens_per_expert"] == [16] * 4
        assert aligned["rows"] == 64
        torch.testing.assert_close(aligned["restored"], plain["restored"])
        torch.testing.assert_close(aligned["grad"], plain["grad"])


def test_drop_and_pad_routed_counts_leave_out_the_capacity_fill(pool_for):
    """Under drop-and-pad the router fills each expert to capacity with routes of weight 0;
    last_routed_per_expert counts only the routes of nonzero weight (real tokens)."""
    from harness.megatron.moe_layer import run_moe_layer_case
    from megatron_patches.local.layer import LayerCase

    dnp = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
    case = LayerCase(world_size=2, topk=2)
    for r in pool_for(2).run(run_moe_layer_case, [(case, dnp)] * 2):
        real = r["router_weighted_per_expert"]
        assert int(r["router_map_per_expert"].sum()) > int(real.sum())  # the router did fill
        assert torch.equal(r["routed_per_expert"].long(), real.long())
