"""Train a tiny MoE GPT (Megatron-Core GPTModel) with expert parallelism through hybrid_ep.

    python -m megatron_patches.local.demo [--steps 30] [--dispatchers hybrid_ep alltoall]

W processes (default 4, as 2 nodes x 2 ranks) form one EP group of W ranks (data parallel W
for the dense weights). The model: GPTModel with Megatron's local (non-Transformer-Engine)
layer spec, 2 layers, hidden 128, 8 experts, top-2, vocabulary 256, fp32, trained on mock
data (each sequence counts upward by a stride of 1 to 4 from a random start, modulo the
vocabulary, which a model learns within a few dozen steps). On CPU the group runs on gloo; with
enough GPUs it runs on NCCL, one GPU per rank, and the same command uses them.

The first lines say where it runs (CPU and gloo, or the GPUs), which hybrid_ep backend the
dispatcher uses, and what the columns mean. Per step rank 0 prints the loss (mean over
ranks), tokens/s, the expert-load imbalance of each MoE layer ((max - mean) / mean of tokens
per expert, over the whole group; 0 = even) and the bytes the forward dispatches send over
NVLink and RDMA. Those bytes are modelled (hybrid_ep.traffic): what the hierarchical scheme
sends on each link for the step's routing, summed over layers and ranks, whichever
dispatcher ran; on CPU every byte actually went through gloo. Every dispatcher named in
--dispatchers trains its own model, from the same weights on the same data, in the same
processes and in alternation: step 1 of each, then step 2 of each, the order rotating every
step (A B, B A, ...), so that each step of one is timed beside the same step of the other,
under the same load of the machine, and neither always goes first. The run ends with one
summary: the largest relative difference of the first two loss curves, their tokens/s
(medians over steps 3 to the last, their ratio, and the median of the per-step ratios), and
the modelled NVLink and RDMA bytes of the first curve's forward dispatches under the
hierarchical scheme against a flat all-to-all for the same routing. fp8 on the wire
(--fp8-recipe blockwise): `hybrid_ep_fp8` sends the forward dispatch and the combine's backward
as fp8 rows (docs/megatron.md), `alltoall_fp8` is the alltoall dispatcher whose experts quantize
their input rows and their output's gradient the same way, and with `hybrid_ep` beside them the
JSON holds the per-step relative loss difference of fp8 against fp32 rows (fp8_rel_loss_diff);
their modelled bytes are those of fp8 rows with their scales. Each step's line is
printed as the step ends (rank 0 appends its record to a file this process reads while the
ranks train). Results go to --out as moe_train.json, with the project's metadata block
(hybrid_ep.metadata), and moe_train.png, both dispatchers' loss and tokens/s curves.

Arguments are checked before torch is loaded (demo_ranks, what the ranks run, loads it): a bad
one exits with status 2 and a message naming it within a second.

Gradients: dense weights are averaged over the W data-parallel ranks; expert gradients
already hold every rank's tokens (combine's backward brings them home), so they are divided
by W, which makes the update the gradient of the mean loss over ranks.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import tempfile
import threading

from hybrid_ep.cli_parser import ArgumentParser, positive_int, positive_number
from hybrid_ep.figures import plots_missing

from .demo_shape import BYTE_FIELDS, EXPERTS, HEADS, HIDDEN, LAYERS, TOPK, VOCAB

TOOL = "python -m megatron_patches.local.demo"
LEGEND = ("legend: imbalance/layer = (max - mean) / mean of tokens per expert in each MoE layer (0 = even);",
          "  NVLink / RDMA = modelled bytes of the forward dispatches under the hierarchical scheme, all layers and "
          "ranks")
UNITS = {
    "loss": "nats per token (cross-entropy, mean over ranks)",
    "tokens_per_s": "tokens per second, all ranks together",
    "imbalance": "(max - mean) / mean of tokens per expert over the group, one value per MoE layer; 0 = even",
    "nvlink_bytes": "bytes, modelled: hierarchical scheme's NVLink bytes of the forward dispatches for the "
                    "step's routing, summed over layers and ranks",
    "rdma_bytes": "bytes, modelled: hierarchical scheme's RDMA bytes of the forward dispatches for the "
                  "step's routing, summed over layers and ranks",
    "flat_nvlink_bytes": "bytes, modelled: a flat all-to-all's NVLink bytes for the same routing",
    "flat_rdma_bytes": "bytes, modelled: a flat all-to-all's RDMA bytes for the same routing",
    "ended_at": "seconds since the epoch when the step ended (rank 0's clock)",
    "max_rel_loss_diff": "largest |a - b| / |b| over the steps of the first two loss curves",
    "fp8_rel_loss_diff": "(fp8 - plain) / |plain| per step: hybrid_ep_fp8's loss against hybrid_ep's (rows in fp32)",
    "summary": "the first two curves' max_rel_loss_diff and speed, and the first curve's modelled bytes summed "
               "over its steps",
    "median_tokens_per_s": "tokens per second, all ranks together: median over steps speed_steps of the first two "
                           "curves",
    "tokens_per_s_ratio": "first curve's median tokens/s / second curve's (steps speed_steps)",
    "tokens_per_s_step_ratio": "median over steps speed_steps of the first curve's tokens/s / the second's at the "
                               "same step (the two steps ran one after the other)",
}
SPEED_FROM_STEP = 3  # the first two steps warm up (buffers, allocator, autograd graphs)


def where_line(transport: str, world_size: int, device: str, backend: str | None) -> str:
    """Where the ranks run and on which hybrid_ep backend (the second line of the output)."""
    if transport == "gloo":
        place = f"on {device}, {world_size} processes over torch.distributed gloo, no GPU"
    else:
        place = f"on {world_size} GPUs ({device}), one per process, torch.distributed nccl"
    via = "hybrid_ep dispatcher not run" if backend is None else f"hybrid_ep backend: {backend}"
    return f"running {place}; {via}"


def format_record(dispatcher: str, rec: dict) -> str:
    imb = " ".join(f"{v:.2f}" for v in rec["imbalance"])
    traffic = (f"modelled dispatch bytes NVLink {rec['nvlink_bytes'] / 1024:8.1f} KiB  "
               f"RDMA {rec['rdma_bytes'] / 1024:8.1f} KiB")
    return (f"[{dispatcher}] step {rec['step']:3d}  loss {rec['loss']:.5f}  "
            f"{rec['tokens_per_s']:8.0f} tok/s  imbalance/layer [{imb}]  {traffic}")


def _size(num_bytes: int) -> str:
    from hybrid_ep.wording import byte_unit

    scale, unit = byte_unit(num_bytes)
    return f"{num_bytes / scale:.1f} {unit}"


def speed(a: list[dict], b: list[dict]) -> dict:
    """tokens/s of two curves trained in alternation, over steps SPEED_FROM_STEP.. (all steps when
    there are fewer): each curve's median, the ratio of the medians (a / b) and the median of the
    per-step ratios (each step of a against the same step of b, timed beside it)."""
    first = SPEED_FROM_STEP if len(a) >= SPEED_FROM_STEP else 1
    ta, tb = ([r["tokens_per_s"] for r in c if r["step"] >= first] for c in (a, b))
    return {"speed_steps": [first, len(a)],
            "median_tokens_per_s": [statistics.median(ta), statistics.median(tb)],
            "tokens_per_s_ratio": statistics.median(ta) / statistics.median(tb),
            "tokens_per_s_step_ratio": statistics.median(x / y for x, y in zip(ta, tb))}


def summary(results: dict) -> dict:
    """The run's point in numbers: do the first two curves agree, how fast the first trains
    against the second, and what the hierarchy saves, modelled, for the first run's routing
    (every byte of it, summed over steps)."""
    names = list(results["curves"])
    first = results["curves"][names[0]]
    out = {"curve": names[0], "steps": len(first), **{f: sum(r[f] for r in first) for f in BYTE_FIELDS}}
    if len(names) >= 2:
        out.update(compared=names[:2], max_rel_loss_diff=results["max_rel_loss_diff"],
                   **speed(first, results["curves"][names[1]]))
    return out


def summary_lines(s: dict) -> list[str]:
    from hybrid_ep.wording import plural

    lines = ["summary:"]
    if "compared" in s:
        a, b = s["compared"]
        lines.append(f"  losses: {a} and {b} agree within a max relative difference of "
                     f"{s['max_rel_loss_diff']:.1e} over {plural(s['steps'], 'step')}")
    lines.append(f"  modelled bytes of the forward dispatches ({s['curve']} run's routing, "
                 f"{plural(s['steps'], 'step')}, all layers and ranks; traffic model, not measured):")
    width = max(len(_size(s[f])) for f in BYTE_FIELDS)
    lines.append(f"    hierarchical scheme   NVLink {_size(s['nvlink_bytes']):>{width}}   "
                 f"RDMA {_size(s['rdma_bytes']):>{width}}")
    lines.append(f"    flat all-to-all       NVLink {_size(s['flat_nvlink_bytes']):>{width}}   "
                 f"RDMA {_size(s['flat_rdma_bytes']):>{width}}")
    if s["flat_rdma_bytes"]:
        saved = 1 - s["rdma_bytes"] / s["flat_rdma_bytes"]
        lines.append(f"    the hierarchy sends {saved:.0%} fewer RDMA bytes; its NVLink forwarding adds "
                     f"{_size(max(s['nvlink_bytes'] - s['flat_nvlink_bytes'], 0))}")
    if "compared" in s:
        a, b = s["compared"]
        ma, mb = s["median_tokens_per_s"]
        lo, hi = s["speed_steps"]
        lines.append(f"  tokens/s, median over steps {lo}-{hi} (trained in alternation, step by step): "
                     f"{a} {ma:.0f}, {b} {mb:.0f}")
        lines.append(f"    {a} / {b}: ratio of medians {s['tokens_per_s_ratio']:.3f}, median of per-step ratios "
                     f"{s['tokens_per_s_step_ratio']:.3f}")
    return lines


def max_relative_difference(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def run(dispatchers, steps=30, world_size=4, ranks_per_node=2, micro_batch=4, seq=32, lr=3e-3,
        seed=1234, pool=None, echo=print) -> dict:
    """Train with each dispatcher on one pool; returns {dispatcher: records, ...}. Each step's
    line is echoed as the step ends (rank 0 appends its record to a progress file, read here
    while the pool trains)."""
    import torch

    from hybrid_ep.metadata import metadata
    from hybrid_ep.spawn import ProcessGroupPool

    from .demo_ranks import probe_backend, train_rank

    if len(set(dispatchers)) != len(dispatchers):
        raise ValueError(f"dispatchers must differ (each trains its own model), got {list(dispatchers)}")
    backend = "gloo"
    if torch.cuda.is_available():
        backend = "nccl"
        if torch.cuda.device_count() < world_size:
            world_size = torch.cuda.device_count()
            ranks_per_node = min(ranks_per_node, world_size)
            while world_size % ranks_per_node:
                ranks_per_node -= 1
            echo(f"using {world_size} GPU rank(s) (one per GPU), {ranks_per_node} per node")
    own_pool = pool is None
    if own_pool:
        pool = ProcessGroupPool(world_size, backend=backend, env={"HYBRID_EP_TIMEOUT_S": "120"})
    device_type = "cuda" if backend == "nccl" else "cpu"
    config = {"world_size": world_size, "ranks_per_node": ranks_per_node, "nodes": world_size // ranks_per_node,
              "transport": backend, "dispatchers": list(dispatchers), "steps": steps, "micro_batch": micro_batch,
              "seq": seq, "lr": lr, "seed": seed, "layers": LAYERS, "hidden": HIDDEN, "heads": HEADS,
              "experts": EXPERTS, "topk": TOPK, "vocab": VOCAB, "dtype": "fp32"}
    results = {"metadata": None, "curves": {}}
    try:
        hep_backend = pool.run(probe_backend, [(ranks_per_node,)] * pool.world_size)[0] \
            if any(name.startswith("hybrid_ep") for name in dispatchers) else None
        results["metadata"] = metadata(TOOL, device_type=device_type, config=config, units=UNITS,
                                       backends=[hep_backend] if hep_backend else [])
        echo(where_line(backend, pool.world_size, results["metadata"]["device"], hep_backend))
        for line in LEGEND:
            echo(line)
        with tempfile.TemporaryDirectory(prefix="hybrid_ep_demo_") as folder:
            progress = os.path.join(folder, "steps.jsonl")
            args = (list(dispatchers), steps, micro_batch, seq, lr, ranks_per_node, seed, progress)
            curves = _run_echoing_steps(lambda: pool.run(train_rank, [args] * pool.world_size,
                                                         timeout_s=1800 * len(dispatchers))[0], progress, echo)
        for name in dispatchers:
            results["curves"][name] = curves[name]
    finally:
        if own_pool:
            pool.close()
    names = list(results["curves"])
    if len(names) >= 2:
        a, b = ([r["loss"] for r in results["curves"][n]] for n in names[:2])
        results["max_rel_loss_diff"] = max_relative_difference(a, b)
    if "hybrid_ep_fp8" in names and "hybrid_ep" in names:
        fp8, plain = ([r["loss"] for r in results["curves"][n]] for n in ("hybrid_ep_fp8", "hybrid_ep"))
        results["fp8_rel_loss_diff"] = [(a - b) / abs(b) for a, b in zip(fp8, plain)]
    if names:
        results["summary"] = summary(results)
    return results


def _run_echoing_steps(train, progress: str, echo, poll_s: float = 0.05):
    """train() in a thread; meanwhile each line rank 0 appends to `progress` is echoed as a step
    line. Returns train()'s value (or raises its error) once every line is echoed."""
    out: dict = {}

    def target():
        try:
            out["value"] = train()
        except BaseException as err:  # handed to the caller below
            out["error"] = err

    thread = threading.Thread(target=target, name="demo-train", daemon=True)
    thread.start()
    done = 0
    while True:
        finished = not thread.is_alive()  # read before the file: no line written before it is missed
        lines = _lines(progress)
        for line in lines[done:]:
            item = json.loads(line)
            echo(format_record(item["dispatcher"], item["record"]))
        done = len(lines)
        if finished:
            break
        thread.join(poll_s)
    if "error" in out:
        raise out["error"]
    return out["value"]


