"""A Megatron MoELayer on W ranks, and the same layer computed densely in one process.

Used by tests/megatron/: `run_moe_layer_case` runs on every rank of a
hybrid_ep.spawn.ProcessGroupPool (forward + backward of one MoELayer built from a
TransformerConfig with the given dispatcher type) and `dense_moe_layer` computes the same
outputs and gradients for all ranks at once, in float64, straight from the definition:

    out_t = sum over the token's top-k experts e of p_te * fc2_e(gelu(fc1_e(x_t)))
    p_t   = topk(softmax(x_t @ router^T))        (Megatron's pre-softmax routing)

Weights and inputs are drawn from seeds (megatron_patches.local.layer: LayerCase,
case_tensors), so every rank and the dense reference see the same numbers without shipping
tensors around. Legend: S sequence, B batch, H hidden, F expert
ffn, E experts, K top-k, W EP ranks, L = E / W.
"""

from __future__ import annotations

import functools

import torch

from megatron_patches.local.common import init_megatron
from megatron_patches.local.layer import LayerCase, build_moe_layer, case_tensors, seeded_layer

# A complete Megatron-LM pretrain_gpt argument list for a tiny MoE GPT on mock data.
TINY_GPT_ARGS = [
    "--num-layers", "2", "--hidden-size", "128", "--num-attention-heads", "4",
    "--seq-length", "32", "--max-position-embeddings", "32",
    "--micro-batch-size", "4", "--global-batch-size", "16",
    "--num-experts", "8", "--moe-router-topk", "2",
    "--train-iters", "10", "--lr", "1e-3", "--mock-data",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "256", "--transformer-impl", "local",
]


def dense_moe_layer(case: LayerCase) -> list[dict]:
    """Expected results of every rank: out, grad_x, grad_router, grad_fc1/fc2 of its experts."""
    router, fc1, fc2, x_all, grad_out = case_tensors(case)
    fc1 = fc1.clone().requires_grad_()
    fc2 = fc2.clone().requires_grad_()
    W, L = case.world_size, case.num_experts // case.world_size
    per_rank = []
    total = 0.0
    for r in range(W):
        x = x_all[r].reshape(-1, case.hidden).clone().requires_grad_()
        w_router = router.clone().requires_grad_()
        scores = torch.softmax(x @ w_router.T, dim=-1)
        probs, idx = torch.topk(scores, case.topk, dim=-1)
        out = torch.zeros_like(x)
        for k in range(case.topk):
            h = torch.nn.functional.gelu(torch.einsum("tfh,th->tf", fc1[idx[:, k]], x))
            out = out + probs[:, k : k + 1] * torch.einsum("thf,tf->th", fc2[idx[:, k]], h)
        total = total + (out * grad_out[r].reshape(-1, case.hidden)).sum()
        per_rank.append((x, w_router, out, idx))
    total.backward()
    results = []
    for r, (x, w_router, out, idx) in enumerate(per_rank):
        mine = slice(r * L, (r + 1) * L)
        results.append({
            "out": out.detach().reshape(case.seq, case.batch, case.hidden),
            "grad_x": x.grad.reshape(case.seq, case.batch, case.hidden),
            "grad_router": w_router.grad,
            "grad_fc1": fc1.grad[mine],
            "grad_fc2": fc2.grad[mine],
            "routed_per_expert": torch.bincount(idx.reshape(-1), minlength=case.num_experts),
        })
    return results


def experts_installed(case: LayerCase):
    """What the case's experts need around building and running them: Transformer Engine stood
    in (te_stand_in) for experts on its op fuser, else nothing."""
    import contextlib

    if not case.op_fuser:
        return contextlib.nullcontext()
    from .te_stand_in import installed

    return installed()


def dispatcher_of(layer):
    """What dispatches a MoELayer's tokens: hybrid_ep's manager under Megatron's flex dispatcher,
    else the layer's token dispatcher."""
    return getattr(layer.token_dispatcher, "_comm_manager", layer.token_dispatcher)


