"""Megatron-Core MoE layer forward + backward: hybrid_ep against Megatron's alltoall dispatcher.

    python -m megatron_patches.layer_bench [--shapes tiny mid deepseek] [--repeats 30]
        [--memory-steps 3] [--world-size 4] [--ranks-per-node 2] [--out DIR]

Selecting `--moe-token-dispatcher-type hybrid_ep` must cost nothing against Megatron's own
alltoall dispatcher where hybrid_ep runs its reference backend; this measures it where it
matters: a whole MoELayer (router, dispatch, experts, combine, and the backward of all of it).
Both dispatchers run in the same process group (Megatron's EP group), with the same router and
expert weights and the same inputs, hence the same routing; hybrid_ep sees the ranks as nodes
of --ranks-per-node (4 ranks as 2 nodes of 2 by default, as the demo does). Samples are interleaved: each
repeat times one forward + backward of every (shape, dispatcher) in turn, the dispatcher order
alternating between repeats, so that the load of a shared machine falls on both alike. A
sample is the slowest rank's time of that step (perf_counter after a barrier); the table gives
the median over repeats and its ratio, hybrid_ep / alltoall. Beside it, the CPU time a step
costs a rank (process_time: all its threads, waits excluded; the mean over ranks per repeat,
then the median), which moves less with the load of a shared machine than the wall time.

Memory, per rank: the peak bytes of the tensor storages a forward + backward creates, above
those live before it (hybrid_ep.peak_memory.PeakMemoryMeter: the same meter, step and inputs for
both dispatchers, in steps of their own, not timed), for the first step of a new layer (the
dispatcher's buffer is created in it, and whatever it keeps between calls) and the largest of
--memory-steps steps after the warm-up (a step's peak can differ from the next one's by a
buffer that is freed a little later); beside them the bytes the hybrid_ep buffer holds for its life
(`memory_plan().held_bytes`). hybrid_ep's memory is bounded by alltoall's where its peak is at
most alltoall's plus the held bytes on every rank: "excess" is the largest
peak(hybrid_ep) - peak(alltoall) - held over the ranks (<= 0: bounded).

Writes layer_bench.json (the project's metadata block first), layer_bench.md (the tables) and
layer_bench.png to --out. docs/benchmarks/megatron_layer.md has a run with its command.
Legend: W ranks, T tokens per rank, H hidden, F expert ffn hidden, E experts, K top-k.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from hybrid_ep.cli_parser import ArgumentParser
from hybrid_ep.figures import plots_missing

TOOL = "python -m megatron_patches.layer_bench"
DISPATCHERS = ("hybrid_ep", "alltoall")
# name -> (H, F, E, K, seq, micro-batch): T = seq x micro-batch tokens per rank.
SHAPES = {
    "tiny": (128, 256, 8, 2, 32, 4),  # the MoE layer of `python -m megatron_patches.local.demo`
    "mid": (1024, 1024, 8, 2, 64, 4),
    "deepseek": (256, 128, 64, 8, 64, 4),  # fine-grained experts, top-8 of 64, at a small hidden
}
UNITS = {
    "median_ms": "milliseconds, median over repeats of the slowest rank's forward + backward time",
    "samples_ms": "milliseconds, the slowest rank's forward + backward time of each repeat, in order",
    "ratio": "hybrid_ep median / alltoall median (1 = same time; below 1 hybrid_ep is faster)",
    "paired_ratio": "median over repeats of hybrid_ep / alltoall of the same repeat",
    "hidden": "elements", "ffn": "elements", "experts": "count", "topk": "count",
    "tokens_per_rank": "tokens",
    "max_abs_diff": "largest |hybrid_ep - alltoall| over the layer outputs of all ranks (same routing: ~0)",
    "median_cpu_ms": "milliseconds of CPU time (process_time) per rank and step: mean over ranks, median over repeats",
    "cpu_samples_ms": "milliseconds of CPU time per rank of each repeat (mean over ranks), in order",
    "cpu_ratio": "hybrid_ep median CPU time / alltoall's",
    "peak_bytes": "bytes per rank, in rank order: the most that the tensor storages created in one forward + "
                  "backward after the warm-up held at one time (PeakMemoryMeter), above those live before it; "
                  "the largest over the memory steps",
    "step_peaks_bytes": "bytes per rank (outer) and memory step (inner, in order): each step's peak",
    "first_step_peak_bytes": "bytes per rank, as peak_bytes for the first forward + backward of a new layer "
                             "(hybrid_ep creates its buffer in it)",
    "output_bytes": "bytes per rank of the layer output's storage",
    "held_bytes": "bytes per rank that the hybrid_ep buffer holds for its life: memory_plan().held_bytes",
    "held_by_region": "bytes per rank by region of held_bytes (memory_plan().held_by_region())",
    "excess_bytes": "bytes, the largest over ranks of hybrid_ep's peak_bytes - alltoall's - held_bytes "
                    "(<= 0: hybrid_ep's peak is at most alltoall's plus the held bytes on every rank)",
    "first_step_excess_bytes": "bytes, excess_bytes of the first step's peaks",
}


def _case(shape: str, dispatcher: str, world_size: int):
    from .local.layer import LayerCase

    H, F, E, K, seq, batch = SHAPES[shape]
    return LayerCase(world_size, num_experts=E, topk=K, hidden=H, ffn=F, seq=seq, batch=batch,
                     dispatcher=dispatcher)


def _step_time(layer, x: torch.Tensor, grad_out: torch.Tensor) -> tuple[float, float]:
    """One forward + backward of the layer: seconds from a barrier to its end on this rank, and
    the CPU seconds this process spent on it."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    dist.barrier()
    start, cpu = time.perf_counter(), time.process_time()
    out, _ = layer(x)
    out.backward(grad_out)
    return time.perf_counter() - start, time.process_time() - cpu


