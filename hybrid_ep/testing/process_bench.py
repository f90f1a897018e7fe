"""One process per rank on one GPU, as a training job runs the cuda backend: correctness against
the oracle, the data path of every call, and the direct path's speed beside the emulation's.

`python -m hybrid_ep.testing.process_bench --out DIR` starts W=8 processes on GPU 0 (run it under
MPS, `nvidia-cuda-mps-control -d`, so that the processes' kernels run side by side), each one
rank of HybridEPBuffer(backend="cuda") with no peer_memory_bytes: peer memory grows on demand
(hybrid_ep/backends/cuda/agreement.py). For each layout (one node of 8; two nodes of 4 joined by
NVSHMEM, where the build has it) it checks a case against the dense oracle
(hybrid_ep.testing.cases.check_case), then times the seed shape (H=8192, 4096 tokens per rank,
top-8 of 16 experts, bf16) and the DeepSeek-V3-like shape (H=7168, 256 experts, top-8) at 1 and 2
SMs per rank: per call its data path, the first call's time (it grows the peer memory) and the
later calls' median dispatch and combine kernel times (CUDA events), the host's CPU time per
static-size pair with nothing synchronised (host_pairs), the bytes of peer memory each rank
holds. Then, with the processes gone, the same shapes in the single-process emulation,
twice: the ranks addressing each other's tensors as they are (`emulation`), and each rank with
peer memory of its own mapped by the others at addresses of theirs, as separate processes map it
(`emulation_peer`, EmulatedGroup(separate_processes=True)). So a gap between the processes and the
emulation is placed in the same run: on the memory and its mappings (the peer emulation has it
too) or on the processes sharing the GPU (it has not). Writes DIR/process_bench.json; prints one
line per point.
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

SHAPES = {"seed": dict(hidden=8192, experts=16, topk=8, tokens=4096),
          "dsv3": dict(hidden=7168, experts=256, topk=8, tokens=4096)}


def _inputs(shape: dict, rank: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    T, H, E, K = shape["tokens"], shape["hidden"], shape["experts"], shape["topk"]
    x = torch.randn(T, H, generator=gen).to(torch.bfloat16)
    idx = torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous()
    w = torch.rand(T, K, generator=gen)
    return x, idx, w


def _time(fn, iters: int, device: str = "cuda") -> list[float]:
    """Milliseconds of each of `iters` calls: CUDA events on a GPU, the wall clock on the CPU model."""
    out = []
    for _ in range(iters):
        if device != "cuda":
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b))
    return out


HOST_WARMUP = 5  # host_pairs: untimed pairs first
HOST_PAIRS = 40  # and timed ones, per rank and shape (the default SMs per rank)


def host_pairs(buf, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor, pairs: int, device: str = "cuda") -> dict:
    """The host's CPU time per static-size dispatch + combine pair on this rank, launches on and
    nothing synchronised, as a training step issues them: the median over the pairs that read
    nothing back. With peer memory a pair the agreement's ledger does not hold reads its count
    kernel's output (a host synchronisation, which would time the kernels queued before it): such
    pairs are counted, not timed. The static size is the largest rank's rows of this routing (one
    size on every rank, as the agreement needs)."""
    import torch.distributed as dist

    rows = torch.tensor([buf.dispatch(x, topk_idx=idx, topk_weights=w).tokens.shape[0]])
    dist.all_reduce(rows, op=dist.ReduceOp.MAX)
    static = int(rows)
    peer = buf._backend._engine.peer
    times, read_pairs = [], 0
    for i in range(HOST_WARMUP + pairs):
        reads = peer.reads if peer is not None else 0
        t0 = time.thread_time_ns()
        res = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_out_tokens=static)
        y = buf.combine(res.tokens, res.handle)
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


def time_on_rank(name: str, ranks_per_node: int, sms: list[int], iters: int) -> dict:
    """Runs on every rank: the shape's calls, their paths and times, the memory held."""
    import torch.distributed as dist

    from ..buffer import HybridEPBuffer

    shape = SHAPES[name]
    rank, W = dist.get_rank(), dist.get_world_size()
    buf = HybridEPBuffer(None, shape["hidden"], shape["tokens"], shape["experts"], ranks_per_node=ranks_per_node,
                         backend="cuda")
    x, idx, w = (t.cuda() for t in _inputs(shape, rank))
    paths, points = [], []
    torch.cuda.synchronize()
    started = time.perf_counter()
    res = buf.dispatch(x, topk_idx=idx, topk_weights=w)  # the first call: grows the peer memory
    y = buf.combine(res.tokens, res.handle)
    torch.cuda.synchronize()
    first_ms = (time.perf_counter() - started) * 1e3
    paths.append(res.handle.data_path)
    del res, y
    for n in sms:
        res = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_sms=n)
        paths.append(res.handle.data_path)
        rows = res.tokens.shape[0]
        dispatch_ms = _time(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=w, num_sms=n), iters)
        combine_ms = _time(lambda r=res: buf.combine(r.tokens, r.handle, num_sms=n), iters)
        again = buf.dispatch(x, topk_idx=idx, topk_weights=w)
        paths.append(again.handle.data_path)
        row_bytes = shape["hidden"] * 2
        points.append({"sms": n, "rows": rows, "dispatch_ms": statistics.median(dispatch_ms),
                       "combine_ms": statistics.median(combine_ms),
                       "dispatch_gbps_per_sm": rows * row_bytes / (statistics.median(dispatch_ms) * 1e6) / n,
                       "combine_gbps_per_sm": rows * row_bytes / (statistics.median(combine_ms) * 1e6) / n})
        del res, again
    host = host_pairs(buf, x, idx, w, HOST_PAIRS)
    held = buf._backend.peer_memory_held() if hasattr(buf._backend, "peer_memory_held") else 0
    return {"rank": rank, "world_size": W, "pid": os.getpid(), "paths": paths, "first_call_ms": first_ms,
            "points": points, "host": host, "peer_memory_held": held, "memory_plan": str(buf.memory_plan())}


