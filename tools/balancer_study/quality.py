"""`python -m tools.balancer_study.quality`: the planner against EPLB and a greedy baseline.

Loads: per layer, token counts drawn from a popularity (multinomial over top-K routes, or
Gumbel top-K routing for the `topk-` patterns). Patterns: Zipf s = 0.6 .. 1.4 (random
expert order per layer), log-normal popularity, two hot experts (25x and 18x the others),
a hot contiguous block (E/16 experts at 6x), uniform with +-20% noise.
Grid: W in --ranks, nodes 1, 2 and W/8 (8 ranks per node) where valid, S/E in --ratios
(S rounded up to a multiple of W). Per case: rank imbalance (max - mean) / mean of the
planner, EPLB (baselines.eplb: best of its hierarchical and global policies) and the
greedy baseline, worst over layers; then the load perturbed by a factor in [0.9, 1.1]
per expert, planned with previous= the first plan: moved-slot fraction, the layers moving
more than --move-target, imbalance minus a fresh plan's, and refit_bound's lower bound on
the slots any placement within the same allowed peak changes (a case above --move-target
whose bound is above it too cannot meet it), and the same bound for placements that keep
every copy count (where only that one is above --move-target, a placement that meets it has
to change copy counts);
cases above --move-target planned again at each of --sweep-tolerances, summed up per layout
(W, S): how much imbalance buys how many fewer moves; and rebalanced --budget-rounds times on
the same load with move_budget = --move-target: how far above a fresh plan one capped
rebalance leaves them and how many rebalances reach the tolerance. Timing: 61 layers x E x 64
ranks on one thread, every pattern, fresh, with previous, and with previous and the move
budget, median of repeats, with the moved slots of all 61 layers (more layers than the grid's
cases, so the share of layers over --move-target shows as well).
Writes balancer_planner.json, balancer_planner.md and balancer_planner.png into --out.
Legend: L layers, E experts, S slots, W ranks, N nodes, K routes per token.
"""

from __future__ import annotations

import argparse
import datetime
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

from hybrid_ep.balancer.metrics import imbalance_ratio, rank_loads
from hybrid_ep.balancer.placement import Placement
from hybrid_ep.balancer.planner import DEFAULT_TOLERANCE, peak, plan_placement
from hybrid_ep.cli_parser import ArgumentParser
from hybrid_ep.paths import refuse_output
from hybrid_ep.synthetic import sample_topk, zipf_popularity

from .baselines import eplb, greedy
from .pages import write_page
from .refit_bound import refit_lower_bound

PATTERNS = ("zipf-0.6", "zipf-0.8", "zipf-1.0", "zipf-1.2", "zipf-1.4", "lognormal-1.0", "lognormal-2.0",
            "two-hot", "hot-block", "uniform-noise", "topk-zipf-1.0", "topk-zipf-1.2")
_CHUNK_TOKENS = 16384  # tokens sampled at once by the topk- patterns ([chunk, E] float64 scores)


