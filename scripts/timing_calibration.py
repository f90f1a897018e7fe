#!/usr/bin/env python3
"""Calibration of the timing model against the measured GPU points (tools/timing/).

Every measured point belongs to a commit (points.json); this script builds that commit's
kernels against today's device layer on the CPU model (tools/timing/builds.py: a scratch
copy under ~/.cache/hybrid-ep/timing-builds) and runs them there.

    python scripts/timing_calibration.py add-run 2026-11-24-h100/bench --commit 3684737 --note "..."
    python scripts/timing_calibration.py --constants tools/timing/h200.json from-micro \
        benchmarks/results/2026-11-26-h200/micro.json
    python scripts/timing_calibration.py build 3684737
    python scripts/timing_calibration.py run 3684737 -w 2 --sms 1 2 4 --tokens 512
    python scripts/timing_calibration.py fit --run 2026-11-24-h100/bench -w 2 --write
    python scripts/timing_calibration.py score --run 2026-11-24-h100/bench -w 8 --model-tokens 256 512
    python scripts/timing_calibration.py score --run 2026-11-24-h100/bench -w 2 --tables grid.json --save gw2.json
    python scripts/timing_calibration.py fit-grid gw2.json --names wake_ns pair_instruction_ns --fixed gmem_load_ns
    python scripts/timing_calibration.py profile 3684737 -w 8 --sms 8 --tokens 256 \
        --ncu benchmarks/results/2026-11-24-h100

`add-run` puts one run's points (its emulated.json under benchmarks/results/) into
points.json with the commit it measured and each point's data path (fit and score run the
kernels of that path); `from-micro` makes a device's table (--constants) from another
(--base) with every constant the microbenchmarks measured (tools/timing/micro.py);
`build` makes the scratch build; `run` prints, per SM count, the model's scheduling rounds of
the second dispatch and combine (the round proxy). `fit` fits up to three constants of the
timing table (--constants, default tools/timing/h100.json) to a run's points
of one world size, run on that run's commit, and with --write puts them into the table with
their source; `score` predicts a run's points with the table and prints predicted against
measured per point, the worst ratio last (with --tables, for each of several variants of the
table in one model run; --save keeps them); `fit-grid` fits on such a saved grid, on the
per-point lines through it (several grids of the same tables, one per data path, as one),
and `score-grid` reads other points off their lines; `profile`
prints what the warps spend their predicted time on, per kernel, and with --ncu beside the
stall samples of that run's ncu stage (tools/timing/shares.py), the difference in points
per category (--save / --load keep a run's reports and read them again, say with the other
--count). Not part of CI: a build takes minutes, a fit at
W = 2 about ten, a score at W = 8 tens of minutes on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from tools.timing import builds, constants, fit, micro, points, predict, shares  # noqa: E402


def add_run(args) -> int:
    path = os.path.join(REPO, "benchmarks", "results", args.name, "emulated.json")
    with open(path) as f:
        run, new_points = points.points_from_run(json.load(f), args.name, args.commit, args.note)
    runs, old_points = ({}, []) if not os.path.exists(args.points) else points.load_points(args.points)
    runs[run.name] = run
    kept = [p for p in old_points if p.run != run.name] + new_points
    points.write_points(args.points, list(runs.values()), kept)
    print(f"{args.points}: {len(new_points)} points of {run.name} (commit {run.commit})")
    return 0


def from_micro(args) -> int:
    """from-micro: the table at --constants made from --base with every constant the
    microbenchmarks' micro.json determines replaced (tools/timing/micro.py)."""
    base = constants.load_table(args.base)
    table = micro.with_measured(base, args.micro, os.path.relpath(os.path.abspath(args.micro), REPO))
    changed = [n for n in table.constants if table.constants[n] != base.constants[n]]
    constants.save_table(table, args.constants)
    for n in changed:
        print(f"{n}: {base.constants[n].value:g} -> {table.constants[n].value:g}")
    print(f"{len(changed)} constants from {args.micro}, written to {args.constants}")
    return 0


def build(args) -> int:
    print(builds.build_commit(args.commit, args.work))
    return 0


