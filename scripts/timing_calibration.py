#!/usr/bin/env python3
"""Calibration of the timing model against the measured GPU points (docs/benchmarks/timing/).

Every measured point belongs to a commit (points.json); this script builds that commit's
kernels against today's device layer on the CPU model (hybrid_ep/timing/builds.py: a scratch
copy under ~/.cache/hybrid-ep/timing-builds) and runs them there.

    python scripts/timing_calibration.py add-run 2026-11-24-h100/bench --commit 3684737 --note "..."
    python scripts/timing_calibration.py build 3684737
    python scripts/timing_calibration.py run 3684737 -w 2 --sms 1 2 4 --tokens 512

`add-run` puts one run's points (its emulated.json under docs/benchmarks/gpu/) into
points.json with the commit it measured; `build` makes the scratch build; `run` prints, per
SM count, the model's scheduling rounds of the second dispatch and combine (the round proxy).
Not part of CI: a build takes about a minute, a run at the bench's shape several.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from hybrid_ep.timing import builds, points  # noqa: E402


def add_run(args) -> int:
    path = os.path.join(REPO, "docs", "benchmarks", "gpu", args.name, "emulated.json")
    with open(path) as f:
        run, new_points = points.points_from_run(json.load(f), args.name, args.commit, args.note)
    runs, old_points = ({}, []) if not os.path.exists(args.points) else points.load_points(args.points)
    runs[run.name] = run
    kept = [p for p in old_points if p.run != run.name] + new_points
    points.write_points(args.points, list(runs.values()), kept)
    print(f"{args.points}: {len(new_points)} points of {run.name} (commit {run.commit})")
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


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    p.add_argument("--work", default=builds.DEFAULT_WORK, help="folder of the scratch builds (default %(default)s)")
    sub = p.add_subparsers(dest="command", required=True)
    a = sub.add_parser("add-run", help="put one GPU run's points into points.json")
    a.add_argument("name", help="the run's folder under docs/benchmarks/gpu/, e.g. 2026-11-24-h100/bench")
    a.add_argument("--commit", required=True, help="the commit whose kernels the run measured")
    a.add_argument("--note", required=True, help="how that commit was established")
    a.add_argument("--points", default=os.path.normpath(points.POINTS_FILE))
    b = sub.add_parser("build", help="build a commit's kernels against today's device layer")
    b.add_argument("commit")
    r = sub.add_parser("run", help="the model's rounds for a commit's kernels at one shape")
    r.add_argument("commit")
    r.add_argument("-w", "--world-size", type=int, default=2)
    r.add_argument("--nodes", type=int, default=1)
    r.add_argument("--sms", type=int, nargs="+", default=[1])
    r.add_argument("--hidden", type=int, default=8192)
    r.add_argument("--tokens", type=int, default=512)
    r.add_argument("--topk", type=int, default=8)
    r.add_argument("--experts", type=int, default=16)
    r.add_argument("--seed", type=int, default=0, help="routing and input seed (the bench's default)")
    args = p.parse_args(argv)
    return {"add-run": add_run, "build": build, "run": run}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