def _expert_out_copies(buf) -> dict:
    engine = getattr(getattr(buf, "_backend", None), "_engine", None)
    if engine is None or engine.peer is None:
        return {"expert_out_copied": None, "expert_out_block": None}
    block = engine.outputs.expert_out_blocks[0]
    return {"expert_out_copied": engine.expert_out_copied_bytes, "expert_out_block": block.numel() if block is not None
            else 0}


def _expert_out_views(dispatcher) -> int | None:
    expert_out = getattr(dispatcher, "expert_out", None)
    return None if expert_out is None else expert_out.views


def run_moe_layer_calls(case: LayerCase, seqs: list[list[int]], config_overrides: dict | None = None) -> list[dict]:
    """On every rank: one layer (fresh buffer cache), forward + backward for each call c with
    seqs[c][rank] sequence positions (input and output gradient drawn from the seed, call
    and rank). Per call: out, grad_x, grad_router, the buffers cached and this dispatcher's
    buffer size in tokens per rank, peer_memory_bytes and pad_multiple; a call that raises gives
    {"error": "Type: message"} and ends the run on that rank."""
    import torch.distributed as dist

    from megatron_patches.buffers import BUFFERS

    init_megatron(case.world_size)
    BUFFERS.clear()  # sized from this run's first call, as a fresh job would
    with experts_installed(case):
        return _run_calls(case, seqs, seeded_layer(case, dist.get_rank(), config_overrides))


def _run_calls(case: LayerCase, seqs: list[list[int]], layer) -> list[dict]:
    import torch.distributed as dist

    from megatron_patches.buffers import BUFFERS

    rank = dist.get_rank()
    results = []
    for c, seq in enumerate(seqs):
        g = torch.Generator().manual_seed(case.seed + 1000 * c + rank)
        x = torch.randn(seq[rank], case.batch, case.hidden, generator=g).requires_grad_()
        grad_out = torch.randn(seq[rank], case.batch, case.hidden, generator=g)
        layer.zero_grad()
        try:
            out, _ = layer(x)
            (out * grad_out).sum().backward()
        except Exception as err:  # reported to the test, which compares the ranks' messages
            results.append({"error": f"{type(err).__name__}: {err}"})
            break
        buf = getattr(dispatcher_of(layer), "_buffer", None)
        record = getattr(dispatcher_of(layer), "last_dispatch_call", None)
        results.append({
            "out": out.detach(), "grad_x": x.grad, "grad_router": layer.router.weight.grad.clone(),
            "buffers": len(BUFFERS), "buffer_tokens": None if buf is None else buf.config.max_tokens_per_rank,
            "buffer_arena": None if buf is None else buf.config.peer_memory_bytes,
            "buffer_pad": None if buf is None else buf.config.pad_multiple,
            "data_path": None if record is None else record.handle.data_path,  # the forward dispatch's
            "peer_memory": None if buf is None else buf.memory_plan().as_dict().get("peer_memory"),  # cuda
            # the cuda backend's engine: the bytes its combines copied into the expert-out block so
            # far, and the block's bytes
            **_expert_out_copies(buf),
            # forwards whose fc2 wrote its output into the expert-out block (None: not installed)
            "expert_out_views": _expert_out_views(dispatcher_of(layer)),
            "rows": None if record is None else record.handle.num_rows,
        })
    return results