def run(args) -> int:
    folder = builds.build_commit(args.commit, args.work)
    job = {"world_size": args.world_size, "nodes": args.nodes, "hidden": args.hidden, "tokens": args.tokens,
           "topk": args.topk, "experts": args.experts, "seed": args.seed, "sms": args.sms, "costs": None}
    result = builds.run_in_build(folder, job)
    print(f"commit {args.commit}: W={args.world_size} nodes={args.nodes} H={args.hidden} T={args.tokens} "
          f"K={args.topk} E={args.experts} (second call, model seed 0)")
    print(f"{'SMs/rank':>8} {'dispatch rounds':>16} {'combine rounds':>15} {'wall s':>8}")
    for r in result["runs"]:
        wall = r["dispatch"]["wall_s"] + r["combine"]["wall_s"]
        print(f"{r['sms']:>8} {r['dispatch']['stats']['rounds']:>16} {r['combine']['stats']['rounds']:>15} "
              f"{wall:>8.1f}")
    return 0


def _selected(args) -> tuple:
    """(run, shape, SM counts, {(sms, kernel): measured ms}, data path) of the run's points at
    -w / --nodes."""
    runs, pts = points.load_points()
    if args.run not in runs:
        raise SystemExit(f"no run {args.run!r} in points.json: {', '.join(runs)}")
    run = runs[args.run]
    chosen = [p for p in pts if p.run == args.run and p.world_size == args.world_size and p.nodes == args.nodes
              and (args.sms is None or p.sms_per_rank in args.sms)]
    if not chosen:
        raise SystemExit(f"{args.run} has no points at W={args.world_size} on {args.nodes} node(s)"
                         + ("" if args.sms is None else f" and SMs per rank {args.sms}"))
    shape = predict.Shape(args.world_size, args.nodes, run.hidden, run.tokens_per_rank, run.topk, run.experts,
                          run.seed)
    sms = sorted({p.sms_per_rank for p in chosen})
    paths = {p.data_path for p in chosen}
    if len(paths) != 1:
        raise SystemExit(f"{args.run} ran W={args.world_size} on more than one data path: {sorted(paths)}")
    return run, shape, sms, {(p.sms_per_rank, p.kernel): p.ms for p in chosen}, paths.pop()


def _evaluator(args, run, shape, sms, table, data_path):
    folder = builds.build_commit(run.commit, args.work)
    environ = {"HYBRID_EP_DATA_PATH": data_path}

    def evaluate(trials: list[dict]) -> list[dict]:
        tables = [table.with_values(**t).costs() for t in trials]
        ns = predict.predict(lambda job: builds.run_in_build(folder, job, environ), shape, sms, tables,
                             tuple(args.model_tokens), concurrent=True, payload=not args.payload_free)
        return [{key: v[i] / 1e6 for key, v in ns.items()} for i in range(len(tables))]

    return evaluate


def _print_points(title: str, predicted: dict, measured: dict) -> None:
    print(title)
    print(f"{'SMs/rank':>8} {'kernel':>9} {'predicted ms':>13} {'measured ms':>12} {'ratio':>6}")
    ratios = {}
    for key in sorted(measured):
        ratios[key] = predicted[key] / measured[key]
        print(f"{key[0]:>8} {key[1]:>9} {predicted[key]:>13.3f} {measured[key]:>12.3f} {ratios[key]:>6.2f}")
    worst = max(ratios, key=lambda k: max(ratios[k], 1 / ratios[k]))
    print(f"worst: {worst[1]} at {worst[0]} SMs/rank, predicted / measured {ratios[worst]:.2f}")


