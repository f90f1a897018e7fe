"""`hybrid-ep-bench` (= `python -m hybrid_ep.bench`): flags, device-dependent defaults, and the order of a run.

Start the ranks, ask them which backends they can use, run every backend (and SM count),
then print one table per run and write results.json and PNG plots into --out.
Under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set) this process is one rank
and rank 0 reports; otherwise --world-size processes are spawned on this machine.
`--calibrate` times reference against cuda instead and writes the evidence `backend="auto"`
follows (calibrate.py).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

from ..cli_parser import ArgumentParser
from ..metadata import metadata
from ..paths import output_problem
from ..synthetic import ROUTINGS
from ..wording import plural
from . import calibrate, deepep, worker
from .launch import open_launcher, under_torchrun
from .metrics import build_run
from .plot import write_plots
from .report import UNITS, format_report, write_json
from .spec import (
    BACKENDS_WITHOUT_SMS,
    BASELINES,
    BENCH_BACKENDS,
    DTYPES,
    MIN_RECOMMENDED_ITERS,
    BenchArgError,
    BenchSpec,
)

PROG = "hybrid-ep-bench"
CPU_WORLD_SIZE = 4
# Without torchrun every rank is a process on this machine (each imports torch, a few hundred
# MB): more than this is a typing slip, not a benchmark. Launch with torchrun for more ranks.
MAX_SPAWNED_RANKS = 256
EXPERTS_PER_RANK = 2
DEFAULT_TOPK = 8
# The seed benchmark on GPU; on CPU a smaller shape so W=4 runs in seconds on two cores.
DEFAULTS = {
    "cuda": dict(hidden=8192, tokens=4096, warmup=10, iters=30),
    "cpu": dict(hidden=1024, tokens=512, warmup=5, iters=20),
}


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas or spaces, got {text!r}") from None


def _name_list(text: str) -> list[str]:
    return [v.strip() for v in text.split(",") if v.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Time HybridEPBuffer dispatch and combine on every rank and report time, algorithm "
                    "bandwidth (algbw) and NVLink / RDMA bus bandwidth (busbw); docs/benchmarks/README.md. "
                    "GPU defaults: H=8192, 4096 tokens/rank, top-8, 2 experts/rank; CPU defaults: H=1024, "
                    "512 tokens/rank.")
    p.add_argument("-w", "--world-size", type=int, default=None,
                   help="ranks W (default: the GPU count on GPU, 4 on CPU; under torchrun: its WORLD_SIZE)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="ranks per NVLink domain G; W / G nodes (default: W, one node; under torchrun: "
                        "LOCAL_WORLD_SIZE)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size H (default 8192 GPU, 1024 CPU)")
    p.add_argument("--tokens", type=int, default=None, help="tokens per rank T (default 4096 GPU, 512 CPU)")
    p.add_argument("--topk", type=int, default=None, help=f"routes per token K (default {DEFAULT_TOPK}, at most E)")
    p.add_argument("--experts", type=int, default=None, help=f"experts E (default {EXPERTS_PER_RANK} x W)")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16",
                   help="dispatch payload; fp8 quantises x per 128 elements and sends the scales, combine "
                        "then runs in bf16 (default %(default)s)")
    p.add_argument("--routing", choices=ROUTINGS, default="uniform", help="synthetic routing (default %(default)s)")
    p.add_argument("--zipf-exponent", type=float, default=1.2, help="skew of --routing zipf (default %(default)s)")
    p.add_argument("--group-limit", type=int, default=None,
                   help="nodes a token may reach with --routing group-limited (default 4, capped at the nodes)")
    p.add_argument("--sms", type=_int_list, nargs="+", default=[], metavar="N",
                   help="SM counts to sweep (num_sms of dispatch and combine), e.g. --sms 16 24 32; backends "
                        "without an SM setting (reference) run once (default: each backend's default)")
    p.add_argument("--backends", type=_name_list, nargs="+", default=[], metavar="NAME",
                   help=f"among {', '.join(BENCH_BACKENDS)} (default: every backend available here)")
    p.add_argument("--warmup", type=int, default=None, help="untimed calls first (default 10 GPU, 5 CPU)")
    p.add_argument("--iters", type=int, default=None,
                   help=f"timed calls; the median is reported (default 30 GPU, 20 CPU; >= {MIN_RECOMMENDED_ITERS} "
                        "recommended)")
    p.add_argument("--out", default=None, help="results folder (default results/bench-<timestamp>)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of routing and inputs, in [0, 2^64 - 1] (default %(default)s)")
    p.add_argument("--emulate", type=int, nargs="+", default=None, metavar="W",
                   help="run the cuda kernels of W virtual ranks (1-8) on this one GPU, for each W given, and "
                        "report per-SM throughput and the fraction of a device copy (default sweep --sms 1 2 4 8 16)")
    # Defaults of None: a flag that only applies with (or without) --emulate is refused when given
    # where it would be ignored (check_flag_combinations).
    p.add_argument("--emulate-nodes", type=int, default=None, metavar="N",
                   help="with --emulate: the W virtual ranks form N nodes of W/N, joined by the loopback transport "
                        "where a cluster uses NVSHMEM (W up to 16); adds the RDMA rows per rank, checked against the "
                        "traffic model, and their bytes per SM per second (default 1)")
    p.add_argument("--reference-iters", type=int, default=None,
                   help="with --emulate: also time the reference backend on the first W's shape (its N nodes and "
                        "routing), this many calls (gloo on the CPU: minutes at the GPU shape); 0 skips it "
                        "(default 0)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None,
                   help="cuda: nccl, one GPU per rank (more ranks than GPUs share them, gloo); cpu: gloo; auto: cuda "
                        "when there is a GPU per rank "
                        "(default auto; not with --emulate)")
    p.add_argument("--calibrate", action="store_true",
                   help="time reference against cuda at this shape and topology (launch it as the job: torchrun or "
                        "srun, one process per GPU) and add the result to the evidence file backend='auto' follows "
                        "(docs/architecture.md#what-runs-where)")
    p.add_argument("--evidence", default=None, metavar="FILE",
                   help="with --calibrate: the evidence file (default $HYBRID_EP_AUTO_EVIDENCE, else "
                        "~/.cache/hybrid-ep/auto-evidence.json)")
    p.add_argument("--reuse", action="store_true",
                   help="with --calibrate: measure nothing where the evidence file holds an entry of this device, "
                        "versions, topology and shape (a failure too); print it and keep it")
    p.add_argument("--time-limit", type=float, default=None, metavar="S",
                   help="with --calibrate: the bound of the whole calibration in seconds; past it the calibration "
                        "stops and records a failure (default: none)")
    return p


def _note(message: str) -> None:
    """A line on stderr (under torchrun from rank 0 only)."""
    if os.environ.get("RANK", "0") == "0":
        print(f"[bench] {message}", file=sys.stderr, flush=True)


# Flags that only the emulation uses, and flags it has no use for: (dest, flag, why).
_EMULATE_ONLY = (("emulate_nodes", "--emulate-nodes", "the nodes of the emulated ranks"),
                 ("reference_iters", "--reference-iters", "the reference run beside the emulated kernels"))
_NOT_WITH_EMULATE = (
    ("world_size", "--world-size", "the emulated world sizes are --emulate's values"),
    ("ranks_per_node", "--ranks-per-node", "the emulated ranks form --emulate-nodes nodes"),
    ("backends", "--backends", "it runs the cuda kernels (and, with --reference-iters, the reference backend)"),
    ("device", "--device", "it runs on this machine's GPU (the reference run on the CPU)"),
)


def check_flag_combinations(args) -> None:
    """Raise BenchArgError for a flag that this kind of run would ignore: --emulate-nodes or
    --reference-iters without --emulate; -w, --ranks-per-node, --backends or --device with it.
    A pure check of the flags, so every rank of a launcher refuses them alike."""
    if args.emulate is None:
        for dest, flag, what in _EMULATE_ONLY:
            if getattr(args, dest) is not None:
                raise BenchArgError(flag, f"only applies with --emulate ({what}); without --emulate it would be "
                                          "ignored")
        return
    for dest, flag, why in _NOT_WITH_EMULATE:
        if getattr(args, dest) not in (None, []):
            raise BenchArgError(flag, f"does not apply with --emulate: {why}")


def _resolve_world(args) -> tuple[str, int, int | None]:
    """(device, world size, ranks per node from the launcher or None)."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    asked = args.device or "auto"
    if under_torchrun():
        W = int(os.environ["WORLD_SIZE"])
        if args.world_size is not None and args.world_size != W:
            raise BenchArgError("--world-size", f"{args.world_size} differs from the launcher's WORLD_SIZE {W}")
        if asked == "cuda" and gpus == 0:
            raise BenchArgError("--device", "cuda was asked for but no CUDA device is visible")
        device = "cuda" if asked == "cuda" or (asked == "auto" and gpus > 0) else "cpu"
        local = os.environ.get("LOCAL_WORLD_SIZE")
        return device, W, int(local) if local and local.isdigit() else None
    if asked == "cuda":
        W = args.world_size if args.world_size is not None else gpus
        if gpus == 0:
            raise BenchArgError("--device", "cuda was asked for but no CUDA device is visible")
        if gpus < W:  # W processes share the GPUs (BenchSpec.shared_gpu)
            _note(f"{plural(W, 'rank')} on {plural(gpus, 'GPU')}: processes share each GPU in a gloo group; kernels "
                  "that wait on their peers need the MPS daemon (docs/benchmarks/README.md)")
        return "cuda", W, None
    if asked == "cpu":
        return "cpu", _spawned_world(args.world_size if args.world_size is not None else CPU_WORLD_SIZE), None
    if args.world_size is None:
        return ("cuda", gpus, None) if gpus > 0 else ("cpu", CPU_WORLD_SIZE, None)
    if gpus >= args.world_size:
        return "cuda", args.world_size, None
    W = _spawned_world(args.world_size)
    if gpus > 0:
        _note(f"{plural(gpus, 'GPU')} for {plural(W, 'rank')}: running on CPU (gloo)")
    return "cpu", W, None


