"""What each rank of the demo runs (`python -m megatron_patches.local.demo`): the tiny MoE GPT,
its training step, and the step's modelled dispatch bytes. Imported by the pool's ranks, and
by the demo only once its arguments are checked (torch and Megatron-Core load here).
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

from hybrid_ep.config import BufferConfig
from hybrid_ep.routing import normalize_routing, send_table
from hybrid_ep.traffic import dispatch_row_bytes, row_counts

from .common import PLAIN_FP32_CONFIG, counting_batch, init_megatron, quiet_libraries
from .demo_shape import BYTE_FIELDS, EXPERTS, HEADS, HIDDEN, LAYERS, TOPK, VOCAB

# The demo's curves that are not a Megatron dispatcher type: fp8 rows on the wire (blockwise
# recipe), from hybrid_ep's dispatcher with both fp8 options on, and from the alltoall
# dispatcher whose experts quantize their input rows and their output's gradient themselves.
FP8_CURVES = {"hybrid_ep_fp8": "hybrid_ep", "alltoall_fp8": "alltoall"}


def wire_dtype(curve: str) -> torch.dtype:
    """The dtype of the dispatched rows: the model's, or fp8 (whose bytes include the scales)."""
    from hybrid_ep.fp8 import FP8_DTYPE

    return FP8_DTYPE if curve in FP8_CURVES else torch.float32


def build_model(curve: str, world_size: int, seq: int, ranks_per_node: int, seed: int, device):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..options import HybridEPOptions

    dispatcher = FP8_CURVES.get(curve, curve)
    fp8 = curve in FP8_CURVES
    config = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        ffn_hidden_size=4 * HIDDEN,
        moe_ffn_hidden_size=2 * HIDDEN,
        num_moe_experts=EXPERTS,
        moe_router_topk=TOPK,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2,
        moe_token_dispatcher_type=dispatcher,
        expert_model_parallel_size=world_size,
        **PLAIN_FP32_CONFIG,
        masked_softmax_fusion=False,
        bias_dropout_fusion=False,
        persist_layer_norm=False,
        **({"fp8_recipe": "blockwise"} if fp8 else {}),
    )
    config.hybrid_ep_options = HybridEPOptions(ranks_per_node=ranks_per_node, dispatch_fp8=fp8,
                                               combine_grad_fp8=fp8)
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=seq)
    # Identical dense weights on every rank (same seed); distinct experts per EP rank.
    g = torch.Generator().manual_seed(seed + 1 + 1000 * parallel_state.get_expert_model_parallel_rank())
    with torch.no_grad():
        for p in model.parameters():
            if not getattr(p, "allreduce", True):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    if fp8 and dispatcher != "hybrid_ep":
        from ..wire_fp8 import BlockwiseQuantizer, quantize_expert_rows

        quantizer = BlockwiseQuantizer()
        for layer in moe_layers(model):
            quantize_expert_rows(layer.experts, quantizer)
    return model.to(device)


def moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def train_rank(dispatchers: list[str], steps: int, micro_batch: int, seq: int, lr: float,
               ranks_per_node: int, seed: int, progress: str | None = None) -> dict[str, list[dict]]:
    """Runs on every rank of the pool: one model per dispatcher, from the same weights, trained
    step by step in turn on the same data, so that each step of one is timed beside the same step
    of the others, under the same load of the machine. The order rotates every step (for two
    dispatchers: A B, then B A), so that neither always runs first. Returns rank 0's per-step
    records of each dispatcher (others: {}). progress: a file rank 0 appends each record to as
    its step ends ({"dispatcher": name, "record": ...} per line), for the demo to print it then."""
    quiet_libraries()
    world = dist.get_world_size()
    rank = dist.get_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    traffic_config = BufferConfig(HIDDEN, micro_batch * seq, EXPERTS, world, ranks_per_node).validate()
    runs = {}
    for name in dispatchers:
        init_megatron(world, seed)  # the same seeds for every model: the same weights
        model = build_model(name, world, seq, ranks_per_node, seed, device)
        routed = keep_routing(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        runs[name] = (model, routed, opt)
    mask = torch.triu(torch.ones(seq, seq, dtype=torch.bool, device=device), diagonal=1)[None, None]
    position_ids = torch.arange(seq, device=device)[None].expand(micro_batch, -1)
    records = {name: [] for name in dispatchers}
    for step in range(steps):
        turn = step % len(dispatchers)
        for name in dispatchers[turn:] + dispatchers[:turn]:
            rec = train_step(*runs[name], step, rank, world, micro_batch, seq, seed, mask, position_ids,
                             traffic_config, device, wire_dtype(name))
            if rec is not None:
                records[name].append(rec)
                if progress is not None:
                    with open(progress, "a") as f:
                        f.write(json.dumps({"dispatcher": name, "record": rec}) + "\n")
    return records if rank == 0 else {}


def keep_routing(model) -> list:
    """[routing_map [T, E] of each MoE layer], refilled by every forward of the model."""
    layers = moe_layers(model)
    routed = [None] * len(layers)

    def hook_for(i):
        def hook(module, args, output):
            routed[i] = output[1].detach()
        return hook

    for i, layer in enumerate(layers):
        layer.router.register_forward_hook(hook_for(i))
    return routed


def train_step(model, routed, opt, step, rank, world, micro_batch, seq, seed, mask, position_ids,
               traffic_config, device, rows_dtype=torch.float32) -> dict:
    """One training step of one model; its record on rank 0 (the numbers it prints), None elsewhere."""
    t0 = time.perf_counter()
    batch = counting_batch(step, rank, micro_batch, seq, VOCAB, seed).to(device)
    tokens, labels = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
    opt.zero_grad(set_to_none=True)
    per_token = model(tokens, position_ids, mask, labels=labels)
    loss = per_token.float().mean()
    loss.backward()
    for p in model.parameters():
        if p.grad is None:
            continue
        if getattr(p, "allreduce", True):
            dist.all_reduce(p.grad)
        p.grad.div_(world)
    opt.step()
    # on the group's device (NCCL carries no host tensors), read on the host after
    stats = torch.tensor([loss.item()], dtype=torch.float64, device=device)
    load = torch.stack([m.sum(dim=0).to(torch.float64) for m in routed])
    counts = torch.stack([routing_counts(m, traffic_config) for m in routed])
    gathered = [torch.empty_like(counts) for _ in range(world)]
    dist.all_reduce(stats)
    dist.all_reduce(load)
    dist.all_gather(gathered, counts)
    load = load.cpu()
    elapsed = time.perf_counter() - t0
    if rank != 0:
        return None
    mean = load.mean(dim=1)
    return {
        "step": step + 1,
        "ended_at": time.time(),
        "loss": stats[0].item() / world,
        "tokens_per_s": world * micro_batch * seq / elapsed,
        "imbalance": ((load.max(dim=1).values - mean) / mean).tolist(),
        **modelled_dispatch_bytes(torch.stack(gathered).cpu(), traffic_config,
                                  dispatch_row_bytes(HIDDEN, rows_dtype)),
    }


def routing_counts(routing_map_TE: torch.Tensor, config: BufferConfig) -> torch.Tensor:
    """[W + N] int64: this rank's dispatch rows per destination rank and tokens per destination
    node for one routing (the two count tables a dispatch exchanges, hybrid_ep.traffic)."""
    T, E = routing_map_TE.shape
    routing = normalize_routing(T, E, routing_map_TE.device, routing_map=routing_map_TE)
    table = send_table(routing, config)
    return torch.cat([table.send_counts_W, table.node_counts_N])


def modelled_dispatch_bytes(counts_RLC: torch.Tensor, config: BufferConfig, row_bytes: int) -> dict:
    """Bytes of one step's dispatches over NVLink and RDMA, hierarchical and flat, summed over
    layers and ranks, from every rank's routing_counts of every layer [ranks, layers, W + N]."""
    W = config.world_size
    total = dict.fromkeys(BYTE_FIELDS, 0)
    for layer in range(counts_RLC.shape[1]):
        c = row_counts(counts_RLC[:, layer, :W], counts_RLC[:, layer, W:], config.ranks_per_node)
        for field, rows in zip(BYTE_FIELDS, (c.dispatch_nvlink, c.dispatch_rdma, c.flat_dispatch_nvlink,
                                             c.flat_dispatch_rdma)):
            total[field] += int(rows.sum()) * row_bytes
    return total


def probe_backend(ranks_per_node: int) -> str:
    """The backend HybridEPBuffer picks on this group for the demo's shape (what the dispatcher gets)."""
    import hybrid_ep as hep

    return hep.HybridEPBuffer(None, HIDDEN, 1, EXPERTS, ranks_per_node=ranks_per_node).backend
