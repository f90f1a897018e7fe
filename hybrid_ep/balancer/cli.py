"""`hybrid-ep-balance` / `python -m hybrid_ep.balancer`: plan a placement offline.

    hybrid-ep-balance plan --stats stats.npz [more.npz ...] --ep-size 32 --num-slots 288 --out placement.yaml \
        [--ranks-per-node 8] [--previous old.yaml] [--report-dir DIR] \
        [--params-per-slot N [--bytes-per-param 14]] [--rdma-weight 0.5] \
        [--traffic group-limited|top-k [--topk 8] [--groups N] [--group-limit 4]]

Reads the statistics file that training writes (report.py), or one per pipeline stage joined
by their layer numbers, plans (planner.py), writes the placement YAML (placement_file.py)
with the statistics' layer numbers, prints imbalance per layer before (the previous
placement, or the identity placement) and after, and optionally a report folder: JSON summary,
imbalance bars and, when the statistics have a history, heatmaps of tokens per rank over
intervals under both placements. With --params-per-slot the table and the report also give
the bytes the moved slots carry, so the cost of applying a plan is known before it is
applied. With --rdma-weight the plan is node-aware (routes by locality) and the table names
every expert served off its home node; with --traffic it also gives RDMA and NVLink bytes per
token of each layer for the identity placement, the placement before and the plan, on a routing
drawn from the layer's tokens per expert (hybrid_ep.traffic.placement). Bad input (a flag, or a
statistics file's field, or more than 64 slots per expert): a message naming the flag or the
field, exit code 2.
Legend: T intervals, L layers, E experts, S slots, W ranks.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch

from ..cli_parser import ArgumentParser, positive_int
from ..paths import output_problem
from ..traffic.placement import ROUTINGS
from ..wording import byte_unit, plural
from .knobs import DEFAULT_RDMA_WEIGHT, knob_type
from .metrics import off_home, rank_loads, summarize
from .placement import Placement
from .placement_file import NumberedPlacement, layer_numbers_problem, load_placement_yaml, save_placement_yaml
from .planner import DEFAULT_TOLERANCE, plan_placement
from .report import DEFAULT_BYTES_PER_PARAM, load_statistics, slot_bytes, write_report


class UsageError(Exception):
    """Bad command-line input; the message names the flag."""


# Most slots per expert this CLI plans: far beyond any useful replication (one spare slot per
# rank is the usual choice), and it bounds the planner's time (--num-slots 400000000 ran for
# minutes) and keeps its native call's integer arguments in range.
MAX_SLOTS_PER_EXPERT = 64


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="hybrid-ep-balance", description=__doc__.split("\n")[0],
                            allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    plan = sub.add_parser("plan", help="plan a placement from a statistics file", allow_abbrev=False)
    plan.add_argument("--stats", required=True, nargs="+",
                      help="statistics .npz (load [L, E], optional history); with pipeline parallelism every "
                           "stage's file (<report dir>/pipeline_stage_<k>/statistics.npz), joined by their layer "
                           "numbers into one plan for the whole model")
    plan.add_argument("--ep-size", type=int, help="ranks W (default: ep_size stored in the statistics)")
    slots = plan.add_mutually_exclusive_group()
    slots.add_argument("--num-slots", type=int,
                       help="slots S over all ranks, at most 64 x E (default: E, placement only)")
    slots.add_argument("--slots-per-rank", type=int, help="slots per rank (S = this x W)")
    plan.add_argument("--ranks-per-node", type=int, help="ranks per node (default: min(8, W))")
    plan.add_argument("--previous", help="placement YAML in use now: keep its slots where that costs no balance "
                                         "(its rows for the statistics' layers, by layer number)")
    plan.add_argument("--out", required=True, help="placement YAML to write")
    plan.add_argument("--report-dir", help="folder for the JSON summary and PNG plots")
    plan.add_argument("--tolerance", type=knob_type("tolerance"), default=None,
                      help="with --previous: accepted rise of the rank imbalance over a fresh plan to keep "
                           f"slots (default {DEFAULT_TOLERANCE})")
    plan.add_argument("--move-budget", type=knob_type("move_budget"), default=None,
                      help="with --previous: most slots per layer to change, as a fraction of the slots; "
                           "where it binds the imbalance may stay above the tolerance (default: no cap)")
    plan.add_argument("--params-per-slot", type=positive_int, default=None,
                      help="parameters of one expert (all its weight matrices): the table and the report add the "
                           "bytes the moved slots carry")
    plan.add_argument("--bytes-per-param", type=positive_int, default=None,
                      help="with --params-per-slot: bytes a moved slot carries per parameter (default "
                           f"{DEFAULT_BYTES_PER_PARAM}: bf16 weight, fp32 main weight, two fp32 Adam moments)")
    plan.add_argument("--rdma-weight", type=knob_type("rdma_weight"), default=None,
                      help="plan for the replica choice by locality (routes take the copies on their own node): "
                           "experts stay on their home node unless moving one lowers the imbalance by more than "
                           "this x the share of routes it then serves off its node, within an RDMA budget of about "
                           "1%% of the routes off their node (docs/balancer.md; recommended for node-limited "
                           f"routing: {DEFAULT_RDMA_WEIGHT}; default: copies on any node, routes spread over them)")
    plan.add_argument("--traffic", choices=ROUTINGS,
                      help="also report RDMA and NVLink bytes per token of every layer, on this routing drawn from "
                           "the layer's tokens per expert (group-limited: DeepSeek-V3's node-limited routing)")
    plan.add_argument("--topk", type=positive_int, default=8, help="routes per token (default 8)")
    plan.add_argument("--groups", type=positive_int, default=None,
                      help="with --traffic group-limited: expert groups, contiguous (default: one per node)")
    plan.add_argument("--group-limit", type=positive_int, default=4,
                      help="with --traffic group-limited: groups a token's routes may use (default 4)")
    plan.add_argument("--traffic-tokens", type=positive_int, default=512,
                      help="with --traffic: tokens drawn per rank and layer (default 512)")
    plan.add_argument("--hidden", type=positive_int, default=7168,
                      help="with --traffic: elements per row, moved as bf16 (default 7168)")
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse already printed the problem
        return int(exc.code or 0)
    try:
        return _plan(args)
    except UsageError as exc:
        print(f"hybrid-ep-balance: error: {exc}", file=sys.stderr)
        return 2


def _plan(args) -> int:
    stats = _read_stats(args.stats)
    stats_label = " ".join(args.stats)
    load_LE = stats["load"]
    L, E = load_LE.shape
    numbers = None if "layer_numbers" not in stats else [int(v) for v in stats["layer_numbers"]]
    W, ep_label = _ep_size(args, stats, stats_label)
    if args.slots_per_rank is not None:
        if args.slots_per_rank < 1:
            raise UsageError(f"--slots-per-rank must be >= 1, got {args.slots_per_rank}")
        S, slots_flag = args.slots_per_rank * W, "--slots-per-rank"
    else:
        S, slots_flag = (args.num_slots if args.num_slots is not None else E), "--num-slots"
    if S < E:
        raise UsageError(f"{slots_flag} gives {S} slots, fewer than the {E} experts in {stats_label}")
    if S > MAX_SLOTS_PER_EXPERT * E:
        raise UsageError(f"{slots_flag} gives {S} slots, more than {MAX_SLOTS_PER_EXPERT} x the {E} experts in "
                         f"{stats_label} ({MAX_SLOTS_PER_EXPERT * E}), the most this tool plans")
    if S % W != 0:
        raise UsageError(f"{slots_flag}: {S} slots do not split evenly over {ep_label} ranks")
    rpn = args.ranks_per_node if args.ranks_per_node is not None else min(8, W)
    if rpn < 1 or W % rpn != 0:
        raise UsageError(f"--ranks-per-node ({rpn}) must be >= 1 and divide {ep_label}")
    N = W // rpn
    if E % W != 0:
        raise UsageError(f"{ep_label} must divide the {E} experts in {stats_label} (as Megatron's EP size must)")
    if E % N != 0:
        raise UsageError(f"--ranks-per-node {rpn} gives {N} nodes, which must divide the {E} experts")
    if args.bytes_per_param is not None and args.params_per_slot is None:
        raise UsageError("--bytes-per-param needs --params-per-slot")
    for flag, value in (("--tolerance", args.tolerance), ("--move-budget", args.move_budget)):
        if value is not None and args.previous is None:
            raise UsageError(f"{flag} needs --previous (it bounds the change from a placement in use)")
    _check_output(args.out, "--out", want_dir=False)
    if args.report_dir:
        _check_output(args.report_dir, "--report-dir", want_dir=True)
    bytes_per_slot = None if args.params_per_slot is None else slot_bytes(
        args.params_per_slot, DEFAULT_BYTES_PER_PARAM if args.bytes_per_param is None else args.bytes_per_param)
    groups = args.groups if args.groups is not None else N
    if args.traffic == "group-limited":
        if E % groups != 0:
            raise UsageError(f"--groups ({groups}) must divide the {E} experts")
        if args.group_limit > groups or args.topk > args.group_limit * (E // groups):
            raise UsageError(f"--group-limit ({args.group_limit}) must be at most --groups ({groups}) and hold "
                             f"--topk ({args.topk}) routes")
    if args.traffic is not None and args.topk > E:
        raise UsageError(f"--topk ({args.topk}) must be at most the {E} experts")
    previous = _read_previous(args.previous, L, E, S, W, N, numbers)
    kwargs = {} if args.tolerance is None else {"tolerance": args.tolerance}
    if args.move_budget is not None:
        kwargs["move_budget"] = args.move_budget
    if args.rdma_weight is not None:
        kwargs["rdma_weight"] = args.rdma_weight
    placement = _run_planner(load_LE, S, N, W, previous, kwargs)
    layer_numbers = numbers or list(range(1, L + 1))  # the table's labels
    local = args.rdma_weight is not None and N > 1
    nodes = N if local else 1  # the replica choice the plan is for (metrics' load model)
    summary = summarize(load_LE, previous, placement, nodes=nodes)
    summary["layer_numbers"] = layer_numbers
    if local:
        summary["node_bound_breaks"] = _node_bound_breaks(load_LE, placement, N, layer_numbers, args.topk,
                                                          2 * args.hidden)
    if args.traffic is not None:
        summary["traffic"] = _traffic(load_LE, previous, placement, args, groups, local)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    sources = [os.path.abspath(path) for path in args.stats]
    extra = {"source_stats": sources[0] if len(sources) == 1 else sources}
    if numbers is not None:  # statistics without them (older versions): a file matched in order, as before
        extra["layer_numbers"] = numbers
    save_placement_yaml(placement, args.out, extra=extra)
    _print_table(summary, previous is not None, bytes_per_slot)
    if local:
        _print_breaks(summary["node_bound_breaks"])
    if args.traffic is not None:
        _print_traffic(summary["traffic"], previous is not None)
    print(f"placement: {args.out}")
    if args.report_dir:
        before = previous or Placement.identity(L, E, S, W, N)
        history = stats.get("history")
        paths = write_report(summary, args.report_dir,
                             history=None if history is None else _history_per_rank(history, placement, nodes),
                             history_before=None if history is None else _history_per_rank(history, before, nodes),
                             layer_names=[f"layer {n}" for n in layer_numbers], bytes_per_slot=bytes_per_slot)
        for kind, path in paths.items():
            print(f"{kind}: {path}")
    return 0


def _ep_size(args, stats: dict, stats_label: str) -> tuple[int, str]:
    """(W, how messages name it): the flag when given, else the statistics' ep_size field, so a
    bad size read from the file does not blame a flag the user never passed."""
    if args.ep_size is not None:
        if args.ep_size < 1:
            raise UsageError(f"--ep-size must be >= 1, got {args.ep_size}")
        return args.ep_size, f"--ep-size {args.ep_size}"
    if stats.get("ep_size") is None:
        raise UsageError("--ep-size is required: the statistics file has no ep_size")
    return stats["ep_size"], f"the statistics' ep_size {stats['ep_size']}"


def _run_planner(load_LE, S: int, N: int, W: int, previous, kwargs: dict) -> Placement:
    """plan_placement with its refusals as usage errors; a TypeError or OverflowError of its
    native call (sizes past its integer range) gets one line, not a traceback with the load."""
    try:
        return plan_placement(load_LE, S, N, W, previous=previous, **kwargs)
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    except (TypeError, OverflowError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise UsageError(f"the planner cannot take {S} slots on {W} ranks in {N} nodes ({first})") from exc


def _read_stats(paths: list[str]) -> dict:
    """The statistics of one file, or of several (one per pipeline stage) joined by layer number."""
    parts = [_read_one_stats(path) for path in paths]
    stats = parts[0] if len(parts) == 1 else _join_stats(paths, parts)
    if "layer_numbers" in stats:
        problem = layer_numbers_problem([int(v) for v in stats["layer_numbers"]], stats["load"].shape[0])
        if problem:
            raise UsageError(f"--stats: layer_numbers of {' '.join(paths)} {problem}")
    return stats


def _join_stats(paths: list[str], parts: list[dict]) -> dict:
    """One statistics dict of several files, layers sorted by layer number; the history where
    every file has one over the same steps."""
    for path, part in zip(paths, parts):
        if "layer_numbers" not in part:
            raise UsageError(f"--stats: {path} has no layer_numbers; several files are joined by their layer numbers")
    experts = sorted({part["load"].shape[1] for part in parts})
    if len(experts) > 1:
        raise UsageError(f"--stats: the files count different numbers of experts ({experts})")
    ep_sizes = sorted({part["ep_size"] for part in parts if "ep_size" in part})
    if len(ep_sizes) > 1:
        raise UsageError(f"--stats: the files were written at different EP sizes ({ep_sizes})")
    numbers = np.concatenate([part["layer_numbers"] for part in parts]).astype(np.int64)
    twice = sorted({int(n) for n in numbers if (numbers == n).sum() > 1})
    if twice:
        raise UsageError(f"--stats: layers {twice} are in more than one file (give each pipeline stage's file once)")
    order = np.argsort(numbers, kind="stable")
    out = {"load": np.concatenate([part["load"] for part in parts])[order], "layer_numbers": numbers[order]}
    if ep_sizes:
        out["ep_size"] = ep_sizes[0]
    steps = [part.get("steps") for part in parts]
    same_steps = all(s is None for s in steps) or all(s is not None and np.array_equal(s, steps[0]) for s in steps)
    histories = [part.get("history") for part in parts]
    if all(h is not None for h in histories) and same_steps and len({h.shape[0] for h in histories}) == 1:
        out["history"] = np.concatenate(histories, axis=1)[:, order]
        if steps[0] is not None:
            out["steps"] = steps[0]
    elif any(h is not None for h in histories):
        print("hybrid-ep-balance: the statistics files' histories cover different steps: planned from their "
              "load, with no heatmaps", file=sys.stderr)
    return out


def _read_one_stats(path: str) -> dict:
    if not os.path.isfile(path):
        raise UsageError(f"--stats: no such file {path}")
    try:
        stats = load_statistics(path)
    except (ValueError, OSError, EOFError) as exc:
        why = str(exc).removeprefix(f"{path}: ")  # load_statistics names the file too
        raise UsageError(f"--stats: cannot read {path}: {why}") from exc
    load = stats["load"]
    if not np.isfinite(load).all() or (load < 0).any():
        raise UsageError(f"--stats: load in {path} must be finite and non-negative")
    return stats


def _check_output(path: str, flag: str, want_dir: bool) -> None:
    problem = output_problem(path, folder=want_dir)
    if problem:
        raise UsageError(f"{flag}: {problem}")


def _read_previous(path: str | None, L: int, E: int, S: int, W: int, N: int,
                   numbers: list[int] | None) -> Placement | None:
    """The placement in use for the statistics' layers: its rows by layer number where both
    have them, else all its rows in order."""
    if path is None:
        return None
    try:
        prev = load_placement_yaml(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--previous: {exc}") from exc
    if numbers is not None and prev.layer_numbers is not None:
        missing = prev.missing_layers(numbers)
        if missing:
            raise UsageError(f"--previous {path} has layer_numbers {list(prev.layer_numbers)}, no row for layers "
                             f"{missing} of the statistics")
        prev = NumberedPlacement(prev.rows_for(numbers), prev.num_ranks, prev.num_nodes, prev.num_experts,
                                 tuple(numbers))
    want = (L, S, E, W, N)
    got = (prev.num_layers, prev.num_slots, prev.num_experts, prev.num_ranks, prev.num_nodes)
    if got != want:
        raise UsageError(f"--previous {path} has (layers, slots, experts, ep_size, nodes) = {got}, "
                         f"this plan needs {want}")
    return prev


def _node_bound_breaks(load_LE, placement: Placement, N: int, layer_numbers, topk: int,
                       row_bytes: int) -> list[dict]:
    """Every expert the plan serves off its home node (metrics.off_home): under node-limited
    routing (groups = nodes) these routes may reach a node beyond a token's limit, each at most
    one RDMA row of row_bytes in dispatch (and one back in combine)."""
    away = off_home(load_LE, placement, N).numpy()
    out = []
    for layer, expert in zip(*np.nonzero(away > 0)):
        tokens = float(load_LE[layer].sum()) / topk
        out.append({"layer": int(layer_numbers[layer]), "expert": int(expert),
                    "home_node": int(expert) // (load_LE.shape[1] // N), "routes": float(away[layer, expert]),
                    "rdma_bytes_per_token": float(away[layer, expert]) / tokens * row_bytes if tokens else 0.0})
    return out


def _print_breaks(breaks: list[dict]) -> None:
    if not breaks:
        print("node bound: every expert's routes from nodes without a copy go to its home node")
        return
    print(f"node bound: {plural(len(breaks), 'expert')} served off its home node, each route at most one RDMA row "
          "(upper bound on the added dispatch RDMA bytes per token):")
    for b in breaks:
        print(f"  layer {b['layer']} expert {b['expert']} (home node {b['home_node']}): {b['routes']:.0f} routes, "
              f"<= {b['rdma_bytes_per_token']:,.0f} B per token")


def _traffic(load_LE, previous, placement: Placement, args, groups: int, local: bool) -> dict:
    """Per layer: RDMA and NVLink bytes per token (dispatch, mean over ranks) of the identity
    placement, the placement before (with --previous) and the plan, on a routing drawn from the
    layer's load; the plan's routes by locality when it is node-aware."""
    from ..traffic.placement import PlacementShape, placement_traffic, routing_from_load

    W, N = placement.num_ranks, placement.num_nodes
    shape = PlacementShape(W, W // N, placement.num_slots, args.hidden)
    identity = Placement.identity(placement.num_layers, placement.num_experts, placement.num_slots, W, N)
    names = [("identity", identity, False)] + ([("previous", previous, local)] if previous is not None else []) \
        + [("plan", placement, local)]
    out = {name: {"rdma_bytes_per_token": [], "nvlink_bytes_per_token": []} for name, _, _ in names}
    for layer in range(placement.num_layers):
        if load_LE[layer].sum() <= 0:
            for name in out:
                out[name]["rdma_bytes_per_token"].append(0.0)
                out[name]["nvlink_bytes_per_token"].append(0.0)
            continue
        routing = routing_from_load(load_LE[layer], W, args.traffic_tokens, args.topk, seed=layer,
                                    routing=args.traffic, num_groups=groups, group_limit=args.group_limit)
        for name, p, by_locality in names:
            t = placement_traffic(routing, p.slot_to_expert[layer], shape, locality=by_locality)
            out[name]["rdma_bytes_per_token"].append(t["bytes_per_token"]["dispatch"]["hierarchical_rdma"]["mean"])
            out[name]["nvlink_bytes_per_token"].append(t["bytes_per_token"]["dispatch"]["hierarchical_nvlink"]["mean"])
    return {"routing": args.traffic, "tokens_per_rank": args.traffic_tokens, "topk": args.topk, "hidden": args.hidden,
            **({"groups": groups, "group_limit": args.group_limit} if args.traffic == "group-limited" else {}),
            **out}


def _print_traffic(traffic: dict, has_previous: bool) -> None:
    names = ["identity"] + (["previous"] if has_previous else []) + ["plan"]
    print(f"traffic ({traffic['routing']} routing drawn from each layer's load, {traffic['tokens_per_rank']} tokens "
          f"per rank, top-{traffic['topk']}, bf16 rows of {traffic['hidden']}): dispatch bytes per token a rank sends")
    print(f"{'layer':>6} " + " ".join(f"{n + ' RDMA':>15} {n + ' NVLink':>15}" for n in names))
    for i in range(len(traffic["plan"]["rdma_bytes_per_token"])):
        print(f"{i + 1:>6} " + " ".join(f"{traffic[n]['rdma_bytes_per_token'][i]:>15,.0f} "
                                       f"{traffic[n]['nvlink_bytes_per_token'][i]:>15,.0f}" for n in names))
    plan, ident = (np.mean(traffic[n]["rdma_bytes_per_token"]) for n in ("plan", "identity"))
    print(f"mean RDMA bytes per token: plan {plan:,.0f}, identity placement {ident:,.0f} "
          f"({plan / ident if ident else float('nan'):.3f}x)")


def _history_per_rank(history_TLE: np.ndarray, placement: Placement, nodes: int = 1) -> np.ndarray:
    """[T, L, W] tokens per rank of each interval under placement (nodes: metrics.rank_loads')."""
    T, L, E = history_TLE.shape
    s2e = placement.slot_to_expert.repeat(T, 1)  # [T * L, S]
    ranks = rank_loads(torch.from_numpy(np.ascontiguousarray(history_TLE).reshape(T * L, E)), s2e,
                       placement.num_ranks, nodes=nodes)
    return ranks.view(T, L, placement.num_ranks).numpy()


def _print_table(summary: dict, has_previous: bool, bytes_per_slot: int | None) -> None:
    before = "previous" if has_previous else "identity"
    print(f"{plural(summary['num_experts'], 'expert')}, {plural(summary['num_slots'], 'slot')}, "
          f"{plural(summary['num_ranks'], 'rank')}, {plural(summary['num_nodes'], 'node')}; "
          f"before = {before} placement")
    head = f"{'layer':>6} {'rank imb before':>16} {'rank imb after':>15} {'slot imb before':>16} " \
           f"{'slot imb after':>15} {'moves':>6}"
    print(head)
    print("-" * len(head))
    keys = ("imbalance_rank_before", "imbalance_rank_after", "imbalance_slot_before", "imbalance_slot_after")
    for i, layer in enumerate(summary["layer_numbers"]):
        vals = " ".join(f"{summary[k][i]:>{w}.4f}" for k, w in zip(keys, (16, 15, 16, 15)))
        print(f"{layer:>6} {vals} {summary['moves'][i]:>6}")
    means = " ".join(f"{np.mean(summary[k]):>{w}.4f}" for k, w in zip(keys, (16, 15, 16, 15)))
    moves = sum(summary["moves"])
    print(f"{'mean':>6} {means} {moves / len(summary['moves']):>6.1f}")
    share = moves / (len(summary["moves"]) * summary["num_slots"])
    line = f"moved: {moves} of {len(summary['moves'])} x {summary['num_slots']} slots ({100 * share:.1f}%)"
    if bytes_per_slot is not None:
        scale, unit = byte_unit(moves * bytes_per_slot)
        line += (f"; {moves * bytes_per_slot / scale:.3g} {unit} at {bytes_per_slot} B per slot (weights, main "
                 "weights and optimizer state of every slot that changes its expert)")
    print(line)


if __name__ == "__main__":
    sys.exit(main())