def fit_constants(args) -> int:
    run, shape, sms, measured, path = _selected(args)
    table = constants.load_table(args.constants)
    evaluate = _evaluator(args, run, shape, sms, table, path)
    start = dict(zip(args.names, args.start)) if args.start else {n: table.constants[n].value for n in args.names}
    result = fit.fit(evaluate, tuple(args.names), start, measured, tuple(args.spans))
    for span, centre, best, surrogate in result.steps:
        print(f"span {span}: grid centre " + ", ".join(f"{n} {v:.4g}" for n, v in centre.items()) +
              f", best on the grid {best:.4f}, surrogate's minimum {surrogate:.4f}")
    fitted = ", ".join(f"{n} = {v:.4g}" for n, v in result.values.items())
    _print_points(f"fit: {fitted}; RMS log ratio {result.score:.4f} (predicted, model at T = "
                  f"{'/'.join(map(str, args.model_tokens))} per rank)", result.predicted_ms, measured)
    if args.write:
        source = (f"fit with {' and '.join(args.names)} to the {len(measured)} points of {run.name} at "
                  f"W={shape.world_size}, {shape.nodes} node(s) (commit {run.commit}, model at "
                  f"T={'/'.join(map(str, args.model_tokens))}), {points.today()}: RMS log ratio {result.score:.3f}")
        constants.save_table(constants.with_sources(table, {n: float(f"{v:.4g}") for n, v in result.values.items()},
                                                    source), args.constants)
        print(f"written to {args.constants}")
    return 0


def score_points(args) -> int:
    run, shape, sms, measured, path = _selected(args)
    if args.tables:
        return _score_tables(args, run, shape, sms, measured, path)
    predicted = _evaluator(args, run, shape, sms, constants.load_table(args.constants), path)([{}])[0]
    _print_points(f"{run.name} (commit {run.commit}, {path} path, table {os.path.basename(args.constants)}), "
                  f"W={shape.world_size} on {shape.nodes} node(s): predicted "
                  f"(model at T = {'/'.join(map(str, args.model_tokens))} per rank) against measured",
                  predicted, measured)
    return 0


def _score_tables(args, run, shape, sms, measured, path) -> int:
    """score --tables: one model run for several variants of the table (each a JSON object of
    values replacing the table's), the predictions of each printed and, with --save, kept."""
    with open(args.tables) as f:
        trials = json.load(f)
    predicted = _evaluator(args, run, shape, sms, constants.load_table(args.constants), path)(trials)
    for trial, pred in zip(trials, predicted):
        _print_points(f"{run.name} (commit {run.commit}), W={shape.world_size} on {shape.nodes} node(s), table with "
                      f"{json.dumps(trial)} (model at T = {'/'.join(map(str, args.model_tokens))} per rank)",
                      pred, measured)
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"run": run.name, "commit": run.commit, "world_size": shape.world_size, "nodes": shape.nodes,
                       "data_path": path, "constants_file": os.path.relpath(args.constants, REPO),
                       "model_tokens": args.model_tokens, "tables": trials,
                       "predicted_ms": [{f"{k[0]} {k[1]}": v for k, v in p.items()} for p in predicted],
                       "measured_ms": {f"{k[0]} {k[1]}": v for k, v in measured.items()}}, f, indent=1)
    return 0


def _saved_grid(path: str, names: tuple[str, ...]) -> tuple[dict, list, list, dict]:
    """A score --tables --save file: (file, the tables that set exactly `names`, their predicted
    ms by (sms, kernel), measured ms by (sms, kernel))."""
    with open(path) as f:
        saved = json.load(f)

    def keyed(d):
        return {(int(k.split()[0]), k.split()[1]): v for k, v in d.items()}

    rows = [(t, keyed(p)) for t, p in zip(saved["tables"], saved["predicted_ms"]) if set(t) == set(names)]
    if len(rows) < len(names) + 1:
        raise SystemExit(f"{path}: {len(rows)} tables set exactly {', '.join(names)}; a line needs {len(names) + 1}")
    return saved, [t for t, _ in rows], [p for _, p in rows], keyed(saved["measured_ms"])