def _step_peak(layer, x: torch.Tensor, grad_out: torch.Tensor) -> dict[str, int]:
    """One forward + backward of the layer under the meter: the peak bytes of the storages it
    creates (above those live before it) and the bytes of the layer's output."""
    from hybrid_ep.peak_memory import PeakMemoryMeter

    layer.zero_grad(set_to_none=True)  # the last step's gradients go before the window
    x = x.detach().requires_grad_()
    gc.collect()
    dist.barrier()
    with PeakMemoryMeter() as meter:
        out, _ = layer(x)
        out_bytes = out.untyped_storage().nbytes()
        out.backward(grad_out)
    return {"peak_bytes": meter.peak_bytes, "output_bytes": out_bytes}


def _output(run) -> torch.Tensor:
    layer, x, _ = run
    with torch.no_grad():
        return layer(x)[0]


def time_rank(shapes: list[str], repeats: int, warmup: int, ranks_per_node: int, memory_steps: int) -> dict:
    """Runs on every rank of the pool: the interleaved samples, each the slowest rank's time and
    the ranks' mean CPU time (s); and this rank's memory: the peaks of every layer's first step
    and of memory_steps steps after the warm-up, the bytes its hybrid_ep buffers hold."""
    from .buffers import BUFFERS
    from .local.common import init_megatron, quiet_libraries
    from .local.layer import case_tensors, seeded_layer
    from .options import HybridEPOptions

    quiet_libraries()
    world, rank = dist.get_world_size(), dist.get_rank()
    init_megatron(world)
    BUFFERS.clear()  # each hybrid_ep layer's first step creates its buffer, in a process that ran others before
    runs = {}
    for shape in shapes:
        for name in DISPATCHERS:
            case = _case(shape, name, world)
            _, _, _, x, grad_out = case_tensors(case)
            layer = seeded_layer(case, rank, {"hybrid_ep_options": HybridEPOptions(ranks_per_node=ranks_per_node)})
            runs[shape, name] = (layer, x[rank].float(), grad_out[rank].float())
    first = {key: _step_peak(*args) for key, args in runs.items()}
    for args in runs.values():
        for _ in range(warmup):
            _step_time(*args)
    steps = {key: [] for key in runs}
    for _ in range(memory_steps):
        for key, args in runs.items():
            steps[key].append(_step_peak(*args))
    memory = {}
    for (shape, name), args in runs.items():
        memory[f"{shape}/{name}"] = {"step_peaks_bytes": [step["peak_bytes"] for step in steps[shape, name]],
                                     "output_bytes": steps[shape, name][-1]["output_bytes"],
                                     "first_step_peak_bytes": first[shape, name]["peak_bytes"]}
        if name == "hybrid_ep":
            plan = args[0].token_dispatcher._comm_manager._buffer.memory_plan()
            memory[shape] = {"held_bytes": plan.held_bytes, "held_by_region": plan.held_by_region()}
    # Same weights, inputs and routing: the two layers must give the same output.
    diffs = torch.tensor([_output(runs[s, "hybrid_ep"]).sub(_output(runs[s, "alltoall"])).abs().max().item()
                          for s in shapes], dtype=torch.float64)
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    mine = {key: [] for key in runs}
    for rep in range(repeats):
        for shape in shapes:
            for name in DISPATCHERS if rep % 2 == 0 else DISPATCHERS[::-1]:
                mine[shape, name].append(_step_time(*runs[shape, name]))
    keys = list(runs)
    times = torch.tensor([mine[k] for k in keys], dtype=torch.float64)  # [keys, repeats, (wall, cpu)]
    slowest, cpu = times[..., 0].contiguous(), times[..., 1].contiguous()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    dist.all_reduce(cpu)
    cpu /= world
    backend = runs[shapes[0], "hybrid_ep"][0].token_dispatcher._comm_manager._buffer.backend
    return {"backend": backend, "max_abs_diff": dict(zip(shapes, diffs.tolist())),
            "samples": {f"{s}/{n}": slowest[i].tolist() for i, (s, n) in enumerate(keys)},
            "cpu_samples": {f"{s}/{n}": cpu[i].tolist() for i, (s, n) in enumerate(keys)}, "memory": memory}


