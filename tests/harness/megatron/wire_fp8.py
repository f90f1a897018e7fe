"""fp8 on the wire against the oracle: what each rank of a pool runs, and the check.

`check_wire_case(pool, case)` quantizes every rank's bf16 tokens by the blockwise rule (or the
MXFP8 rule: case.scale_format), runs
the fp8 dispatch and the combine with an fp8 backward of `megatron_patches.wire_fp8` on each
rank, and asserts, bit for bit: the received fp8 rows and scales against the dense oracle of
the quantized tokens; the combine's backward (the expert rows' gradient) against the oracle's
dispatch of the quantized output gradient, dequantized; the dispatch's backward (to x and to
the routing weights) against the same calls in bf16 through hybrid_ep's own autograd.

Legend: T tokens, K routes per token, H hidden, R dispatched rows.
"""

from __future__ import annotations

import torch

from hybrid_ep.fp8 import dequantize_rows, quantize_blockwise, quantize_mxfp8
from hybrid_ep.verify.cases import Case, make_rank_inputs
from hybrid_ep.verify.compare import assert_dispatch_matches
from hybrid_ep.verify.oracle import dispatch_oracle


def _buffer(case: Case):
    from hybrid_ep.buffer import HybridEPBuffer

    cfg = case.config
    return HybridEPBuffer(None, cfg.hidden_dim, cfg.max_tokens_per_rank, cfg.num_experts,
                          ranks_per_node=cfg.ranks_per_node, backend=case.backend,
                          pad_multiple=cfg.pad_multiple, min_rows_per_expert=cfg.min_rows_per_expert)


class _FromGrouped(torch.autograd.Function):
    """The rows a GroupedTensor holds, as the experts compute on them; their gradient leaves as a
    plain tensor (what Transformer Engine's op fuser does with fc1's input)."""

    @staticmethod
    def forward(ctx, grouped):
        return grouped.rows()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GradFromGrouped(torch.autograd.Function):
    """y as it is; a GroupedTensor gradient arriving for it is read back as rows and counted
    (what TE's op fuser does with fc2's output gradient)."""

    @staticmethod
    def forward(ctx, y, seen):
        ctx.seen = seen
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        if hasattr(grad, "rows"):
            ctx.seen.append(grad)
            grad = grad.rows()
        return grad, None


def wire_on_rank(case: Case, inputs: dict, grad_rows: torch.Tensor, grad_probs: torch.Tensor,
                 grad_y: torch.Tensor, grouped: bool = False) -> dict:
    """Runs on one rank: the fp8 path and, for the gradients, the same calls in bf16.
    grouped: the rows and the combine's backward handed on as TE's GroupedTensor
    (te_grouped_rows; TE stood in by te_stand_in), read back as rows."""
    import hybrid_ep as hep
    from megatron_patches import te_grouped_rows, wire_fp8

    from . import te_stand_in

    buf = _buffer(case)
    quantizer = wire_fp8.QUANTIZERS[case.scale_format](use_te=False)
    routed = dict(num_out_tokens=case.num_out_tokens, topk_idx=inputs["topk_idx"])
    x = inputs["x"].clone().requires_grad_()
    w = inputs["topk_weights"].clone().requires_grad_()
    res = wire_fp8.send(buf, x, quantizer, topk_weights=w, **routed)
    as_rows = wire_fp8.dequantized
    if grouped:
        with te_stand_in.installed(megatron=False):
            as_rows = te_grouped_rows.GroupedRows(res.tokens_per_expert, te_grouped_rows.te_api())
    rows = wire_fp8.received_rows(buf, x, res, as_rows)
    if grouped:
        rows = _FromGrouped.apply(rows)
    ((rows.float() * grad_rows).sum() + (res.probs * grad_probs).sum()).backward()
    expert_out = torch.zeros(rows.shape, dtype=rows.dtype, requires_grad=True)
    grouped_grads = []
    out_rows = _GradFromGrouped.apply(expert_out, grouped_grads) if grouped else expert_out
    wire_fp8.combine(buf, out_rows, res.handle, quantizer, as_rows=as_rows).backward(grad_y)
    # The same in bf16 through hybrid_ep's autograd: the gradients the fp8 path must equal.
    x16 = inputs["x"].clone().requires_grad_()
    w16 = inputs["topk_weights"].clone().requires_grad_()
    res16 = hep.dispatch(buf, x16, topk_weights=w16, **routed)
    ((res16.tokens.float() * grad_rows).sum() + (res16.probs * grad_probs).sum()).backward()
    return {
        "tokens": res.tokens, "scales": res.scales, "probs": res.probs.detach(),
        "tokens_per_expert": res.tokens_per_expert, "num_dropped": int(res.handle.num_dropped),
        "rows": rows.detach(), "grad_x": x.grad, "grad_w": w.grad, "grad_x16": x16.grad, "grad_w16": w16.grad,
        "grad_expert_out": expert_out.grad, "grouped_grads": len(grouped_grads),
    }