def popularity(pattern: str, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """[E] float64 routing popularity of one layer for a pattern of PATTERNS (topk- prefix ignored)."""
    name = pattern[len("topk-"):] if pattern.startswith("topk-") else pattern
    if name.startswith("zipf-"):
        p = zipf_popularity(num_experts, float(name[len("zipf-"):]), gen)
    elif name.startswith("lognormal-"):
        p = torch.exp(float(name[len("lognormal-"):]) * torch.randn(num_experts, generator=gen, dtype=torch.float64))
    elif name == "two-hot":
        p = torch.ones(num_experts, dtype=torch.float64)
        p[torch.randperm(num_experts, generator=gen)[:2]] = torch.tensor([25.0, 18.0], dtype=torch.float64)
    elif name == "hot-block":
        p = torch.ones(num_experts, dtype=torch.float64)
        width = max(1, num_experts // 16)
        start = int(torch.randint(0, num_experts - width + 1, (1,), generator=gen))
        p[start:start + width] = 6.0
    elif name == "uniform-noise":
        p = 1.0 + 0.4 * (torch.rand(num_experts, generator=gen, dtype=torch.float64) - 0.5)
    else:
        raise ValueError(f"pattern must be one of {', '.join(PATTERNS)}, got {pattern!r}")
    return p / p.sum()


def sample_load(pattern: str, num_layers: int, num_experts: int, topk: int, num_tokens: int,
                seed: int) -> torch.Tensor:
    """[L, E] float64 tokens per expert for num_tokens tokens of topk routes each.

    `topk-` patterns route every token to topk distinct experts (Gumbel top-k); the others
    draw the num_tokens * topk routes as one multinomial over the popularity.
    """
    gen = torch.Generator().manual_seed(seed)
    out = torch.zeros(num_layers, num_experts, dtype=torch.float64)
    for layer in range(num_layers):
        pop = popularity(pattern, num_experts, gen)
        if not pattern.startswith("topk-"):
            idx = torch.multinomial(pop, num_tokens * topk, replacement=True, generator=gen)
            out[layer] = torch.bincount(idx, minlength=num_experts).to(torch.float64)
            continue
        for start in range(0, num_tokens, _CHUNK_TOKENS):
            idx = sample_topk(min(_CHUNK_TOKENS, num_tokens - start), num_experts, topk, gen, popularity=pop)
            out[layer] += torch.bincount(idx.reshape(-1), minlength=num_experts).to(torch.float64)
    return out


def grid(ranks: list[int], ratios: list[float], num_experts: int) -> list[tuple[int, int, int]]:
    """(W, N, S) cases: nodes 1, 2 and W/8 (where N divides W and E), S = E x ratio rounded up to W."""
    out = []
    for W in ranks:
        for N in sorted({1, 2, max(1, W // 8)}):
            if W % N or num_experts % N or N > 16:
                continue
            for S in sorted({-(-int(round(num_experts * r)) // W) * W for r in ratios}):
                out.append((W, N, S))
    return out


def copies_gained(before: Placement, after: Placement) -> int:
    """Copies experts gained from before to after, summed over layers (as many as they lost)."""
    return int((after.expert_replicas - before.expert_replicas).clamp(min=0).sum())


def imbalance(load_LE: np.ndarray, s2e_LS, W: int) -> np.ndarray:
    """[L] rank imbalance of a placement."""
    return np.asarray(imbalance_ratio(rank_loads(load_LE, torch.as_tensor(np.asarray(s2e_LS)), W)))


def quality(args) -> list[dict]:
    """One row per (pattern, W, N, S): worst-layer imbalance of each planner, moves under perturbation."""
    rows = []
    cases = grid(args.ranks, args.ratios, args.experts)
    for i, pattern in enumerate(args.patterns):
        _progress(f"[{i + 1}/{len(args.patterns)}] {pattern}: {len(cases)} cases x {args.layers} layers")
        for W, N, S in cases:
            seed = args.seed + 1000 * i + W
            load = sample_load(pattern, args.layers, args.experts, args.topk, args.tokens_per_rank * W, seed).numpy()
            p = plan_placement(load, S, N, W)
            rng = np.random.default_rng(seed)
            moved_load = load * rng.uniform(0.9, 1.1, load.shape)
            fresh = plan_placement(moved_load, S, N, W)
            kept = plan_placement(moved_load, S, N, W, previous=p)
            mean = moved_load.sum(1) / W  # the allowed peak plan_placement uses
            allowed = peak(moved_load, fresh.slot_to_expert.numpy(), W) + (DEFAULT_TOLERANCE + 1e-9) * mean
            bound = refit_lower_bound(moved_load, p.slot_to_expert.numpy(), W, allowed)
            bound_kept = refit_lower_bound(moved_load, p.slot_to_expert.numpy(), W, allowed, keep_counts=True)
            moves_L = kept.moves(p)
            moved_fraction = float(moves_L.sum()) / (args.layers * S)
            sweep, rounds = [], []
            fresh_imb = imbalance(moved_load, fresh.slot_to_expert, W)
            if moved_fraction > args.move_target:  # what a larger tolerance buys where the default moves too many
                for tol in args.sweep_tolerances:
                    looser = plan_placement(moved_load, S, N, W, previous=p, tolerance=tol)
                    sweep.append({"tolerance": tol, "moved_fraction": float(looser.moves(p).sum()) / (args.layers * S),
                                  "imbalance_vs_fresh": float((imbalance(moved_load, looser.slot_to_expert, W)
                                                               - fresh_imb).max())})
                rounds = budget_rounds(moved_load, p, fresh_imb, args.move_target, args.budget_rounds)
            rows.append({
                "pattern": pattern, "num_layers": args.layers, "num_experts": args.experts, "num_ranks": W,
                "num_nodes": N, "num_slots": S,
                "planner": float(imbalance(load, p.slot_to_expert, W).max()),
                "eplb": float(imbalance(load, eplb(load, S, N, W), W).max()),
                "greedy": float(imbalance(load, greedy(load, S, W), W).max()),
                "moved_fraction": moved_fraction,
                "moved_fraction_max_layer": float(moves_L.max()) / S,
                "layers_over_target": int((moves_L > args.move_target * S + 1e-9).sum()),
                "moved_bound_fraction": float(bound.sum()) / (args.layers * S),
                "moved_bound_kept_counts_fraction": float(bound_kept.sum()) / (args.layers * S),
                "copies_gained": copies_gained(p, kept),
                "imbalance_vs_fresh": float((imbalance(moved_load, kept.slot_to_expert, W) - fresh_imb).max()),
                "tolerance_sweep": sweep,
                "budget_rounds": rounds,
            })
    return rows


def budget_rounds(load_LE: np.ndarray, previous: Placement, fresh_imb_L: np.ndarray, budget: float,
                  rounds: int) -> list[dict]:
    """Rebalances of one load with move_budget, each from the last one's plan (what the balancer
    does while the load holds): per round the largest moved fraction of a layer and the largest
    imbalance above a fresh plan's."""
    out, p = [], previous
    for _ in range(rounds):
        nxt = plan_placement(load_LE, p.num_slots, p.num_nodes, p.num_ranks, previous=p, move_budget=budget)
        out.append({"moved_fraction_max_layer": float(nxt.moves(p).max()) / p.num_slots,
                    "imbalance_vs_fresh": float((imbalance(load_LE, nxt.slot_to_expert, p.num_ranks)
                                                 - fresh_imb_L).max())})
        p = nxt
    return out


def summarize_patterns(rows: list[dict], target: float) -> list[dict]:
    """Per pattern: worst imbalance (cases with spare slots, and placement only), margins, moves,
    cases moving more than target and how many of them the bound shows no placement can avoid."""
    out = []
    for pattern in dict.fromkeys(r["pattern"] for r in rows):
        mine = [r for r in rows if r["pattern"] == pattern]
        spare = [r for r in mine if r["num_slots"] > r["num_experts"]]
        only = [r for r in mine if r not in spare]
        out.append({
            "pattern": pattern, "cases": len(mine),
            **{f"worst_{k}": max((r[k] for r in spare), default=float("nan")) for k in ("planner", "eplb", "greedy")},
            **{f"worst_{k}_placement_only": max((r[k] for r in only), default=float("nan"))
               for k in ("planner", "eplb", "greedy")},
            "max_planner_minus_eplb": max(r["planner"] - r["eplb"] for r in mine),
            "max_planner_minus_greedy": max(r["planner"] - r["greedy"] for r in mine),
            "cases_worse_than_eplb": sum(r["planner"] > r["eplb"] + 1e-12 for r in mine),
            "moved_fraction_mean": float(np.mean([r["moved_fraction"] for r in mine])),
            "moved_fraction_max": max(r["moved_fraction"] for r in mine),
            "moved_bound_at_max": max(mine, key=lambda r: r["moved_fraction"])["moved_bound_fraction"],
            "cases_over_target": sum(r["moved_fraction"] > target for r in mine),
            "layers_over_target": sum(r["layers_over_target"] for r in mine),
            "layers": sum(r["num_layers"] for r in mine),
            "cases_over_target_infeasible": sum(r["moved_bound_fraction"] > target for r in mine),
            "max_imbalance_vs_fresh": max(r["imbalance_vs_fresh"] for r in mine),
        })
    return out


def summarize_sweep(rows: list[dict], target: float) -> list[dict]:
    """Per layout (W, S) with cases over target at the default tolerance: per tolerance, the worst
    moved fraction, the cases still over target and the largest imbalance above a fresh plan's
    (worst over patterns and node counts). Slots per rank, not the pattern, decides how many ranks
    a +-10% change pushes over the allowed peak, so the layout is what a user looks up."""
    out = []
    for W, S, mine in _by_layout(rows, "tolerance_sweep"):
        points = [[{"tolerance": DEFAULT_TOLERANCE, "moved_fraction": r["moved_fraction"],
                    "imbalance_vs_fresh": r["imbalance_vs_fresh"]}] + r["tolerance_sweep"] for r in mine]
        out.append({"num_ranks": W, "num_slots": S, "slots_per_rank": S // W, "cases": len(mine),
                    "patterns": sorted({r["pattern"] for r in mine}),
                    "by_tolerance": [{"tolerance": col[0]["tolerance"],
                                      "moved_fraction_max": max(c["moved_fraction"] for c in col),
                                      "cases_over_target": sum(c["moved_fraction"] > target for c in col),
                                      "imbalance_vs_fresh_max": max(c["imbalance_vs_fresh"] for c in col)}
                                     for col in zip(*points)]})
    return out


def _by_layout(rows: list[dict], key: str):
    """(W, S, rows of that layout) over the rows where key is non-empty, by W then S."""
    over = [r for r in rows if r[key]]
    for W, S in sorted({(r["num_ranks"], r["num_slots"]) for r in over}):
        yield W, S, [r for r in over if (r["num_ranks"], r["num_slots"]) == (W, S)]


def summarize_budget(rows: list[dict]) -> list[dict]:
    """Per layout (W, S) with cases over target: per rebalance under the move budget, the largest
    moved fraction of a layer, the largest imbalance above a fresh plan's, and the cases within
    the default tolerance of it (worst over patterns and node counts)."""
    out = []
    for W, S, mine in _by_layout(rows, "budget_rounds"):
        out.append({"num_ranks": W, "num_slots": S, "slots_per_rank": S // W, "cases": len(mine),
                    "by_round": [{"round": k + 1,
                                  "moved_fraction_max_layer": max(c["moved_fraction_max_layer"] for c in col),
                                  "imbalance_vs_fresh_max": max(c["imbalance_vs_fresh"] for c in col),
                                  "cases_within_tolerance": sum(c["imbalance_vs_fresh"] <= DEFAULT_TOLERANCE + 1e-9
                                                                for c in col)}
                                 for k, col in enumerate(zip(*(r["budget_rounds"] for r in mine)))]})
    return out


def timing_nodes(num_ranks: int) -> int:
    """Nodes of the timing case: 8 GPUs per node, at least one."""
    return max(1, num_ranks // 8)


def timing(args) -> list[dict]:
    """Median planning time on one thread per pattern of --time-patterns; previous planned from a
    load +-10% off. Every pattern, because the refit's searches run only on layers that move
    more than the target: one load cannot show the time of another."""
    L, E, W, N = args.time_layers, args.experts, args.time_ranks, timing_nodes(args.time_ranks)
    out = []
    for pattern in args.time_patterns:
        _progress(f"timing {pattern}: sampling {L} layers x {args.time_tokens} tokens x top-{args.topk}")
        load = sample_load(pattern, L, E, args.topk, args.time_tokens, args.seed + 100).numpy()
        perturbed = load * np.random.default_rng(args.seed).uniform(0.9, 1.1, load.shape)
        for slots in args.time_slots:
            _progress(f"timing {pattern} S={slots}: {L} layers, E={E}, W={W}, {N} nodes, {args.repeats} repeats")
            fresh = [_timed(lambda: plan_placement(perturbed, slots, N, W)) for _ in range(args.repeats)]
            previous = plan_placement(load, slots, N, W)
            warm = [_timed(lambda: plan_placement(perturbed, slots, N, W, previous=previous))
                    for _ in range(args.repeats)]
            cpu_fresh = [_cpu_timed(lambda: plan_placement(perturbed, slots, N, W)) for _ in range(args.repeats)]
            cpu_warm = [_cpu_timed(lambda: plan_placement(perturbed, slots, N, W, previous=previous))
                        for _ in range(args.repeats)]
            cpu_budget = [_cpu_timed(lambda: plan_placement(perturbed, slots, N, W, previous=previous,
                                                            move_budget=args.move_target))
                          for _ in range(args.repeats)]
            again = plan_placement(perturbed, slots, N, W, previous=previous)
            fresh_plan = plan_placement(perturbed, slots, N, W)
            moves_L = again.moves(previous).numpy()
            out.append({"pattern": pattern, "num_slots": slots, "num_layers": L, "num_experts": E, "num_ranks": W,
                        "num_nodes": N, "fresh_ms": 1e3 * statistics.median(fresh),
                        "with_previous_ms": 1e3 * statistics.median(warm),
                        "fresh_cpu_ms": 1e3 * statistics.median(cpu_fresh),
                        "with_previous_cpu_ms": 1e3 * statistics.median(cpu_warm),
                        "with_budget_cpu_ms": 1e3 * statistics.median(cpu_budget),
                        "moves_with_previous": int(moves_L.sum()), "slots_total": L * slots,
                        "moved_fraction_max_layer": float(moves_L.max() / slots),
                        "layers_over_target": int((moves_L > args.move_target * slots + 1e-9).sum()),
                        "imbalance_fresh": float(imbalance(perturbed, fresh_plan.slot_to_expert, W).mean()),
                        "imbalance_with_previous": float(imbalance(perturbed, again.slot_to_expert, W).mean())})
    return out


def _timed(fn) -> float:
    """Wall seconds (time.perf_counter) of one call."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _cpu_timed(fn) -> float:
    """CPU seconds of this process (time.process_time): what a shared machine's other jobs do not add."""
    start = time.process_time()
    fn()
    return time.process_time() - start


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def markdown(doc: dict) -> str:
    """balancer_planner.md: how it was measured, then the tables."""
    c = doc["config"]
    lines = [
        "# Balancer planner: quality against EPLB and a greedy baseline, moves, time", "",
        f"Measured {doc['date']} on {doc['machine']}. Command:", "", "```bash",
        f"OMP_NUM_THREADS=1 {doc['command']}", "```", "",
        f"E = {c['experts']}, W in {c['ranks']}, nodes 1, 2 and W/8 where valid, S/E in {c['ratios']} (S rounded "
        f"up to a multiple of W), {c['layers']} layer(s) per case, {c['tokens_per_rank']} tokens per rank x "
        f"top-{c['topk']}. Imbalance: (max - mean) / mean of tokens per rank, worst layer and case. Columns 3-5: "
        "worst over the cases with spare slots (S > E); placement only: S = E. Margins: largest "
        "planner minus baseline over all cases (negative: the planner is better in every case). Moves: "
        "slots whose expert changed when the load is multiplied by a factor in [0.9, 1.1] per expert and "
        f"planned with previous= (default tolerance {DEFAULT_TOLERANCE}), and the imbalance then minus a fresh "
        f"plan's. Bound: refit_bound's lower bound on the slots any placement within the same allowed peak "
        f"changes, at the worst case; cases over {100 * c['move_target']:.0f}%: cases whose layers together move "
        "more, and in parentheses those whose bound is above it too (no placement meets it); layers over: single "
        "layers moving more (a call's layers share the refit's costliest searches, so a case with more layers "
        "gives each fewer).", ""]
    lines += ["| pattern | cases | planner | EPLB | greedy | placement only: planner / EPLB / greedy "
             "| max planner - EPLB | max planner - greedy | moved slots mean / max (bound) | cases over "
             f"{100 * c['move_target']:.0f}% (infeasible) | layers over {100 * c['move_target']:.0f}% "
             "| max imbalance - fresh |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for s in doc["patterns"]:
        lines.append(
            f"| {s['pattern']} | {s['cases']} | {s['worst_planner']:.4f} | {s['worst_eplb']:.4f} | "
            f"{s['worst_greedy']:.4f} | {s['worst_planner_placement_only']:.3f} / {s['worst_eplb_placement_only']:.3f}"
            f" / {s['worst_greedy_placement_only']:.3f} | {s['max_planner_minus_eplb']:+.4f} | "
            f"{s['max_planner_minus_greedy']:+.4f} | {100 * s['moved_fraction_mean']:.1f}% / "
            f"{100 * s['moved_fraction_max']:.1f}% ({100 * s['moved_bound_at_max']:.1f}%) | "
            f"{s['cases_over_target']} ({s['cases_over_target_infeasible']}) | {s['layers_over_target']} of "
            f"{s['layers']} | {s['max_imbalance_vs_fresh']:+.4f} |")
    rows = doc["cases"]
    over = [r for r in rows if r["moved_fraction"] > c["move_target"]]
    open_ = [r for r in over if r["moved_bound_fraction"] <= c["move_target"]]
    need_counts = [r for r in open_ if r["moved_bound_kept_counts_fraction"] > c["move_target"]]
    lines += ["", f"All patterns: {len(over)} of {len(rows)} cases move more than {100 * c['move_target']:.0f}% "
              f"of the slots ({sum(r['layers_over_target'] for r in rows)} of {sum(r['num_layers'] for r in rows)} "
              f"layers); the bound shows {len(over) - len(open_)} of them cannot move fewer. Of the other "
              f"{len(open_)}, {len(need_counts)} need more than {100 * c['move_target']:.0f}% if every copy count "
              "stays (the bound with counts kept): a placement that meets the target there changes copy counts "
              f"(the planner's plans in those {len(need_counts)} cases gained "
              f"{sum(r['copies_gained'] for r in need_counts)} copies over "
              f"{sum(r['moved_fraction'] * c['layers'] * r['num_slots'] for r in need_counts):.0f} changed slots). "
              f"Mean moved {100 * np.mean([r['moved_fraction'] for r in rows]):.1f}%, "
              f"mean bound {100 * np.mean([r['moved_bound_fraction'] for r in rows]):.1f}%, with counts kept "
              f"{100 * np.mean([r['moved_bound_kept_counts_fraction'] for r in rows]):.1f}%."]
    if doc.get("tolerance_sweep"):
        tols = [b["tolerance"] for b in doc["tolerance_sweep"][0]["by_tolerance"]]
        lines += ["", f"Tolerance: the layouts with cases over {100 * c['move_target']:.0f}% re-planned with "
                  "plan_placement(previous=, tolerance=t) (the balancer's `balancer_tolerance`). Per t: worst moved "
                  f"slots over those cases, in parentheses how many are still over {100 * c['move_target']:.0f}%, "
                  "then the largest imbalance above a fresh plan's.", "",
                  "| W | slots per rank | S | cases (patterns) | "
                  + " | ".join(f"t = {t:g}" for t in tols) + " |", "|---|---|---|---|" + "---|" * len(tols)]
        for g in doc["tolerance_sweep"]:
            cells = [f"{100 * b['moved_fraction_max']:.1f}% ({b['cases_over_target']}), "
                     f"{b['imbalance_vs_fresh_max']:+.4f}" for b in g["by_tolerance"]]
            lines.append(f"| {g['num_ranks']} | {g['slots_per_rank']} | {g['num_slots']} | {g['cases']} "
                         f"({', '.join(g['patterns'])}) | " + " | ".join(cells) + " |")
    if doc.get("move_budget"):
        rounds = len(doc["move_budget"][0]["by_round"])
        lines += ["", f"Move budget: the same cases rebalanced {rounds} times on the same load with "
                  f"plan_placement(previous=, move_budget={c['move_target']:g}) (the balancer's "
                  "`balancer_move_budget`), each from the last plan. Per rebalance: largest moved fraction of a "
                  "layer, largest imbalance above a fresh plan's, and in parentheses the cases within the default "
                  f"tolerance ({DEFAULT_TOLERANCE:g}).", "",
                  "| W | slots per rank | S | cases | " + " | ".join(f"rebalance {k + 1}" for k in range(rounds))
                  + " |", "|---|---|---|---|" + "---|" * rounds]
        for g in doc["move_budget"]:
            cells = [f"{100 * b['moved_fraction_max_layer']:.1f}%, {b['imbalance_vs_fresh_max']:+.4f} "
                     f"({b['cases_within_tolerance']})" for b in g["by_round"]]
            lines.append(f"| {g['num_ranks']} | {g['slots_per_rank']} | {g['num_slots']} | {g['cases']} | "
                         + " | ".join(cells) + " |")
    limit = c["time_limit_ms"]
    over_limit = [t for t in doc["timing"] if t["with_previous_cpu_ms"] > limit]
    lines += ["", f"Planning time: one thread, median of {c['repeats']}, wall (time.perf_counter) and, in "
              "parentheses, CPU time of the process (time.process_time); each pattern's load "
              f"({c['time_tokens']} tokens per layer); with previous: the plan of a load +-10% off; with budget: the "
              f"same with move_budget={c['move_target']:g} (CPU time). Layers over {100 * c['move_target']:.0f}%: "
              "the layers whose moved slots exceed the move target, and the largest moved fraction of a layer. "
              f"With previous, {len(over_limit)} of {len(doc['timing'])} loads take more than {limit:g} ms (CPU)"
              + (f": {', '.join(t['pattern'] + ' S=' + str(t['num_slots']) for t in over_limit)}." if over_limit
                 else "."), "",
              "| pattern | L x E, W, nodes, S | fresh ms (CPU ms) | with previous ms (CPU ms) | with budget CPU ms "
              f"| slots moved | layers over {100 * c['move_target']:.0f}% (largest) "
              "| imbalance fresh / with previous |",
              "|---|---|---|---|---|---|---|---|"]
    for t in doc["timing"]:
        lines.append(f"| {t['pattern']} | {t['num_layers']} x {t['num_experts']}, {t['num_ranks']}, {t['num_nodes']}, "
                     f"{t['num_slots']} | {t['fresh_ms']:.1f} ({t['fresh_cpu_ms']:.1f}) | {t['with_previous_ms']:.1f} "
                     f"({t['with_previous_cpu_ms']:.1f}) | "
                     f"{t['with_budget_cpu_ms']:.1f} | {t['moves_with_previous']} / "
                     f"{t['slots_total']} ({100 * t['moves_with_previous'] / t['slots_total']:.1f}%) | "
                     f"{t['layers_over_target']} of {t['num_layers']} ({100 * t['moved_fraction_max_layer']:.1f}%) | "
                     f"{t['imbalance_fresh']:.4f} / {t['imbalance_with_previous']:.4f} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict, path: str) -> str:
    sweep = doc.get("tolerance_sweep") or []
    budget = doc.get("move_budget") or []
    timed = doc.get("timing") or []
    panels = 2 + bool(sweep) + bool(budget) + bool(timed)
    cols = 3 if panels > 4 else (2 if panels == 4 else panels)
    rows_ = -(-panels // cols)
    fig = Figure(figsize=(6.5 * cols, 5.2 * rows_))
    ax = fig.add_subplot(rows_, cols, 1)
    pats = doc["patterns"]
    x = np.arange(len(pats))
    for j, (key, label) in enumerate((("planner", "planner"), ("eplb", "EPLB (best of 2 policies)"),
                                      ("greedy", "greedy + LPT"))):
        ax.bar(x + (j - 1) * 0.27, [max(s[f"worst_{key}"], 1e-5) for s in pats], 0.27, label=label)
    ax.set_yscale("log")
    ax.set_xticks(x, [s["pattern"] for s in pats], rotation=40, ha="right", fontsize=10)
    ax.set_ylabel("worst rank imbalance, cases with spare slots (log)", fontsize=10)
    ax.set_title(f"E={doc['config']['experts']}, W in {doc['config']['ranks']}, S/E in {doc['config']['ratios']}",
                 fontsize=10)
    ax.legend(fontsize=9)
    ax = fig.add_subplot(rows_, cols, 2)
    ax.bar(x - 0.2, [100 * s["moved_fraction_mean"] for s in pats], 0.4, label="mean over cases")
    ax.bar(x + 0.2, [100 * s["moved_fraction_max"] for s in pats], 0.4, label="worst case")
    ax.scatter(x + 0.2, [100 * s["moved_bound_at_max"] for s in pats], marker="_", s=300, color="k", zorder=3,
               label="lower bound, worst case")
    target = 100 * doc["config"]["move_target"]
    ax.axhline(target, color="k", ls="--", lw=0.8, label=f"target {target:.0f}%")
    ax.set_xticks(x, [s["pattern"] for s in pats], rotation=40, ha="right", fontsize=10)
    ax.set_ylabel("slots moved after a +-10% load change (%)", fontsize=10)
    ax.set_title("moves with previous= (imbalance within tolerance of a fresh plan)\n"
                 f"n/m above a bar: layers over {target:.0f}% of the pattern's m layers", fontsize=10)
    top = max([target] + [100 * s["moved_fraction_max"] for s in pats])
    ax.set_ylim(0, 1.35 * top)  # room for the legend above the bars
    for i, s in enumerate(pats):  # single layers over the target, per pattern
        ax.annotate(f"{s['layers_over_target']}/{s['layers']}", (i + 0.2, 100 * s["moved_fraction_max"]),
                    xytext=(0, 3), textcoords="offset points", ha="center", va="bottom", fontsize=7, rotation=90)
    ax.legend(fontsize=9, loc="upper left", ncol=3)
    if sweep:
        ax = fig.add_subplot(rows_, cols, 3)
        for g in sweep:
            t = [b["tolerance"] for b in g["by_tolerance"]]
            ax.plot(t, [100 * b["moved_fraction_max"] for b in g["by_tolerance"]], marker="o",
                    label=f"W={g['num_ranks']}, {g['slots_per_rank']} slots/rank ({g['cases']} cases)")
        ax.axhline(target, color="k", ls="--", lw=0.8, label=f"target {target:.0f}%")
        ax.set_xticks([b["tolerance"] for b in sweep[0]["by_tolerance"]])
        ax.set_xlabel("tolerance (imbalance allowed above a fresh plan's)", fontsize=10)
        ax.set_ylabel("slots moved, worst case (%)", fontsize=10)
        ax.set_title("cases over the target: moves against tolerance", fontsize=10)
        ax.set_ylim(0, None)
        ax.legend(fontsize=8)
    if budget:
        ax = fig.add_subplot(rows_, cols, 2 + bool(sweep) + 1)
        for g in budget:
            k = [b["round"] for b in g["by_round"]]
            ax.plot(k, [b["imbalance_vs_fresh_max"] for b in g["by_round"]], marker="o",
                    label=f"W={g['num_ranks']}, {g['slots_per_rank']} slots/rank ({g['cases']} cases)")
        ax.axhline(DEFAULT_TOLERANCE, color="k", ls="--", lw=0.8, label=f"tolerance {DEFAULT_TOLERANCE:g}")
        ax.set_xticks([b["round"] for b in budget[0]["by_round"]])
        ax.set_xlabel(f"rebalance on the same load, each moving at most {target:.0f}% of a layer's slots",
                      fontsize=10)
        ax.set_ylabel("imbalance above a fresh plan's, worst case", fontsize=10)
        ax.set_title("cases over the target: a move budget, rebalance after rebalance", fontsize=10)
        ax.set_ylim(0, None)
        ax.legend(fontsize=8)
    if timed:
        ax = fig.add_subplot(rows_, cols, panels)
        several = len({t["num_slots"] for t in timed}) > 1
        names = [t["pattern"] + (f" S={t['num_slots']}" if several else "") for t in timed]
        x = np.arange(len(timed))
        ax.bar(x - 0.2, [t["fresh_cpu_ms"] for t in timed], 0.4, label="fresh")
        ax.bar(x + 0.2, [t["with_previous_cpu_ms"] for t in timed], 0.4, label="with previous (+-10% load)")
        limit = doc["config"]["time_limit_ms"]
        ax.axhline(limit, color="k", ls="--", lw=0.8, label=f"limit {limit:g} ms")
        ax.set_xticks(x, names, rotation=40, ha="right", fontsize=10)
        ax.set_ylabel("CPU ms per plan, one thread (median)", fontsize=10)
        t0 = timed[0]
        ax.set_title(f"planning time: {t0['num_layers']} layers x {t0['num_experts']} experts, W={t0['num_ranks']}"
                     + ("" if several else f", S={t0['num_slots']}"), fontsize=10)
        ax.set_ylim(0, 1.3 * max([limit] + [t["with_previous_cpu_ms"] for t in timed]))
        ax.legend(fontsize=9, loc="upper left", ncol=3)
    fig.suptitle(f"hybrid-ep balancer planner | {doc['machine']} | {doc['date']}", fontsize=11)
    fig.tight_layout()
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=100)
    return path


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m tools.balancer_study.quality", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, nargs="+", default=[8, 16, 32, 64, 128])
    p.add_argument("--ratios", type=float, nargs="+", default=[1.0, 1.125, 1.25, 1.5], help="S / E")
    p.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--tokens-per-rank", type=int, default=4096)
    p.add_argument("--layers", type=int, default=2, help="layers per case (each sampled separately)")
    p.add_argument("--time-layers", type=int, default=61)
    p.add_argument("--time-ranks", type=int, default=64)
    p.add_argument("--time-slots", type=int, nargs="+", default=[320])
    p.add_argument("--time-patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS,
                   help="loads timed, one each")
    p.add_argument("--time-limit-ms", type=float, default=25.0,
                   help="planning-time limit drawn in the timing table and plot (CPU time with previous)")
    p.add_argument("--time-tokens", type=int, default=16384, help="tokens per layer of the timing load")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--move-target", type=float, default=0.10, help="moved-slot fraction the refit aims below")
    p.add_argument("--sweep-tolerances", type=float, nargs="*", default=[0.015, 0.02, 0.03],
                   help="tolerances tried (besides the default) on cases that move more than --move-target")
    p.add_argument("--budget-rounds", type=int, default=3,
                   help="rebalances with move_budget = --move-target of each case that moves more (0: none)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--machine", default=platform.processor() or platform.machine())
    p.add_argument("--out", default=os.path.join("docs", "benchmarks"))
    return p


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_output(parser, "--out", args.out, folder=True)
    if not args.time_limit_ms > 0:
        parser.error(f"--time-limit-ms must be > 0, got {args.time_limit_ms}")
    for flag in ("experts", "topk", "tokens_per_rank", "layers", "time_layers", "time_ranks", "time_tokens",
                 "repeats", "budget_rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if min(args.ranks) < 1:
        parser.error(f"--ranks must all be >= 1, got {args.ranks}")
    if not min(args.ratios) >= 1:
        parser.error(f"--ratios (S / E) must all be >= 1: every expert needs a slot; got {args.ratios}")
    nodes = timing_nodes(args.time_ranks)
    if args.experts % nodes or args.time_ranks % nodes:
        parser.error(f"--time-ranks {args.time_ranks} is {nodes} nodes of 8, which must divide --experts "
                     f"({args.experts}) and the ranks")
    bad = [s for s in args.time_slots if s < args.experts or s % args.time_ranks]
    if bad:
        parser.error(f"--time-slots {bad}: each must be >= --experts ({args.experts}) and a multiple of "
                     f"--time-ranks ({args.time_ranks})")
    torch.set_num_threads(1)
    doc = {"date": datetime.date.today().isoformat(), "machine": args.machine,
           "command": shlex.join(["python", "-m", "tools.balancer_study.quality"]
                                 + list(sys.argv[1:] if argv is None else argv)),
           "config": {k: v for k, v in vars(args).items() if k not in ("out", "machine")}}
    doc["timing"] = timing(args)
    doc["cases"] = quality(args)
    doc["patterns"] = summarize_patterns(doc["cases"], args.move_target)
    doc["tolerance_sweep"] = summarize_sweep(doc["cases"], args.move_target)
    doc["move_budget"] = summarize_budget(doc["cases"])
    write_page(doc, args.out, "balancer_planner", markdown, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
