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
from hybrid_ep.testing.cases import Case, make_rank_inputs
from hybrid_ep.testing.compare import assert_dispatch_matches
from hybrid_ep.testing.oracle import dispatch_oracle


def _buffer(case: Case):
    from hybrid_ep.buffer import HybridEPBuffer

    cfg = case.config
    return HybridEPBuffer(None, cfg.hidden_dim, cfg.max_tokens_per_rank, cfg.num_experts,
                          ranks_per_node=cfg.ranks_per_node, backend=case.backend,
                          pad_multiple=cfg.pad_multiple, min_rows_per_expert=cfg.min_rows_per_expert)


def wire_on_rank(case: Case, inputs: dict, grad_rows: torch.Tensor, grad_probs: torch.Tensor,
                 grad_y: torch.Tensor, grouped: bool = False) -> dict:
    """Runs on one rank: the fp8 path and, for the gradients, the same calls in bf16.
    grouped: the rows and the combine's backward handed on as TE's GroupedTensor
    (te_grouped_rows, TE stood in), read back as rows."""
    import hybrid_ep as hep

    from .. import te_grouped_rows, wire_fp8
    from . import te_grouped_stand_in

    buf = _buffer(case)
    quantizer = wire_fp8.QUANTIZERS[case.scale_format](use_te=False)
    routed = dict(num_out_tokens=case.num_out_tokens, topk_idx=inputs["topk_idx"])
    x = inputs["x"].clone().requires_grad_()
    w = inputs["topk_weights"].clone().requires_grad_()
    res = wire_fp8.send(buf, x, quantizer, topk_weights=w, **routed)
    as_rows = wire_fp8.dequantized
    if grouped:
        as_rows = te_grouped_rows.GroupedRows(res.tokens_per_expert, te_grouped_stand_in.api())
    rows = wire_fp8.received_rows(buf, x, res, as_rows)
    if grouped:
        rows = te_grouped_stand_in.read_rows(rows)
    ((rows.float() * grad_rows).sum() + (res.probs * grad_probs).sum()).backward()
    expert_out = torch.zeros(rows.shape, dtype=rows.dtype, requires_grad=True)
    grouped_grads = []
    out_rows = te_grouped_stand_in.grad_read_back(expert_out, grouped_grads) if grouped else expert_out
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

    from ..local.common import init_megatron
    from ..local.layer import case_tensors, seeded_layer

    init_megatron(case.world_size)
    rank = dist.get_rank()
    _, _, _, x_all, grad_out = case_tensors(case)
    layer = seeded_layer(case, rank, config_overrides)
    layer.token_dispatcher.slot_table.load_(torch.arange(case.num_experts))
    x = x_all[rank].float().clone().requires_grad_()
    out, _ = layer(x)
    (out * grad_out[rank].float()).sum().backward()
    return {
        "dispatcher": type(layer.token_dispatcher).__name__, "out": out.detach(), "grad_x": x.grad,
        "grad_router": layer.router.weight.grad,
        "grad_fc1": torch.stack([e.linear_fc1.weight.grad for e in layer.experts.local_experts]),
        "grad_fc2": torch.stack([e.linear_fc2.weight.grad for e in layer.experts.local_experts]),
    }


def run_fp8_layer_grouped(case, config_overrides: dict) -> dict:
    """On every rank: the seeded MoELayer with fp8 on the wire whose experts take the received
    rows as Transformer Engine's GroupedTensor (te_grouped_rows; TE stood in by
    te_grouped_stand_in, the hand-off's conditions taken as met); forward + backward. Returns
    run_moe_layer_case's fields and the GroupedTensors the experts got, forward and backward."""
    from .. import te_grouped_rows
    from . import te_grouped_stand_in
    from .moe_layer import run_moe_layer_case

    seen = {}

    def on_layer(layer):
        seen.update(te_grouped_stand_in.take_grouped_rows(layer.experts))

    kept = te_grouped_rows.te_api, te_grouped_rows.handoff_reason
    te_grouped_rows.te_api, te_grouped_rows.handoff_reason = te_grouped_stand_in.api, lambda *args: None
    try:
        result = run_moe_layer_case(case, config_overrides, on_layer=on_layer)
    finally:  # the pool's process runs other cases next
        te_grouped_rows.te_api, te_grouped_rows.handoff_reason = kept
    inputs, grads = seen["inputs"], seen["grads"]
    result["grouped"] = [
        {"shape": tuple(t.shape), "first_dims": t.fields["first_dims"].tolist(),
         "tensor_offsets": t.fields["tensor_offsets"].tolist(), "num_tensors": t.fields["num_tensors"],
         "swizzled": t.fields["with_gemm_swizzled_scales"], "data": t.fields["data"],
         "scale_inv": t.fields["scale_inv"],
         "columnwise": (t.fields["quantizer"].rowwise_usage, t.fields["quantizer"].columnwise_usage)}
        for t in inputs + grads]
    result["grouped_inputs"], result["grouped_grads"] = len(inputs), len(grads)
    return result