def check_wire_case(pool, case: Case, grouped: bool = False) -> list[dict]:
    """Run `case` (bf16 tokens) with fp8 on the wire on the pool's ranks; assert every rank.
    grouped: the experts' side takes the rows as TE's GroupedTensor (wire_on_rank)."""
    if case.dtype != torch.bfloat16:
        raise ValueError(f"case.dtype must be torch.bfloat16 (the rows fp8 travels for), got {case.dtype}")
    cfg = case.config
    inputs = make_rank_inputs(case)
    quantize = quantize_mxfp8 if case.scale_format == "mxfp8" else quantize_blockwise
    wire = [quantize(i["x"]) for i in inputs]
    idx = [i["topk_idx"] for i in inputs]
    run = dispatch_oracle(cfg, [q for q, _ in wire], idx, [i["topk_weights"] for i in inputs],
                          [s for _, s in wire], case.num_out_tokens)
    gen = torch.Generator().manual_seed(case.seed + 7)
    grad_rows = [torch.randn(r.tokens.shape, generator=gen) for r in run.ranks]
    grad_probs = [torch.randn(r.probs.shape, generator=gen) for r in run.ranks]
    grad_y = [torch.randn(i["x"].shape, generator=gen).to(torch.bfloat16) for i in inputs]
    # The combine's backward: the oracle's dispatch of the quantized output gradient.
    wire_grad = [quantize(g) for g in grad_y]
    grad_run = dispatch_oracle(cfg, [q for q, _ in wire_grad], idx, None, [s for _, s in wire_grad],
                               case.num_out_tokens)
    args = [(case, inputs[r], grad_rows[r], grad_probs[r], grad_y[r], grouped) for r in range(case.world_size)]
    results = pool.run(wire_on_rank, args)
    for r, got in enumerate(results):
        where = f"{case} rank {r}"
        want = run.ranks[r]
        assert_dispatch_matches(got, want, where)
        assert torch.equal(got["rows"], dequantize_rows(want.tokens, want.scales, torch.bfloat16)), where
        want_grad = dequantize_rows(grad_run.ranks[r].tokens, grad_run.ranks[r].scales, torch.bfloat16)
        assert torch.equal(got["grad_expert_out"], want_grad), f"{where}: the combine's fp8 backward"
        assert got["grouped_grads"] == int(grouped), f"{where}: the combine's backward as a GroupedTensor"
        assert torch.equal(got["grad_x"], got["grad_x16"]), f"{where}: the dispatch's backward to x"
        assert torch.equal(got["grad_w"], got["grad_w16"]), f"{where}: the dispatch's backward to the weights"
    return results


def run_fp8_layer_with_slots(case, config_overrides: dict) -> dict:
    """On every rank: the seeded MoELayer with the expert balancer's slots (one per expert, in
    expert order: the placement a fresh balancer starts from) and fp8 on the wire; forward +
    backward. Returns out, grad_x, grad_router, grad_fc1, grad_fc2 as run_moe_layer_case."""
    import torch.distributed as dist

    from megatron_patches.local.common import init_megatron
    from megatron_patches.local.layer import case_tensors, seeded_layer

    from .moe_layer import dispatcher_of

    init_megatron(case.world_size)
    rank = dist.get_rank()
    _, _, _, x_all, grad_out = case_tensors(case)
    layer = seeded_layer(case, rank, config_overrides)
    dispatcher_of(layer).slot_table.load_(torch.arange(case.num_experts))
    x = x_all[rank].float().clone().requires_grad_()
    out, _ = layer(x)
    (out * grad_out[rank].float()).sum().backward()
    return {
        "dispatcher": type(dispatcher_of(layer)).__name__, "out": out.detach(), "grad_x": x.grad,
        "grad_router": layer.router.weight.grad,
        "grad_fc1": torch.stack([e.linear_fc1.weight.grad for e in layer.experts.local_experts]),
        "grad_fc2": torch.stack([e.linear_fc2.weight.grad for e in layer.experts.local_experts]),
    }


