"""`python -m hybrid_ep.bench.store_sweep`: the direct dispatch's store plans side by side.

The direct dispatch's store path has candidate designs, one kernel instantiation each
(HYBRID_EP_DIRECT_STORES, csrc/kernels/dispatch_direct.cuh StoreCrew), and a store queue depth
(HYBRID_EP_STORE_GROUPS). This times every plan at each queue depth and SM count on one
emulated group of W virtual ranks, in one process: per point the dispatch call (CUDA events,
L2 flushed, median) and its dispatch_direct kernel (torch.profiler), as destination GB/s per
SM (the bench's measure). Every plan's dispatch must give the first plan's rows, weights and
scales bit for bit, or the sweep stops with an error.

Without CUDA the group runs on the CPU model of the kernels: with `--costs` (a timing-model
table, tools/timing/h100.json) each point's kernel times are the model's prediction, without it
only the outputs are checked. Writes store_sweep.json and store_sweep.png; progress goes to
stderr, one line per point.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from unittest import mock

import torch

from ..backends.cuda import launch
from ..dtypes import DISPATCH_BY_NAME
from ..fp8 import FP8_DTYPE
from ..metadata import metadata
from .emulated import KERNEL_CALLS, _inputs, _median_ms
from .kernel_times import profiled_kernels
from .spec import L2_FLUSH_BYTES

DEFAULT_GROUPS = (0, 1, 2)
UNITS = {"dispatch_ms": "ms per call (median; CPU model: the predicted kernels' sum)",
         "kernel_ms": "ms per call of the dispatch_direct kernel (GPU: torch.profiler mean; CPU model: predicted)",
         "count_ms": "ms per call of the count kernel (as kernel_ms)",
         "dest_gbps_per_sm": "GB/s per SM: destination bytes (rows received x row bytes) / kernel_ms / (W x SMs)",
         "store_groups": "bulk-store groups each store warp leaves reading (the launch's, after the ring's bound)",
         "stages": "FIFO stages of the launch", "elapsed_s": "s"}


def _note(msg: str) -> None:
    print(f"[store_sweep] {msg}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m hybrid_ep.bench.store_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("--out", required=True, help="folder for store_sweep.json and store_sweep.png")
    p.add_argument("--plans", nargs="+", default=sorted(launch.STORE_PLANS), choices=sorted(launch.STORE_PLANS))
    p.add_argument("--store-groups", nargs="+", type=int, default=list(DEFAULT_GROUPS),
                   help=f"HYBRID_EP_STORE_GROUPS values (0 to {launch.MAX_STORE_GROUPS}; default "
                        f"{' '.join(map(str, DEFAULT_GROUPS))})")
    p.add_argument("--sms", nargs="+", type=int, default=[1, 2], help="SMs per rank (default 1 2)")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--hidden", type=int, default=8192)
    p.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--dtype", choices=["bf16", "fp8"], default="bf16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--costs", default=None, help="CPU model only: a timing-model table (tools/timing/*.json)")
    args = p.parse_args(argv)
    bad = [g for g in args.store_groups if not 0 <= g <= launch.MAX_STORE_GROUPS]
    if bad:
        p.error(f"--store-groups: each must be in [0, {launch.MAX_STORE_GROUPS}], got {bad}")
    if any(s < 1 for s in args.sms):
        p.error(f"--sms: each must be >= 1, got {args.sms}")
    if args.world_size < 1 or args.experts % args.world_size:
        p.error(f"--experts ({args.experts}) must be a multiple of --world-size ({args.world_size})")
    if not 1 <= args.topk <= args.experts:
        p.error(f"--topk must be in [1, --experts], got {args.topk}")
    if args.tokens < 1 or args.warmup < 0 or args.iters < 1:
        p.error("--tokens and --iters must be >= 1, --warmup >= 0")
    return args


def _load_costs(path: str | None) -> dict | None:
    """{name: value} of a timing-model table file (its schema: {"constants": {name: {"value": ...}}})."""
    if path is None:
        return None
    with open(path) as f:
        table = json.load(f)
    return {name: float(c["value"]) for name, c in table["constants"].items()}


def _outputs(results) -> list[torch.Tensor]:
    """A dispatch's outputs as bytes, for a bitwise comparison between plans."""
    out = []
    for r in results:
        for t in (r.tokens, r.probs, r.scales):
            if t is not None:
                out.append(t.detach().contiguous().view(torch.uint8).cpu())
    return out


class _Timer:
    """Per point: (call ms, {kernel: ms}) on a GPU, or the model's prediction on the CPU."""

    def __init__(self, args, device: torch.device, costs: dict | None):
        self.args, self.device, self.costs = args, device, costs
        self.flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device) if device.type == "cuda" else None

    def __call__(self, group, call) -> tuple[float | None, dict]:
        if self.device.type == "cuda":
            ms = _median_ms(call, self.args.warmup, self.args.iters, self.flush)
            got = profiled_kernels(call, KERNEL_CALLS, self.flush.zero_)
            return ms, ({} if got is None else dict(got.ours))
        if self.costs is None:
            call()
            group.synchronize()
            return None, {}
        ext = group.ext
        call()  # warms the buffers, as the timed calls after warm-up on a GPU
        group.synchronize()
        ext.set_timing([self.costs])
        try:
            ext.timing_reports()
            call()
            group.synchronize()
            reports = ext.timing_reports()
        finally:
            ext.set_timing(None)
        kernels: dict[str, float] = {}
        for r in reports:
            name = f"{r['kernel']}_kernel"
            kernels[name] = kernels.get(name, 0.0) + r["time_ns"] * 1e-6
        return sum(kernels.values()), kernels


