"""`python -m hybrid_ep.balancer.quality`: how well and how fast the planner balances.

Quality: synthetic routings (top-K distinct experts per token, sampled from a popularity,
hybrid_ep.synthetic) for E experts on W ranks in N nodes; rank imbalance with no balancing
(expert e on rank e // (E/W)), placement only (S = E) and with spare slots (S > E).
Patterns: Zipf over experts (a random expert order per layer), two hot experts on one rank
(experts 0 and 1 at 10x the others' popularity), uniform with +-20% popularity noise.
Timing: plan_placement on one CPU thread for a large model (61 layers, W=64, Zipf 1.2),
median of repeats, fresh and with a previous placement planned from a load +-10% off.
Writes balancer_planner.json and balancer_planner.png into --out.
Legend: L layers, E experts, S slots, W ranks, N nodes, K routes per token.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import statistics
import sys
import time

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..synthetic import sample_topk, zipf_popularity
from .metrics import default_rank_loads, imbalance_ratio, rank_loads
from .planner import plan_placement

PATTERNS = ("zipf-0.8", "zipf-1.2", "two-hot", "uniform-noise")
_CHUNK_TOKENS = 16384  # tokens sampled at once (a [chunk, E] float64 score matrix)


def popularity(pattern: str, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """[E] float64 routing popularity of one layer for a pattern of PATTERNS."""
    if pattern.startswith("zipf-"):
        return zipf_popularity(num_experts, float(pattern[len("zipf-"):]), gen)
    if pattern == "two-hot":
        p = torch.ones(num_experts, dtype=torch.float64)
        p[:2] = 10.0
    elif pattern == "uniform-noise":
        p = 1.0 + 0.4 * (torch.rand(num_experts, generator=gen, dtype=torch.float64) - 0.5)
    else:
        raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")
    return p / p.sum()


def sample_load(pattern: str, num_layers: int, num_experts: int, topk: int, num_tokens: int,
                seed: int) -> torch.Tensor:
    """[L, E] float64 tokens per expert: num_tokens tokens, each routed to topk distinct experts."""
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(num_layers, num_experts, dtype=torch.float64)
    for layer in range(num_layers):
        pop = popularity(pattern, num_experts, gen)
        for start in range(0, num_tokens, _CHUNK_TOKENS):
            idx = sample_topk(min(_CHUNK_TOKENS, num_tokens - start), num_experts, topk, gen, popularity=pop)
            out[layer] += torch.bincount(idx.reshape(-1), minlength=num_experts).to(torch.float64)
    return out


def quality(args) -> list[dict]:
    rows = []
    num_nodes = args.ranks // args.ranks_per_node
    for i, pattern in enumerate(PATTERNS):
        _progress(f"[{i + 1}/{len(PATTERNS)}] sampling {pattern}: {args.layers} layers x "
                  f"{args.tokens_per_rank * args.ranks} tokens x top-{args.topk}")
        load = sample_load(pattern, args.layers, args.experts, args.topk, args.tokens_per_rank * args.ranks,
                           args.seed + i)
        row = {"pattern": pattern, "none": _stats(imbalance_ratio(default_rank_loads(load, args.ranks)))}
        for slots in args.slots:
            p = plan_placement(load, slots, num_nodes, args.ranks)
            row[f"S={slots}"] = _stats(imbalance_ratio(rank_loads(load, p, args.ranks)))
        rows.append(row)
    return rows


def timing(args) -> list[dict]:
    """Median planning time on one thread for a Zipf-1.2 load; previous comes from a load +-10% off."""
    L, E, W, N = args.time_layers, args.experts, args.time_ranks, args.time_ranks // args.ranks_per_node
    _progress(f"timing: sampling zipf-1.2, {L} layers x {args.time_tokens} tokens x top-{args.topk}")
    load = sample_load("zipf-1.2", L, E, args.topk, args.time_tokens, args.seed + 100)
    gen = torch.Generator().manual_seed(args.seed)
    perturbed = load * (1 + 0.2 * (torch.rand(L, E, generator=gen, dtype=torch.float64) - 0.5))
    out = []
    for slots in args.time_slots:
        _progress(f"timing S={slots}: {L} layers, E={E}, W={W}, {N} nodes, {args.repeats} repeats")
        fresh = [_timed(lambda: plan_placement(load, slots, N, W)) for _ in range(args.repeats)]
        previous = plan_placement(load, slots, N, W)
        warm = [_timed(lambda: plan_placement(perturbed, slots, N, W, previous=previous))
                for _ in range(args.repeats)]
        again = plan_placement(perturbed, slots, N, W, previous=previous)
        out.append({"num_slots": slots, "num_layers": L, "num_experts": E, "num_ranks": W, "num_nodes": N,
                    "fresh_ms": 1e3 * statistics.median(fresh), "with_previous_ms": 1e3 * statistics.median(warm),
                    "moves_with_previous": int(again.moves(previous).sum()), "slots_total": L * slots,
                    "imbalance_fresh": float(imbalance_ratio(rank_loads(load, previous, W)).mean()),
                    "imbalance_with_previous": float(imbalance_ratio(rank_loads(perturbed, again, W)).mean())})
    return out


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _stats(imb: torch.Tensor) -> dict:
    return {"mean": float(imb.mean()), "max": float(imb.max())}


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def print_tables(doc: dict) -> None:
    cols = ["none"] + [f"S={s}" for s in doc["config"]["slots"]]
    print(f"rank imbalance (max - mean) / mean, mean [max] over {doc['config']['layers']} layers; "
          f"E={doc['config']['experts']}, W={doc['config']['ranks']}, top-{doc['config']['topk']}")
    print(f"{'pattern':<15}" + "".join(f"{c:>20}" for c in cols))
    for row in doc["quality"]:
        print(f"{row['pattern']:<15}" + "".join(f"{row[c]['mean']:>11.4f} [{row[c]['max']:.4f}]" for c in cols))
    print(f"\nplanning time, one thread, median of {doc['config']['repeats']}")
    print(f"{'L x E, W, S':<26}{'fresh ms':>10}{'prev ms':>10}{'moves':>14}{'imb fresh':>11}{'imb prev':>10}")
    for t in doc["timing"]:
        shape = f"{t['num_layers']} x {t['num_experts']}, {t['num_ranks']}, {t['num_slots']}"
        print(f"{shape:<26}{t['fresh_ms']:>10.1f}{t['with_previous_ms']:>10.1f}"
              f"{t['moves_with_previous']:>7}/{t['slots_total']:<6}{t['imbalance_fresh']:>11.4f}"
              f"{t['imbalance_with_previous']:>10.4f}")


def plot(doc: dict, path: str) -> str:
    fig = Figure(figsize=(11, 4.2))
    ax = fig.add_subplot(1, 2, 1)
    cols = ["none"] + [f"S={s}" for s in doc["config"]["slots"]]
    x = np.arange(len(doc["quality"]))
    width = 0.8 / len(cols)
    for j, col in enumerate(cols):
        vals = [max(r[col]["mean"], 1e-5) for r in doc["quality"]]
        label = "no balancing" if col == "none" else col
        if col == f"S={doc['config']['experts']}":
            label += " (placement only)"
        ax.bar(x + (j - (len(cols) - 1) / 2) * width, vals, width, label=label)
    ax.axhline(0.05, color="k", ls="--", lw=0.8, label="target 0.05")
    ax.set_yscale("log")
    ax.set_xticks(x, [r["pattern"] for r in doc["quality"]], fontsize=8)
    ax.set_ylabel("rank imbalance (mean over layers, log)")
    ax.set_title(f"E={doc['config']['experts']}, W={doc['config']['ranks']}, top-{doc['config']['topk']}", fontsize=9)
    ax.legend(fontsize=7)
    ax = fig.add_subplot(1, 2, 2)
    labels = [f"S={t['num_slots']}" for t in doc["timing"]]
    xt = np.arange(len(labels))
    ax.bar(xt - 0.2, [t["fresh_ms"] for t in doc["timing"]], 0.4, label="fresh")
    ax.bar(xt + 0.2, [t["with_previous_ms"] for t in doc["timing"]], 0.4, label="with previous")
    ax.axhline(50, color="k", ls="--", lw=0.8, label="budget 50 ms")
    ax.set_xticks(xt, labels)
    ax.set_ylabel("ms (median, one thread)")
    t0 = doc["timing"][0] if doc["timing"] else {}
    ax.set_title(f"planning time: {t0.get('num_layers')} layers, E={t0.get('num_experts')}, "
                 f"W={t0.get('num_ranks')}", fontsize=9)
    ax.legend(fontsize=7)
    fig.suptitle(f"hybrid-ep balancer planner | {doc['machine']} | {doc['date']}", fontsize=9)
    fig.tight_layout()
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hybrid_ep.balancer.quality", description=__doc__.split("\n")[0])
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=32, help="W for the quality runs")
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens-per-rank", type=int, default=4096)
    p.add_argument("--layers", type=int, default=4, help="layers per pattern (each sampled separately)")
    p.add_argument("--slots", type=int, nargs="+", default=[256, 288], help="slot counts to plan for")
    p.add_argument("--time-layers", type=int, default=61)
    p.add_argument("--time-ranks", type=int, default=64)
    p.add_argument("--time-slots", type=int, nargs="+", default=[256, 320])
    p.add_argument("--time-tokens", type=int, default=16384, help="tokens per layer of the timing load")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--machine", default=platform.processor() or platform.machine())
    p.add_argument("--out", default=os.path.join("docs", "benchmarks"))
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    torch.set_num_threads(1)
    doc = {"date": datetime.date.today().isoformat(), "machine": args.machine,
           "command": shlex.join(["python", "-m", "hybrid_ep.balancer.quality"]
                                 + list(sys.argv[1:] if argv is None else argv)),
           "config": {k: v for k, v in vars(args).items() if k not in ("out", "machine")}}
    doc["quality"] = quality(args)
    doc["timing"] = timing(args)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "balancer_planner.json"), "w") as f:
        json.dump(doc, f, indent=1)
    plot(doc, os.path.join(args.out, "balancer_planner.png"))
    print_tables(doc)
    print(f"\nwrote {os.path.join(args.out, 'balancer_planner.json')} and balancer_planner.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