def _spawned_world(W: int) -> int:
    """W, when this machine can start W rank processes (gloo); the range check of W itself is resolve's."""
    if W > MAX_SPAWNED_RANKS:
        raise BenchArgError("--world-size", f"{W} ranks would start {W} processes on this machine; at most "
                                            f"{MAX_SPAWNED_RANKS} without torchrun (launch more ranks with torchrun)")
    return W


def results_folder(args, prefix: str) -> str:
    """--out as given (an empty path included, which check_out_dir refuses), else results/<prefix>-<timestamp>."""
    if args.out is not None:
        return args.out
    return os.path.join("results", f"{prefix}-" + datetime.datetime.now().strftime("%Y%m%d-%H%M%S"))


def check_out_dir(out: str, flag: str = "--out") -> None:
    """Raise BenchArgError(flag) unless `out` is a writable folder or one that can be made:
    checked before the run, so a bad path does not cost a whole benchmark. Nothing is left
    behind (paths.output_problem creates and removes a probe entry). Every rank of a launcher
    runs it before the process group forms, so all refuse a bad --out alike and none waits for
    a rank that has exited; rank 0 alone writes."""
    problem = output_problem(out, folder=True)
    if problem:
        raise BenchArgError(flag, problem)


def resolve(args) -> tuple[BenchSpec, str]:
    """Flags plus device-dependent defaults -> a validated spec and the results folder."""
    device, W, launcher_G = _resolve_world(args)
    if W < 1:
        raise BenchArgError("--world-size", f"must be >= 1, got {W}")
    d = DEFAULTS[device]
    G = args.ranks_per_node if args.ranks_per_node is not None else (launcher_G or W)
    experts = args.experts if args.experts is not None else EXPERTS_PER_RANK * W
    topk = args.topk if args.topk is not None else min(DEFAULT_TOPK, experts)
    spec = BenchSpec(
        world_size=W, ranks_per_node=G,
        hidden=args.hidden if args.hidden is not None else d["hidden"],
        tokens=args.tokens if args.tokens is not None else d["tokens"],
        topk=topk, experts=experts, dtype=args.dtype, routing=args.routing,
        sms=tuple(n for chunk in args.sms for n in chunk),
        backends=tuple(dict.fromkeys(n for chunk in args.backends for n in chunk)),
        warmup=args.warmup if args.warmup is not None else d["warmup"],
        iters=args.iters if args.iters is not None else d["iters"],
        seed=args.seed, device=device, zipf_exponent=args.zipf_exponent, group_limit=args.group_limit,
        shared_gpu=device == "cuda" and not under_torchrun() and W > torch.cuda.device_count(),
    ).validate()
    if deepep.NAME in spec.backends:
        deepep.check_spec(spec)  # what DeepEP's intranode kernels cannot run, by its flag
    if args.topk is None and topk < DEFAULT_TOPK:
        _note(f"--topk defaults to {topk}: there are only {plural(experts, 'expert')}")
    out = results_folder(args, "bench")
    check_out_dir(out)  # on every rank (see check_out_dir); only the reporting rank writes there
    return spec, out