def _lines(path: str) -> list[str]:
    """The complete lines of a file (none when it does not exist yet); a line still being written is left."""
    try:
        with open(path) as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return text.splitlines()[:text.count("\n")]


def plot(results: dict, path: str) -> str:
    """PNG of the curves: loss (left) and tokens/s (right) per step, one line per dispatcher
    (the second dashed: the loss curves lie on each other when the dispatchers agree), the
    tokens/s medians the summary gives as horizontal lines over the steps they cover."""
    from hybrid_ep.figures import new_figure, save_png

    meta, curves, summ = results["metadata"], results["curves"], results.get("summary", {})
    cfg = meta["config"]
    fig = new_figure(figsize=(12, 4.8), layout="constrained")
    styles = [dict(linestyle="-", marker="o", markersize=4), dict(linestyle="--", marker="s", markersize=6,
                                                                   markerfacecolor="none")]
    for k, (field, label) in enumerate((("loss", "loss (nats per token, mean over ranks)"),
                                        ("tokens_per_s", "tokens/s, all ranks together"))):
        ax = fig.add_subplot(1, 2, k + 1)
        for i, (name, recs) in enumerate(curves.items()):
            line, = ax.plot([r["step"] for r in recs], [r[field] for r in recs], label=name,
                            **styles[min(i, len(styles) - 1)])
            if field == "tokens_per_s" and name in summ.get("compared", []):
                lo, hi = summ["speed_steps"]
                median = summ["median_tokens_per_s"][summ["compared"].index(name)]
                ax.hlines(median, lo, hi, colors=line.get_color(), linestyles=":", linewidth=1.5,
                          label=f"{name} median, steps {lo}-{hi}: {median:.0f}")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if field == "loss" and "max_rel_loss_diff" in results:
            ax.set_title(f"largest relative difference of the two curves: {results['max_rel_loss_diff']:.1e}",
                         fontsize=10)
        ax.legend(fontsize=9)
    fig.suptitle(f"tiny MoE GPT (Megatron-Core, {cfg['layers']} layers, hidden {cfg['hidden']}, {cfg['experts']} "
                 f"experts, top-{cfg['topk']}): EP={cfg['world_size']} as {cfg['nodes']} nodes x "
                 f"{cfg['ranks_per_node']} ranks over {cfg['transport']}; dispatchers trained in alternation\n"
                 f"{meta['device']} | {meta['date']}", fontsize=10)
    return save_png(fig, path)


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(prog=TOOL, description=__doc__.split("\n")[0], allow_abbrev=False)
    parser.add_argument("--dispatchers", nargs="+", default=["hybrid_ep", "alltoall"],
                        choices=["hybrid_ep", "alltoall", "allgather", "hybrid_ep_fp8", "alltoall_fp8"],
                        help="curves to train; hybrid_ep_fp8: fp8 rows on the wire (--fp8-recipe blockwise), "
                             "alltoall_fp8: alltoall whose experts quantize their rows and output gradient alike")
    parser.add_argument("--steps", type=positive_int, default=30, help="training steps (>= 1)")
    parser.add_argument("--world-size", type=positive_int, default=4)
    parser.add_argument("--ranks-per-node", type=positive_int, default=2)
    parser.add_argument("--micro-batch", type=positive_int, default=4)
    parser.add_argument("--seq", type=positive_int, default=32)
    parser.add_argument("--lr", type=positive_number, default=3e-3)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--out", default="results/demo", help="folder for moe_train.json and moe_train.png")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    a = parser.parse_args(argv)  # before torch is loaded: a bad argument costs no start-up
    if len(set(a.dispatchers)) != len(a.dispatchers):
        parser.error(f"--dispatchers must differ (each trains its own model), got {' '.join(a.dispatchers)}")
    if a.world_size % a.ranks_per_node or EXPERTS % a.world_size:
        parser.error(f"--world-size must be a multiple of --ranks-per-node and divide {EXPERTS} experts")
    from hybrid_ep.paths import refuse_output

    refuse_output(parser, "--out", a.out, folder=True)
    print(f"tiny MoE GPT (Megatron-Core): {LAYERS} layers, hidden {HIDDEN}, {EXPERTS} experts, top-{TOPK}, "
          f"vocab {VOCAB}, fp32; EP={a.world_size} as {a.world_size // a.ranks_per_node} nodes x "
          f"{a.ranks_per_node} ranks; {a.steps} steps of {a.micro_batch}x{a.seq} tokens per rank", flush=True)
    results = run(a.dispatchers, a.steps, a.world_size, a.ranks_per_node, a.micro_batch, a.seq, a.lr, a.seed,
                  echo=lambda s: print(s, flush=True))
    for name, recs in results["curves"].items():
        print(f"{name}: first loss {recs[0]['loss']:.6f}, last loss {recs[-1]['loss']:.6f}")
    if "summary" in results:
        print("\n".join(summary_lines(results["summary"])))
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "moe_train.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=1)
    print(f"wrote {path}")
    missing = plots_missing()
    print(f"wrote {plot(results, os.path.join(a.out, 'moe_train.png'))}" if missing is None else f"no plot: {missing}")
    bad = [n for n, recs in results["curves"].items() if not all(math.isfinite(r["loss"]) for r in recs)]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