# Address space each virtual rank reserves for its peer memory in the peer emulation: room for the
# largest shape's growth (about 2.2 GB per rank at the seed shape), a reservation only.
PEER_RESERVE_BYTES = 8 << 30


def emulated_points(shape: dict, ranks_per_node: int, sms: list[int], iters: int, *, peer: bool = False,
                    device: str = "cuda") -> list[dict]:
    """The same shape in the single-process emulation (8 virtual ranks, one launch). peer: each
    rank with peer memory of its own that the others map at addresses of theirs, as separate
    processes do (its first pair grows the memory and takes the receive path; untimed)."""
    from ..backends.cuda.emulation import EmulatedGroup

    extra = dict(separate_processes=True, peer_reserve=PEER_RESERVE_BYTES) if peer else {}
    group = EmulatedGroup(8, shape["hidden"], shape["tokens"], shape["experts"], ranks_per_node=ranks_per_node,
                          device=torch.device(device), **extra)
    xs, idx, ws = zip(*[(t.to(device) for t in _inputs(shape, r)) for r in range(8)])
    out = []
    try:
        if peer:
            first = group.dispatch(list(xs), list(idx), list(ws))
            group.combine([r.tokens for r in first], [r.handle for r in first])
            group.synchronize()
            del first
        for n in sms:
            res = group.dispatch(list(xs), list(idx), list(ws), num_sms=n)
            rows = res[0].tokens.shape[0]
            d = _time(lambda: group.dispatch(list(xs), list(idx), list(ws), num_sms=n), iters, device)
            c = _time(lambda rs=res: group.combine([r.tokens for r in rs], [r.handle for r in rs], num_sms=n), iters,
                      device)
            row_bytes = shape["hidden"] * 2
            out.append({"sms": n, "rows_rank0": rows, "dispatch_ms": statistics.median(d),
                        "combine_ms": statistics.median(c),
                        "dispatch_gbps_per_sm": sum(r.tokens.shape[0] for r in res) / 8 * row_bytes
                        / (statistics.median(d) * 1e6) / n,
                        "combine_gbps_per_sm": sum(r.tokens.shape[0] for r in res) / 8 * row_bytes
                        / (statistics.median(c) * 1e6) / n,
                        "data_path": res[0].handle.data_path})
            del res
    finally:
        group.close()
    return out