def _saved_grids(paths: list[str], names: tuple[str, ...], sms: list[int] | None = None) -> tuple:
    """Several grids of the same tables (say one per data path) as one: (what they hold, in words;
    the first file; the tables; predicted ms per table; measured ms), only the points at `sms`
    SMs per rank when given. With more than one file a point's key is
    ("<data path or run>:<sms>", kernel)."""
    loaded = []
    for p in paths:
        saved, grid, res, meas = _saved_grid(p, names)
        if sms:
            meas = {k: v for k, v in meas.items() if k[0] in sms}
            if not meas:
                raise SystemExit(f"{p}: no point at {sms} SMs per rank")
            res = [{k: r[k] for k in meas} for r in res]
        loaded.append((saved, grid, res, meas))
    grid = loaded[0][1]
    for p, (_, other, _, _) in zip(paths, loaded):
        if other != grid:
            raise SystemExit(f"{p}: its tables differ from those of {paths[0]}; the grids must be run alike")
    if len(loaded) == 1:
        saved = loaded[0][0]
        return (f"the {len(loaded[0][3])} points of {saved['run']} at W={saved['world_size']}, {saved['nodes']} "
                f"node(s){_at_sms(sms)} (commit {saved['commit']}"), saved, grid, loaded[0][2], loaded[0][3]
    results, measured, parts = [{} for _ in grid], {}, []
    for saved, _, res, meas in loaded:
        label = saved.get("data_path") or saved["run"]
        for r, one in zip(results, res):
            r.update({(f"{label}:{k[0]}", k[1]): v for k, v in one.items()})
        measured.update({(f"{label}:{k[0]}", k[1]): v for k, v in meas.items()})
        parts.append(f"{saved['run']} ({label} path)")
    saved = loaded[0][0]
    commits = sorted({s['commit'] for s, _, _, _ in loaded})
    return (f"the {len(measured)} points of {' and '.join(parts)} at W={saved['world_size']}, {saved['nodes']} "
            f"node(s){_at_sms(sms)} (commit {', '.join(commits)}"), saved, grid, results, measured


def _at_sms(sms: list[int] | None) -> str:
    return f", {'/'.join(map(str, sms))} SMs per rank" if sms else ""


def fit_grid(args) -> int:
    """fit-grid: the fit's first round on grids already run (score --tables --save): the values
    that minimise the score on the per-point lines through the grids, without a run at them."""
    names = tuple(args.names)
    if not 1 <= len(names) <= fit.MAX_FITTED:
        raise SystemExit(f"fit 1 to {fit.MAX_FITTED} constants, got {len(names)}")
    what, saved, grid, results, measured = _saved_grids(args.grid, names + tuple(args.fixed), args.sms)
    table = constants.load_table(args.constants)
    fixed = {n: table.constants[n].value for n in args.fixed}
    names_all = names + tuple(args.fixed)
    values, score = fit.surrogate_minimum(grid, results, measured, names_all, args.box, fixed)
    coef, worst = fit.linear_surrogate(grid, results, names_all, measured)
    for n in args.fixed:
        del values[n]
    fitted = ", ".join(f"{n} = {v:.4g}" for n, v in values.items())
    if fixed:
        fitted += " (" + ", ".join(f"{n} {v:.4g} from the table" for n, v in fixed.items()) + ")"
    tokens = "/".join(map(str, saved["model_tokens"]))
    _print_points(f"fit on the grid of {' '.join(args.grid)}: {fitted}; RMS log ratio {score:.4f} on the lines "
                  f"through {len(grid)} tables (largest residual of a line on the grid {worst:.1%}; predicted, model "
                  f"at T = {tokens} per rank)", fit.surrogate_at(coef, names_all, {**values, **fixed}), measured)
    if args.write:
        source = (f"fit with {' and '.join(names)} to {what}, model at T={tokens}, on the lines through a grid of "
                  f"{len(grid)} tables, largest residual {worst:.1%}), {points.today()}: RMS log ratio {score:.3f}")
        constants.save_table(constants.with_sources(table, {n: float(f"{v:.4g}") for n, v in values.items()},
                                                    source), args.constants)
        print(f"written to {args.constants}")
    return 0


def score_grid(args) -> int:
    """score-grid: saved grids' points at the table's values of their constants, on the lines
    through the grid (held-out points scored without a run at the fitted values)."""
    names = tuple(args.names)
    what, saved, grid, results, measured = _saved_grids(args.grid, names, args.sms)
    table = constants.load_table(args.constants)
    values = {n: table.constants[n].value for n in names}
    coef, worst = fit.linear_surrogate(grid, results, names, measured)
    _print_points(f"{what}): predicted at " + ", ".join(f"{n} {v:.4g}" for n, v in values.items()) +
                  f" on the lines through {len(grid)} tables (largest residual {worst:.1%}; model at T = "
                  f"{'/'.join(map(str, saved['model_tokens']))} per rank) against measured",
                  fit.surrogate_at(coef, names, values), measured)
    return 0


