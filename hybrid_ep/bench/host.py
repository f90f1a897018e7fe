"""`python -m hybrid_ep.bench.host`: host time per dispatch + combine pair, without a GPU.

Times the cuda backend's host path (argument checks, allocations, the launch arguments the
extension fills, the handles) of an EmulatedGroup on the CPU model of the kernels, with
the launches switched off (ext.set_launches_enabled(False)): every call does all its host
work and runs no kernel. Static-size mode (num_out_tokens), as the GPU benchmark times it.
Per world size W (virtual ranks one call drives; 1 is production's one rank per process)
and data path: the median over the timed pairs of the wall time and of the thread's CPU
time (on a loaded machine the CPU time is the steadier), per pair and per rank (/ W), at two
levels: `engine` (Engine.dispatch + Engine.combine on routings normalised beforehand: the
per-call host path this package owns below the API), `group` (EmulatedGroup.dispatch +
combine: the API's argument checks, routing normalisation and handles on top) and, at W = 1,
`buffer` (HybridEPBuffer.dispatch + combine over the cuda backend, one rank per process as
in production: the public API's path, on the same engine, in a torch.distributed world of
one), `autograd` (hybrid_ep.dispatch + combine on that buffer, inputs without gradients:
no graph to record, as in evaluation) and `training` (the same with x, topk_weights and
expert_out asking for gradients: Megatron's training forward, which records the graph; the
graph is freed after each pair, its backward is not timed). `--dtype fp8` dispatches fp8 rows
with their fp32 scales (the scales' checks and output on top; no `training` level: fp8 rows
are not differentiable).

Paths: `receive`, `direct` (ranks in one process: outputs from PyTorch's allocator, combine
reads expert_out where it lies) and `peer`: the direct path as ranks in separate processes
take it (EmulatedGroup(separate_processes=True): each rank's peer memory of memfd chunks
mapped at addresses of its own, the agreement's words set on calls that read, blocks taken from peer
memory, expert_out in the rank's expert-out block). Peer memory is pre-sized
(PEER_BYTES) and the pairs are the static calls the agreement's ledger holds, which launch
both dispatch kernels in one call without a host read; the ledger is set back before each
pair, outside the timing, since with launches off no read can refresh it (a call the ledger
does not hold reads once: tests/model/test_launches_made.py counts both).

The outputs (megabytes per rank) come from glibc's heap, not a fresh mmap per call
(steady_cpu_heap): on a GPU the caching allocator serves them with no system call, while
glibc's default mmap threshold moves with what was freed before, so a point's time depended
on the points run before it (two modes, 8-10 us per rank apart).

`--dynamic` measures the dynamic-size dispatch instead (num_out_tokens=None, Megatron's
default), with the launches on (the count kernel must compute the output size): a proxy
around the engine's HostPath records the thread's CPU time from the call's start to the
count launch, and from the count kernel's return (its one host read follows) to the
dispatch launch. On a GPU the second part runs while the GPU idles after the read.

These are CPU measurements of the host path with stubbed launches, not GPU numbers: the
GPU benchmark (`python -m hybrid_ep.bench --emulate W`) reports the host time per rank
next to the kernels'. Writes JSON to --out.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import json
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

from ..autograd import combine as hep_combine
from ..autograd import dispatch as hep_dispatch
from ..cli_parser import ArgumentParser
from ..config import FP8_BLOCK
from ..fp8 import FP8_DTYPE
from ..metadata import metadata
from ..routing import normalize_routing

LEVELS = ("engine", "group", "buffer", "autograd", "training")  # the last three at W = 1 only
PATHS = ("receive", "direct", "peer")
DTYPES = ("bf16", "fp8")  # the dispatch's rows; fp8 with its fp32 scales (combine: bf16 either way)
PEER_BYTES = 64 << 20  # the peer path's pre-sized peer memory per rank: the bench's calls with room to spare
DEFAULTS = dict(worlds=(1, 2, 8), paths=PATHS, hidden=1024, tokens=256, topk=8, warmup=50,
                iters=500)


def _routing(W: int, T: int, E: int, K: int, gen: torch.Generator):
    idx = [torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous() for _ in range(W)]
    w = [torch.rand(T, K, generator=gen) for _ in range(W)]
    return idx, w


def steady_cpu_heap() -> str:
    """Fix glibc's mmap and trim thresholds (mallopt) for this process, so allocations up to
    32 MiB reuse heap memory instead of a new mapping each call; says what it set."""
    name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(name) if name else None
    if libc is None or not hasattr(libc, "mallopt"):
        return "default (no glibc mallopt)"
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # malloc.h
    if libc.mallopt(M_MMAP_THRESHOLD, 32 << 20) != 1 or libc.mallopt(M_TRIM_THRESHOLD, 1 << 30) != 1:
        return "default (mallopt refused)"
    return "glibc mallopt: M_MMAP_THRESHOLD 32 MiB, M_TRIM_THRESHOLD 1 GiB"


@contextlib.contextmanager
def _world_of_one():
    """torch.distributed in this process as a world of one (gloo), unless it already is."""
    if dist.is_initialized():
        yield
        return
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _single_rank_buffer(group):
    """A HybridEPBuffer of one rank whose cuda backend drives `group`'s buffers with an Engine
    of its own, as production's (W = 1)."""
    from ..backends.cuda.backend import CudaBackend
    from ..buffer import HybridEPBuffer

    c = group.config
    buf = HybridEPBuffer(None, c.hidden_dim, c.max_tokens_per_rank, c.num_experts, backend="reference",
                         num_sms_dispatch=1, num_sms_combine=1)
    buf._backend = CudaBackend.on_group(buf.config, buf.rank, buf._owner, group)
    return buf


