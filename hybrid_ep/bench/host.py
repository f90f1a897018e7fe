"""`python -m hybrid_ep.bench.host`: host time per dispatch + combine pair, without a GPU.

Times the cuda backend's host path (argument checks, allocations, the launch arguments the
extension fills, the handles) of an EmulatedGroup on the CPU model of the kernels, with
the launches switched off (ext.set_launches_enabled(False)): every call does all its host
work and runs no kernel. Static-size mode (num_out_tokens), as the GPU benchmark times it.
Per world size W (virtual ranks one call drives; 1 is production's one rank per process)
and data path: the median over the timed pairs of the wall time and of the thread's CPU
time (on a loaded machine the CPU time is the steadier), per pair and per rank (/ W), at two
levels: `engine` (Engine.dispatch + Engine.combine on routings normalised beforehand: the
per-call host path this package owns below the API) and `group` (EmulatedGroup.dispatch +
combine: the API's argument checks, routing normalisation and handles on top).

These are CPU measurements of the host path with stubbed launches, not GPU numbers: the
GPU benchmark (`python -m hybrid_ep.bench --emulate W`) reports the host time per rank
next to the kernels'. Writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from ..metadata import metadata
from ..routing import normalize_routing

DEFAULTS = dict(worlds=(1, 2, 8), paths=("receive", "direct"), hidden=1024, tokens=256, topk=8, warmup=50,
                iters=500)


def _routing(W: int, T: int, E: int, K: int, gen: torch.Generator):
    idx = [torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous() for _ in range(W)]
    w = [torch.rand(T, K, generator=gen) for _ in range(W)]
    return idx, w


def measure(world_size: int, data_path: str, *, hidden: int, tokens: int, topk: int, warmup: int,
            iters: int) -> dict:
    """One point: EmulatedGroup on the CPU model, launches off, static size T x K rows."""
    from ..backends.cuda.emulation import EmulatedGroup

    W, H, T, K = world_size, hidden, tokens, topk
    E = max(2 * W, K)
    group = EmulatedGroup(W, H, T, E, device="cpu", data_path=data_path, num_sms_dispatch=1, num_sms_combine=1)
    ext = group.ext
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=gen).to(torch.bfloat16) for _ in range(W)]
    idx, w = _routing(W, T, E, K, gen)
    static = T * K
    # In the arena on the direct path, as the GPU benchmark has them (else combine copies them in).
    expert_outs = [group.in_arena(i, torch.zeros(static, H, dtype=torch.bfloat16)) for i in range(W)]
    routings = [normalize_routing(T, E, x.device, topk_idx=i, topk_weights=v, check_values=False)
                for x, i, v in zip(xs, idx, w)]
    engine = group.engine

    def group_pair():
        res = group.dispatch(xs, idx, w, num_out_tokens=static)
        group.combine(expert_outs, [r.handle for r in res])

    def engine_pair():
        res = engine.dispatch(xs, [None] * W, routings, static, 1)
        engine.combine(expert_outs, [r.send for r in res], [r.recv for r in res], [r.probs_R for r in res], False, 1)

    point = {"world_size": W, "data_path": data_path, "hidden": H, "tokens": T, "topk": K, "experts": E,
             "num_out_tokens": static, "iters": iters}
    ext.set_launches_enabled(False)
    try:
        for level, pair in (("engine", engine_pair), ("group", group_pair)):
            wall, cpu = _time(pair, warmup, iters)
            wall_us, cpu_us = statistics.median(wall), statistics.median(cpu)
            deciles = statistics.quantiles(wall, n=10)
            point[level] = {"wall_us_per_pair": wall_us, "wall_us_per_pair_per_rank": wall_us / W,
                            "cpu_us_per_pair": cpu_us, "cpu_us_per_pair_per_rank": cpu_us / W,
                            "wall_us_p10_p90": [deciles[0], deciles[-1]]}
    finally:
        ext.set_launches_enabled(True)
        group.close()
    return point


def _time(pair, warmup: int, iters: int) -> tuple[list[float], list[float]]:
    wall, cpu = [], []
    for i in range(warmup + iters):
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        pair()
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        if i >= warmup:
            wall.append((t1 - t0) / 1e3)
            cpu.append((c1 - c0) / 1e3)
    return wall, cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hybrid_ep.bench.host", description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULTS["worlds"]))
    parser.add_argument("--paths", nargs="+", choices=("receive", "direct"), default=list(DEFAULTS["paths"]))
    for name in ("hidden", "tokens", "topk", "warmup", "iters"):
        parser.add_argument(f"--{name}", type=int, default=DEFAULTS[name])
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the host path is single-threaded; no pool threads in the timings
    points = []
    for W in args.worlds:
        for path in args.paths:
            p = measure(W, path, hidden=args.hidden, tokens=args.tokens, topk=args.topk, warmup=args.warmup,
                        iters=args.iters)
            points.append(p)
            for level in ("engine", "group"):
                q = p[level]
                print(f"W={W} {path} {level}: {q['cpu_us_per_pair_per_rank']:.1f} us CPU per pair per rank "
                      f"({q['cpu_us_per_pair']:.1f} per pair); wall {q['wall_us_per_pair_per_rank']:.1f} per rank",
                      flush=True)
    units = {"engine": "Engine.dispatch + Engine.combine", "group": "EmulatedGroup.dispatch + combine",
             "wall_us_per_pair": "microseconds (median)", "wall_us_per_pair_per_rank": "microseconds (median / W)",
             "cpu_us_per_pair": "microseconds of this thread's CPU time (median)",
             "cpu_us_per_pair_per_rank": "microseconds of CPU time (median / W)",
             "wall_us_p10_p90": "microseconds (10th and 90th percentile)"}
    config = {k: getattr(args, k) for k in ("worlds", "paths", "hidden", "tokens", "topk", "warmup", "iters")}
    doc = {"metadata": metadata("python -m hybrid_ep.bench.host", device_type="cpu", config=config, units=units,
                                backends=("cuda",)),
           "what": "host time per dispatch + combine pair, static size, cuda backend on the CPU model with "
                   "launches off (no kernel runs): a CPU measurement of the host path, not a GPU number",
           "command": "python -m hybrid_ep.bench.host " + " ".join(sys.argv[1:] if argv is None else argv),
           "points": points}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