def _pick_backends(spec: BenchSpec, probes: list[dict]) -> tuple[list[str], dict[str, str]]:
    """(backends to run, {baseline: why it is skipped}). By default hybrid-ep's backends that every
    rank can use; a named backend that cannot run is an error, a named baseline is skipped with
    its reason (the other backends' figures are still worth the run) unless nothing else is left."""
    usable = [b for b in probes[0]["backends"] if all(b in p["backends"] for p in probes)]
    if not spec.backends:
        return [b for b in usable if b not in BASELINES], {}
    unusable = {name: probes[0]["unavailable"].get(name) or "not available on every rank"
                for name in spec.backends if name not in usable}
    run = [name for name in spec.backends if name not in unusable]
    for name, reason in unusable.items():
        if name not in BASELINES or not run:
            raise BenchArgError("--backends", f"{name!r} is not available here: {reason}")
        _note(f"{name}: not run: {reason}")
    return run, unusable


def _sms_note(spec: BenchSpec, backend: str) -> str:
    if backend in BACKENDS_WITHOUT_SMS:
        return "no SM setting; --sms ignored, run once" if spec.sms else "no SM setting"
    return "backend default SMs"


def _label(spec: BenchSpec, probes: list[dict]) -> str:
    if spec.device == "cpu":
        return "CPU numbers (gloo): they say nothing about GPU performance"
    return f"GPU numbers ({probes[0]['device']}, {spec.transport})"


