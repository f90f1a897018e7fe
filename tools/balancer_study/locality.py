"""`python -m tools.balancer_study.locality`: what the balancer's plans cost in RDMA bytes.

A DeepSeek-V3-like layer (E = 256, top-8, 8 groups, a token's routes in its 4 best groups,
groups over nodes as contiguous blocks) on 8 nodes of 8 ranks and 4 nodes of 8, with Zipf
popularities (exponents --zipf, a random order of the experts per seed) and, with --stats,
the tokens per expert of a training run's statistics file (one layer, its counts as the
popularity). Per case the routing is drawn (--tokens-per-rank tokens on every rank), its
counts are the planner's load, and three placements route it:
  default: the identity placement the balancer starts from (expert e on rank e // (E / W); with
    spare slots each rank's spare a copy of an expert of the next rank), routes spread over
    copies;
  today: plan_placement without rdma_weight (copies on any node), routes spread over copies;
  new: plan_placement(rdma_weight=--rdma-weight), routes by locality (hybrid_ep.balancer.slots).
Each placement is measured on the same routing: rank imbalance (max - mean) / mean of the
routes every rank receives, and RDMA and NVLink bytes per token a rank sends in dispatch
(hybrid_ep.traffic: hierarchical scheme, bf16 rows of --hidden elements). Slots: S = E, and
one spare slot per rank (S = E + W: 9/8 of the experts at W = 32, 5/4 at W = 64, where 9/8
is not a multiple of the ranks). Plain top-k routing (no group limit) is measured too, and
the new planner at other rdma weights. Planning time: 61 layers x E x 64 ranks, S = 320,
group-limited Zipf loads, fresh and with previous after a +-10% change, median CPU time.

Writes balancer_locality.json, balancer_locality.md and balancer_locality.png into --out.
Legend: E experts, S slots, W ranks, N nodes, G ranks per node, K routes per token.
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

from hybrid_ep.balancer.knobs import DEFAULT_RDMA_WEIGHT
from hybrid_ep.balancer.metrics import imbalance_ratio, off_home
from hybrid_ep.balancer.placement import Placement
from hybrid_ep.balancer.planner import plan_placement
from hybrid_ep.paths import refuse_output
from hybrid_ep.synthetic import sample_topk, zipf_popularity
from hybrid_ep.traffic.placement import PlacementShape, placement_traffic

from .pages import write_page

E, K, GROUPS, GROUP_LIMIT = 256, 8, 8, 4
LAYOUTS = ((8, 8), (4, 8))  # (nodes, ranks per node)


def draw_routing(popularity: torch.Tensor, W: int, T: int, seed: int, grouped: bool) -> list[torch.Tensor]:
    """[T, K] expert ids per rank: Gumbel top-K over the popularity, group-limited when grouped."""
    gen = torch.Generator().manual_seed(seed)
    groups = dict(num_groups=GROUPS, topk_groups=GROUP_LIMIT) if grouped else {}
    return [sample_topk(T, E, K, gen, popularity=popularity, **groups) for _ in range(W)]


def popularity_of(load: str, seed: int, stats_load: np.ndarray | None) -> torch.Tensor:
    if load == "stats":
        p = torch.as_tensor(stats_load, dtype=torch.float64)
        return p / p.sum()
    return zipf_popularity(E, float(load.split("-")[1]), torch.Generator().manual_seed(seed))


def placements(load_E: np.ndarray, S: int, N: int, W: int, weights: list[float]) -> dict[str, np.ndarray]:
    out = {"default": Placement.identity(1, E, S, W, N).slot_to_expert[0].numpy(),
           "today": plan_placement(load_E, S, N, W).slot_to_expert[0].numpy()}
    for w in weights:
        out[f"new@{w:g}"] = plan_placement(load_E, S, N, W, rdma_weight=w).slot_to_expert[0].numpy()
    return out


def measure(routing: list[torch.Tensor], row: np.ndarray, N: int, G: int, hidden: int, locality: bool,
            load_E: np.ndarray) -> dict:
    W, S = N * G, len(row)
    t = placement_traffic(routing, torch.from_numpy(row), PlacementShape(W, G, S, hidden), locality=locality)
    per_token = t["bytes_per_token"]["dispatch"]
    away = off_home(load_E, torch.from_numpy(row), N)[0] if locality else torch.zeros(E, dtype=torch.float64)
    breaks = [{"expert": int(e), "home_node": int(e) // (E // N), "routes_off_home": float(away[e])}
              for e in torch.nonzero(away > 0).flatten().tolist()]
    return {"imbalance": float(imbalance_ratio(torch.tensor(t["routes_per_rank"], dtype=torch.float64))),
            "rdma_bytes_per_token": per_token["hierarchical_rdma"]["mean"],
            "nvlink_bytes_per_token": per_token["hierarchical_nvlink"]["mean"],
            "nodes_per_token": t["destinations_per_token"]["nodes"]["mean"],
            "max_nodes_per_token": t["destinations_per_token"]["nodes"]["max"],
            "node_bound_breaks": breaks}


def cases(args, stats_load: np.ndarray | None) -> list[dict]:
    loads = [f"zipf-{z:g}" for z in args.zipf] + (["stats"] if stats_load is not None else [])
    weights = sorted({args.rdma_weight, *args.sweep_weights})
    rows = []
    for routing_kind in ("group-limited", "top-k"):
        for N, G in LAYOUTS:
            W = N * G
            for i, load in enumerate(loads):
                if routing_kind == "top-k" and load not in args.topk_loads:
                    continue
                seed = args.seed + 100 * i
                _progress(f"{routing_kind} {N}x{G} {load}")
                routing = draw_routing(popularity_of(load, seed, stats_load), W, args.tokens_per_rank, seed + 1,
                                       routing_kind == "group-limited")
                load_E = np.bincount(torch.cat(routing).reshape(-1).numpy(), minlength=E).astype(np.float64)
                for S in (E, E + W):
                    plans = placements(load_E, S, N, W, weights)
                    out = {"routing": routing_kind, "nodes": N, "ranks_per_node": G, "num_slots": S, "load": load,
                           "seed": seed}
                    for name, row in plans.items():
                        locality = name.startswith("new")
                        out[name] = measure(routing, row, N, G, args.hidden, locality, load_E)
                    out["new"] = out[f"new@{args.rdma_weight:g}"]
                    out["rdma_ratio"] = out["new"]["rdma_bytes_per_token"] / out["default"]["rdma_bytes_per_token"]
                    if S == E:
                        out["off_home_for_today"] = off_home_needed(load_E, N, out["today"]["imbalance"])
                    rows.append(out)
    return rows


def off_home_needed(load_E: np.ndarray, N: int, imbalance: float) -> float:
    """Share of all routes a placement without spare slots must serve off their home node for a
    rank imbalance of at most `imbalance`: every expert has one copy, so a node's ranks carry
    its experts' routes, and each node above (1 + imbalance) x the mean node load sheds the
    excess, (N - 1) / N of a moved expert's routes coming from other nodes."""
    node = load_E.reshape(N, -1).sum(1)
    excess = np.clip(node - (1 + imbalance) * node.mean(), 0, None).sum()
    return float(excess * (N - 1) / N / load_E.sum())


