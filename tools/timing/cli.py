"""`python -m tools.timing`: predicted kernel times, and predictions against a measured run.

    python -m tools.timing predict --emulate 2 8 --hidden 8192 --tokens 4096 --topk 8 \\
        --experts 16 --sms 1 2 4 [--data-path receive] --out results/predicted
    python -m tools.timing validate results/predicted/predicted.json \\
        benchmarks/results/2026-11-24-h100/bench/emulated.json

`predict` runs this checkout's kernels on the CPU model with the timing table (default
tools/timing/h100.json) at the points hybrid-ep-bench --emulate measures on a GPU (bf16,
uniform routing, its seed), and prints and writes (predicted.json) the predicted dispatch and
combine ms of each, labelled as predictions. The model runs at one or two smaller token
counts per rank (--model-tokens; the bench's 4096 does not fit this machine at W=8) and the
prediction is read off the line through them (--model-tokens 4096: the run itself; with
--payload-free the model's bulk copies move no bytes, the same times in far less memory, so
the bench's own count fits at W = 8; --count-run times the count kernel by one dispatch call at
the bench's count instead, as the line misses its 992-token tiles; --posted-puts prices the puts between nodes as a
cluster's NIC does, the nic_* constants, where the emulated bench copies them with a warp's
lanes: a cluster's prediction, which no emulated run scores). --data-path picks the kernels as
HYBRID_EP_DATA_PATH does for the bench; HYBRID_EP_STORE_GROUPS is honoured as by the bench.
--commit runs that commit's kernels instead, built with today's device layer and its plain code
named where the commit did not name it (tools/timing/builds.py), as a measured run of them is
scored.
`validate` prints predicted / measured per point of a measured emulated.json (points of the
same data path; a measured point naming none ran the receive path), the worst last. Exit
status 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from unittest import mock

from hybrid_ep.cli_parser import ArgumentParser
from hybrid_ep.paths import output_problem

PROG = "python -m tools.timing"


def _predict(args) -> int:
    from hybrid_ep.backends.cuda import launch
    from hybrid_ep.metadata import metadata

    from . import constants, readings, report

    problem = output_problem(args.out, folder=True)
    if problem:
        print(f"{PROG} predict: --out: {problem}", file=sys.stderr)
        return 2
    from hybrid_ep.backends.cuda.layout import MAX_LAUNCH_RANKS

    worlds, nodes = args.emulate, args.emulate_nodes
    if any(w < 1 or w > MAX_LAUNCH_RANKS or w % nodes for w in worlds):
        print(f"{PROG} predict: --emulate: world sizes in [1, {MAX_LAUNCH_RANKS}] (the ranks one emulated launch "
              f"holds) that --emulate-nodes {nodes} divides, got {worlds}", file=sys.stderr)
        return 2
    experts = args.experts or 2 * max(worlds)
    if any(experts % w for w in worlds) or not 1 <= args.topk <= experts:
        print(f"{PROG} predict: --experts {experts} must be a multiple of every world size and >= --topk "
              f"{args.topk} >= 1", file=sys.stderr)
        return 2
    if args.posted_puts and nodes == 1:
        print(f"{PROG} predict: --posted-puts prices the puts between nodes: it needs --emulate-nodes > 1",
              file=sys.stderr)
        return 2
    path = args.data_path or launch.data_path(True, environ={})
    table = constants.load_table(args.constants)
    import hybrid_ep._model as model

    constants.check_against_model(table, model)
    started = time.monotonic()
    # the driver's emulated group reads the variable (it runs older commits' kernels too)
    tables = {"table": table} | {name: table.with_values(**values)
                                 for name, values in (readings.READINGS.items() if args.readings else ())}
    run_job, commit, annotations = None, _checkout_commit(), None
    if args.commit:
        from . import builds

        try:
            folder = builds.build_commit(args.commit)
        except (ValueError, RuntimeError) as err:
            print(f"{PROG} predict: --commit: {err}", file=sys.stderr)
            return 2
        annotations = builds.annotations_of(folder)
        commit = builds.resolve_commit(args.commit)[:7]
        run_job = lambda job: builds.run_in_build(folder, job)  # noqa: E731
    with mock.patch.dict(os.environ, {launch.DATA_PATH_ENV: path}):
        rows = _predicted_rows(args, tables, path, nodes, worlds, experts, run_job)
    config = {"world_sizes": worlds, "nodes": nodes, "hidden": args.hidden, "tokens_per_rank": args.tokens,
              "topk": args.topk, "experts": experts, "dtype": args.dtype, "routing": "uniform", "seed": args.seed,
              "sms_per_rank": args.sms, "model_tokens": args.model_tokens or "256/512 for W > 4, else 512/1024",
              "payload_free": args.payload_free, "posted_puts": args.posted_puts, "data_path": path,
              "count_run": args.count_run,
              "store_groups": launch.store_groups_override(),
              "direct_combine_stages": launch.direct_combine_stages_override(),
              "reducer_wait": launch.reducer_wait_override(), "reducer_warps": launch.reducer_warps_override(),
              "combine_stage": launch.combine_stage_override(), "store_runs": launch.store_runs_override(),
              "readings": {name: readings.READINGS[name] for name in tables if name != "table"},
              "constants_file": os.path.relpath(args.constants), "device_modelled": table.device,
              "commit": commit}
    if args.commit:  # the kernels of another commit than the checkout's (builds.py), on its model
        config["kernels_built_from"] = commit
        config["annotations"] = annotations
        config["model_commit"] = _checkout_commit()
    doc = {"metadata": metadata(f"{PROG} predict", device_type="cpu", config=config, units=report.units()),
           "predicted": True, "command": " ".join([PROG] + sys.argv[1:]),
           "constants": {n: vars(c) for n, c in table.constants.items()},
           "runs": rows, "elapsed_s": time.monotonic() - started, **_usage()}
    os.makedirs(args.out, exist_ok=True)
    out_path = os.path.join(args.out, "predicted.json")
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
    print(report.format_predicted(doc))
    print(f"\npredictions: {out_path}")
    return 0


def _usage() -> dict:
    """This process's CPU seconds and peak resident memory (MB), for the record of a run."""
    import resource

    u = resource.getrusage(resource.RUSAGE_SELF)
    return {"cpu_s": u.ru_utime + u.ru_stime, "peak_rss_mb": u.ru_maxrss / 1024}