def _load_gated_weights(layer, case, rank: int) -> None:
    """The seeded router and expert weights (case_tensors) into a layer of SwiGLU experts: fc1's
    gate rows are the case's fc1, its linear rows drawn from the seed too."""
    from megatron_patches.local.layer import case_tensors

    L = case.num_experts // case.world_size
    router, fc1, fc2, _, _ = case_tensors(case)
    linear = torch.randn(fc1.shape, generator=torch.Generator().manual_seed(case.seed + 1), dtype=torch.float64)
    with torch.no_grad():
        layer.router.weight.copy_(router)
        for j in range(L):
            e = rank * L + j
            getattr(layer.experts.linear_fc1, f"weight{j}").copy_(torch.cat([fc1[e], linear[e] / 2]))
            getattr(layer.experts.linear_fc2, f"weight{j}").copy_(fc2[e])


def _start_offloading_chunk(config) -> None:
    """Megatron's fine-grained offloading handler for one micro-batch, as GPTModel's
    preprocess_for_fine_grained_offloading starts it (pipeline stage 0, no virtual stages)."""
    from megatron.core.pipeline_parallel import fine_grained_activation_offload as offload

    offload.FineGrainedActivationOffloadingInterface.init_chunk_handler(
        pp_rank=0, vp_size=None, vp_stage=None, min_offloaded_tensor_size=config.min_offloaded_tensor_size,
        delta_offload_bytes_across_pp_ranks=config.delta_offload_bytes_across_pp_ranks,
        activation_offload_fraction=config.activation_offload_fraction)


def run_fp8_layer_on_op_fuser(case, config_overrides: dict, capability: tuple[int, int] = (10, 0)) -> dict:
    """On every rank: the seeded MoELayer in bf16 with fp8 on the wire whose experts are Megatron's
    TEGroupedMLP on Transformer Engine's op fuser (SwiGLU; `TEGroupedMLP._fused_forward`), TE
    stood in by te_stand_in as on a GPU of `capability`; forward under the fp8 autocast Megatron's
    get_fp8_context gives the model's first layer (TE's MXFP8 autocast, or none where
    is_first_last_bf16_layer says it runs in bf16) and backward.

    Returns out, grad_x, grad_router, grad_fc1 [L, 2F, H], grad_fc2 [L, H, F] (float32), and the
    types of what TE's fused ops got: fc1's input forward ("inputs") and fc2's output gradient
    backward ("grads"); or {"error": "Type: message"} where the run raises."""
    import dataclasses

    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    from megatron_patches.local.common import init_megatron
    from megatron_patches.local.layer import build_moe_layer, case_tensors

    from . import te_stand_in

    init_megatron(case.world_size)
    rank = dist.get_rank()
    _, _, _, x_all, grad_out = case_tensors(case)
    overrides = dict(use_transformer_engine_op_fuser=True, moe_grouped_gemm=True, gated_linear_unit=True,
                     activation_func=F.silu, params_dtype=torch.bfloat16, bf16=True, fp8="e4m3",
                     fp8_recipe="mxfp8", **config_overrides)
    with te_stand_in.installed(capability=capability):
        for seen in te_stand_in.SEEN.values():
            seen.clear()
        try:
            layer = build_moe_layer(dataclasses.replace(case, **te_stand_in.OP_FUSER_CASE), **overrides)
            _load_gated_weights(layer, case, rank)
            x = x_all[rank].to(torch.bfloat16).requires_grad_()
            if layer.config.fine_grained_activation_offloading:  # what GPTModel's forward does first
                _start_offloading_chunk(layer.config)
            fp8_layer = not is_first_last_bf16_layer(layer.config, layer.layer_number - 1)
            with te_stand_in.autocast(enabled=fp8_layer, recipe=te_stand_in.MXFP8BlockScaling()):
                out, _ = layer(x)
            (out.float() * grad_out[rank].float()).sum().backward()
        except Exception as err:  # reported to the test, which checks the type and message
            return {"error": f"{type(err).__name__}: {err}"}
        seen = {k: [type(t).__name__ for t in v] for k, v in te_stand_in.SEEN.items()}
    L = case.num_experts // case.world_size
    return {
        "out": out.detach().float(), "grad_x": x.grad.float(), "grad_router": layer.router.weight.grad.float(),
        "grad_fc1": torch.stack([getattr(layer.experts.linear_fc1, f"weight{j}").grad.float() for j in range(L)]),
        "grad_fc2": torch.stack([getattr(layer.experts.linear_fc2, f"weight{j}").grad.float() for j in range(L)]),
        **seen,
    }