def sweep(args) -> dict:
    from ..backends.cuda.emulation import EmulatedGroup

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    W, H, T, E, K = args.world_size, args.hidden, args.tokens, args.experts, args.topk
    dtype = DISPATCH_BY_NAME[args.dtype]
    idxs, xs, scales = _inputs(W, T, H, E, K, dtype, "uniform", args.seed, device)
    scales = None if dtype != FP8_DTYPE else scales
    row_bytes = H * xs[0].element_size() + (H // 128 * 4 if dtype == FP8_DTYPE else 0)
    timer = _Timer(args, device, _load_costs(args.costs))
    started = time.monotonic()
    first_outputs, points = None, []
    for plan in args.plans:
        for groups in args.store_groups:
            # the variables a buffer reads when it is made, set for its making only
            with mock.patch.dict(os.environ, {launch.STORE_PLAN_ENV: plan, launch.STORE_GROUPS_ENV: str(groups)}):
                group = EmulatedGroup(W, H, T, E, data_path="direct", device=device)
            try:
                res = group.dispatch(xs, idxs, scales=scales)
                group.synchronize()
                outputs = _outputs(res)
                if first_outputs is None:
                    first_outputs = outputs
                elif len(outputs) != len(first_outputs) or not all(torch.equal(a, b)
                                                                   for a, b in zip(outputs, first_outputs)):
                    raise RuntimeError(f"store plan {plan} with {groups} store groups dispatched other rows than "
                                       f"{args.plans[0]} with {args.store_groups[0]}")
                dest = sum(int(r.handle.recv_counts_W.sum()) for r in res) * row_bytes
                res = None
                for sms in args.sms:
                    ms, kernels = timer(group, lambda sms=sms: group.dispatch(xs, idxs, scales=scales, num_sms=sms))
                    shape = group.engine.launch_shapes(sms)["dispatch_direct"]
                    kernel_ms = kernels.get("dispatch_direct_kernel")
                    point = {"plan": plan, "store_groups_requested": groups, "store_groups": shape["store_groups"],
                             "stages": shape["stages"], "sms_per_rank": sms, "dispatch_ms": ms,
                             "kernel_ms": kernel_ms, "count_ms": kernels.get("count_kernel"),
                             "dest_gbps_per_sm": None if not kernel_ms else dest / (kernel_ms * 1e-3) / (W * sms) / 1e9}
                    points.append(point)
                    rate = "-" if point["dest_gbps_per_sm"] is None else f"{point['dest_gbps_per_sm']:.1f} GB/s/SM"
                    _note(f"{plan}, {groups} store groups (launched {shape['store_groups']}), {sms} SM(s)/rank: "
                          f"kernel {kernel_ms if kernel_ms is None else round(kernel_ms, 4)} ms, {rate} "
                          f"[{time.monotonic() - started:.0f} s]")
            finally:
                group.close()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU model"
    timed = "CUDA events and torch.profiler" if device.type == "cuda" else (
        "the timing model's prediction" if timer.costs else "not timed (outputs checked only)")
    config = {"world_size": W, "hidden": H, "tokens_per_rank": T, "topk": K, "experts": E, "dtype": args.dtype,
              "seed": args.seed, "plans": args.plans, "store_groups": args.store_groups, "sms_per_rank": args.sms,
              "warmup": args.warmup, "iters": args.iters, "costs": args.costs, "timed_by": timed}
    return {"metadata": metadata("hybrid_ep.bench.store_sweep", device_type=device.type, config=config, units=UNITS,
                                 backends=["cuda"], device=where),
            "command": " ".join(sys.argv), "outputs_match": True, "points": points,
            "elapsed_s": time.monotonic() - started}


def plot(doc: dict, path: str) -> None:
    """GB/s per SM by plan and store groups, a panel per SM count."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in doc["points"] if p["dest_gbps_per_sm"] is not None]
    c = doc["metadata"]["config"]
    sms_list = c["sms_per_rank"]
    fig, axes = plt.subplots(1, len(sms_list), figsize=(4.5 * len(sms_list), 3.6), squeeze=False)
    width = 0.8 / max(1, len(c["store_groups"]))
    for ax, sms in zip(axes[0], sms_list):
        for j, groups in enumerate(c["store_groups"]):
            ys = [next((p["dest_gbps_per_sm"] for p in points if p["plan"] == plan and p["sms_per_rank"] == sms
                        and p["store_groups_requested"] == groups), 0.0) for plan in c["plans"]]
            ax.bar([i + j * width for i in range(len(c["plans"]))], ys, width, label=f"{groups} groups")
        ax.set_xticks([i + width * (len(c["store_groups"]) - 1) / 2 for i in range(len(c["plans"]))], c["plans"])
        ax.set_title(f"{sms} SM(s) per rank")
        ax.set_ylabel("dispatch_direct: destination GB/s per SM")
        ax.legend(fontsize="small")
    fig.suptitle(f"W={c['world_size']} H={c['hidden']} T={c['tokens_per_rank']} top-{c['topk']} of "
                 f"{c['experts']} {c['dtype']} | {doc['metadata'].get('device', '')} ({c['timed_by']})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    doc = sweep(args)
    path = os.path.join(args.out, "store_sweep.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    plot(doc, os.path.join(args.out, "store_sweep.png"))
    for p in doc["points"]:
        rate = "-" if p["dest_gbps_per_sm"] is None else f"{p['dest_gbps_per_sm']:6.1f}"
        print(f"{p['plan']:>10} groups {p['store_groups_requested']} ({p['store_groups']}) sms {p['sms_per_rank']}: "
              f"{rate} GB/s/SM")
    print(f"\nresults: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