def _document(spec: BenchSpec, probes: list[dict], runs: list[dict], launcher_name: str) -> dict:
    hosts = sorted({p["host"] for p in probes})
    devices = sorted({p["device"] for p in probes})
    config = {
        "world_size": spec.world_size, "ranks_per_node": spec.ranks_per_node, "nodes": spec.num_nodes,
        "hidden": spec.hidden, "tokens_per_rank": spec.tokens, "topk": spec.topk, "experts": spec.experts,
        "experts_per_rank": spec.experts_per_rank, "dtype": spec.dtype,
        "combine_dtype": str(spec.combine_dtype).replace("torch.", ""), "routing": spec.routing,
        "zipf_exponent": spec.zipf_exponent if spec.routing == "zipf" else None,
        "group_limit": spec.topk_groups if spec.routing == "group-limited" else None,
        "sms": list(spec.sms) or None, "backends": sorted({r["backend"] for r in runs}, key=BENCH_BACKENDS.index),
        "warmup": spec.warmup, "iters": spec.iters, "seed": spec.seed, "device": spec.device,
        "transport": spec.transport,
    }
    return {
        "metadata": metadata(PROG, device_type=spec.device, config=config, units=UNITS, backends=config["backends"],
                             device=devices[0] if len(devices) == 1 else "; ".join(devices),
                             driver=probes[0]["driver"]),
        "label": _label(spec, probes),
        "machine": {"hosts": hosts, "logical_nodes": len(hosts) < spec.num_nodes, "launcher": launcher_name},
        "runs": runs,
    }


