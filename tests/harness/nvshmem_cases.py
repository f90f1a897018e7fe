"""Dispatch and combine of the cuda backend across real NVSHMEM PEs on one GPU.

`python -m harness.nvshmem_cases --out DIR` starts W processes on GPU 0 for each
world size W of its cases (2 to 4), each process one rank and one NVSHMEM PE, and runs every
case through HybridEPBuffer(backend="cuda") exactly as a cluster would: ranks grouped into
nodes of `ranks_per_node`, CUDA IPC inside a node, the NVSHMEM transport between nodes
(put with signal, fence, quiet). Each case is checked against the dense oracle like every
backend (hybrid_ep.verify.cases.check_case): dispatch bitwise, the combine's every hop
rounding, and a dispatch that reuses the handle.

This is where the NVSHMEM instantiation of the kernels runs before a cluster; the loopback
transport of the single-process emulation runs the same kernel code with peer stores.
Without the MPS daemon the processes' kernels take turns on the GPU (NVSHMEM's limited
support of several PEs per GPU), so the waits are long but bounded (HYBRID_EP_TIMEOUT_S).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from hybrid_ep.bench.shared_gpu import pool_env
from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.verify.cases import Case, check_case

from .hierarchy_cases import hierarchy_case


def default_cases(hidden: int = 2048) -> list[Case]:
    """Two to four nodes of one or two ranks: bf16, fp8 with scales, static size with
    overflow, one hot expert, dropped routes, no tokens anywhere, several chunks per source,
    rows larger than a FIFO stage."""
    c = hierarchy_case
    return [
        c(2, 1, hidden),
        c(3, 1, hidden),
        c(4, 1, hidden),
        c(2, 2, hidden),
        c(2, 2, hidden, dtype=FP8_DTYPE, num_experts=16, topk=8, tokens=(64, 17, 1, 0)),
        c(2, 2, hidden, num_out_tokens=10, topk=8, num_experts=16, tokens=(64, 17, 0, 5)),
        c(4, 1, hidden, routing="one-expert", tokens=(33,) * 4),
        c(3, 1, hidden, drop_fraction=0.3, topk=6),
        c(2, 2, hidden, tokens=(0, 0, 0, 0)),
        c(2, 2, hidden, tokens=(130, 0, 97, 1), topk=8, num_experts=16),
        c(2, 2, hidden, wire_dtype=torch.float32, topk=8, num_experts=16),
        c(2, 1, 12288, dtype=torch.float32, tokens=(3, 2)),
    ]


def run(cases: list[Case], out: Path, timeout_s: float = 60.0, progress=print) -> list[dict]:
    """Run `cases` (grouped by world size, one process pool each); one result per case, also
    written to out/nvshmem_cases.json. A failed case closes its pool (a rank may be stuck in a
    kernel or a collective); the next case starts a fresh one."""
    from hybrid_ep.spawn import ProcessGroupPool

    out.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    for world_size in sorted({c.world_size for c in cases}):
        pool = None
        for case in [c for c in cases if c.world_size == world_size]:
            started = time.monotonic()
            entry = {"case": str(case), "world_size": case.world_size, "ranks_per_node": case.ranks_per_node}
            try:
                if pool is None or pool.closed:
                    pool = ProcessGroupPool(world_size, "gloo", env=pool_env(world_size, timeout_s))
                check_case(pool, case)
                entry.update(ok=True)
            except (AssertionError, RuntimeError) as exc:
                entry.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:4000],
                             where=traceback.format_exc()[-2000:])
                if pool is not None:
                    pool.close()
            entry["seconds"] = round(time.monotonic() - started, 2)
            results.append(entry)
            progress(f"nvshmem_cases {'PASSED' if entry['ok'] else 'FAILED'} {case} ({entry['seconds']} s)"
                     + ("" if entry["ok"] else f"\n  {entry['error'][:600]}"))
            (out / "nvshmem_cases.json").write_text(json.dumps(results, indent=1))
        if pool is not None:
            pool.close()
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for nvshmem_cases.json")
    parser.add_argument("--only", default="", help="run the cases whose name contains this text")
    parser.add_argument("--timeout", type=float, default=60.0, help="HYBRID_EP_TIMEOUT_S of the ranks")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("nvshmem_cases: needs a CUDA device", file=sys.stderr)
        return 2
    cases = [c for c in default_cases() if args.only in str(c)]
    if not cases:
        print(f"nvshmem_cases: no case name contains {args.only!r}", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    results = run(cases, args.out, args.timeout)
    passed = sum(r["ok"] for r in results)
    print(f"nvshmem_cases: {passed} of {len(results)} cases match the oracle")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    sys.exit(main())