def _memory_fields(shape: str, memory: list[dict]) -> dict:
    """The row's memory fields from every rank's memory (time_rank's, in rank order)."""
    per_rank = {field: {n: [m[f"{shape}/{n}"][field] for m in memory] for n in DISPATCHERS}
                for field in ("step_peaks_bytes", "first_step_peak_bytes", "output_bytes")}
    per_rank["peak_bytes"] = {n: [max(steps) for steps in per_rank["step_peaks_bytes"][n]] for n in DISPATCHERS}
    held = [m[shape]["held_bytes"] for m in memory]

    def excess(field):
        return max(h - a - b for h, a, b in zip(per_rank[field]["hybrid_ep"], per_rank[field]["alltoall"], held))

    return {**per_rank, "held_bytes": held, "held_by_region": [m[shape]["held_by_region"] for m in memory],
            "excess_bytes": excess("peak_bytes"), "first_step_excess_bytes": excess("first_step_peak_bytes")}


def summarize(samples: dict, shapes: list[str], max_abs_diff: dict, cpu_samples: dict,
              memory: list[dict]) -> list[dict]:
    """One row per shape: medians (ms), ratio of medians and the median of per-repeat ratios;
    the same medians and ratio of the CPU time; the peaks of memory per rank (memory: each
    rank's, in rank order), the bytes held and the excess over alltoall's peak plus them."""
    rows = []
    for shape in shapes:
        H, F, E, K, seq, batch = SHAPES[shape]
        ms = {n: [1e3 * t for t in samples[f"{shape}/{n}"]] for n in DISPATCHERS}
        med = {n: statistics.median(ms[n]) for n in DISPATCHERS}
        cpu = {n: [1e3 * t for t in cpu_samples[f"{shape}/{n}"]] for n in DISPATCHERS}
        cpu_med = {n: statistics.median(cpu[n]) for n in DISPATCHERS}
        rows.append({
            "shape": shape, "hidden": H, "ffn": F, "experts": E, "topk": K, "tokens_per_rank": seq * batch,
            "median_ms": med, "samples_ms": ms,
            "ratio": med["hybrid_ep"] / med["alltoall"],
            "paired_ratio": statistics.median(a / b for a, b in zip(ms["hybrid_ep"], ms["alltoall"])),
            "max_abs_diff": max_abs_diff[shape],
            "median_cpu_ms": cpu_med, "cpu_samples_ms": cpu, "cpu_ratio": cpu_med["hybrid_ep"] / cpu_med["alltoall"],
            **_memory_fields(shape, memory),
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| shape | H | F | E | top-k | T/rank | hybrid_ep ms | alltoall ms | ratio | paired ratio "
             "| CPU ms hybrid_ep | CPU ms alltoall | CPU ratio | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['hidden']} | {r['ffn']} | {r['experts']} | {r['topk']} | "
                     f"{r['tokens_per_rank']} | {r['median_ms']['hybrid_ep']:.2f} | {r['median_ms']['alltoall']:.2f}"
                     f" | {r['ratio']:.3f} | {r['paired_ratio']:.3f} | {r['median_cpu_ms']['hybrid_ep']:.2f}"
                     f" | {r['median_cpu_ms']['alltoall']:.2f} | {r['cpu_ratio']:.3f} | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def _kib(nbytes: int) -> str:
    return f"{nbytes / 1024:,.1f}"


def memory_table(rows: list[dict]) -> str:
    """Peaks of memory in KiB, the largest over ranks; excess over alltoall's peak plus the held
    bytes (<= 0: bounded on every rank)."""
    lines = ["| shape | peak KiB hybrid_ep | peak KiB alltoall | held KiB | excess KiB "
             "| first step: peak KiB hybrid_ep | peak KiB alltoall | excess KiB | output KiB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        peak, first = r["peak_bytes"], r["first_step_peak_bytes"]
        lines.append(f"| {r['shape']} | {_kib(max(peak['hybrid_ep']))} | {_kib(max(peak['alltoall']))} | "
                     f"{_kib(max(r['held_bytes']))} | {_kib(r['excess_bytes'])} | {_kib(max(first['hybrid_ep']))} | "
                     f"{_kib(max(first['alltoall']))} | {_kib(r['first_step_excess_bytes'])} | "
                     f"{_kib(max(r['output_bytes']['alltoall']))} |")
    return "\n".join(lines)


def _bound_ratio(r: dict, field: str) -> float:
    """The largest over ranks of hybrid_ep's peak / (alltoall's peak + the held bytes)."""
    return max(h / (a + held) for h, a, held in zip(r[field]["hybrid_ep"], r[field]["alltoall"], r["held_bytes"]))


def _memory_panel(ax, rows: list[dict]) -> None:
    """Per shape, hybrid_ep's peak over alltoall's plus the held bytes (the largest over ranks),
    after the warm-up and in the first step, with the peaks in MiB above the bars."""
    xs = range(len(rows))
    windows = (("peak_bytes", "after the warm-up", "tab:green"), ("first_step_peak_bytes", "first step", "tab:gray"))
    for i, (field, label, color) in enumerate(windows):
        at = [x + (i - 0.5) * 0.38 for x in xs]
        ratios = [_bound_ratio(r, field) for r in rows]
        ax.bar(at, ratios, 0.38, label=label, color=color)
        for x, q, r in zip(at, ratios, rows):
            mib = {n: max(r[field][n]) / 2**20 for n in DISPATCHERS}
            ax.annotate(f"{q:.3f}\n{mib['hybrid_ep']:.2f} / {mib['alltoall']:.2f} MiB", (x, q), ha="center",
                        va="bottom", xytext=(0, 2), textcoords="offset points", fontsize=7)
    ax.axhline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xticks(list(xs), [r["shape"] for r in rows])
    ax.set_ylim(0, 1.45 * max(max(_bound_ratio(r, f) for r in rows) for f in ("peak_bytes", "first_step_peak_bytes")))
    ax.set_ylabel("peak hybrid_ep / (peak alltoall + held), largest rank")
    ax.set_title("memory: the ratio, and the peaks of hybrid_ep / alltoall", fontsize=9)
    ax.legend(fontsize=8, loc="lower right")


def plot(doc: dict, path: str) -> None:
    """Per shape, one bar per dispatcher with the ratio above each pair: the median wall time
    (left) and the median CPU time per rank (middle); the peaks of memory (right)."""
    from hybrid_ep.figures import new_figure, save_png

    rows, meta = doc["rows"], doc["metadata"]
    fig = new_figure(figsize=(18, 5.2), layout="constrained")
    xs = range(len(rows))
    panels = (("median_ms", "ratio", "ms, median forward + backward (slowest rank)"),
              ("median_cpu_ms", "cpu_ratio", "ms of CPU time per rank, median forward + backward"))
    _memory_panel(fig.add_subplot(1, 3, 3), rows)
    for k, (field, ratio, label) in enumerate(panels):
        ax = fig.add_subplot(1, 3, k + 1)
        for i, name in enumerate(DISPATCHERS):
            ax.bar([x + (i - 0.5) * 0.38 for x in xs], [r[field][name] for r in rows], 0.38, label=name)
        for x, r in zip(xs, rows):
            ax.annotate(f"{r[ratio]:.2f}x", (x, max(r[field].values())), ha="center", va="bottom", xytext=(0, 3),
                        textcoords="offset points")
        ax.set_xticks(list(xs), [f"{r['shape']}\nH {r['hidden']}, top-{r['topk']} of {r['experts']}" for r in rows])
        ax.set_ylabel(label)
        ax.legend()
    fig.suptitle(f"Megatron MoELayer, W={meta['config']['world_size']} gloo ranks ({meta['config']['nodes']} nodes "
                 f"for hybrid_ep): hybrid_ep (reference) vs alltoall\n{meta['device']} | {meta['date']}", fontsize=10)
    save_png(fig, path)


def run(shapes: list[str], repeats: int, warmup: int, world_size: int, ranks_per_node: int, pool=None,
        memory_steps: int = 3) -> dict:
    from hybrid_ep.metadata import metadata
    from hybrid_ep.spawn import ProcessGroupPool

    own = pool is None
    if own:
        pool = ProcessGroupPool(world_size, backend="gloo", env={"HYBRID_EP_TIMEOUT_S": "120"})
    try:
        args = (shapes, repeats, warmup, ranks_per_node, memory_steps)
        outs = pool.run(time_rank, [args] * pool.world_size, timeout_s=3600)
    finally:
        if own:
            pool.close()
    config = {"world_size": world_size, "ranks_per_node": ranks_per_node, "nodes": world_size // ranks_per_node,
              "transport": "gloo", "dispatchers": list(DISPATCHERS), "shapes": shapes,
              "repeats": repeats, "warmup": warmup, "memory_steps": memory_steps, "dtype": "fp32",
              "layer": "MoELayer, local spec, SequentialMLP",
              "timing": "time.perf_counter after a barrier, forward + backward, slowest rank per repeat; "
                        "time.process_time over the same span, mean over ranks per repeat",
              "memory": "hybrid_ep.peak_memory.PeakMemoryMeter over forward + backward steps of their own (not "
                        "timed): the first of a new layer, and memory_steps after the warm-up; every rank"}
    out = outs[0]
    meta = metadata(TOOL, device_type="cpu", config=config, units=UNITS, backends=[out["backend"]])
    rows = summarize(out["samples"], shapes, out["max_abs_diff"], out["cpu_samples"], [o["memory"] for o in outs])
    return {"metadata": meta, "rows": rows}


def main(argv=None) -> int:
    parser = ArgumentParser(prog=TOOL, description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--memory-steps", type=int, default=3,
                        help="steps after the warm-up whose peak of memory is measured (the largest is reported)")
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--ranks-per-node", type=int, default=2,
                        help="hybrid_ep's ranks per node (default 2: 4 ranks as 2 nodes, as in the demo)")
    parser.add_argument("--out", default="results/layer_bench")
    a = parser.parse_args(argv)
    for flag, value, low in (("--repeats", a.repeats, 1), ("--warmup", a.warmup, 0), ("--world-size", a.world_size, 1),
                             ("--memory-steps", a.memory_steps, 1)):
        if value < low:
            parser.error(f"{flag} must be >= {low}, got {value}")
    if a.ranks_per_node < 1 or a.world_size % a.ranks_per_node:
        parser.error(f"--ranks-per-node must divide --world-size {a.world_size}, got {a.ranks_per_node}")
    for shape in a.shapes:
        if SHAPES[shape][2] % a.world_size:
            parser.error(f"--world-size {a.world_size} must divide the {SHAPES[shape][2]} experts of shape {shape}")
    doc = run(a.shapes, a.repeats, a.warmup, a.world_size, a.ranks_per_node, memory_steps=a.memory_steps)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "layer_bench.json"), "w") as f:
        json.dump(doc, f, indent=1)
    text = table(doc["rows"]) + "\n\n" + memory_table(doc["rows"])
    with open(os.path.join(a.out, "layer_bench.md"), "w") as f:
        f.write(text + "\n")
    missing = plots_missing()
    if missing is None:
        plot(doc, os.path.join(a.out, "layer_bench.png"))
    print(f"{doc['metadata']['device']} | {doc['metadata']['date']} | W={a.world_size} gloo "
          f"({a.world_size // a.ranks_per_node} nodes x {a.ranks_per_node} for hybrid_ep), "
          f"{a.repeats} interleaved repeats\n{text}\nwrote {a.out}/layer_bench.json, .md"
          + (", .png" if missing is None else f"; no plot: {missing}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