def _execute(spec: BenchSpec, out_dir: str) -> int:
    started = time.monotonic()
    _note(f"starting {plural(spec.world_size, 'rank')} ({spec.transport}, {spec.device}) ...")
    launcher = open_launcher(spec)
    try:
        _note(f"ranks ready after {time.monotonic() - started:.1f} s")
        probes = launcher.run(worker.probe, spec)
        backends, skipped = _pick_backends(spec, probes)
        runs = []
        for backend in backends:
            if spec.sms and backend in BACKENDS_WITHOUT_SMS:
                _note(f"{backend}: no SM setting (torch.distributed collectives); run once, --sms ignored")
            raw = launcher.run(worker.run_backend, spec, backend)
            for k, num_sms in enumerate(spec.sms_for(backend)):
                runs.append(build_run(backend, num_sms, _sms_note(spec, backend), [per_rank[k] for per_rank in raw],
                                      spec.ranks_per_node, probes))
    finally:
        launcher.close()
    if not launcher.is_reporter:
        return 0
    doc = _document(spec, probes, runs, launcher.name) | {"skipped": skipped}
    print(format_report(doc), flush=True)
    os.makedirs(out_dir, exist_ok=True)
    plots = write_plots(doc, out_dir)
    json_path = os.path.join(out_dir, "results.json")
    doc["files"] = {"json": json_path, "plots": plots}
    write_json(doc, json_path)
    print(f"\nresults: {json_path}")
    for path in plots:
        print(f"plot:    {path}")
    print(f"total wall time {time.monotonic() - started:.1f} s", flush=True)
    return 0


def reference_spec(args, shape: dict) -> BenchSpec:
    """The --reference-iters run beside --emulate: the reference backend (gloo, CPU) on the first
    emulated world size with the same nodes (--emulate-nodes), shape, routing and seed, so it
    times the rows the kernels move. Validated."""
    from .emulated import bench_spec

    return bench_spec(args, shape, shape["worlds"][0], sms=(), backends=("reference",), warmup=1,
                      iters=args.reference_iters, device="cpu").validate()


def _emulate(args) -> int:
    """The kernels in emulation, then the reference backend on the same shape (gloo, CPU).

    Every flag, --out and the reference run's shape are checked before the GPU is touched
    (a bad one raises BenchArgError)."""
    from .emulated import run as run_emulated
    from .emulated import settings

    shape = settings(args)  # raises BenchArgError (main reports it)
    args.out = results_folder(args, "emulated")
    check_out_dir(args.out)
    spec = reference_spec(args, shape) if args.reference_iters else None
    rc = run_emulated(args)
    if rc != 0 or spec is None:
        return rc
    _note(f"reference backend on the same shape: {plural(spec.world_size, 'rank')} "
          f"({plural(spec.num_nodes, 'node')}) on the CPU (gloo, a process each), {plural(spec.iters, 'timed call')}")
    return _execute(spec, os.path.join(args.out, "reference"))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse printed usage and the error (or --help)
        return exit_.code if isinstance(exit_.code, int) else 2
    try:
        check_flag_combinations(args)
        calibrate.check_flags(args)
        if args.calibrate:
            evidence = calibrate.evidence_file(args)
            return calibrate.run(resolve(args)[0], evidence, _note, reuse=args.reuse, time_limit_s=args.time_limit)
        if args.emulate is not None:
            return _emulate(args)
        spec, results_dir = resolve(args)
        if spec.iters < MIN_RECOMMENDED_ITERS:
            _note(f"{plural(spec.iters, 'timed call')}: medians of >= {MIN_RECOMMENDED_ITERS} are recommended "
                  "(docs/benchmarks/README.md, What is timed)")
        return _execute(spec, results_dir)
    except BenchArgError as err:
        if os.environ.get("RANK", "0") == "0":
            parser.print_usage(sys.stderr)
            print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
