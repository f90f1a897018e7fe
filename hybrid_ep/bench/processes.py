"""`python -m hybrid_ep.bench.processes --out DIR`: one process per rank on one GPU, as a training
job runs the cuda backend, timed in the emulation bench's unit and written in its JSON form.

It starts W=8 processes on GPU 0 (run it under MPS, `nvidia-cuda-mps-control -d`, so that the
processes' kernels run side by side), each one rank of HybridEPBuffer(backend="cuda"): peer
memory grows on demand (hybrid_ep/backends/cuda/agreement.py). For each layout (one node of 8;
two nodes of 4 joined by NVSHMEM, where the build has it) it checks a case against the dense
oracle (hybrid_ep.verify.cases.check_case), then times the seed shape (H=8192, 4096 tokens per
rank, top-8 of 16 experts) and the DeepSeek-V3-like shape (H=7168, 256 experts, top-8) at 1 and 2
SMs per rank, bf16 and (--dtypes) fp8. Then, with the processes gone, the same points in the
single-process emulation, twice: the ranks addressing each other's tensors as they are
(`emulation`), and each rank with peer memory of its own mapped by the others at addresses of
theirs, as separate processes map it (`emulation_peer`). A gap between the processes and the
emulation is so placed in one run: on the memory and its mappings (the peer emulation has them
too) or on the processes sharing the GPU (it has not).

Every figure is in the emulation bench's unit (hybrid_ep.bench.emulated): destination bytes, one
row per token and destination rank (the rows a rank receives, `recv_rows`; fp8 counts its scales)
per second per SM, over the slowest rank's median. Each timed call is kept: its time and its data
path. DIR/processes.json starts with the metadata block every JSON of the project has; one line
per point goes to stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from ..fp8 import FP8_DTYPE, quantize_fp8
from ..metadata import metadata
from .spec import L2_FLUSH_BYTES

TOOL = "python -m hybrid_ep.bench.processes"
SHAPES = {"seed": dict(hidden=8192, experts=16, topk=8, tokens=4096),
          "dsv3": dict(hidden=7168, experts=256, topk=8, tokens=4096)}
DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}
WARMUP = 3  # untimed calls before each op's timed ones
UNITS = {"world_size": "ranks", "nodes": "nodes", "sms_per_rank": "SMs",
         "recv_rows": "rows the ranks received in the dispatch (one per token and destination rank)",
         "out_rows": "rows the ranks hand to their experts (one per token and routed local expert, padding included)",
         "row_bytes": "bytes per dispatched row (fp8: its scales included)",
         "combine_row_bytes": "bytes per combined row (bf16)",
         "dispatch_ms": "ms: the slowest rank's median (CUDA events, L2 flushed before each call)",
         "combine_ms": "ms: the slowest rank's median",
         "dispatch_dest_gbps_per_sm": "GB/s per SM (1e9 bytes/s): recv_rows x row_bytes / dispatch_ms / (world_size "
                                      "x sms_per_rank), the emulation bench's unit",
         "combine_dest_gbps_per_sm": "GB/s per SM: recv_rows x combine_row_bytes / combine_ms / SMs",
         "samples_ms": "ms: every timed call's time, in call order",
         "paths": "data path of every timed call, in call order (direct or receive)",
         "data_path": "the data paths of a row's timed calls (direct+receive: some took the receive path)",
         "first_call_ms": "ms: the first dispatch + combine pair of a fresh buffer, peer memory's growth included",
         "host_us_per_pair": "microseconds of host CPU time per static-size pair (median over pairs that read "
                             "nothing back)",
         "peer_memory_held": "bytes of peer memory the rank holds after its points",
         "elapsed_s": "s"}


def _inputs(shape: dict, rank: int, dtype: torch.dtype, seed: int = 0):
    """One rank's tokens, fp8 scales (or None), top-k experts and weights; the same on every run."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    T, H, E, K = shape["tokens"], shape["hidden"], shape["experts"], shape["topk"]
    x = torch.randn(T, H, generator=gen)
    idx = torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, generator=gen)
    if dtype == FP8_DTYPE:
        q, scales = quantize_fp8(x)
        return q, scales, idx, w
    return x.to(dtype), None, idx, w


