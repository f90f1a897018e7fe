#!/usr/bin/env python3
"""The count kernel's predicted time at the bench's points, for this checkout or a commit.

    python scripts/timing_layout.py --emulate 2 8 --tokens 4096 --constants tools/timing/h200.json \\
        --payload-free --out layout.json [--commit c714646] [--emulate-nodes 2]

The count kernel runs on one SM per rank whatever the bench's SMs per rank, so one dispatch
call per world size (driver.py's "dispatch_only" job) gives its time at every point. The rows
are those of `python -m tools.timing predict` with only the count kernel's time
(kernels_ms: {"dispatch": {"count_kernel": ms}}), one per SM count of --sms, so that
`python -m tools.timing validate` scores them against the bench's kernels_ms. With
--commit the commit's kernels run on today's model (tools/timing/builds.py: its tree, today's
device layer). PREDICTED: what the timing model says, not a
measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from unittest import mock

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)


def layout_ms(result: dict) -> float:
    """The count launch's predicted ms of a dispatch_only driver result (the first SM count's)."""
    (launch,) = [x for x in result["runs"][0]["dispatch"]["launches"] if x["kernel"] == "count"]
    return launch["time_ns"] / 1e6


def main(argv=None) -> int:
    from hybrid_ep.metadata import metadata
    from tools.timing import builds, constants, driver, predict, report
    from tools.timing.cli import _checkout_commit

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--emulate", type=int, nargs="+", required=True, metavar="W")
    p.add_argument("--emulate-nodes", type=int, default=1)
    predict.add_shape_arguments(p, tokens=4096)
    p.add_argument("--sms", type=int, nargs="+", default=[1, 2, 4], help="the rows' SMs per rank (one run serves all)")
    p.add_argument("--data-path", choices=("direct", "receive"), default=None,
                   help="the dispatch kernel run after the layout (default: direct on one node, else receive)")
    p.add_argument("--payload-free", action="store_true")
    p.add_argument("--commit", default=None, help="a commit's kernels (default: this checkout's)")
    p.add_argument("--constants", default=constants.H200)
    p.add_argument("--out", required=True, help="the JSON file to write")
    args = p.parse_args(argv)
    nodes = args.emulate_nodes
    path = args.data_path or ("direct" if nodes == 1 else "receive")
    table = constants.load_table(args.constants)
    environ = {"HYBRID_EP_DATA_PATH": path}
    if args.commit is not None:
        folder = builds.build_commit(args.commit)

        def run_job(job):
            return builds.run_in_build(folder, job, environ)
    else:
        def run_job(job):
            with mock.patch.dict(os.environ, environ):
                return driver.run_job(job)
    started = time.monotonic()
    rows = []
    for W in args.emulate:
        shape = predict.Shape.from_args(args, W, nodes)
        job = predict.job(shape, args.tokens, [1], [table.costs()], payload=not args.payload_free)
        job["dispatch_only"] = True
        ms = layout_ms(run_job(job))
        print(f"[timing_layout] W={W}, {nodes} node(s): count kernel {ms:.4f} ms (predicted)", file=sys.stderr,
              flush=True)
        rows += [{"world_size": W, "nodes": nodes, "sms_per_rank": s, "total_sms": W * s, "data_path": path,
                  "kernels_ms": {"dispatch": {"count_kernel": ms}}, "model_tokens": [args.tokens]} for s in args.sms]
    kernels = args.commit or _checkout_commit()
    config = {"world_sizes": args.emulate, "nodes": nodes, "hidden": args.hidden, "tokens_per_rank": args.tokens,
              "topk": args.topk, "experts": args.experts, "dtype": "bf16", "routing": "uniform", "seed": args.seed,
              "sms_per_rank": args.sms, "model_tokens": [args.tokens], "payload_free": args.payload_free,
              "data_path": path, "constants_file": os.path.relpath(args.constants), "device_modelled": table.device,
              "commit": _checkout_commit(), "kernels_commit": kernels}
    units = {k: v for k, v in report.UNITS.items() if k not in ("dispatch_ms", "combine_ms")}
    doc = {"metadata": metadata("scripts/timing_layout.py", device_type="cpu", config=config, units=units),
           "predicted": True, "command": " ".join(["python scripts/timing_layout.py"] + sys.argv[1:]),
           "constants": {n: vars(c) for n, c in table.constants.items()}, "runs": rows,
           "elapsed_s": time.monotonic() - started}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"PREDICTED count kernel ms ({kernels}'s kernels, constants {config['constants_file']}): "
          + ", ".join(f"W={r['world_size']}: {r['kernels_ms']['dispatch']['count_kernel']:.4f}"
                      for r in rows if r["sms_per_rank"] == args.sms[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
