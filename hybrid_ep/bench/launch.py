"""How the ranks are started: W local processes, or this process as one rank of torchrun.

Both give `run(fn, *args, timeout_s=None)`: call the module-level fn(*args) on every rank and
return the list of per-rank results (to the spawning process, or to every torchrun rank); the
spawned ranks' wait is bounded by timeout_s (default _RUN_TIMEOUT_S), a torchrun rank's by its
collectives (a calibration adds its own watch). `gather(value)`: every torchrun rank's value, or
the spawning process's own.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..spawn import ProcessGroupPool
from .spec import BenchSpec

# A run's collectives are bounded by HYBRID_EP_TIMEOUT_S; this only bounds the whole call.
_RUN_TIMEOUT_S = 3600.0


def under_torchrun() -> bool:
    """True when a launcher (torchrun, or srun exporting the same variables) made us one rank."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"))


class SpawnLauncher:
    """W processes on this machine (gloo, or nccl with one GPU per rank)."""

    name = "spawn"
    is_reporter = True

    def __init__(self, spec: BenchSpec):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        threads = os.environ.get("HYBRID_EP_THREADS_PER_RANK", str(max(1, cores // spec.world_size)))
        self.world_size = spec.world_size
        self._pool = ProcessGroupPool(spec.world_size, backend=spec.transport,
                                      env={"HYBRID_EP_THREADS_PER_RANK": threads})

    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        wait = _RUN_TIMEOUT_S if timeout_s is None else timeout_s
        return self._pool.run(fn, [args] * self.world_size, timeout_s=wait)

    def gather(self, value) -> list:
        return [value]

    def close(self) -> None:
        self._pool.close()


class TorchrunLauncher:
    """This process is one rank; the group comes from the launcher's environment (env://)."""

    name = "torchrun"

    def __init__(self, spec: BenchSpec):
        if spec.device == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            dist.init_process_group(spec.transport)
        self.world_size = dist.get_world_size()
        self.is_reporter = dist.get_rank() == 0

    def run(self, fn, *args, timeout_s: float | None = None) -> list:
        return self.gather(fn(*args))

    def gather(self, value) -> list:
        out = [None] * self.world_size
        dist.all_gather_object(out, value)
        return out

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()


def open_launcher(spec: BenchSpec):
    return TorchrunLauncher(spec) if under_torchrun() else SpawnLauncher(spec)