def run_moe_layer_calls_on_faked_cuda(case: LayerCase, seqs: list[list[int]],
                                      config_overrides: dict | None = None) -> dict:
    """run_moe_layer_calls with --hybrid-ep-backend cuda in this CPU process, the cuda backend's
    kernels faked (harness.faked_kernels: its peer memory, agreement and engine are
    the real ones): the calls, the dispatcher's startup lines, and the kernels launched."""
    import logging

    from harness import faked_kernels
    from megatron_patches import buffers
    from megatron_patches.options import HybridEPOptions

    lines: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger(buffers.__name__)
    handler, level = Lines(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    overrides = {"hybrid_ep_options": HybridEPOptions(backend="cuda"), **(config_overrides or {})}
    try:
        with faked_kernels.installed():
            calls = run_moe_layer_calls(case, seqs, overrides)
            launched = [dict(buf._backend._engine.host.launched) for buf in buffers.BUFFERS.buffers()]
            buffers.BUFFERS.clear()
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    return {"calls": calls, "startup": lines, "launched": launched}


def run_moe_layer_case(case: LayerCase, config_overrides: dict | None = None, quantizing_experts: bool = False,
                       on_layer=None) -> dict:
    """On every rank: build the layer, load the seeded weights, forward + backward.
    quantizing_experts: the experts quantize their input rows and their output's gradient as
    fp8 on the wire does (megatron_patches.wire_fp8.quantize_expert_rows). on_layer: called
    with the layer before its forward.

    Returns this rank's out, grad_x, grad_router, grad_fc1 [L, F, H], grad_fc2 [L, H, F]
    (float32), the dispatcher's class name (dispatcher_of) and its routed-per-expert counts.
    """
    import torch.distributed as dist

    init_megatron(case.world_size)
    rank = dist.get_rank()
    _, _, _, x_all, grad_out = case_tensors(case)
    layer = seeded_layer(case, rank, config_overrides)
    if quantizing_experts:
        from megatron_patches.wire_fp8 import QUANTIZERS, quantize_expert_rows

        quantize_expert_rows(layer.experts, QUANTIZERS[(config_overrides or {}).get("fp8_recipe", "blockwise")]())
    if on_layer is not None:
        on_layer(layer)
    router_out = {}
    hook = layer.router.register_forward_hook(lambda m, i, out: router_out.update(probs=out[0], map=out[1]))
    x = x_all[rank].float().clone().requires_grad_()
    out, _ = layer(x)
    hook.remove()
    (out * grad_out[rank].float()).sum().backward()
    dispatcher = dispatcher_of(layer)
    routed = getattr(dispatcher, "last_routed_per_expert", None)
    return {
        "dispatcher": type(dispatcher).__name__,
        "out": out.detach(),
        "grad_x": x.grad,
        "grad_router": layer.router.weight.grad,
        "grad_fc1": torch.stack([e.linear_fc1.weight.grad for e in layer.experts.local_experts]),
        "grad_fc2": torch.stack([e.linear_fc2.weight.grad for e in layer.experts.local_experts]),
        "routed_per_expert": None if routed is None else routed.clone(),
        # what a CUDA graph of moe_preprocess would return for the dispatcher (Megatron keeps
        # the names that resolve to tensors)
        "cudagraph_tensors": [name for name in layer.token_dispatcher.cudagraph_attrs
                              if isinstance(functools.reduce(lambda o, a: getattr(o, a, None), name.split("."),
                                                             layer.token_dispatcher), torch.Tensor)],
        # The router's map per expert, and its routes of nonzero weight (real tokens).
        "router_map_per_expert": router_out["map"].sum(dim=0),
        "router_weighted_per_expert": (router_out["map"] & (router_out["probs"] != 0)).sum(dim=0),
        "pad_multiple": getattr(dispatcher, "pad_multiple", None),
        "static_size_factor": getattr(dispatcher, "static_size_factor", None),
        "over_budget": None if getattr(layer.token_dispatcher, "check_over_budget", lambda: None)() is None
        else bool(layer.token_dispatcher.check_over_budget()),
        "rows": None if getattr(dispatcher, "last_dispatch_call", None) is None
        else dispatcher.last_dispatch_call.handle.num_rows,
    }


def try_build_moe_layer(case: LayerCase, config_overrides: dict) -> str:
    """Build a MoELayer with some config fields changed after validation; returns the
    dispatcher's class name, or "ErrorType: message" when construction raises."""
    init_megatron(case.world_size)
    try:
        layer = build_moe_layer(case, **config_overrides)
    except Exception as err:  # reported to the test, which checks the type and message
        return f"{type(err).__name__}: {err}"
    return type(dispatcher_of(layer)).__name__
