"""Local mode: run a recipe on this machine, without Slurm.

One process per rank (cluster.gpus_per_node of them, cluster.nodes must be 1), each with the
variables srun would give it (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) plus the recipe's env, running the recipe's Megatron argument list through:

- `python -m megatron_patches.pretrain_gpt` (Megatron-LM's pretrain_gpt.py with the
  patches) when that script is found (recipe megatron_lm_dir, $MEGATRON_LM_DIR, PYTHONPATH)
  and there is a GPU per rank; or
- `python -m megatron_patches.local.cpu_train` (Megatron-Core GPTModel, same arguments,
  parsed by Megatron's parser) otherwise, e.g. on a CPU-only machine.

The first line says which path runs. Rank 0 prints to this terminal; the other ranks write
to log files whose tail is shown when a rank fails.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

from hybrid_ep.wording import plural

from .megatron_args import megatron_args
from .recipe import RecipeError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAINERS = ("auto", "megatron", "core")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pretrain_script(recipe) -> str | None:
    from megatron_patches.pretrain_gpt import LauncherError, find_pretrain_script

    lm_dir = recipe["megatron_lm_dir"]
    if not lm_dir or not os.path.isdir(os.path.expanduser(lm_dir)):
        lm_dir = None
    try:
        return find_pretrain_script(lm_dir)
    except LauncherError:
        return None


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclasses.dataclass(frozen=True)
class LocalPath:
    """What local mode runs: `python -m` arguments, a one-line description, and whether the
    ranks use GPUs (Megatron-LM's pretrain_gpt.py) or the CPU (the Megatron-Core trainer, gloo)."""

    world: int
    module: list[str]
    description: str
    on_gpus: bool


def choose(recipe, trainer: str = "auto") -> LocalPath:
    """Check that the recipe runs here and pick the path (RecipeError naming the field otherwise)."""
    if recipe.kind != "pretrain":
        raise RecipeError([("kind", "local mode runs pretraining recipes; run the benchmark with hybrid-ep-bench")])
    if recipe["cluster.nodes"] != 1:
        raise RecipeError([("cluster.nodes", f"local mode runs on this one machine; got {recipe['cluster.nodes']} "
                                             "nodes (--set cluster.nodes=1 or --nodes 1)")])
    if trainer not in TRAINERS:
        raise RecipeError([("--trainer", f"must be one of {', '.join(TRAINERS)}, got {trainer!r}")])
    world = recipe["cluster.gpus_per_node"]
    script = _pretrain_script(recipe)
    gpus = _gpus()
    if trainer == "megatron" or (trainer == "auto" and script and gpus >= world):
        if not script:
            raise RecipeError([("megatron_lm_dir", "--trainer megatron needs Megatron-LM's pretrain_gpt.py: set "
                                                   "megatron_lm_dir or $MEGATRON_LM_DIR")])
        return LocalPath(world, ["-m", "megatron_patches.pretrain_gpt", "--megatron-lm-dir", os.path.dirname(script)],
                         f"Megatron-LM pretrain_gpt.py ({script}) through megatron_patches.pretrain_gpt", True)
    why = "forced by --trainer core" if trainer == "core" else \
        ("pretrain_gpt.py not found" if not script else f"{plural(gpus, 'GPU')} for {plural(world, 'rank')}")
    return LocalPath(world, ["-m", "megatron_patches.local.cpu_train"],
                     f"Megatron-Core trainer megatron_patches.local.cpu_train on the CPU, gloo ({why}; model "
                     "from Megatron's parser)", False)


def run_local(recipe, trainer: str = "auto", timeout_s: float = 3600.0, echo=print,
              path: LocalPath | None = None) -> int:
    path = path or choose(recipe, trainer)
    world, module = path.world, path.module
    echo(f"local mode: {world} {'process' if world == 1 else 'processes'} on this machine; path: "
         f"{path.description}", flush=True)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    base = dict(os.environ)
    base.update({k: str(v) for k, v in recipe["env"].items()})
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(world),
                LOCAL_WORLD_SIZE=str(world), PYTHONWARNINGS="ignore",
                OMP_NUM_THREADS=base.get("OMP_NUM_THREADS", str(max(1, cores // world))),
                PYTHONPATH=os.pathsep.join(p for p in (REPO, base.get("PYTHONPATH")) if p))
    cmd = [sys.executable, *module, *megatron_args(recipe)]
    logs = tempfile.mkdtemp(prefix="hybrid_ep_local_")
    procs, files = [], []
    for rank in range(world):
        env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        if rank == 0:
            procs.append(subprocess.Popen(cmd, env=env))
        else:
            f = open(os.path.join(logs, f"rank{rank}.log"), "w")
            files.append(f)
            procs.append(subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout_s
    rc = 0
    try:
        while any(p.poll() is None for p in procs):
            failed = [p for p in procs if p.poll() not in (None, 0)]
            if failed or time.monotonic() > deadline:
                rc = failed[0].returncode if failed else 124
                break
            time.sleep(0.2)
        else:
            rc = next((p.returncode for p in procs if p.returncode), 0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        for f in files:
            f.close()
    if rc:
        echo(f"local mode: failed with status {rc}; logs of ranks 1..{world - 1} in {logs}", flush=True)
        for rank in range(1, world):
            with open(os.path.join(logs, f"rank{rank}.log")) as f:
                tail = f.read()[-2000:]
            echo(f"--- rank {rank} (tail) ---\n{tail}", flush=True)
    else:
        shutil.rmtree(logs, ignore_errors=True)  # kept only where a failure needs reading
    return rc