def row_bytes(hidden: int, dtype: torch.dtype) -> int:
    """Bytes of one dispatched row as the bench counts them: fp8 carries a scale per 128 values."""
    if dtype == FP8_DTYPE:
        return hidden + hidden // 128 * 4
    return hidden * torch.empty(0, dtype=dtype).element_size()


def timed_calls(fn, iters: int, device: str = "cuda", warmup: int = WARMUP) -> list[tuple[float, object]]:
    """(milliseconds, what fn returned) of each of `iters` calls after `warmup` untimed ones: CUDA
    events with the L2 flushed before each call on a GPU (as the emulation bench times), the wall
    clock on the CPU model."""
    for _ in range(warmup):
        fn()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda") if device == "cuda" else None
    out = []
    for _ in range(iters):
        if flush is None:
            t0 = time.perf_counter()
            got = fn()
            out.append(((time.perf_counter() - t0) * 1e3, got))
            continue
        flush.zero_()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        got = fn()
        b.record()
        b.synchronize()
        out.append((a.elapsed_time(b), got))
    return out


def _op_record(calls: list[tuple[float, object]]) -> dict:
    samples = [ms for ms, _ in calls]
    return {"median_ms": statistics.median(samples), "samples_ms": samples, "paths": [path for _, path in calls]}


HOST_WARMUP = 5  # host_pairs: untimed pairs first
HOST_PAIRS = 40  # and timed ones, per rank and shape (the default SMs per rank)


def host_pairs(buf, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, pairs: int, device: str = "cuda",
               scales: torch.Tensor | None = None) -> dict:
    """The host's CPU time per static-size dispatch + combine pair on this rank, launches on and
    nothing synchronised, as a training step issues them: the median over the pairs that read
    nothing back. With peer memory a pair the agreement's ledger does not hold reads its count
    kernel's output (a host synchronisation, which would time the kernels queued before it): such
    pairs are counted, not timed. The static size is the largest rank's rows of this routing (one
    size on every rank, as the agreement needs)."""
    import torch.distributed as dist

    rows = torch.tensor([buf.dispatch(x, topk_idx=idx, topk_weights=w, scales=scales).tokens.shape[0]])
    dist.all_reduce(rows, op=dist.ReduceOp.MAX)
    static = int(rows)
    peer = buf._backend._engine.peer
    times, read_pairs = [], 0
    for i in range(HOST_WARMUP + pairs):
        reads = peer.reads if peer is not None else 0
        t0 = time.thread_time_ns()
        res = buf.dispatch(x, topk_idx=idx, topk_weights=w, scales=scales, num_out_tokens=static)
        y = buf.combine(_combinable(res.tokens), res.handle)
        t1 = time.thread_time_ns()
        read = peer is not None and peer.reads > reads
        del res, y
        if i >= HOST_WARMUP:
            read_pairs += read
            if not read:
                times.append((t1 - t0) / 1e3)
    if device == "cuda":
        torch.cuda.synchronize()
    return {"static_rows": static, "pairs": pairs, "pairs_that_read": read_pairs, "pairs_timed": len(times),
            "host_us_per_pair": statistics.median(times) if times else None}


def _combinable(tokens: torch.Tensor) -> torch.Tensor:
    """What the experts hand the combine: the dispatch's rows themselves (in peer memory, read in
    place) for bf16; for fp8 rows a bf16 copy, as an expert's output would be."""
    return tokens.to(torch.bfloat16) if tokens.dtype == FP8_DTYPE else tokens


