"""Train a tiny MoE GPT (Megatron-Core GPTModel) with expert parallelism through hybrid_ep.

    python -m megatron_patches.local.demo [--steps 30] [--dispatchers hybrid_ep alltoall]

W processes (default 4, as 2 nodes x 2 ranks) form one EP group of W ranks (data parallel W
for the dense weights). The model: GPTModel with Megatron's local (non-Transformer-Engine)
layer spec, 2 layers, hidden 128, 8 experts, top-2, vocabulary 256, fp32, trained on mock
data (each sequence counts upward by a stride of 1 to 4 from a random start, modulo the
vocabulary, which a model learns within a few dozen steps). On CPU the group runs on gloo; with
enough GPUs it runs on NCCL, one GPU per rank, and the same command uses them.

The first lines say where it runs (CPU and gloo, or the GPUs), which hybrid_ep backend the
dispatcher uses, and what the columns mean. Per step rank 0 prints the loss (mean over
ranks), tokens/s, the expert-load imbalance of each MoE layer ((max - mean) / mean of tokens
per expert, over the whole group; 0 = even) and the bytes the forward dispatches send over
NVLink and RDMA. Those bytes are modelled (hybrid_ep.traffic): what the hierarchical scheme
sends on each link for the step's routing, summed over layers and ranks, whichever
dispatcher ran; on CPU every byte actually went through gloo. Every dispatcher named in
--dispatchers trains its own model, from the same weights on the same data, in the same
processes and in alternation: step 1 of each, then step 2 of each, the order rotating every
step (A B, B A, ...), so that each step of one is timed beside the same step of the other,
under the same load of the machine, and neither always goes first. The run ends with one
summary: the largest relative difference of the first two loss curves, their tokens/s
(medians over steps 3 to the last, their ratio, and the median of the per-step ratios), and
the modelled NVLink and RDMA bytes of the first curve's forward dispatches under the
hierarchical scheme against a flat all-to-all for the same routing. Results go to --out as
moe_train.json, with the project's metadata block (hybrid_ep.metadata).

Gradients: dense weights are averaged over the W data-parallel ranks; expert gradients
already hold every rank's tokens (combine's backward brings them home), so they are divided
by W, which makes the update the gradient of the mean loss over ranks.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from hybrid_ep.config import BufferConfig
from hybrid_ep.paths import output_problem
from hybrid_ep.routing import normalize_routing, source_layout
from hybrid_ep.traffic import dispatch_row_bytes, row_counts
from hybrid_ep.wording import byte_unit, plural

from .common import PLAIN_FP32_CONFIG, counting_batch, init_megatron, quiet_libraries

LAYERS, HIDDEN, HEADS, EXPERTS, TOPK, VOCAB = 2, 128, 4, 8, 2, 256
TOOL = "python -m megatron_patches.local.demo"
LEGEND = ("legend: imbalance/layer = (max - mean) / mean of tokens per expert in each MoE layer (0 = even); "
          "NVLink / RDMA = modelled bytes of the forward dispatches under the hierarchical scheme, "
          "all layers and ranks")
UNITS = {
    "loss": "nats per token (cross-entropy, mean over ranks)",
    "tokens_per_s": "tokens per second, all ranks together",
    "imbalance": "(max - mean) / mean of tokens per expert over the group, one value per MoE layer; 0 = even",
    "nvlink_bytes": "bytes, modelled: hierarchical scheme's NVLink bytes of the forward dispatches for the "
                    "step's routing, summed over layers and ranks",
    "rdma_bytes": "bytes, modelled: hierarchical scheme's RDMA bytes of the forward dispatches for the "
                  "step's routing, summed over layers and ranks",
    "flat_nvlink_bytes": "bytes, modelled: a flat all-to-all's NVLink bytes for the same routing",
    "flat_rdma_bytes": "bytes, modelled: a flat all-to-all's RDMA bytes for the same routing",
    "max_rel_loss_diff": "largest |a - b| / |b| over the steps of the first two loss curves",
    "summary": "the first two curves' max_rel_loss_diff and speed, and the first curve's modelled bytes summed "
               "over its steps",
    "median_tokens_per_s": "tokens per second, all ranks together: median over steps speed_steps of the first two "
                           "curves",
    "tokens_per_s_ratio": "first curve's median tokens/s / second curve's (steps speed_steps)",
    "tokens_per_s_step_ratio": "median over steps speed_steps of the first curve's tokens/s / the second's at the "
                               "same step (the two steps ran one after the other)",
}
SPEED_FROM_STEP = 3  # the first two steps warm up (buffers, allocator, autograd graphs)
BYTE_FIELDS = ("nvlink_bytes", "rdma_bytes", "flat_nvlink_bytes", "flat_rdma_bytes")


def build_model(dispatcher: str, world_size: int, seq: int, ranks_per_node: int, seed: int, device):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ..options import HybridEPOptions

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
    )
    config.hybrid_ep_options = HybridEPOptions(ranks_per_node=ranks_per_node)
    torch.manual_seed(seed)
    spec = get_gpt_layer_local_spec(num_experts=EXPERTS, moe_grouped_gemm=False)
    model = GPTModel(config, spec, vocab_size=VOCAB, max_sequence_length=seq)
    # Identical dense weights on every rank (same seed); distinct experts per EP rank.
    g = torch.Generator().manual_seed(seed + 1 + 1000 * parallel_state.get_expert_model_parallel_rank())
    with torch.no_grad():
        for p in model.parameters():
            if not getattr(p, "allreduce", True):
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.to(device)


def moe_layers(model):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    return [m for m in model.modules() if isinstance(m, MoELayer)]


def train_rank(dispatchers: list[str], steps: int, micro_batch: int, seq: int, lr: float,
               ranks_per_node: int, seed: int) -> dict[str, list[dict]]:
    """Runs on every rank of the pool: one model per dispatcher, from the same weights, trained
    step by step in turn on the same data, so that each step of one is timed beside the same step
    of the others, under the same load of the machine. The order rotates every step (for two
    dispatchers: A B, then B A), so that neither always runs first. Returns rank 0's per-step
    records of each dispatcher (others: {})."""
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
                             traffic_config, device)
            if rec is not None:
                records[name].append(rec)
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
               traffic_config, device) -> dict:
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
        "loss": stats[0].item() / world,
        "tokens_per_s": world * micro_batch * seq / elapsed,
        "imbalance": ((load.max(dim=1).values - mean) / mean).tolist(),
        **modelled_dispatch_bytes(torch.stack(gathered).cpu(), traffic_config,
                                  dispatch_row_bytes(HIDDEN, torch.float32)),
    }


def routing_counts(routing_map_TE: torch.Tensor, config: BufferConfig) -> torch.Tensor:
    """[W + N] int64: this rank's dispatch rows per destination rank and tokens per destination
    node for one routing (the two count tables a dispatch exchanges, hybrid_ep.traffic)."""
    T, E = routing_map_TE.shape
    routing = normalize_routing(T, E, routing_map_TE.device, routing_map=routing_map_TE)
    layout = source_layout(routing, config)
    return torch.cat([layout.send_counts_W, layout.node_counts_N])


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


def where_line(transport: str, world_size: int, device: str, backend: str | None) -> str:
    """Where the ranks run and on which hybrid_ep backend (the second line of the output)."""
    if transport == "gloo":
        place = f"on {device}, {world_size} processes over torch.distributed gloo, no GPU"
    else:
        place = f"on {world_size} GPUs ({device}), one per process, torch.distributed nccl"
    via = "hybrid_ep dispatcher not run" if backend is None else f"hybrid_ep backend: {backend}"
    return f"running {place}; {via}"


def format_record(dispatcher: str, rec: dict) -> str:
    imb = " ".join(f"{v:.2f}" for v in rec["imbalance"])
    traffic = (f"modelled dispatch bytes NVLink {rec['nvlink_bytes'] / 1024:8.1f} KiB  "
               f"RDMA {rec['rdma_bytes'] / 1024:8.1f} KiB")
    return (f"[{dispatcher}] step {rec['step']:3d}  loss {rec['loss']:.5f}  "
            f"{rec['tokens_per_s']:8.0f} tok/s  imbalance/layer [{imb}]  {traffic}")


def _size(num_bytes: int) -> str:
    scale, unit = byte_unit(num_bytes)
    return f"{num_bytes / scale:.1f} {unit}"


def speed(a: list[dict], b: list[dict]) -> dict:
    """tokens/s of two curves trained in alternation, over steps SPEED_FROM_STEP.. (all steps when
    there are fewer): each curve's median, the ratio of the medians (a / b) and the median of the
    per-step ratios (each step of a against the same step of b, timed beside it)."""
    first = SPEED_FROM_STEP if len(a) >= SPEED_FROM_STEP else 1
    ta, tb = ([r["tokens_per_s"] for r in c if r["step"] >= first] for c in (a, b))
    return {"speed_steps": [first, len(a)],
            "median_tokens_per_s": [statistics.median(ta), statistics.median(tb)],
            "tokens_per_s_ratio": statistics.median(ta) / statistics.median(tb),
            "tokens_per_s_step_ratio": statistics.median(x / y for x, y in zip(ta, tb))}


def summary(results: dict) -> dict:
    """The run's point in numbers: do the first two curves agree, how fast the first trains
    against the second, and what the hierarchy saves, modelled, for the first run's routing
    (every byte of it, summed over steps)."""
    names = list(results["curves"])
    first = results["curves"][names[0]]
    out = {"curve": names[0], "steps": len(first), **{f: sum(r[f] for r in first) for f in BYTE_FIELDS}}
    if len(names) >= 2:
        out.update(compared=names[:2], max_rel_loss_diff=results["max_rel_loss_diff"],
                   **speed(first, results["curves"][names[1]]))
    return out


def summary_lines(s: dict) -> list[str]:
    lines = ["summary:"]
    if "compared" in s:
        a, b = s["compared"]
        lines.append(f"  losses: {a} and {b} agree within a max relative difference of "
                     f"{s['max_rel_loss_diff']:.1e} over {plural(s['steps'], 'step')}")
    lines.append(f"  modelled bytes of the forward dispatches ({s['curve']} run's routing, "
                 f"{plural(s['steps'], 'step')}, all layers and ranks; traffic model, not measured):")
    width = max(len(_size(s[f])) for f in BYTE_FIELDS)
    lines.append(f"    hierarchical scheme   NVLink {_size(s['nvlink_bytes']):>{width}}   "
                 f"RDMA {_size(s['rdma_bytes']):>{width}}")
    lines.append(f"    flat all-to-all       NVLink {_size(s['flat_nvlink_bytes']):>{width}}   "
                 f"RDMA {_size(s['flat_rdma_bytes']):>{width}}")
    if s["flat_rdma_bytes"]:
        saved = 1 - s["rdma_bytes"] / s["flat_rdma_bytes"]
        lines.append(f"    the hierarchy sends {saved:.0%} fewer RDMA bytes; its NVLink forwarding adds "
                     f"{_size(max(s['nvlink_bytes'] - s['flat_nvlink_bytes'], 0))}")
    if "compared" in s:
        a, b = s["compared"]
        ma, mb = s["median_tokens_per_s"]
        lo, hi = s["speed_steps"]
        lines.append(f"  tokens/s, median over steps {lo}-{hi} (trained in alternation, step by step): "
                     f"{a} {ma:.0f}, {b} {mb:.0f}; {a} / {b}: ratio of medians "
                     f"{s['tokens_per_s_ratio']:.3f}, median of per-step ratios {s['tokens_per_s_step_ratio']:.3f}")
    return lines


def max_relative_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def run(dispatchers, steps=30, world_size=4, ranks_per_node=2, micro_batch=4, seq=32, lr=3e-3,
        seed=1234, pool=None, echo=print) -> dict:
    """Train with each dispatcher on one pool; returns {dispatcher: records, ...}."""
    from hybrid_ep.metadata import metadata
    from hybrid_ep.spawn import ProcessGroupPool

    if len(set(dispatchers)) != len(dispatchers):
        raise ValueError(f"dispatchers must differ (each trains its own model), got {list(dispatchers)}")
    backend = "gloo"
    if torch.cuda.is_available():
        backend = "nccl"
        if torch.cuda.device_count() < world_size:
            world_size = torch.cuda.device_count()
            ranks_per_node = min(ranks_per_node, world_size)
            while world_size % ranks_per_node:
                ranks_per_node -= 1
            echo(f"using {world_size} GPU rank(s) (one per GPU), {ranks_per_node} per node")
    own_pool = pool is None
    if own_pool:
        pool = ProcessGroupPool(world_size, backend=backend, env={"HYBRID_EP_TIMEOUT_S": "120"})
    device_type = "cuda" if backend == "nccl" else "cpu"
    config = {"world_size": world_size, "ranks_per_node": ranks_per_node, "nodes": world_size // ranks_per_node,
              "transport": backend, "dispatchers": list(dispatchers), "steps": steps, "micro_batch": micro_batch,
              "seq": seq, "lr": lr, "seed": seed, "layers": LAYERS, "hidden": HIDDEN, "heads": HEADS,
              "experts": EXPERTS, "topk": TOPK, "vocab": VOCAB, "dtype": "fp32"}
    results = {"metadata": None, "curves": {}}
    try:
        hep_backend = pool.run(probe_backend, [(ranks_per_node,)] * pool.world_size)[0] \
            if "hybrid_ep" in dispatchers else None
        results["metadata"] = metadata(TOOL, device_type=device_type, config=config, units=UNITS,
                                       backends=[hep_backend] if hep_backend else [])
        echo(where_line(backend, pool.world_size, results["metadata"]["device"], hep_backend))
        echo(LEGEND)
        args = (list(dispatchers), steps, micro_batch, seq, lr, ranks_per_node, seed)
        curves = pool.run(train_rank, [args] * pool.world_size, timeout_s=1800 * len(dispatchers))[0]
        for name in dispatchers:
            for rec in curves[name]:
                echo(format_record(name, rec))
            results["curves"][name] = curves[name]
    finally:
        if own_pool:
            pool.close()
    names = list(results["curves"])
    if len(names) >= 2:
        a, b = ([r["loss"] for r in results["curves"][n]] for n in names[:2])
        results["max_rel_loss_diff"] = max_relative_difference(a, b)
    if names:
        results["summary"] = summary(results)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog=TOOL, description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--dispatchers", nargs="+", default=["hybrid_ep", "alltoall"],
                        choices=["hybrid_ep", "alltoall", "allgather"])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="results/demo", help="folder for moe_train.json")
    a = parser.parse_args(argv)
    problem = output_problem(a.out, folder=True)
    if problem:
        parser.error(f"--out: {problem}")
    if len(set(a.dispatchers)) != len(a.dispatchers):
        parser.error(f"--dispatchers must differ (each trains its own model), got {' '.join(a.dispatchers)}")
    if a.world_size % a.ranks_per_node or EXPERTS % a.world_size:
        parser.error(f"--world-size must be a multiple of --ranks-per-node and divide {EXPERTS} experts")
    print(f"tiny MoE GPT (Megatron-Core): {LAYERS} layers, hidden {HIDDEN}, {EXPERTS} experts, top-{TOPK}, "
          f"vocab {VOCAB}, fp32; EP={a.world_size} as {a.world_size // a.ranks_per_node} nodes x "
          f"{a.ranks_per_node} ranks; {a.steps} steps of {a.micro_batch}x{a.seq} tokens per rank", flush=True)
    results = run(a.dispatchers, a.steps, a.world_size, a.ranks_per_node, a.micro_batch, a.seq, a.lr, a.seed,
                  echo=lambda s: print(s, flush=True))
    for name, recs in results["curves"].items():
        print(f"{name}: first loss {recs[0]['loss']:.6f}, last loss {recs[-1]['loss']:.6f}")
    if "summary" in results:
        print("\n".join(summary_lines(results["summary"])))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "moe_train.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")
    bad = [n for n, recs in results["curves"].items() if not all(math.isfinite(r["loss"]) for r in recs)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