def timing(args) -> dict:
    """CPU ms of plan_placement(rdma_weight) for 61 group-limited Zipf layers x E x 64 ranks, S = 320."""
    W, N, S = 64, 8, 320
    out = {"load_average": [round(os.getloadavg()[0], 2)]}  # the machine's, at the start and the end
    for z in args.zipf:
        gen = torch.Generator().manual_seed(args.seed)
        load = np.zeros((args.time_layers, E))
        for layer in range(args.time_layers):
            idx = sample_topk(args.time_tokens, E, K, gen, popularity=zipf_popularity(E, z, gen), num_groups=GROUPS,
                              topk_groups=GROUP_LIMIT)
            load[layer] = np.bincount(idx.reshape(-1).numpy(), minlength=E)
        moved = load * np.random.default_rng(args.seed).uniform(0.9, 1.1, load.shape)
        previous = plan_placement(load, S, N, W, rdma_weight=args.rdma_weight)
        fresh_ms, kept_ms = [], []
        for _ in range(args.repeats):
            t = time.process_time()
            plan_placement(moved, S, N, W, rdma_weight=args.rdma_weight)
            fresh_ms.append(1e3 * (time.process_time() - t))
            t = time.process_time()
            kept = plan_placement(moved, S, N, W, previous=previous, rdma_weight=args.rdma_weight)
            kept_ms.append(1e3 * (time.process_time() - t))
        today = []
        for _ in range(args.repeats):
            t = time.process_time()
            plan_placement(moved, S, N, W)
            today.append(1e3 * (time.process_time() - t))
        out[f"zipf-{z:g}"] = {"fresh_ms": statistics.median(fresh_ms), "previous_ms": statistics.median(kept_ms),
                             "today_fresh_ms": statistics.median(today),
                             "moved_fraction": float(kept.moves(previous).sum()) / (args.time_layers * S)}
    out["load_average"].append(round(os.getloadavg()[0], 2))
    return out


