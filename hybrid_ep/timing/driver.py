"""Runs emulated dispatch + combine calls on the CPU model and reports what the model counted.

This file imports nothing of hybrid_ep.timing, so that the calibration script can run it
inside an older checkout of the project (`python driver.py JOB.json` with that checkout on
PYTHONPATH), whose kernels were built against today's device layer: the measured GPU points
belong to older commits. It uses only what every such checkout has: EmulatedGroup on the
CPU, the bench's synthetic routing and inputs, and hybrid_ep._model.

A job is a dict: world_size, nodes, hidden, tokens, topk, experts, seed, sms (a list), and
costs (the timing model's constants, or None for the functional model alone). Per SM count
the first dispatch + combine pair warms the buffers (the benchmark times calls after
warm-up); the second is measured: the model's statistics (scheduling rounds, switches,
copies) of each, and with costs the timing report of every launch.
"""

from __future__ import annotations

import json
import sys
import time

STATS = ("rounds", "switches", "copies", "idle_rounds")


def _stats_delta(ext, before: dict) -> dict:
    after = ext.stats()
    return {k: after[k] - before[k] for k in STATS}


def _inputs(job: dict):
    import torch

    from hybrid_ep.synthetic import iter_rank_routings

    W, T, H = job["world_size"], job["tokens"], job["hidden"]
    idxs = list(iter_rank_routings("uniform", [T] * W, job["experts"], job["topk"], job["seed"]))
    gen = torch.Generator().manual_seed(job["seed"])
    xs = [torch.randn(T, H, generator=gen).to(torch.bfloat16) for _ in range(W)]
    return idxs, xs


def run_job(job: dict) -> dict:
    """The job's measured calls: {"runs": [{sms, dispatch: {...}, combine: {...}}]}."""
    import torch

    from hybrid_ep.backends.cuda.emulation import EmulatedGroup

    W, nodes = job["world_size"], job.get("nodes", 1)
    group = EmulatedGroup(W, job["hidden"], job["tokens"], job["experts"], ranks_per_node=W // nodes,
                          device=torch.device("cpu"))
    ext = group.ext
    costs = job.get("costs")
    if costs is not None:
        ext.set_timing(costs)
    runs = []
    try:
        idxs, xs = _inputs(job)
        for sms in job["sms"]:
            ext.set_seed(job.get("model_seed", 0))
            first = group.dispatch(xs, idxs, num_sms=sms)
            gen = torch.Generator().manual_seed(job["seed"] + 1)
            outs = [torch.randn(r.tokens.shape[0], job["hidden"], generator=gen).to(torch.bfloat16) for r in first]
            group.combine(outs, [r.handle for r in first], num_sms=sms)
            group.synchronize()
            first = None  # its outputs leave the arena to the timed dispatch (direct path)
            run = {"sms": sms}
            for kind in ("dispatch", "combine"):
                if costs is not None:
                    ext.timing_reports()  # drop the warm-up call's reports
                before, t0 = ext.stats(), time.perf_counter()
                if kind == "dispatch":
                    res = group.dispatch(xs, idxs, num_sms=sms)
                else:
                    group.combine(outs, [r.handle for r in res], num_sms=sms)
                group.synchronize()
                run[kind] = {"stats": _stats_delta(ext, before), "wall_s": time.perf_counter() - t0}
                if costs is not None:
                    run[kind]["launches"] = ext.timing_reports()
            runs.append(run)
    finally:
        if costs is not None:
            ext.set_timing(None)
        group.close()
    return {"job": job, "runs": runs}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python driver.py JOB.json (writes the result as JSON to stdout)", file=sys.stderr)
        return 2
    with open(argv[1]) as f:
        job = json.load(f)
    json.dump(run_job(job), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