def time_on_rank(name: str, dtype_name: str, ranks_per_node: int, sms: list[int], iters: int) -> dict:
    """Runs on every rank: the shape's timed calls with their paths, the memory held."""
    import torch.distributed as dist

    from ..buffer import HybridEPBuffer

    shape, dtype = SHAPES[name], DTYPES[dtype_name]
    rank, W = dist.get_rank(), dist.get_world_size()
    buf = HybridEPBuffer(None, shape["hidden"], shape["tokens"], shape["experts"], ranks_per_node=ranks_per_node,
                         backend="cuda")
    x, scales, idx, w = (None if t is None else t.cuda() for t in _inputs(shape, rank, dtype))

    def dispatch(n=None):
        return buf.dispatch(x, topk_idx=idx, topk_weights=w, scales=scales, num_sms=n)

    torch.cuda.synchronize()
    started = time.perf_counter()
    res = dispatch()  # the first call: grows the peer memory
    y = buf.combine(_combinable(res.tokens), res.handle)
    torch.cuda.synchronize()
    first = {"first_call_ms": (time.perf_counter() - started) * 1e3, "path": res.handle.data_path}
    del res, y
    points = []
    for n in sms:
        res = dispatch(n)
        expert_out = _combinable(res.tokens)
        d = timed_calls(lambda n=n: dispatch(n).handle.data_path, iters)
        c = timed_calls(lambda r=res, e=expert_out, n=n: (buf.combine(e, r.handle, num_sms=n), r.handle.data_path)[1],
                        iters)
        points.append({"sms": n, "recv_rows": int(res.handle.recv_counts_W.sum()), "out_rows": res.tokens.shape[0],
                       "dispatch": _op_record(d), "combine": _op_record(c)})
        del res, expert_out
    host = host_pairs(buf, x, idx, w, HOST_PAIRS, scales=scales)
    held = buf._backend.peer_memory_held() if hasattr(buf._backend, "peer_memory_held") else 0
    return {"rank": rank, "world_size": W, "pid": os.getpid(), **first, "points": points, "host": host,
            "peer_memory_held": held, "memory_plan": str(buf.memory_plan())}


def process_rows(got: list[dict], name: str, dtype_name: str, nodes: int) -> list[dict]:
    """The processes' points as rows of the bench's form: per SM count, the slowest rank's median
    and all ranks' destination rows; each rank's samples and paths kept under `ranks`."""
    shape, dtype = SHAPES[name], DTYPES[dtype_name]
    ranks = sorted(got, key=lambda g: g["rank"])
    out = []
    for i, point in enumerate(ranks[0]["points"]):
        per_rank = [g["points"][i] for g in ranks]
        row = {"mode": "processes", "shape": name, "dtype": dtype_name, "world_size": len(ranks), "nodes": nodes,
               "sms_per_rank": point["sms"], "recv_rows": sum(p["recv_rows"] for p in per_rank),
               "out_rows": sum(p["out_rows"] for p in per_rank), "row_bytes": row_bytes(shape["hidden"], dtype),
               "combine_row_bytes": shape["hidden"] * 2,
               "dispatch_ms": max(p["dispatch"]["median_ms"] for p in per_rank),
               "combine_ms": max(p["combine"]["median_ms"] for p in per_rank),
               "ranks": [{"rank": g["rank"], "pid": g["pid"], "recv_rows": p["recv_rows"], "dispatch": p["dispatch"],
                          "combine": p["combine"]} for g, p in zip(ranks, per_rank)]}
        paths = [path for p in per_rank for op in ("dispatch", "combine") for path in p[op]["paths"]]
        out.append(_with_rates(row, paths))
    return out


def _with_rates(row: dict, paths: list[str]) -> dict:
    """The two destination rates of a row (the bench's unit), from its rows, bytes and times, and
    the data paths its timed calls took (direct+receive: some took the receive path)."""
    row["data_path"] = "+".join(sorted(set(paths)))
    sms = row["world_size"] * row["sms_per_rank"]
    row["dispatch_dest_gbps_per_sm"] = row["recv_rows"] * row["row_bytes"] / (row["dispatch_ms"] * 1e6) / sms
    row["combine_dest_gbps_per_sm"] = row["recv_rows"] * row["combine_row_bytes"] / (row["combine_ms"] * 1e6) / sms
    return row


# Address space each virtual rank reserves for its peer memory in the peer emulation: room for the
# largest shape's growth (about 2.2 GB per rank at the seed shape), a reservation only.
PEER_RESERVE_BYTES = 8 << 30