def markdown(doc: dict) -> str:
    w = doc["config"]["rdma_weight"]
    lines = [
        "# Balancer placements and RDMA bytes: node-aware plans under node-limited routing", "",
        f"Measured {doc['date']} on {doc['machine']}. Command:", "", "```bash", doc["command"], "```", "",
        "A DeepSeek-V3-like layer: 256 experts, top-8, 8 groups of 32, each token's routes in its 4 best "
        "groups (group score: the sum of its two best expert scores), groups over nodes in blocks (8 nodes: "
        f"one group each; 4 nodes: two), {doc['config']['tokens_per_rank']} tokens per rank. Loads: Zipf "
        "popularity over a random expert order, and `stats`: "
        + (doc["stats"]["description"] if doc.get("stats") else "none given") + ". The planner plans on the "
        "routing's own counts; every placement routes the same tokens. Imbalance: (max - mean) / mean of the "
        "routes each rank receives. RDMA and NVLink: bytes a rank sends per token of its own in dispatch, "
        "hierarchical scheme, bf16 rows of H = 7168 (the traffic model; combine sends as many back). "
        "default: the identity placement (spare slots: a copy of an expert of the next rank), routes spread over "
        "copies; today: `plan_placement` without `rdma_weight`, routes spread over copies; new: "
        f"`plan_placement(rdma_weight={w:g})` (its RDMA budget: routes off their home node, less 0.3 x those "
        "its satellites keep on their own node, at most 1% of all routes), routes by locality. Slots S = E (8/8) "
        "and one spare slot per rank (S = E + W: 9/8 at W = 32; at W = 64, 9/8 = 288 slots is not a multiple of "
        "the ranks, so 320, 5/4).", "",
        "## Group-limited routing (top-4 groups of 8)", "",
        "| nodes x ranks | load | slots per rank | imbalance default / today / new | RDMA bytes/token default / "
        "today / new | new / default RDMA | NVLink bytes/token default / today / new | experts off their node (new) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    group = [c for c in doc["cases"] if c["routing"] == "group-limited"]
    for c in group:
        lines.append(_row(c))
    worst = max(c["rdma_ratio"] for c in group)
    lines += ["", f"worst RDMA ratio (new planner / default placement): {worst:.2f}", ""]
    lines += _reading(group)
    plain = [c for c in doc["cases"] if c["routing"] == "top-k"]
    if plain:
        lines += ["## Plain top-k routing (no group limit)", "",
                  "| nodes x ranks | load | slots per rank | imbalance default / today / new | RDMA bytes/token "
                  "default / today / new | new / default RDMA | NVLink bytes/token default / today / new | experts "
                  "off their node (new) |", "|---|---|---|---|---|---|---|---|"]
        lines += [_row(c) for c in plain] + [""]
    weights = sorted(k for k in doc["cases"][0] if k.startswith("new@"))
    lines += ["## The RDMA weight", "",
              "The new planner at each weight, group-limited rows with spare slots: imbalance and RDMA ratio to the "
              "default placement.", "", "| nodes x ranks | load | " + " | ".join(k[4:] for k in weights) + " |",
              "|---|---|" + "---|" * len(weights)]
    for c in group:
        if c["num_slots"] == E:
            continue
        cells = [f"{c[k]['imbalance']:.3f} / {c[k]['rdma_bytes_per_token'] / c['default']['rdma_bytes_per_token']:.3f}"
                 for k in weights]
        lines.append(f"| {c['nodes']} x {c['ranks_per_node']} | {c['load']} | " + " | ".join(cells) + " |")
    t = dict(doc["timing"])
    machine_load = t.pop("load_average", None)
    lines += ["", "## Planning time", "",
              f"{doc['config']['time_layers']} layers x 256 experts x 64 ranks (8 nodes), S = 320, group-limited "
              f"Zipf loads of "
              f"{doc['config']['time_tokens']} tokens per layer, +-10% per expert for the plan with previous; "
              f"median CPU ms of {doc['config']['repeats']}, one thread"
              + (f"; the machine's load average {machine_load[0]:g} when the timing started and "
                 f"{machine_load[1]:g} when it ended" if machine_load else "") + ".", "",
              "| load | new, fresh | new, with previous | moved slots with previous | today, fresh |",
              "|---|---|---|---|---|"]
    for load, v in t.items():
        lines.append(f"| {load} | {v['fresh_ms']:.1f} | {v['previous_ms']:.1f} | {100 * v['moved_fraction']:.1f}% | "
                     f"{v['today_fresh_ms']:.1f} |")
    return "\n".join(lines) + "\n"


def _reading(group: list[dict]) -> list[str]:
    """The rows against three marks: RDMA at most 1.02x the default placement's; with spare
    slots, imbalance at most 0.02 where today's plan reaches it; elsewhere no more imbalance
    than today's (to within 0.001, the noise of one plan's rounding)."""
    def name(c):
        per_rank = c["num_slots"] // (c["nodes"] * c["ranks_per_node"])
        return f"{c['nodes']} x {c['ranks_per_node']} {c['load']} ({per_rank} slots per rank)"

    over = [f"{name(c)} {c['rdma_ratio']:.3f}x" for c in group if c["rdma_ratio"] > 1.02]
    spare = [c for c in group if c["num_slots"] > E]
    short = [f"{name(c)} {c['new']['imbalance']:.3f} (today {c['today']['imbalance']:.3f})" for c in spare
             if c["today"]["imbalance"] <= 0.02 < c["new"]["imbalance"]]
    def needed(c):  # without spare slots: what matching today's imbalance takes off the home nodes
        share = c.get("off_home_for_today")
        return "" if share is None else f", which needs at least {100 * share:.1f}% of the routes off their node"

    worse = [f"{name(c)} {c['new']['imbalance']:.3f} (today {c['today']['imbalance']:.3f}{needed(c)})" for c in group
             if not (c["num_slots"] > E and c["today"]["imbalance"] <= 0.02)
             and c["new"]["imbalance"] > c["today"]["imbalance"] + 1e-3]
    top = max(group, key=lambda c: c["rdma_ratio"])
    out = [f"Rows above 1.02x the default placement's RDMA bytes: {len(over)} of {len(group)}"
           + (": " + "; ".join(over) if over else f" (the largest: {name(top)} {top['rdma_ratio']:.3f}x)") + ".",
           f"Rows with spare slots where today's plan is at most 0.02 imbalanced and the new one is not: "
           f"{len(short)} of {sum(c['today']['imbalance'] <= 0.02 for c in spare)}" + (": " + "; ".join(short) if short
                                                                                      else "") + ".",
           f"Other rows where the new plan is more imbalanced than today's: {len(worse)}"
           + (": " + "; ".join(worse) if worse else "") + ".", ""]
    if any(c.get("off_home_for_today") for c in group if c["new"]["imbalance"] > c["today"]["imbalance"] + 1e-3):
        out[-1:] = ["Without spare slots a plan only permutes experts: evening nodes whose own loads differ "
                    "moves routes off their home node, and the node-aware plan spends at most 1% of "
                    "them (its RDMA budget, docs/balancer.md), so where today's imbalance needs more it stays "
                    "above it.", ""]
    return out


def _row(c: dict) -> str:
    names = ("default", "today", "new")
    P = c["num_slots"] // (c["nodes"] * c["ranks_per_node"])
    breaks = c["new"]["node_bound_breaks"]
    moved = "none" if not breaks else f"{len(breaks)} ({sum(b['routes_off_home'] for b in breaks):.0f} routes)"
    return (f"| {c['nodes']} x {c['ranks_per_node']} | {c['load']} | {P} | "
            + " / ".join(f"{c[n]['imbalance']:.3f}" for n in names) + " | "
            + " / ".join(f"{c[n]['rdma_bytes_per_token']:,.0f}" for n in names) + f" | {c['rdma_ratio']:.3f} | "
            + " / ".join(f"{c[n]['nvlink_bytes_per_token']:,.0f}" for n in names) + f" | {moved} |")


def plot(doc: dict, path: str) -> str:
    group = [c for c in doc["cases"] if c["routing"] == "group-limited"]
    labels = [f"{c['nodes']}x{c['ranks_per_node']} {c['load']} P{c['num_slots'] // (c['nodes'] * c['ranks_per_node'])}"
              for c in group]
    fig = Figure(figsize=(13, 8))
    x = np.arange(len(group))
    for k, (key, title, log) in enumerate((("imbalance", "rank imbalance (max - mean) / mean", True),
                                            ("rdma_bytes_per_token", "RDMA bytes per token, relative to default",
                                             False))):
        ax = fig.add_subplot(2, 1, k + 1)
        for j, name in enumerate(("default", "today", "new")):
            v = [c[name][key] / (c["default"][key] if key != "imbalance" else 1.0) for c in group]
            ax.bar(x + (j - 1) * 0.27, v, width=0.27, label=name)
        if log:
            ax.set_yscale("log")
            ax.axhline(0.02, color="k", lw=0.8, ls="--")
        else:
            ax.axhline(1.02, color="k", lw=0.8, ls="--")
        ax.set_title(title)
        ax.set_xticks(x)
        ax.set_xticklabels(labels, rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=8)
    fig.suptitle(f"Group-limited routing: default placement, today's planner, node-aware planner "
                 f"(rdma_weight {doc['config']['rdma_weight']:g}); {doc['date']}")
    fig.tight_layout()
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tools.balancer_study.locality", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--zipf", type=float, nargs="+", default=[0.8, 1.2, 1.6], help="Zipf exponents")
    p.add_argument("--stats", default=None, help="a training run's statistics file (hybrid-ep-balance plan --stats)")
    p.add_argument("--stats-layer", type=int, default=None,
                   help="its layer number to take (default: the one the identity placement balances worst)")
    p.add_argument("--stats-description", default="", help="how the statistics were made (for the page)")
    p.add_argument("--tokens-per-rank", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--rdma-weight", type=float, default=DEFAULT_RDMA_WEIGHT)
    p.add_argument("--sweep-weights", type=float, nargs="*", default=[0.25, 1.0])
    p.add_argument("--topk-loads", nargs="*", default=["zipf-1.2"], help="loads also measured with plain top-k")
    p.add_argument("--time-layers", type=int, default=61)
    p.add_argument("--time-tokens", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--machine", default=platform.processor() or platform.machine())
    p.add_argument("--out", default=os.path.join("docs", "benchmarks"))
    p.add_argument("--render", metavar="JSON", default=None,
                   help="write the page and plot of an earlier run's JSON into --out, measuring nothing")
    return p


def _stats_layer(path: str, layer: int | None) -> tuple[np.ndarray, dict]:
    from hybrid_ep.balancer.report import load_statistics

    st = load_statistics(path)
    load = st["history"].sum(0) if "history" in st else st["load"]
    numbers = [int(n) for n in st.get("layer_numbers", range(1, load.shape[0] + 1))]
    if load.shape[1] != E:
        raise ValueError(f"--stats: {path} has {load.shape[1]} experts, this study needs {E}")
    if layer is None:
        worst = imbalance_ratio(torch.as_tensor(load).view(load.shape[0], 32, -1).sum(-1))
        index = int(torch.argmax(worst))
    elif layer in numbers:
        index = numbers.index(layer)
    else:
        raise ValueError(f"--stats-layer {layer}: the statistics hold layers {numbers}")
    return load[index], {"path": path, "layer_number": numbers[index], "tokens": float(load[index].sum() / K)}


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_output(parser, "--out", args.out, folder=True)
    if args.render:
        try:
            with open(args.render) as f:
                doc = json.load(f)
        except (OSError, ValueError) as e:
            parser.error(f"--render: cannot read {args.render}: {e}")
        write_page(doc, args.out, "balancer_locality", markdown, plot)
        return 0
    for flag in ("tokens_per_rank", "hidden", "time_layers", "time_tokens", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not args.rdma_weight >= 0:
        parser.error(f"--rdma-weight must be >= 0, got {args.rdma_weight}")
    stats_load, stats = None, None
    if args.stats:
        try:
            stats_load, stats = _stats_layer(args.stats, args.stats_layer)
        except (OSError, ValueError) as e:
            parser.error(f"--stats: {e}")
        stats["description"] = args.stats_description or f"{args.stats}, layer {stats['layer_number']}"
    torch.set_num_threads(1)
    doc = {"date": datetime.date.today().isoformat(), "machine": args.machine,
           "command": shlex.join(["python", "-m", "tools.balancer_study.locality"]
                                 + list(sys.argv[1:] if argv is None else argv)),
           "config": {k: v for k, v in vars(args).items() if k not in ("out", "machine")}, "stats": stats}
    doc["cases"] = cases(args, stats_load)
    doc["timing"] = timing(args)
    group = [c for c in doc["cases"] if c["routing"] == "group-limited"]
    doc["worst_rdma_ratio"] = max(c["rdma_ratio"] for c in group)
    write_page(doc, args.out, "balancer_locality", markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
