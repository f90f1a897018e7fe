"""`hybrid-ep-bench --calibrate` as a job runs it (torchrun, one process per rank, on the CPU):
a calibration whose cuda kernels fault (faked at the kernels' launch, harness.
calibration_faults) or that runs past its bound records the failure in the evidence and never
leaves auto following something it did not measure: the training that follows runs reference
and its log line gives the reason. About 10 s per torchrun on 2 cores."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from harness import calibration_faults
from helpers import checkout_env
from hybrid_ep.backends import evidence

pytestmark = pytest.mark.unit

SHAPE = ["--hidden", "64", "--tokens", "16", "--topk", "2", "--experts", "4"]


def _torchrun(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 -m module args` on the CPU: it ends the other rank when one fails,
    as srun --kill-on-bad-exit=1 does."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                           "--master-port", str(port), "-m", module, *args],
                          capture_output=True, text=True, timeout=timeout,
                          env=checkout_env(PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))


def test_a_faulting_kernel_is_recorded_and_training_runs_reference(tmp_path, pool_for):
    path = str(tmp_path / "auto-evidence.json")
    proc = _torchrun("harness.calibration_faults", "--calibrate", "--reuse", "--device", "cpu", *SHAPE,
                     "--warmup", "1", "--iters", "2", "--evidence", path, "--time-limit", "100")
    assert proc.returncode != 0  # the calibration failed (the job's script goes on: tests/unit/.../test_recipes.py)
    fault = f"rank {calibration_faults.FAULT_RANK} failed: RuntimeError: {calibration_faults.FAULT} (timing cuda"
    assert f"hybrid-ep calibration: {fault}" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    (entry,) = evidence.read(path)  # the first rank's failure, not its peer's broken connection
    assert entry.failure.startswith(fault) and entry.reference_ms > 0 and entry.cuda_ms is None
    assert (entry.nodes, entry.ranks_per_node, entry.shape["hidden"], entry.faster) == (1, 2, 64, "reference")
    results = pool_for(2).run(calibration_faults.train_after, [(path, 64, 16, 4)] * 2)
    backends, lines, round_trips = zip(*results)
    assert backends == ("reference", "reference") and all(round_trips)
    assert lines[0].startswith("hybrid_ep: backend reference (asked: auto) for EP group of ranks 0-1 (1 node x 2 "
                               f"ranks): the calibration here failed: {fault}")
    assert lines[0].endswith(f"({path}; delete it to measure again)") and lines[1] == ""  # rank 0 logs


def test_a_calibration_past_its_bound_records_a_timeout(tmp_path):
    path = str(tmp_path / "auto-evidence.json")
    # a bound the ranks start well within on a loaded machine (3.4 s once beside the nvcc check),
    # so the call it cuts short is the timing's
    proc = _torchrun("hybrid_ep.bench", "--calibrate", "--device", "cpu", *SHAPE, "--warmup", "1", "--iters",
                     "1000000", "--evidence", path, "--time-limit", "8")
    assert proc.returncode != 0
    (entry,) = evidence.read(path)
    assert entry.failure.startswith("no result within its bound of 8 s (timing reference, after 8.")
    assert entry.reference_ms is None and entry.faster == "reference"
    assert f"hybrid-ep calibration: {entry.failure}; recorded in {path}: auto keeps reference" in proc.stdout