def emulated_points(shape: dict, ranks_per_node: int, sms: list[int], iters: int, *, peer: bool = False,
                    device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """The same shape in the single-process emulation (8 virtual ranks, one launch), as rows of the
    bench's form. peer: each rank with peer memory of its own that the others map at addresses of
    theirs, as separate processes do (its first pair grows the memory and takes the receive path;
    untimed)."""
    from ..backends.cuda.emulation import EmulatedGroup

    W = 8
    extra = dict(separate_processes=True, peer_reserve=PEER_RESERVE_BYTES) if peer else {}
    group = EmulatedGroup(W, shape["hidden"], shape["tokens"], shape["experts"], ranks_per_node=ranks_per_node,
                          device=torch.device(device), **extra)
    xs, scales, idx, ws = ([None if t is None else t.to(device) for t in part]
                           for part in zip(*[_inputs(shape, r, dtype) for r in range(W)]))
    scales = scales if dtype == FP8_DTYPE else None

    def dispatch(n=None):
        return group.dispatch(xs, idx, ws, scales=scales, num_sms=n)

    out = []
    try:
        if peer:
            first = dispatch()
            group.combine([_combinable(r.tokens) for r in first], [r.handle for r in first])
            group.synchronize()
            del first
        for n in sms:
            res = dispatch(n)
            outs, handles = [_combinable(r.tokens) for r in res], [r.handle for r in res]
            d = timed_calls(lambda n=n: dispatch(n)[0].handle.data_path, iters, device)
            c = timed_calls(lambda n=n, e=outs, h=handles: (group.combine(e, h, num_sms=n), h[0].data_path)[1],
                            iters, device)
            row = {"mode": "emulation_peer" if peer else "emulation", "world_size": W, "nodes": W // ranks_per_node,
                   "sms_per_rank": n, "recv_rows": sum(int(h.recv_counts_W.sum()) for h in handles),
                   "out_rows": sum(r.tokens.shape[0] for r in res), "row_bytes": row_bytes(shape["hidden"], dtype),
                   "combine_row_bytes": shape["hidden"] * 2, "dispatch": _op_record(d), "combine": _op_record(c)}
            row["dispatch_ms"], row["combine_ms"] = row["dispatch"]["median_ms"], row["combine"]["median_ms"]
            out.append(_with_rates(row, row["dispatch"]["paths"] + row["combine"]["paths"]))
            del res, outs, handles
    finally:
        group.close()
    return out


def _rates_text(rows: list[dict]) -> str:
    return ", ".join(f"{r['sms_per_rank']} SM: {r['dispatch_dest_gbps_per_sm']:.1f}/{r['combine_dest_gbps_per_sm']:.1f}"
                     f" GB/s/SM ({r['data_path']})" for r in rows)


def _host_text(got: list[dict]) -> str:
    """The log line's host time: every rank's median CPU us per pair, and the pairs that read."""
    times = [g["host"]["host_us_per_pair"] for g in got]
    shown = "/".join("-" if t is None else f"{t:.0f}" for t in times)
    return f"{shown} us per pair by rank, {sum(g['host']['pairs_that_read'] for g in got)} pairs read"


def _processes(pool, layout: dict, nodes: int, G: int, args) -> None:
    """The oracle case three times on each rank's buffer (the direct path from the second call),
    then every shape and dtype's timed points, in the pool's processes."""
    from ..verify.cases import Case, check_case

    case = Case(world_size=8, ranks_per_node=G, num_experts=16, hidden=2048, tokens=(64, 17, 0, 5, 33, 1, 40, 9),
                topk=4, dtype=torch.bfloat16, backend="cuda")
    got = check_case(pool, case, calls=3)  # the first call grows peer memory, the later ones go direct
    layout["oracle"] = {"ok": True, "call_paths": [r["call_paths"] for r in got]}
    print(f"processes nodes={nodes} oracle: every call of every rank matches, paths of rank 0 by call "
          f"{got[0]['call_paths']}", flush=True)
    for name in args.shapes:
        for dtype_name in args.dtypes:
            got = pool.run(time_on_rank, [(name, dtype_name, G, args.sms, args.iters)] * 8, timeout_s=180)
            rows = process_rows(got, name, dtype_name, nodes)
            layout["runs"].extend(rows)
            layout["ranks"].append({"shape": name, "dtype": dtype_name,
                                    **{k: [g[k] for g in got]
                                       for k in ("pid", "first_call_ms", "path", "host", "peer_memory_held")}})
            print(f"processes nodes={nodes} {name} {dtype_name}: {len({g['pid'] for g in got})} processes, first call "
                  f"{got[0]['first_call_ms']:.1f} ms, held {got[0]['peer_memory_held']} B, {_rates_text(rows)}; "
                  f"host {_host_text(got)}", flush=True)


def _emulations(layout: dict, nodes: int, G: int, args) -> int:
    """The same points in the single-process emulation, plain and through peer memory; 1 when one failed."""
    worst = 0
    for name in args.shapes:
        for dtype_name in args.dtypes:
            for mode, peer in (("emulation", False), ("emulation_peer", True)):
                try:
                    rows = emulated_points(SHAPES[name], G, args.sms, args.iters, peer=peer, dtype=DTYPES[dtype_name])
                    for r in rows:
                        r.update(shape=name, dtype=dtype_name)
                    layout["runs"].extend(rows)
                    print(f"processes nodes={nodes} {name} {dtype_name} {mode}: {_rates_text(rows)}", flush=True)
                except Exception as exc:  # noqa: BLE001 - recorded; the next points and layouts still run
                    key = f"{mode}/{name}/{dtype_name}"
                    layout["errors"][key] = f"{type(exc).__name__}: {exc}"[:2000]
                    print(f"processes nodes={nodes} {key}: FAILED {layout['errors'][key][:400]}", flush=True)
                    worst = 1
    return worst


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2], choices=[1, 2],
                        help="1: one node of 8; 2: two of 4")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["bf16"], choices=list(DTYPES))
    parser.add_argument("--sms", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--emulation", choices=["both", "none"], default="both",
                        help="also time the points in the single-process emulation, plain and through peer memory")
    parser.add_argument("--pool", choices=["yes", "none"], default="yes",
                        help="none: no processes, the emulation points alone (a fault there is then theirs)")
    parser.add_argument("--timeout", type=float, default=20.0, help="HYBRID_EP_TIMEOUT_S of the ranks")
    args = parser.parse_args(argv)
    if args.pool == "none" and args.emulation == "none":
        parser.error("--pool none with --emulation none leaves nothing to run")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("processes: needs a CUDA device", file=sys.stderr)
        return 2
    from ..spawn import ProcessGroupPool
    from .shared_gpu import pool_env

    args.out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    config = {"world_size": 8, "nodes": args.nodes, "shapes": {k: SHAPES[k] for k in args.shapes},
              "dtypes": args.dtypes, "sms_per_rank": args.sms, "iters": args.iters, "warmup": WARMUP,
              "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")), "pool": args.pool,
              "env": {k: v for k, v in os.environ.items() if k.startswith("HYBRID_EP_")}}
    record = {"metadata": metadata(TOOL, device_type="cuda", config=config, units=UNITS, backends=["cuda"]),
              "layouts": []}
    worst = 0
    for nodes in args.nodes:
        G = 8 // nodes
        layout = {"nodes": nodes, "ranks_per_node": G, "runs": [], "ranks": [], "errors": {}}
        env = pool_env(8, args.timeout) if nodes > 1 else {"HYBRID_EP_TIMEOUT_S": str(args.timeout)}
        try:
            if args.pool == "yes":
                with ProcessGroupPool(8, "gloo", env=env) as pool:
                    _processes(pool, layout, nodes, G, args)
        except (AssertionError, RuntimeError) as exc:
            layout["errors"]["processes"] = f"{type(exc).__name__}: {exc}"[:4000]
            print(f"processes nodes={nodes}: FAILED {layout['errors']['processes'][:600]}", flush=True)
            worst = 1
        if args.emulation == "both":
            worst = max(worst, _emulations(layout, nodes, G, args))
        record["layouts"].append(layout)
        record["elapsed_s"] = time.perf_counter() - started
        (args.out / "processes.json").write_text(json.dumps(record, indent=1))
    return worst


if __name__ == "__main__":
    sys.exit(main())