def _inputs(W: int, T: int, H: int, dtype: str, gen: torch.Generator):
    """Each rank's rows in the dispatch's dtype, and their scales (fp8: one fp32 per 128 columns;
    bf16: None)."""
    xs = [torch.randn(T, H, generator=gen) for _ in range(W)]
    if dtype == "fp8":
        return [x.to(FP8_DTYPE) for x in xs], [torch.rand(T, H // FP8_BLOCK, generator=gen) + 0.5 for _ in range(W)]
    return [x.to(torch.bfloat16) for x in xs], [None] * W


def measure(world_size: int, data_path: str, *, hidden: int, tokens: int, topk: int, warmup: int,
            iters: int, dtype: str = "bf16") -> dict:
    """One point: EmulatedGroup on the CPU model, launches off, static size T x K rows."""
    from ..backends.cuda.emulation import EmulatedGroup

    W, H, T, K = world_size, hidden, tokens, topk
    E = max(2 * W, K)
    peer = data_path == "peer"
    group = EmulatedGroup(W, H, T, E, device="cpu", data_path="direct" if peer else data_path, num_sms_dispatch=1,
                          num_sms_combine=1, separate_processes=peer, peer_memory_bytes=PEER_BYTES if peer else None)
    ext = group.ext
    gen = torch.Generator().manual_seed(0)
    xs, scales = _inputs(W, T, H, dtype, gen)
    idx, w = _routing(W, T, E, K, gen)
    static = T * K
    routings = [normalize_routing(T, E, x.device, topk_idx=i, topk_weights=v, check_values=False)
                for x, i, v in zip(xs, idx, w)]
    ext.set_launches_enabled(False)
    stack = contextlib.ExitStack()
    try:
        point = _measure_levels(group, stack, data_path, xs, scales, idx, w, routings, static, warmup, iters)
        point["dtype"] = dtype
        return point
    finally:
        ext.set_launches_enabled(True)
        group.close()
        stack.close()


def _peer_ledger(group, xs, scales, routings, static):
    """The peer path's start: a first direct call takes each rank's expert-out block (where
    expert_out then lies); returns what sets the agreement's ledger back to where it is after it."""
    group.engine.dispatch_ranks(xs, scales, routings, static, 1)
    ledger = list(group.peer.ledger)

    def between():
        group.peer.ledger = list(ledger)

    return between


def _measure_levels(group, stack, data_path, xs, scales, idx, w, routings, static, warmup, iters) -> dict:
    """measure's levels on `group`, launches off (`stack` holds what a level at W = 1 opens); fp8
    rows (scales given) are not differentiable, so they have no `training` level."""
    W, engine, (T, H), K, E = group.world_size, group.engine, xs[0].shape, idx[0].shape[1], group.config.num_experts
    peer = data_path == "peer"
    fp8 = scales[0] is not None
    between = _peer_ledger(group, xs, scales, routings, static) if peer else None
    # With separate processes, in the expert-out block on the direct path, as the GPU benchmark
    # has them (else combine copies them in).
    expert_outs = [group.in_peer_memory(i, torch.zeros(static, H, dtype=torch.bfloat16)) for i in range(W)]

    group_scales = scales if fp8 else None

    def group_pair():
        res = group.dispatch(xs, idx, w, scales=group_scales, num_out_tokens=static)
        group.combine(expert_outs, [r.handle for r in res])

    def buffer_pair():
        res = buf.dispatch(xs[0], idx[0], w[0], scales=scales[0], num_out_tokens=static)
        buf.combine(expert_outs[0], res.handle)

    def autograd_pair():
        res = hep_dispatch(buf, xs[0], idx[0], w[0], scales=scales[0], num_out_tokens=static)
        hep_combine(buf, expert_outs[0], res.handle)

    leaves = [t.detach().requires_grad_() for t in (xs[0], w[0], expert_outs[0])]  # views, no copies

    def training_pair():
        res = hep_dispatch(buf, leaves[0], idx[0], leaves[1], num_out_tokens=static)
        hep_combine(buf, leaves[2], res.handle)  # its graph and res's die on return

    def engine_pair():
        res = engine.dispatch_ranks(xs, scales, routings, static, 1)
        engine.combine_ranks(expert_outs, [r.send for r in res], [r.recv for r in res], [r.probs_R for r in res],
                             False, 1)

    point = {"world_size": W, "data_path": data_path, "hidden": H, "tokens": T, "topk": K, "experts": E,
             "num_out_tokens": static, "iters": iters}
    levels = [("engine", engine_pair), ("group", group_pair)]
    if W == 1:
        stack.enter_context(_world_of_one())
        buf = _single_rank_buffer(group)
        levels += [("buffer", buffer_pair), ("autograd", autograd_pair)]
        if not fp8:
            levels.append(("training", training_pair))
    reads, directs = (group.peer.reads, group.peer.directs) if peer else (0, 0)
    for level, pair in levels:
        wall, cpu = _time(pair, warmup, iters, between)
        wall_us, cpu_us = statistics.median(wall), statistics.median(cpu)
        deciles = statistics.quantiles(wall, n=10)
        point[level] = {"wall_us_per_pair": wall_us, "wall_us_per_pair_per_rank": wall_us / W,
                        "cpu_us_per_pair": cpu_us, "cpu_us_per_pair_per_rank": cpu_us / W,
                        "wall_us_p10_p90": [deciles[0], deciles[-1]]}
    if peer:  # every pair on the ledger: no host read, every dispatch direct
        point["peer_pairs"] = len(levels) * (warmup + iters)
        point["peer_reads"] = group.peer.reads - reads
        point["peer_direct_dispatches"] = group.peer.directs - directs
    return point


class _HostClock:
    """A proxy of an engine's ext.HostPath that notes the thread's CPU time around the
    dynamic dispatch's two launches."""

    def __init__(self, host):
        self._host, self.marks = host, {}

    def dispatch_count(self, *args):
        self.marks["count_launch"] = time.thread_time_ns()
        self._host.dispatch_count(*args)
        self.marks["count_done"] = time.thread_time_ns()

    def dispatch_rows(self, *args):
        self.marks["rows_launch"] = time.thread_time_ns()
        return self._host.dispatch_rows(*args)

    def dispatch_rows_into(self, *args):
        self.marks["rows_launch"] = time.thread_time_ns()
        return self._host.dispatch_rows_into(*args)  # blocks of peer memory: their tensors

    def __getattr__(self, name):
        return getattr(self._host, name)


def measure_dynamic(world_size: int, data_path: str, *, hidden: int, tokens: int, topk: int, warmup: int,
                    iters: int) -> dict:
    """One point of the dynamic-size dispatch (EmulatedGroup.dispatch, num_out_tokens=None) on
    the CPU model with launches on: the median CPU time before the count launch and between
    the count kernel's return and the dispatch launch, per call and per rank."""
    from ..backends.cuda.emulation import EmulatedGroup

    W, H, T, K = world_size, hidden, tokens, topk
    E = max(2 * W, K)
    peer = data_path == "peer"
    group = EmulatedGroup(W, H, T, E, device="cpu", data_path="direct" if peer else data_path, num_sms_dispatch=1,
                          num_sms_combine=1, separate_processes=peer)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=gen).to(torch.bfloat16) for _ in range(W)]
    idx, w = _routing(W, T, E, K, gen)
    clock = group.engine.host = _HostClock(group.engine.host)
    before, after = [], []
    try:
        for i in range(warmup + iters):
            t0 = time.thread_time_ns()
            res = group.dispatch(xs, idx, w)
            del res
            if i >= warmup:
                m = clock.marks
                before.append((m["count_launch"] - t0) / 1e3)
                after.append((m["rows_launch"] - m["count_done"]) / 1e3)
        path = "peer" if peer and group.engine.data_path == "direct" else group.engine.data_path
    finally:
        group.close()
    b, a = statistics.median(before), statistics.median(after)
    return {"world_size": W, "data_path": path, "hidden": H, "tokens": T, "topk": K, "experts": E,
            "num_out_tokens": None, "iters": iters,
            "before_count": {"cpu_us_per_call": b, "cpu_us_per_rank": b / W},
            "after_read": {"cpu_us_per_call": a, "cpu_us_per_rank": a / W}}