def _host_text(got: list[dict]) -> str:
    """The log line's host time: every rank's median CPU us per pair, and the pairs that read."""
    times = [g["host"]["host_us_per_pair"] for g in got]
    shown = "/".join("-" if t is None else f"{t:.0f}" for t in times)
    return f"{shown} us per pair by rank, {sum(g['host']['pairs_that_read'] for g in got)} pairs read"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--nodes", type=int, nargs="+", default=[1, 2], help="1: one node of 8; 2: two of 4")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--sms", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--timeout", type=float, default=20.0, help="HYBRID_EP_TIMEOUT_S of the ranks")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("process_bench: needs a CUDA device", file=sys.stderr)
        return 2
    from ..spawn import ProcessGroupPool
    from .cases import Case, check_case
    from .nvshmem_cases import pool_env

    args.out.mkdir(parents=True, exist_ok=True)
    record = {"separate_processes": True, "world_size": 8, "mps": bool(os.environ.get("CUDA_MPS_PIPE_DIRECTORY")),
              "device": torch.cuda.get_device_name(0), "layouts": []}
    worst = 0
    for nodes in args.nodes:
        G = 8 // nodes
        layout = {"nodes": nodes, "ranks_per_node": G, "shapes": {}}
        env = pool_env(8, args.timeout) if nodes > 1 else {"HYBRID_EP_TIMEOUT_S": str(args.timeout)}
        try:
            with ProcessGroupPool(8, "gloo", env=env) as pool:
                case = Case(world_size=8, ranks_per_node=G, num_experts=16, hidden=2048,
                            tokens=(64, 17, 0, 5, 33, 1, 40, 9), topk=4, dtype=torch.bfloat16, backend="cuda")
                first = check_case(pool, case)
                second = check_case(pool, case)
                layout["oracle"] = {"ok": True, "paths": [[r["data_path"] for r in first],
                                                          [r["data_path"] for r in second]]}
                for name in args.shapes:
                    got = pool.run(time_on_rank, [(name, G, args.sms, args.iters)] * 8, timeout_s=120)
                    layout["shapes"][name] = {"processes": got}
                    pids = {g["pid"] for g in got}
                    print(f"process_bench nodes={nodes} {name}: {len(pids)} processes, paths rank 0 {got[0]['paths']}, "
                          f"first call {got[0]['first_call_ms']:.1f} ms, held {got[0]['peer_memory_held']} B, "
                          + ", ".join(f"{p['sms']} SM: {p['dispatch_gbps_per_sm']:.1f}/{p['combine_gbps_per_sm']:.1f}"
                                      f" GB/s/SM" for p in got[0]["points"])
                          + f"; host {_host_text(got)}")
        except (AssertionError, RuntimeError) as exc:
            layout["error"] = f"{type(exc).__name__}: {exc}"[:4000]
            print(f"process_bench nodes={nodes}: FAILED {layout['error'][:600]}")
            worst = 1
        for name in args.shapes:
            for key, peer in (("emulation", False), ("emulation_peer", True)):
                try:
                    e = emulated_points(SHAPES[name], G, args.sms, args.iters, peer=peer)
                    layout["shapes"].setdefault(name, {})[key] = e
                    print(f"process_bench nodes={nodes} {name} {key}: "
                          + ", ".join(f"{p['sms']} SM: {p['dispatch_gbps_per_sm']:.1f}/{p['combine_gbps_per_sm']:.1f} "
                                      f"GB/s/SM ({p['data_path']})" for p in e))
                except Exception as exc:  # noqa: BLE001 - recorded; the next points and layouts still run
                    layout["shapes"].setdefault(name, {})[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:2000]
                    print(f"process_bench nodes={nodes} {name} {key}: FAILED {type(exc).__name__}: {str(exc)[:400]}")
                    worst = 1
        record["layouts"].append(layout)
        (args.out / "process_bench.json").write_text(json.dumps(record, indent=1))
    return worst


if __name__ == "__main__":
    sys.exit(main())
