"""The environment of processes that share one GPU, each one NVSHMEM PE: NVSHMEM's
several-PEs-per-GPU mode, as the process benchmark (bench/processes.py) and the NVSHMEM
self-tests run it. NVSHMEM gives full support when the MPS daemon runs and the processes'
CUDA_MPS_ACTIVE_THREAD_PERCENTAGE add up to at most 100 (set here to 100 / procs)."""

from __future__ import annotations

import os

# One GPU, no network: what every PE gets unless the caller's environment says otherwise.
SINGLE_GPU_ENV = {
    "NVSHMEM_REMOTE_TRANSPORT": "none",
    "NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME": "lo",
    "NVSHMEM_DISABLE_NCCL": "1",
}


def worker_env(procs: int, base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of each PE: the caller's, completed with the single-GPU defaults and an
    MPS share of 100 / procs percent of the GPU's threads."""
    env = dict(os.environ if base is None else base)
    for key, value in SINGLE_GPU_ENV.items():
        env.setdefault(key, value)
    env.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(100 // procs))
    env["PYTHONUNBUFFERED"] = "1"
    return env


# One heap for every case a process runs: NVSHMEM is initialised once per process.
HEAP = "1G"


def pool_env(world_size: int, timeout_s: float) -> dict[str, str]:
    """The environment of a process pool of `world_size` PEs on the GPU: one heap, the ranks' timeout."""
    env = worker_env(world_size)
    env.setdefault("NVSHMEM_SYMMETRIC_SIZE", HEAP)
    env.setdefault("HYBRID_EP_TIMEOUT_S", str(timeout_s))
    return env