def profile(args) -> int:
    if args.posted_puts and (args.load or args.nodes < 2):
        print("timing_calibration.py profile: --posted-puts prices the puts between nodes of a model run: it needs "
              "--nodes > 1 and no --load", file=sys.stderr)
        return 2
    if args.load:
        with open(args.load) as f:
            result = json.load(f)
    else:
        folder = builds.build_commit(args.commit, args.work)
        table = constants.load_table(args.constants)
        shape = predict.Shape.from_args(args, args.world_size, args.nodes)
        result = builds.run_in_build(folder, predict.job(shape, args.tokens, [args.sms], [table.costs()],
                                                         payload=not args.payload_free,
                                                         posted_puts=args.posted_puts))
        if args.save:
            with open(args.save, "w") as f:
                json.dump(result, f)
    run = result["runs"][0]
    job = result["job"]
    print(f"commit {args.commit}: W={job['world_size']} nodes={job['nodes']} T={job['tokens']} H={job['hidden']}, "
          f"{run['sms']} SMs/rank: shares of the warps' time (predicted), a warp counted by its {args.count}")
    worst = 0.0
    for kernel in predict.KERNELS:
        launches = run[kernel]["launches"]
        for launch in launches:
            name = launch["kernel"].split("<")[0]
            model = shares.model_shares(launch, args.count)
            print(f"{name} ({launch['time_ns'] / 1e6:.3f} ms): " +
                  ", ".join(f"{k} {v:.1%}" for k, v in sorted(model.items(), key=lambda kv: -kv[1])))
            # ncu profiled each call's main kernel (dispatch_kernel after the layout, combine_kernel)
            path = os.path.join(args.ncu, f"ncu_lines_{kernel}_kernel.txt") if args.ncu else None
            if launch is launches[-1] and path and os.path.exists(path):
                with open(path) as f:
                    lines = shares.read_ncu_lines(f.read())
                rows = shares.compare(model, shares.ncu_shares(
                    lines, lambda base: shares.git_source(REPO, args.commit, base)))
                print(shares.format_comparison(f"{name} against {os.path.basename(path)}", rows))
                worst = max([worst] + [abs(m - n) for _, m, n in rows])
    if args.ncu:
        print(f"worst difference: {100 * worst:.1f} points")
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--work", default=builds.DEFAULT_WORK, help="folder of the scratch builds (default %(default)s)")
    p.add_argument("--constants", default=constants.H100, help="the timing table read and, by --write, written "
                   "(default tools/timing/h100.json; tools/timing/h200.json for the H200's points)")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("add-run", help="put one GPU run's points into points.json")
    a.add_argument("name", help="the run's folder under benchmarks/results/, e.g. 2026-11-24-h100/bench")
    a.add_argument("--commit", required=True, help="the commit whose kernels the run measured")
    a.add_argument("--note", required=True, help="how that commit was established")
    a.add_argument("--points", default=os.path.normpath(points.POINTS_FILE))
    m = sub.add_parser("from-micro", help="a table with the constants the microbenchmarks measured, at --constants")
    m.add_argument("micro", help="a GPU run's micro.json (hybrid_ep_microbench all)")
    m.add_argument("--base", default=constants.H100, help="the table the other constants come from (default h100.json)")
    b = sub.add_parser("build", help="build a commit's kernels against today's device layer")
    b.add_argument("commit")
    r = sub.add_parser("run", help="the model's rounds for a commit's kernels at one shape")
    r.add_argument("commit")
    r.add_argument("-w", "--world-size", type=int, default=2)
    r.add_argument("--nodes", type=int, default=1)
    r.add_argument("--sms", type=int, nargs="+", default=[1])
    predict.add_shape_arguments(r, tokens=512)
    for name, what in (("fit", "fit up to three constants of the timing table to a run's points"),
                       ("score", "predicted against measured for a run's points")):
        f = sub.add_parser(name, help=what)
        f.add_argument("--run", default="2026-11-24-h100/bench", help="a run of points.json (default %(default)s)")
        f.add_argument("-w", "--world-size", type=int, default=2)
        f.add_argument("--nodes", type=int, default=1)
        f.add_argument("--model-tokens", type=int, nargs="+", default=[512, 1024],
                       help="one or two tokens per rank the model runs at (default 512 1024)")
        f.add_argument("--payload-free", action="store_true",
                       help="the model's bulk copies move no bytes (the same times in far less memory: the run's own "
                            "4096 tokens per rank fit)")
        f.add_argument("--sms", type=int, nargs="+", default=None,
                       help="only the points at these SMs per rank (default all of the run's)")
        if name == "score":
            f.add_argument("--tables", default=None, help="a JSON list of {constant: value} objects: the table "
                           "with each one's values, all in one model run")
            f.add_argument("--save", default=None, help="with --tables: the predictions as JSON")
        if name == "fit":
            f.add_argument("--names", nargs="+", default=["engine_store_bytes_per_ns", "pair_instruction_ns"],
                           help="the constants to fit, at most 3 (default %(default)s)")
            f.add_argument("--start", nargs="+", type=float, default=None,
                           help="their starting values (default: the table's; a 0 cannot start a log search)")
            f.add_argument("--spans", nargs="+", type=float, default=[3.0, 1.5],
                           help="factor between a grid's values, per round (default 3 1.5)")
            f.add_argument("--write", action="store_true", help="put the fitted values into the table")
    for name, what in (("fit-grid", "a fit's first round on a grid run by score --tables --save"),
                       ("score-grid", "a saved grid's points at the table's values, on the lines through it")):
        g = sub.add_parser(name, help=what)
        g.add_argument("grid", nargs="+", help="the JSON of score --tables ... --save; several files of the same "
                       "tables (one per data path, say) are fitted or read as one")
        g.add_argument("--names", nargs="+", required=True, help="the constants the grid varies")
        g.add_argument("--sms", type=int, nargs="+", default=None,
                       help="only the points at these SMs per rank (default all the grids hold)")
        if name == "fit-grid":
            g.add_argument("--box", type=float, default=4.0, help="search within this factor of the grid's centre")
            g.add_argument("--fixed", nargs="+", default=[], help="constants the grid varies that are not fitted: "
                           "at the table's values")
            g.add_argument("--write", action="store_true", help="put the fitted values into the table")
    pr = sub.add_parser("profile", help="shares of the warps' time by what they wait for, per kernel")
    pr.add_argument("commit")
    pr.add_argument("-w", "--world-size", type=int, default=8)
    pr.add_argument("--nodes", type=int, default=1)
    pr.add_argument("--sms", type=int, default=8)
    predict.add_shape_arguments(pr, tokens=256)
    pr.add_argument("--ncu", default=None, metavar="FOLDER",
                    help="a GPU run's folder with ncu_lines_<kernel>.txt (scripts/ncu_lines.py): the shares beside "
                         "ncu's, measured at the commit given, with the difference in points")
    pr.add_argument("--count", choices=(shares.SAMPLED, shares.BUSIEST), default=shares.SAMPLED,
                    help="how a warp counts: its paths alike, as ncu's warp sampling sees a diverged warp "
                         "(default), or its busiest lane alone (tools/timing/shares.py)")
    pr.add_argument("--payload-free", action="store_true",
                    help="the model's bulk copies move no bytes (the same times in far less memory)")
    pr.add_argument("--posted-puts", action="store_true",
                    help="with --nodes > 1: the puts between nodes priced as a cluster's NIC does (the table's nic_* "
                         "constants), not as the emulation's copy by a warp's lanes")
    pr.add_argument("--save", default=None, metavar="JSON", help="keep the model run's reports")
    pr.add_argument("--load", default=None, metavar="JSON",
                    help="the reports of an earlier run (--save) instead of a model run; the shape is the run's")
    args = p.parse_args(argv)
    return {"add-run": add_run, "from-micro": from_micro, "build": build, "run": run, "fit": fit_constants,
            "score": score_points, "profile": profile, "fit-grid": fit_grid,
            "score-grid": score_grid}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
