"""`python -m hybrid_ep.testing.calibration_faults <hybrid-ep-bench flags>`: hybrid-ep-bench in a
process whose cuda kernels fault, on CPU processes: what a failing calibration leaves behind.

Launch it as a job launches the calibration (torchrun or srun, one process per rank, --device
cpu). The cuda backend runs as hybrid_ep.testing.faked_kernels runs it, its host side real and
its kernels computed over gloo, except that on rank FAULT_RANK the count kernel, the first
launch of every dispatch, raises what a CUDA fault raises on the host. Everything around it (the
calibration, the buffer, the engine) is the real code.

`train_after(path, hidden, tokens, experts)`, on every rank of a pool: what the training that
follows does, a buffer made with backend="auto" reading the evidence at `path`, then a dispatch
and a combine; it returns the backend, the buffer's log line and whether the combine gave the
rows back.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
import torch.distributed as dist

from ..backends import evidence
from ..bench import cli
from . import faked_kernels

FAULT = "CUDA error: an illegal memory access was encountered"
FAULT_RANK = 1


class FaultingKernels(faked_kernels.GlooKernels):
    """GlooKernels whose count kernel faults on rank FAULT_RANK (its peers then wait for it)."""

    def dispatch_count(self, args, stream, ptr, layout, static_rows, inputs, read):
        if self.rank == FAULT_RANK:
            raise RuntimeError(FAULT)
        super().dispatch_count(args, stream, ptr, layout, static_rows, inputs, read)


def train_after(path: str, hidden: int, tokens: int, experts: int) -> tuple[str, str, bool]:
    """A buffer made with auto after a calibration wrote `path`, and one dispatch + combine on it."""
    from ..buffer import HybridEPBuffer

    os.environ[evidence.ENV] = path
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    log = logging.getLogger("hybrid_ep")
    log.addHandler(handler)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        buf = HybridEPBuffer(dist.group.WORLD, hidden, tokens, experts)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    rank = dist.get_rank()
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(rank))
    idx = torch.stack([torch.arange(tokens) % experts, (torch.arange(tokens) + 1) % experts], dim=1)
    res = buf.dispatch(x, idx, torch.ones(tokens, 2))
    y = buf.combine(res.tokens, res.handle)
    line = next((text for text in lines if text.startswith("hybrid_ep: backend")), "")
    return buf.backend, line, torch.allclose(y, 2 * x)


def main(argv: list[str] | None = None) -> int:
    with faked_kernels.installed(FaultingKernels):
        return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
