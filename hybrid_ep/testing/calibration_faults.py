"""`python -m hybrid_ep.testing.calibration_faults <hybrid-ep-bench flags>`: hybrid-ep-bench in a
process whose cuda kernels fault, on CPU processes: what a failing calibration leaves behind.

Launch it as a job launches the calibration (torchrun or srun, one process per rank, --device
cpu). The cuda backend runs as hybrid_ep.testing.faked_kernels runs it, its host side real and
its kernels computed over gloo, except that on rank FAULT_RANK the count kernel, the first
launch of every dispatch, raises what a CUDA fault raises on the host. Everything around it (the
calibration, the buffer, the engine) is the real code.
"""

from __future__ import annotations

import sys

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


def main(argv: list[str] | None = None) -> int:
    with faked_kernels.installed(FaultingKernels):
        return cli.main(argv)


if __name__ == "__main__":
    sys.exit(main())
