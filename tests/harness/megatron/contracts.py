"""Megatron's token-dispatcher contracts, run per rank the way Megatron's own unit tests run them.

Megatron-LM's tests/unit_tests/transformer/moe/test_token_dispatcher.py drives a dispatcher
through its six phases with the layer's router (`token_permutation` / `token_unpermutation`)
and checks: dropless permute + unpermute restores the input and its gradient; with a
capacity factor, tokens_per_expert <= capacity x EP x TP and the restored output is the
input times its kept routing weights; drop-and-pad gives every expert exactly
capacity x EP x TP rows and the same result as without padding. The functions here run
those steps on one rank of a process-group pool and return the tensors; the test file
asserts on them in the parent process (a failed assertion in one rank would leave its peers
waiting in a collective).

Legend: T tokens of this rank, H hidden, R dispatched rows, L local experts.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .moe_layer import dispatcher_of

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclasses.dataclass(frozen=True)
class ContractCase:
    world_size: int
    dispatcher: str = "hybrid_ep"
    num_experts: int = 8
    topk: int = 2
    hidden: int = 16
    dtype: str = "fp32"
    grouped: bool = False  # TEGroupedMLP on torch._grouped_mm (TorchGroupedLinear), else SequentialMLP
    moe_grouped_gemm: bool = False  # the config flag (with grouped=False: SequentialMLP all the same)
    capacity_factor: float | None = None
    tp: int = 1
    etp: int = 1
    seed: int = 123

    @property
    def ep(self) -> int:
        return self.world_size // self.etp if self.tp == 1 else self.world_size // self.tp


def _config(case: ContractCase, **overrides):
    from megatron.core.transformer.transformer_config import TransformerConfig

    fields = dict(
        tensor_model_parallel_size=case.tp,
        expert_model_parallel_size=case.ep,
        expert_tensor_parallel_size=case.etp,
        moe_router_topk=case.topk,
        num_moe_experts=case.num_experts,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.1,
        moe_token_dispatcher_type=case.dispatcher,
        moe_expert_capacity_factor=case.capacity_factor,
        moe_token_drop_policy="probs",
        num_layers=1,
        moe_router_dtype="fp32",
        moe_grouped_gemm=case.moe_grouped_gemm or case.grouped,
        hidden_size=case.hidden,
        num_attention_heads=4,
        use_cpu_initialization=True,
        sequence_parallel=case.tp > 1,
        add_bias_linear=False,
        bias_activation_fusion=False,
        gradient_accumulation_fusion=False,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)


def _submodules(case: ContractCase):
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec

    spec = get_moe_module_spec(use_te=False, num_experts=case.num_experts, moe_grouped_gemm=False)
    submodules = spec.keywords["submodules"]
    if case.grouped:
        from megatron.core.transformer.moe.experts import TEGroupedMLP

        from megatron_patches.grouped_gemm import torch_grouped_mlp_submodules

        experts = functools.partial(TEGroupedMLP, submodules=torch_grouped_mlp_submodules())
        submodules = dataclasses.replace(submodules, experts=experts)
    return submodules


def build_layer(case: ContractCase, after_validation: dict | None = None, **overrides):
    """Megatron's MoEModelTestContainer.new_moe_layer: a MoELayer in the case's dtype.
    after_validation: config fields set after TransformerConfig validated (fp8 without
    Transformer Engine, which validation refuses; the experts are then built but not run)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer

    torch.manual_seed(case.seed)
    config = _config(case, **overrides)
    for name, value in (after_validation or {}).items():
        setattr(config, name, value)
    layer = MoELayer(config, _submodules(case)).to(dtype=DTYPES[case.dtype])
    layer.set_layer_number(0)
    return layer


def _permute(dispatcher, hidden, probs, routing_map):
    hidden, probs = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    hidden, probs = dispatcher.token_dispatch(hidden, probs)
    return dispatcher.dispatch_postprocess(hidden, probs)


def _unpermute(dispatcher, rows):
    out = dispatcher.combine_preprocess(rows)
    out = dispatcher.token_combine(out)
    return dispatcher.combine_postprocess(out)


def _setup(case: ContractCase):
    import torch.distributed as dist

    from megatron_patches.buffers import BUFFERS
    from megatron_patches.local.common import init_megatron

    init_megatron(case.ep, case.seed, tensor_parallel=case.tp, expert_tensor_parallel=case.etp)
    BUFFERS.clear()  # each case sizes its buffers from its own first call, as a fresh job would
    return dist.get_rank()


def _input(case: ContractCase, rank: int, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * case.seed + rank)
    return torch.randn(shape, generator=g).to(DTYPES[case.dtype]).requires_grad_()


def _kept_rows(rows, tokens_per_expert, probs):
    rows = (rows * probs.unsqueeze(-1)).to(rows.dtype)
    return rows, [int(n) for n in tokens_per_expert.tolist()]


