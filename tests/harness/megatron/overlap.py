"""A tiny MoE GPTModel trained one step through Megatron's own schedules, for comparing runs.

`train_step` runs on every rank of a process-group pool: it builds GPTModel (local spec,
2 layers, bf16, 8 experts top-2, EP = world size / PP; with PP 2 one layer per stage and
a virtual pipeline size, as Megatron's EP overlap requires) from a seed, runs one
forward_backward_func call over several micro-batches of mock tokens, and returns each
micro-batch's loss and every parameter gradient. With overlap_moe_expert_parallel_comm the
schedule is Megatron's combined 1F1B (each layer split into attention, dispatch, experts and
combine nodes; micro-batch i's forward runs interleaved with micro-batch i-1's backward);
without it, the plain one-micro-batch-at-a-time schedule. Both must give the same numbers.
`shared_expert_overlap` adds a shared expert, overlapped with dispatch/combine or not.
Parameter names may carry Float16Module's "module." prefix (bf16 runs).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .moe_layer import dispatcher_of

VOCAB = 64


@dataclasses.dataclass(frozen=True)
class GPTCase:
    world_size: int = 2
    dispatcher: str = "hybrid_ep"
    overlap_ep_comm: bool = False
    shared_expert: bool = False
    shared_expert_overlap: bool = False
    bf16: bool = True  # the EP overlap requires bf16/fp16; shared-expert overlap also runs in fp32
    pipeline: int = 1  # PP; with PP > 1 Megatron's EP overlap needs a virtual pipeline
    virtual_pipeline: int | None = None
    micro_batches: int = 3
    micro_batch_size: int = 2
    seq: int = 16
    seed: int = 5
    hidden: int = 32
    fp8_wire: bool = False  # hybrid_ep's dispatch and combine backward in fp8 (needs hidden % 128 == 0)


def _config(case: GPTCase):
    from megatron.core.transformer.transformer_config import TransformerConfig

    shared = dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_overlap=case.shared_expert_overlap) \
        if case.shared_expert else {}
    config = TransformerConfig(
        num_layers=2, hidden_size=case.hidden, num_attention_heads=4, ffn_hidden_size=64, moe_ffn_hidden_size=32,
        num_moe_experts=8, moe_router_topk=2, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type=case.dispatcher, expert_model_parallel_size=case.world_size // case.pipeline,
        pipeline_model_parallel_size=case.pipeline, virtual_pipeline_model_parallel_size=case.virtual_pipeline,
        overlap_moe_expert_parallel_comm=case.overlap_ep_comm, bf16=case.bf16,
        pipeline_dtype=torch.bfloat16 if case.bf16 else torch.float32, use_cpu_initialization=True, hidden_dropout=0.0,
        attention_dropout=0.0,
        add_bias_linear=False, bias_activation_fusion=False, gradient_accumulation_fusion=False,
        masked_softmax_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False,
        **shared,
        **({"fp8_recipe": "blockwise"} if case.fp8_wire else {}),
    )
    if case.fp8_wire:
        from megatron_patches.options import HybridEPOptions

        config.hybrid_ep_options = HybridEPOptions(dispatch_fp8=True, combine_grad_fp8=True)
    return config


def _batch(case: GPTCase, rank: int, index: int) -> dict:
    g = torch.Generator().manual_seed(case.seed * 7919 + rank * 131 + index)
    tokens = torch.randint(0, VOCAB, (case.micro_batch_size, case.seq + 1), generator=g)
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "position_ids": torch.arange(case.seq).expand(case.micro_batch_size, -1).contiguous(),
        "attention_mask": torch.tril(torch.ones(1, 1, case.seq, case.seq)) < 0.5,
        "loss_mask": torch.ones(case.micro_batch_size, case.seq),
    }


def _loss(loss_mask, output_tensor):
    losses = output_tensor.float().view(-1)
    loss = (losses * loss_mask.view(-1)).sum() / loss_mask.sum()
    return loss, {"lm loss": loss.detach().clone()}


_SCHEDULE_PLANS = [0]  # forward steps that built a combined-1F1B schedule plan in this process


def _forward_step(data_iterator, model, return_schedule_plan: bool = False):
    batch = next(data_iterator)
    args = (batch["tokens"], batch["position_ids"], batch["attention_mask"])
    if return_schedule_plan:
        _SCHEDULE_PLANS[0] += 1
        plan = model.build_schedule_plan(*args, labels=batch["labels"], loss_mask=batch["loss_mask"])
        return plan, functools.partial(_loss, batch["loss_mask"])
    output = model(*args, labels=batch["labels"], loss_mask=batch["loss_mask"])
    return output, functools.partial(_loss, batch["loss_mask"])


def train_step(case: GPTCase) -> dict:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module

    from megatron_patches.buffers import BUFFERS
    from megatron_patches.local.common import init_megatron

    init_megatron(case.world_size // case.pipeline, case.seed, pipeline_parallel=case.pipeline,
                  virtual_pipeline=case.virtual_pipeline)
    BUFFERS.clear()  # buffers sized from this run's first call, as a fresh job would
    config = _config(case)
    torch.manual_seed(case.seed)
    spec = get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False)
    chunks = []
    for vp_stage in range(case.virtual_pipeline or 1):
        stage = dict(vp_stage=vp_stage) if case.virtual_pipeline else {}
        chunks.append(GPTModel(
            config, spec, vocab_size=VOCAB, max_sequence_length=case.seq,
            pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, **stage),
            post_process=ps.is_pipeline_last_stage(ignore_virtual=False, **stage), **stage))
    ep_rank = ps.get_expert_model_parallel_rank()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    g = torch.Generator().manual_seed(case.seed + 1 + 1000 * ep_rank + 100 * pp_rank)
    with torch.no_grad():  # distinct experts per EP rank, the same dense weights everywhere
        for model in chunks:
            for p in model.parameters():
                if not getattr(p, "allreduce", True):
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    if case.bf16:  # bf16 weights and activations, as Megatron trains
        chunks = [Float16Module(config, model) for model in chunks]
    _SCHEDULE_PLANS[0] = 0
    batches = [_batch(case, ep_rank, i) for i in range(case.micro_batches)]
    iterators = [iter(batches) for _ in chunks] if case.virtual_pipeline else iter(batches)
    losses = get_forward_backward_func()(
        forward_step_func=_forward_step, data_iterator=iterators, model=chunks,
        num_microbatches=case.micro_batches, seq_length=case.seq, micro_batch_size=case.micro_batch_size,
        forward_only=False,
    )
    model = chunks[0]
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    layer = getattr(model, "module", model).decoder.layers[0].mlp
    return {"losses": [float(x["lm loss"]) for x in losses], "grads": grads,
            "dispatcher": type(dispatcher_of(layer)).__name__, "schedule_plans": _SCHEDULE_PLANS[0],
            "cudagraph_attrs": list(layer.token_dispatcher.cudagraph_attrs)}