def _time(pair, warmup: int, iters: int, between=None) -> tuple[list[float], list[float]]:
    """Wall and thread CPU time of each timed call of `pair`; `between` (untimed) before each."""
    wall, cpu = [], []
    for i in range(warmup + iters):
        if between is not None:
            between()
        c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
        pair()
        t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        if i >= warmup:
            wall.append((t1 - t0) / 1e3)
            cpu.append((c1 - c0) / 1e3)
    return wall, cpu


def main(argv=None) -> int:
    parser = ArgumentParser(prog="python -m hybrid_ep.bench.host", description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULTS["worlds"]))
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(DEFAULTS["paths"]))
    parser.add_argument("--dtype", choices=DTYPES, default="bf16",
                        help="the dispatch's rows: bf16, or fp8 with its fp32 scales (static size only)")
    for name in ("hidden", "tokens", "topk", "warmup", "iters"):
        parser.add_argument(f"--{name}", type=int, default=DEFAULTS[name])
    parser.add_argument("--dynamic", action="store_true",
                        help="the dynamic-size dispatch's host time around its host read, launches on")
    parser.add_argument("--out", help="JSON file to write")
    args = parser.parse_args(argv)
    if args.dynamic and args.dtype != "bf16":
        parser.error("--dtype fp8 times the static-size pairs; --dynamic takes bf16 rows")
    torch.set_num_threads(1)  # the host path is single-threaded; no pool threads in the timings
    heap = steady_cpu_heap()
    points = []
    for W in args.worlds:
        for path in args.paths:
            if args.dynamic:
                p = measure_dynamic(W, path, hidden=args.hidden, tokens=args.tokens, topk=args.topk,
                                    warmup=args.warmup, iters=args.iters)
                points.append(p)
                print(f"W={W} {path} dynamic: before the count launch {p['before_count']['cpu_us_per_call']:.1f} us "
                      f"CPU per call ({p['before_count']['cpu_us_per_rank']:.1f} per rank); from the layout "
                      f"kernel's return to the dispatch launch {p['after_read']['cpu_us_per_call']:.1f} "
                      f"({p['after_read']['cpu_us_per_rank']:.1f} per rank)", flush=True)
                continue
            p = measure(W, path, hidden=args.hidden, tokens=args.tokens, topk=args.topk, warmup=args.warmup,
                        iters=args.iters, dtype=args.dtype)
            points.append(p)
            for level in LEVELS:
                if level not in p:
                    continue
                q = p[level]
                print(f"W={W} {path} {level}: {q['cpu_us_per_pair_per_rank']:.1f} us CPU per pair per rank "
                      f"({q['cpu_us_per_pair']:.1f} per pair); wall {q['wall_us_per_pair_per_rank']:.1f} per rank",
                      flush=True)
    units = {"engine": "Engine.dispatch + Engine.combine", "group": "EmulatedGroup.dispatch + combine",
             "buffer": "HybridEPBuffer.dispatch + combine (cuda backend, W = 1 only)",
             "autograd": "hybrid_ep.dispatch + combine on that buffer, inputs without gradients (W = 1 only)",
             "training": "the same with x, topk_weights and expert_out requiring gradients: the forward "
                         "records the graph (W = 1 only)",
             "wall_us_per_pair": "microseconds (median)", "wall_us_per_pair_per_rank": "microseconds (median / W)",
             "cpu_us_per_pair": "microseconds of this thread's CPU time (median)",
             "cpu_us_per_pair_per_rank": "microseconds of CPU time (median / W)",
             "wall_us_p10_p90": "microseconds (10th and 90th percentile)"}
    if args.dynamic:
        units = {"before_count": "from EmulatedGroup.dispatch's start to the count launch",
                 "after_read": "from the count kernel's return (the host read follows) to the dispatch launch",
                 "cpu_us_per_call": "microseconds of this thread's CPU time (median)",
                 "cpu_us_per_rank": "microseconds of CPU time (median / W)"}
    config = {k: getattr(args, k) for k in ("worlds", "paths", "dtype", "hidden", "tokens", "topk", "warmup",
                                            "iters", "dynamic")}
    doc = {"metadata": metadata("python -m hybrid_ep.bench.host", device_type="cpu", config=config, units=units,
                                backends=("cuda",)),
           "what": ("host time of the dynamic-size dispatch around its host read, cuda backend on the CPU model "
                    "with launches on: a CPU measurement of the host path, not a GPU number" if args.dynamic else
                    "host time per dispatch + combine pair, static size, cuda backend on the CPU model with "
                    "launches off (no kernel runs): a CPU measurement of the host path, not a GPU number"),
           "command": "python -m hybrid_ep.bench.host " + " ".join(sys.argv[1:] if argv is None else argv),
           "cpu_heap": heap,
           "points": points}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