def dropless(case: ContractCase) -> dict:
    """dispatcher_dropless_test: unpermute(permute(x) * probs) / ETP == x, and its gradient."""
    rank = _setup(case)
    layer = build_layer(case)
    x = _input(case, rank, (8, 4, case.hidden))
    probs, routing_map = layer.router(x)
    probs = torch.ones_like(probs) / case.topk
    rows, tokens_per_expert, row_probs = _permute(layer.token_dispatcher, x, probs, routing_map)
    rows, counts = _kept_rows(rows, tokens_per_expert, row_probs)
    restored = _unpermute(layer.token_dispatcher, rows) / case.etp
    torch.autograd.backward(restored, x)
    return {"x": x.detach(), "restored": restored.detach(), "grad": x.grad, "rows": rows.shape[0],
            "tokens_per_expert": counts, "dispatcher": type(dispatcher_of(layer)).__name__,
            "pad_multiple": getattr(dispatcher_of(layer), "pad_multiple", None),
            "experts": type(layer.experts).__name__}


def capacity(case: ContractCase) -> dict:
    """dispatcher_capacity_test: token dropping in the router, counts within the capacity."""
    rank = _setup(case)
    layer = build_layer(case)
    x = _input(case, rank, (16, case.hidden))
    probs, routing_map = layer.router(x)
    kept = (probs != 0)
    probs = torch.ones_like(probs) * kept / case.topk
    answer = (x * probs.sum(dim=1).unsqueeze(1)).to(x.dtype)
    rows, tokens_per_expert, row_probs = _permute(layer.token_dispatcher, x, probs, routing_map)
    rows, counts = _kept_rows(rows, tokens_per_expert, row_probs)
    restored = _unpermute(layer.token_dispatcher, rows / case.tp)
    torch.autograd.backward(restored, x)
    return {"answer": answer.detach(), "restored": restored.detach(), "grad": x.grad,
            "tokens_per_expert": counts, "routed_per_expert": kept.sum(dim=0)}


def _same_tokens_two_layers(case: ContractCase, num_tokens: int, variants: dict) -> dict:
    """Megatron's padded-vs-plain pattern: one input through layers built with each of
    `variants` (key -> build_layer kwargs) from the same weights; per key the restored
    output, input gradient (backward with the output itself), rows and tokens_per_expert."""
    rank = _setup(case)
    x = _input(case, rank, (num_tokens, case.hidden))
    results, state = {}, None
    for key, kwargs in variants.items():
        layer = build_layer(case, **kwargs)
        if state is None:
            state = layer.state_dict()
        else:
            layer.load_state_dict(state)
        probs, routing_map = layer.router(x)
        rows, tokens_per_expert, row_probs = _permute(layer.token_dispatcher, x, probs, routing_map)
        rows, counts = _kept_rows(rows, tokens_per_expert, row_probs)
        restored = _unpermute(layer.token_dispatcher, rows)
        torch.autograd.backward(restored, restored.detach())
        results[key] = {"restored": restored.detach(), "grad": x.grad.clone(), "rows": rows.shape[0],
                        "tokens_per_expert": counts}
        x.grad = None
    return results


def drop_and_pad(case: ContractCase) -> dict:
    """dispatcher_drop_and_pad_test: padded to capacity == not padded, exactly capacity rows."""
    return _same_tokens_two_layers(case, 16, {pad: dict(moe_pad_expert_input_to_capacity=pad) for pad in (False, True)})


def router_padding_for_fp8(case: ContractCase) -> dict:
    """dispatcher_router_padding_for_fp8_test: the same tokens without and with
    moe_router_padding_for_quantization (fp8 config; the experts are built, not run)."""
    padded = dict(after_validation=dict(moe_router_padding_for_quantization=True, fp8="hybrid"))
    return _same_tokens_two_layers(case, 32, {False: {}, True: padded})


def drop_and_pad_quantization_alignment(case: ContractCase) -> dict:
    """Drop-and-pad without and with the fp8 row alignment (16, from
    moe_router_padding_for_quantization; the experts are built, not run): the same tokens."""
    aligned = dict(after_validation=dict(moe_router_padding_for_quantization=True, fp8="hybrid"))
    dnp = dict(moe_pad_expert_input_to_capacity=True)
    return _same_tokens_two_layers(case, 16, {False: dnp, True: dict(aligned, **dnp)})


def layer_forward_backward(case: ContractCase) -> dict:
    """A whole MoELayer forward + backward (router, dispatcher, experts): output, input
    gradient and every parameter gradient by name, for comparing dispatchers."""
    rank = _setup(case)
    layer = build_layer(case)
    x = _input(case, rank, (8, 2, case.hidden))
    out, _ = layer(x)
    g = torch.Generator().manual_seed(7 + rank)
    out.backward(torch.randn(out.shape, generator=g).to(out.dtype))
    grads = {name: p.grad.detach().clone() for name, p in layer.named_parameters() if p.grad is not None}
    return {"out": out.detach(), "grad_x": x.grad, "grads": grads}

