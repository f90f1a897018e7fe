"""Runs emulated dispatch + combine calls on the CPU model and reports what the model counted.

This file imports nothing of tools.timing, so that the calibration script can run it
inside an older checkout of the project (`python driver.py JOB.json` with that checkout on
PYTHONPATH), whose kernels were built against today's device layer: the measured GPU points
belong to older commits. It uses only what every such checkout has: EmulatedGroup on the
CPU, the bench's synthetic routing and inputs, and hybrid_ep._model.

A job is a dict: world_size, nodes, hidden, tokens, topk, experts, seed, sms (a list), and
costs (the timing model's constants, or None for the functional model alone); "dtype": "fp8"
dispatches float8_e4m3fn rows with their fp32 scales (the bench's --dtype fp8; its combines
take bf16 rows), else bf16. Per SM count
the first dispatch + combine pair warms the buffers (the benchmark times calls after
warm-up); the second is measured: the model's statistics (scheduling rounds, switches,
copies) of each, and with costs the timing report of every launch.

With "dispatch_only": True each SM count makes one dispatch call, measured, and nothing else:
the count kernel's time at a shape without the cost of the combines (the count kernel waits
for nothing the call before it wrote that the model costs: its flow control reads flags
written before its launch).

With "posted_puts": True the puts between nodes are posted (hybrid_ep._model.set_posted_puts):
the timing model prices them as a cluster's NIC does, not as the emulation's copy by a warp's
lanes; the results are the same.

With "payload": False the model runs payload-free (hybrid_ep._model.set_payload): the bulk
copies are timed but move no bytes, the inputs are made without touching their pages
(torch.empty) and each combine takes its dispatch's output rows as expert_out, so the
bench's shape fits this machine's memory. The times are those of a run with payload; the
rows are not (nothing here reads them).
"""

from __future__ import annotations

import json
import resource
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
    fp8 = job.get("dtype", "bf16") == "fp8"
    if not job.get("payload", True):  # rows nobody reads: pages left untouched
        if fp8:
            return idxs, [torch.empty(T, H, dtype=torch.float8_e4m3fn) for _ in range(W)], \
                [torch.empty(T, H // 128, dtype=torch.float32) for _ in range(W)]
        return idxs, [torch.empty(T, H, dtype=torch.bfloat16) for _ in range(W)], None
    gen = torch.Generator().manual_seed(job["seed"])
    x32 = [torch.randn(T, H, generator=gen) for _ in range(W)]
    if fp8:
        from hybrid_ep.fp8 import quantize_fp8

        pairs = [quantize_fp8(x) for x in x32]
        return idxs, [p[0] for p in pairs], [p[1] for p in pairs]
    return idxs, [x.to(torch.bfloat16) for x in x32], None


def _expert_outs(job: dict, results: list):
    """The combine's expert_out per rank for a dispatch's results: random rows, or without
    payload the dispatch's own output rows (no new memory; on the direct path already in the
    arena, so the combine copies nothing in)."""
    import torch

    if not job.get("payload", True):
        if job.get("dtype", "bf16") == "fp8":  # bf16 rows for the combine: new, untouched pages
            return [torch.empty(r.tokens.shape[0], job["hidden"], dtype=torch.bfloat16) for r in results]
        return [r.tokens for r in results]
    gen = torch.Generator().manual_seed(job["seed"] + 1)
    return [torch.randn(r.tokens.shape[0], job["hidden"], generator=gen).to(torch.bfloat16) for r in results]


def _set_payload(ext, moves: bool) -> None:
    if not hasattr(ext, "set_payload"):
        raise RuntimeError("this checkout's hybrid_ep._model has no payload-free mode (set_payload): run the job "
                           "with payload")
    ext.set_payload(moves)


def _set_posted_puts(ext, on: bool) -> None:
    if not hasattr(ext, "set_posted_puts"):
        raise RuntimeError("this checkout's hybrid_ep._model cannot post puts (set_posted_puts): run the job "
                           "without posted_puts")
    ext.set_posted_puts(on)


def _peak_rss_mb() -> float:
    """The process's peak resident memory so far (ru_maxrss: KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _measured(ext, costs, call) -> dict:
    """One call's statistics and wall time, and with costs its launches' timing reports."""
    if costs is not None:
        ext.timing_reports()  # drop what came before
    before, t0 = ext.stats(), time.perf_counter()
    call()
    out = {"stats": _stats_delta(ext, before), "wall_s": time.perf_counter() - t0}
    if costs is not None:
        out["launches"] = ext.timing_reports()
    return out


def run_job(job: dict) -> dict:
    """The job's measured calls: {"runs": [{sms, dispatch: {...}, combine: {...}}]}."""
    import torch

    from hybrid_ep.backends.cuda.emulation import EmulatedGroup

    W, nodes = job["world_size"], job.get("nodes", 1)
    group = EmulatedGroup(W, job["hidden"], job["tokens"], job["experts"], ranks_per_node=W // nodes,
                          device=torch.device("cpu"))
    ext = group.ext
    costs = job.get("costs")
    payload = job.get("payload", True)
    if not payload:
        _set_payload(ext, False)
    posted = job.get("posted_puts", False)
    if posted:
        _set_posted_puts(ext, True)
    if costs is not None:
        ext.set_timing(costs)
    runs = []
    try:
        idxs, xs, scales = _inputs(job)
        for sms in job["sms"]:
            ext.set_seed(job.get("model_seed", 0))
            if job.get("dispatch_only"):
                def call(sms=sms):
                    group.dispatch(xs, idxs, scales=scales, num_sms=sms)
                    group.synchronize()

                runs.append({"sms": sms, "dispatch": _measured(ext, costs, call), "peak_rss_mb": _peak_rss_mb()})
                continue
            first = group.dispatch(xs, idxs, scales=scales, num_sms=sms)
            outs = _expert_outs(job, first)
            group.combine(outs, [r.handle for r in first], num_sms=sms)
            group.synchronize()
            first = None  # its outputs leave the arena to the timed dispatch (direct path)
            if not payload:
                outs = None  # ... and without payload they were those outputs
            run = {"sms": sms}
            for kind in ("dispatch", "combine"):
                if costs is not None:
                    ext.timing_reports()  # drop the warm-up call's reports
                before, t0 = ext.stats(), time.perf_counter()
                if kind == "dispatch":
                    res = group.dispatch(xs, idxs, scales=scales, num_sms=sms)
                    if not payload:
                        outs = _expert_outs(job, res)
                else:
                    group.combine(outs, [r.handle for r in res], num_sms=sms)
                group.synchronize()
                run[kind] = {"stats": _stats_delta(ext, before), "wall_s": time.perf_counter() - t0}
                if costs is not None:
                    run[kind]["launches"] = ext.timing_reports()
            run["peak_rss_mb"] = _peak_rss_mb()
            runs.append(run)
    finally:
        if costs is not None:
            ext.set_timing(None)
        if not payload:
            ext.set_payload(True)
        if posted:
            ext.set_posted_puts(False)
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