def _checkout_commit() -> str | None:
    """The commit of the checkout whose kernels ran (a prediction is scored against a GPU run of
    the same kernels); None outside a git checkout. Uncommitted changes are not seen."""
    import subprocess

    here = os.path.dirname(os.path.abspath(__file__))
    try:
        done = subprocess.run(["git", "-C", here, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


def _row_bytes(hidden: int, dtype: str) -> int:
    """A dispatched row's bytes, as the bench counts them: bf16, or fp8 with its fp32 scales."""
    return 2 * hidden if dtype == "bf16" else hidden + hidden // 128 * 4


def _predicted_rows(args, tables: dict, path: str, nodes: int, worlds: list[int], experts: int,
                    run_job=None) -> list[dict]:
    """One row per world size and SMs per rank: the model's runs at the smaller token counts,
    read off at the bench's, with the first of `tables` ({name: Table}); each other table's
    prediction of the same runs goes into the row's "readings". run_job(job) runs the model
    (default: this checkout's, driver.run_job)."""
    from hybrid_ep.config import BufferConfig
    from hybrid_ep.synthetic import iter_rank_routings
    from hybrid_ep.traffic.model import count_tables, row_counts

    from . import driver, predict, report

    rows = []
    for W in worlds:
        model_tokens = tuple(args.model_tokens or ((256, 512) if W > 4 else (512, 1024)))
        shape = predict.Shape.from_args(args, W, nodes, experts)
        costs = [t.costs() for t in tables.values()]
        ns = predict.predict(run_job or driver.run_job, shape, args.sms, costs, model_tokens,
                             payload=not args.payload_free, posted_puts=args.posted_puts)
        if args.count_run:
            ns = predict.with_count(ns, predict.count_run(run_job or driver.run_job, shape, costs,
                                                          payload=not args.payload_free))
        idxs = list(iter_rank_routings("uniform", [args.tokens] * W, experts, args.topk, args.seed))
        cfg = BufferConfig(hidden_dim=args.hidden, max_tokens_per_rank=args.tokens, num_experts=experts,
                           world_size=W, ranks_per_node=W // nodes)
        count_WW, node_counts_WN = count_tables(idxs, cfg)
        recv = int(count_WW.sum())
        rdma = int(row_counts(count_WW, node_counts_WN, W // nodes).combine_rdma.sum()) if nodes > 1 else None
        out_rows = int(sum(int((i >= 0).sum()) for i in idxs))
        for sms in args.sms:
            def row_of(i: int, sms=sms) -> dict:
                row = report.predicted_row(W, nodes, sms, ns[(sms, "dispatch")][i] / 1e6,
                                           ns[(sms, "combine")][i] / 1e6, recv, out_rows,
                                           _row_bytes(args.hidden, args.dtype), 2 * args.hidden, rdma, path=path,
                                           store_bytes_per_ns=costs[i]["engine_store_bytes_per_ns"])
                row["kernels_ms"] = report.kernels_ms(ns, sms, table=i)
                return row

            row = row_of(0)
            if len(tables) > 1:
                row["readings"] = {name: row_of(i) for i, name in enumerate(tables) if i > 0}
            row["model_tokens"] = list(model_tokens)
            if args.count_run:
                row["count_tokens"] = args.tokens
            row["data_path"] = path
            rows.append(row)
            print(f"[{PROG} predict] W={W}, SMs/rank {sms}: dispatch {row['dispatch_ms']:.3f} ms, combine "
                  f"{row['combine_ms']:.3f} ms (predicted, {path} path)", file=sys.stderr, flush=True)
    return rows


def _validate(args) -> int:
    from . import report

    docs = []
    for path in (args.predicted, args.measured):
        try:
            with open(path) as f:
                docs.append(json.load(f))
        except (OSError, ValueError) as err:
            print(f"{PROG} validate: cannot read {path}: {err}", file=sys.stderr)
            return 2
    if not docs[0].get("predicted"):
        print(f"{PROG} validate: {args.predicted} is not a file of predictions ({PROG} predict)", file=sys.stderr)
        return 2
    if docs[0]["metadata"]["config"].get("posted_puts"):
        print(f"{PROG} validate: {args.predicted} predicts a cluster (--posted-puts): an emulated run copies its puts "
              "with a warp's lanes and does not score it", file=sys.stderr)
        return 2
    if docs[1].get("predicted"):
        print(f"{PROG} validate: {args.measured} holds predictions, not measurements", file=sys.stderr)
        return 2
    differ = report.shape_differences(docs[0], docs[1])
    if differ:
        print(f"{PROG} validate: the two runs are of other shapes: " + "; ".join(differ), file=sys.stderr)
        return 2
    rows = report.compare(docs[0], docs[1])
    if not rows:
        print(f"{PROG} validate: no point of {args.predicted} is in {args.measured}", file=sys.stderr)
        return 2
    print(report.format_comparison(rows, args.predicted, args.measured))
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import constants, predict

    p = ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                       allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    pr = sub.add_parser("predict", help="predicted dispatch and combine ms at the bench's emulated points")
    pr.add_argument("--emulate", type=int, nargs="+", required=True, metavar="W", help="world sizes")
    pr.add_argument("--emulate-nodes", type=int, default=1, help="nodes the ranks form (default 1)")
    predict.add_shape_arguments(pr, tokens=4096, experts=None, experts_help="default 2 x the largest world size")
    pr.add_argument("--sms", type=int, nargs="+", default=[1, 2, 4], help="SMs per rank (default 1 2 4)")
    pr.add_argument("--model-tokens", type=int, nargs="+", default=None,
                    help="one or two tokens per rank the model runs at (default 512 1024, at W > 4 256 512)")
    pr.add_argument("--payload-free", action="store_true",
                    help="the model's bulk copies move no bytes (the same predicted times; the bench's 4096 tokens "
                         "per rank fit this machine)")
    pr.add_argument("--posted-puts", action="store_true",
                    help="price the puts between nodes as a cluster's NIC does (the table's nic_* constants), not as "
                         "the emulation's copy by a warp's lanes: a cluster's prediction")
    pr.add_argument("--count-run", action="store_true",
                    help="the count kernel's time from one dispatch call at --tokens (with --payload-free, none of "
                         "its bytes), not from the line through --model-tokens: its 992-token tiles")
    pr.add_argument("--dtype", choices=("bf16", "fp8"), default="bf16",
                    help="the dispatched rows' dtype (fp8: with fp32 scales per 128 columns; combines in bf16)")
    pr.add_argument("--data-path", choices=("direct", "receive"), default=None,
                    help="the kernels' data path (default: the bench's, direct)")
    pr.add_argument("--constants", default=constants.H100, help="the timing table (default h100.json)")
    pr.add_argument("--commit", default=None,
                    help="predict this commit's kernels (built with today's device layer, tools/timing/builds.py), "
                         "not the checkout's")
    pr.add_argument("--readings", action="store_true",
                    help="also predict under each reading of the store cost (tools/timing/readings.py), from the "
                         "same runs of the model")
    pr.add_argument("--out", required=True, help="folder for predicted.json")
    va = sub.add_parser("validate", help="predicted / measured per point, the worst last")
    va.add_argument("predicted", help="predicted.json of the predict command")
    va.add_argument("measured", help="emulated.json of hybrid-ep-bench --emulate on a GPU")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "predict":
        if args.model_tokens is not None and not 1 <= len(args.model_tokens) <= 2:
            parser.error("--model-tokens takes one or two token counts")
        return _predict(args)
    return _validate(args)
