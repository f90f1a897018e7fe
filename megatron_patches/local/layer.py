"""One Megatron MoELayer with seeded weights: the case of the layer benchmark and the tests.

`LayerCase` says the layer's shape, dispatcher and seed; `case_tensors` draws router and
expert weights, inputs and output gradients from the seed (float64), so every rank and a
dense reference see the same numbers without shipping tensors around; `build_moe_layer`
builds the layer (Megatron's local spec, fp32 on the host; SequentialMLP experts, or a
TEGroupedMLP on TorchGroupedLinear or on the Transformer-Engine-like
PythonAllocatedGroupedLinear: `LayerCase.experts`) and `seeded_layer` loads the drawn
weights into it. Legend: S sequence, B batch, H hidden,
F expert ffn, E experts, K top-k, W EP ranks, L = E / W.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import torch

from .common import PLAIN_FP32_CONFIG


@dataclasses.dataclass(frozen=True)
class LayerCase:
    world_size: int
    num_experts: int = 8
    topk: int = 2
    hidden: int = 16
    ffn: int = 12
    seq: int = 6
    batch: int = 2
    dispatcher: str = "hybrid_ep"
    pad_multiple: int = 1
    cold_experts: tuple[int, ...] = ()  # experts the router never picks
    static_size_factor: float | None = None
    seed: int = 1234
    # "sequential": SequentialMLP; "grouped": TEGroupedMLP on TorchGroupedLinear (output allocated
    # in torch._grouped_mm); "module:function": TEGroupedMLP on the submodules that function
    # returns (the tests name their Transformer Engine-like linears so, tests/harness/megatron)
    experts: str = "sequential"
    op_fuser: bool = False  # the experts on Transformer Engine's op fuser (Megatron's op-fuser fields set)

    @property
    def num_tokens(self) -> int:
        return self.seq * self.batch


def case_tensors(case: LayerCase):
    """Everything drawn from the seed: router [E, H], fc1 [E, F, H], fc2 [E, H, F],
    inputs [W, S, B, H] and output gradients [W, S, B, H] (float64)."""
    g = torch.Generator().manual_seed(case.seed)
    E, H, F, W = case.num_experts, case.hidden, case.ffn, case.world_size
    router = torch.randn(E, H, generator=g, dtype=torch.float64) * 0.5
    fc1 = torch.randn(E, F, H, generator=g, dtype=torch.float64) / H**0.5
    fc2 = torch.randn(E, H, F, generator=g, dtype=torch.float64) / F**0.5
    x = torch.randn(W, case.seq, case.batch, H, generator=g, dtype=torch.float64)
    grad_out = torch.randn(W, case.seq, case.batch, H, generator=g, dtype=torch.float64)
    if case.cold_experts:
        # Positive inputs and a negative router row: these experts always score lowest.
        x = x.abs() + 0.1
        router = router.abs()
        for e in case.cold_experts:
            router[e] = -1.0
    return router, fc1, fc2, x, grad_out


def moe_config(case: LayerCase):
    """TransformerConfig of the case's layer (fp32 on the host, pre-softmax top-k routing, no aux loss)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    import megatron_patches

    config = TransformerConfig(
        num_layers=1,
        hidden_size=case.hidden,
        num_attention_heads=1,
        ffn_hidden_size=case.ffn,
        moe_ffn_hidden_size=case.ffn,
        num_moe_experts=case.num_experts,
        moe_router_topk=case.topk,
        moe_router_pre_softmax=True,
        moe_router_load_balancing_type="none",
        moe_aux_loss_coeff=0.0,
        moe_token_dispatcher_type=case.dispatcher,
        expert_model_parallel_size=case.world_size,
        **PLAIN_FP32_CONFIG,
    )
    config.hybrid_ep_options = megatron_patches.HybridEPOptions(
        pad_multiple=case.pad_multiple, static_size_factor=case.static_size_factor
    )
    return config


def _op_fuser_fields() -> dict:
    """Config fields of experts on Transformer Engine's op fuser: TEGroupedMLP with the weighted
    squared ReLU Megatron fuses (fc1 [F, H] as the other experts, so the seeded weights load)."""
    from megatron.core.activations import squared_relu

    return dict(use_transformer_engine_op_fuser=True, moe_grouped_gemm=True, gated_linear_unit=False,
                activation_func=squared_relu, use_fused_weighted_squared_relu=True,
                moe_use_grouped_tensor=True)  # Megatron-Core main's op fuser requires it (0.19.x has no field)


def build_moe_layer(case: LayerCase, **config_overrides):
    """The case's MoELayer (weights as Megatron initialises them); config_overrides are set after
    validation (with op_fuser: on top of the op fuser's fields, where Transformer Engine or a
    stand-in of it is installed)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = _with_experts(get_moe_module_spec(use_te=False, num_experts=case.num_experts, moe_grouped_gemm=False),
                         case.experts)
    config = moe_config(case)
    if case.op_fuser:
        config_overrides = {**_op_fuser_fields(), **config_overrides}
    for name, value in config_overrides.items():
        setattr(config, name, value)
    return spec(config=config, layer_number=1)  # a partial of MoELayer (Megatron-Core >= 0.19: versions.py)


def _with_experts(spec, experts: str):
    """The MoE spec with TEGroupedMLP experts on the grouped linears `experts` names (LayerCase.experts)."""
    if experts == "sequential":
        return spec
    from megatron.core.transformer.moe.experts import TEGroupedMLP

    from ..grouped_gemm import torch_grouped_mlp_submodules

    if experts == "grouped":
        submodules_of = torch_grouped_mlp_submodules
    elif experts.count(":") == 1:
        module, function = experts.split(":")
        submodules_of = getattr(importlib.import_module(module), function)
    else:
        raise ValueError(f"LayerCase.experts must be 'sequential', 'grouped' or 'module:function', got {experts!r}")
    if not isinstance(spec, functools.partial):
        raise NotImplementedError("grouped experts need a Megatron-Core whose MoE spec is a partial of MoELayer")
    submodules = dataclasses.replace(spec.keywords["submodules"],
                                     experts=functools.partial(TEGroupedMLP, submodules=submodules_of()))
    return functools.partial(spec.func, *spec.args, **{**spec.keywords, "submodules": submodules})


def seeded_layer(case: LayerCase, rank: int, config_overrides: dict | None):
    """A MoELayer with the seeded router and expert weights (case_tensors) loaded."""
    L = case.num_experts // case.world_size
    router, fc1, fc2, _, _ = case_tensors(case)
    layer = build_moe_layer(case, **(config_overrides or {}))
    with torch.no_grad():
        layer.router.weight.copy_(router)
        if case.experts == "sequential":
            for j, expert in enumerate(layer.experts.local_experts):
                expert.linear_fc1.weight.copy_(fc1[rank * L + j])
                expert.linear_fc2.weight.copy_(fc2[rank * L + j])
        else:  # grouped linears: weight{j} [out, in] per local expert
            for j in range(L):
                getattr(layer.experts.linear_fc1, f"weight{j}").copy_(fc1[rank * L + j])
                getattr(layer.experts.linear_fc2, f"weight{j}").copy_(fc2[rank * L + j])
    return layer
