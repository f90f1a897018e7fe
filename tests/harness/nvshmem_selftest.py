"""The NVSHMEM transport between real processes on one GPU: NVSHMEM's several-PEs-per-GPU mode.

`python -m harness.nvshmem_selftest --procs 2` starts that many processes on GPU 0,
each one PE: a gloo process group, NVSHMEM initialised through hybrid_ep.backends.cuda.nvshmem
(unique id from rank 0), one symmetric allocation, then `--calls` rounds of the transport
self-test kernel (csrc/transport/nvshmem_selftest_nvshmem.cu): every PE sends a pattern to the
next with put_signal and with put + fence + signal, waits for its own signals (bounded) and
checks the bytes. Each process writes its result as JSON and its log (NVSHMEM's messages
included) into --out; the summary says which PE failed and how. Used by
tests/unit/hybrid_ep/backends/cuda/test_nvshmem_transport.py and by `scripts/gpu_check.sh nvshmem`.

Several processes on one GPU: NVSHMEM gives full support when the MPS daemon runs and the
processes' CUDA_MPS_ACTIVE_THREAD_PERCENTAGE add up to at most 100 (set here to 100 / procs),
limited support (no NVSHMEM collectives on the GPU) without MPS; this test needs only puts,
signals and host-side setup. NVSHMEM_REMOTE_TRANSPORT=none keeps NVSHMEM from looking for
NICs, the unique-id bootstrap listens on the loopback interface, and NCCL inside NVSHMEM is
off (it does not support several PEs per GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from hybrid_ep.bench.shared_gpu import worker_env
from hybrid_ep.checks import is_int


def _worker(rank: int, procs: int, store: str, nbytes: int, calls: int, timeout_s: float, out: Path) -> int:
    """One PE: set up, run the self-test `calls` times, write rank<N>.json."""
    result: dict = {"rank": rank, "procs": procs, "bytes": nbytes, "stage": "start"}
    path = out / f"rank{rank}.json"

    def save():
        path.write_text(json.dumps(result, indent=1))

    save()
    try:
        import torch
        import torch.distributed as dist

        from hybrid_ep.backends.cuda import load_extension, nvshmem

        result["stage"] = "process group"
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=procs)
        result["stage"] = "cuda device"
        torch.cuda.set_device(0)
        torch.empty(1, device="cuda")  # the CUDA context exists before NVSHMEM looks for it
        ext = nvshmem.require_built(load_extension("cuda"))
        region = ext.nvshmem_selftest_region_bytes(nbytes)
        result["stage"] = "nvshmem init"
        save()
        session = nvshmem.initialize(None, region, ext=ext)
        result.update(status=session.status, heap_bytes=session.heap_bytes, stage="allocate")
        save()
        alloc = nvshmem.allocate(region)
        pes = nvshmem.pe_table(None)
        result.update(pes=pes, stage="self-test", runs=[])
        stream = torch.cuda.current_stream().cuda_stream
        ext.nvshmem_selftest_clear(alloc.ptr, nbytes, stream)
        dist.barrier()  # every region is clear before any PE puts into it
        for call in range(1, calls + 1):
            started = time.perf_counter()
            run = ext.nvshmem_selftest(alloc.ptr, pes, rank, nbytes, call, int(timeout_s * 1e9), stream)
            run.update(call=call, seconds=round(time.perf_counter() - started, 4))
            result["runs"].append(run)
            save()
            dist.barrier()  # nobody overwrites a receive area before its owner checked it
        result["ok"] = all(_run_ok(r) for r in result["runs"])
        result["stage"] = "cleanup"
        save()
        nvshmem.free(alloc)
        nvshmem.finalize()
        dist.destroy_process_group()
        result["stage"] = "done"
    except Exception as exc:  # recorded for the summary; the parent decides
        result["error"] = f"{type(exc).__name__}: {exc}"
    save()
    return 0 if result.get("ok") and "error" not in result else 1


def _run_ok(run: dict) -> bool:
    return not run["timed_out"] and run["mismatches"] == 0 and run["signal_put"] == run["call"] \
        and run["signal_fenced"] == run["call"] and run["signal_empty"] == run["call"]


def describe(result: dict) -> str:
    """One line per PE: what it did, or where and how it failed."""
    rank, procs = result["rank"], result["procs"]
    head = f"rank {rank}/{procs}"
    if "error" in result:
        return f"{head}: failed at {result['stage']}: {result['error']}"
    bad = [r for r in result.get("runs", []) if not _run_ok(r)]
    if bad:
        r = bad[0]
        src = (rank - 1) % procs
        if r["timed_out"]:
            return (f"{head}: call {r['call']}: the signals from rank {src} did not arrive in time "
                    f"(put_signal word {r['signal_put']}, fenced word {r['signal_fenced']}, 0-byte put_signal word "
                    f"{r['signal_empty']}, expected {r['call']})")
        return (f"{head}: call {r['call']}: {r['mismatches']} words from rank {src} differ, "
                f"first at word {r['first_bad']}")
    if not result.get("ok"):
        return f"{head}: stopped at {result['stage']}"
    runs = result["runs"]
    return (f"{head}: {len(runs)} calls of {result['bytes']} bytes correct, {result['status']}, heap "
            f"{result['heap_bytes']} bytes, slowest call {max(r['seconds'] for r in runs):.4f} s")


def run(procs: int, nbytes: int = 1 << 20, calls: int = 3, timeout_s: float = 20.0, deadline_s: float = 180.0,
        out: Path | None = None, env: dict[str, str] | None = None) -> tuple[bool, list[str]]:
    """Start `procs` PEs on GPU 0 and wait for them; (every PE correct, one line per PE)."""
    if not is_int(procs, 2, 8):
        raise ValueError(f"procs must be an int in 2..8 (PEs on the one GPU), got {procs!r}")
    if not is_int(nbytes, 1) or nbytes % 32:
        raise ValueError(f"nbytes must be a positive multiple of 32, got {nbytes!r}")
    out = Path(tempfile.mkdtemp(prefix="nvshmem_selftest_")) if out is None else Path(out)
    out.mkdir(parents=True, exist_ok=True)
    store = out / "pg_store"
    store.unlink(missing_ok=True)
    child_env = worker_env(procs, env)
    here = Path(__file__).resolve()  # the checkout for hybrid_ep, its tests/ for this harness
    child_env["PYTHONPATH"] = os.pathsep.join([str(here.parents[2]), str(here.parents[1])]
                                              + [p for p in [child_env.get("PYTHONPATH")] if p])
    children = []
    for rank in range(procs):
        cmd = [sys.executable, "-m", "harness.nvshmem_selftest", "--worker", str(rank), "--procs",
               str(procs), "--bytes", str(nbytes), "--calls", str(calls), "--timeout", str(timeout_s),
               "--store", str(store), "--out", str(out)]
        log = open(out / f"rank{rank}.log", "w")
        children.append((subprocess.Popen(cmd, env=child_env, stdout=log, stderr=subprocess.STDOUT), log))
    end = time.monotonic() + deadline_s
    lines = []
    for rank, (child, log) in enumerate(children):
        try:
            child.wait(timeout=max(1.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            lines.append(f"rank {rank}/{procs}: killed after {deadline_s:.0f} s")
        log.close()
    ok = all(child.returncode == 0 for child, _ in children)
    for rank in range(procs):
        path = out / f"rank{rank}.json"
        if path.exists():
            lines.append(describe(json.loads(path.read_text())))
        else:
            lines.append(f"rank {rank}/{procs}: wrote no result (see {out / f'rank{rank}.log'})")
    return ok, lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--procs", type=int, default=2, help="PEs (processes) on GPU 0, 2..8")
    p.add_argument("--bytes", type=int, default=1 << 20, help="pattern bytes per PE and call (multiple of 32)")
    p.add_argument("--calls", type=int, default=3)
    p.add_argument("--timeout", type=float, default=20.0, help="seconds a PE waits for its signals")
    p.add_argument("--deadline", type=float, default=180.0, help="seconds before the PEs are killed")
    p.add_argument("--out", type=Path, default=None, help="folder for rank<N>.json and rank<N>.log")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--store", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is not None:
        return _worker(args.worker, args.procs, args.store, args.bytes, args.calls, args.timeout, args.out)
    ok, lines = run(args.procs, args.bytes, args.calls, args.timeout, args.deadline, args.out)
    print("\n".join(lines))
    print(f"nvshmem self-test, {args.procs} PEs on one GPU: {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
