"""Padding rows only where the experts need them (megatron_patches.expert_rows): the decision
per expert module and precision, TEGroupedMLP skipping its own padding copy after hybrid_ep
aligned the rows, and Megatron's router-padding-for-fp8 contract through the dispatcher."""

from __future__ import annotations

import types

import pytest
import torch

pytest.importorskip("megatron.core")

from megatron.core.enums import Fp8Recipe  # noqa: E402
from megatron.core.transformer.moe import experts as experts_module  # noqa: E402

import megatron_patches  # noqa: E402
from megatron_patches import contract_testing as ct  # noqa: E402
from megatron_patches import expert_rows  # noqa: E402
from megatron_patches.grouped_gemm import TorchGroupedLinear  # noqa: E402


def _config(dispatcher="hybrid_ep", fp8=None, recipe=Fp8Recipe.tensorwise, fp4=None, fuser=False, grouped=True):
    return types.SimpleNamespace(moe_token_dispatcher_type=dispatcher, fp8=fp8, fp8_recipe=recipe, fp4=fp4,
                                 fp4_recipe=None, use_transformer_engine_op_fuser=fuser, moe_grouped_gemm=grouped,
                                 moe_router_padding_for_quantization=False)


def _te_grouped(fc1=None):
    """A TEGroupedMLP as far as the padding decision looks at it (no Transformer Engine here)."""
    module = object.__new__(experts_module.TEGroupedMLP)
    module.__dict__["linear_fc1"] = fc1
    return module


@pytest.mark.parametrize("experts, config, pad", [
    (object.__new__(experts_module.SequentialMLP), _config(fp8="e4m3"), 1),
    (object.__new__(experts_module.SequentialMLP), _config(), 1),
    (_te_grouped(), _config(), 1),                                  # bf16/fp32 grouped GEMM: no alignment
    (_te_grouped(), _config(fp8="e4m3"), 16),
    (_te_grouped(), _config(fp8="e4m3", recipe=Fp8Recipe.mxfp8), 32),
    (_te_grouped(), _config(fp8="e4m3", fuser=True), 256),
    (_te_grouped(object.__new__(TorchGroupedLinear)), _config(fp8="e4m3"), 1),  # grouped_mm aligns inside
    (None, _config(fp8="e4m3"), 16),                                # not built yet: from the config
    (None, _config(), 1),
])
def test_pad_multiple_follows_the_experts_built(experts, config, pad):
    assert expert_rows.pad_multiple_for(experts, config)[0] == pad


def test_grouped_mlp_skips_its_padding_only_after_hybrid_ep_padded():
    megatron_patches.apply()
    skip = experts_module.skip_routed_expert_padding
    assert skip(_config(fp8="e4m3")) is True
    assert skip(_config()) is False
    assert skip(_config(dispatcher="alltoall", fp8="e4m3")) is False  # Megatron's answer for its own types


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
