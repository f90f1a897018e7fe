"""A pool of W processes joined in one torch.distributed group, reused for many calls.

Starting processes and importing torch costs seconds per rank, so tests and the benchmark
start the group once and send it work. Every result wait is bounded; a failed or late rank
closes the pool (its peers may be stuck in a collective) and the error says which rank, the
likely cause and what to do. HYBRID_EP_POOL_TIMEOUT_S (seconds, default 300) bounds the
start and the process group's collectives, and raises the bound of every task to at least
that much: on a loaded machine starting W ranks (each imports torch) can take minutes.

The ranks are started with multiprocessing's "spawn" (a fresh interpreter each) or, with
start_method="forkserver", forked from multiprocessing's fork server: modules named in
`preload_for_forkserver` (torch, ...) are imported there once, so a rank starts in a fraction
of a second instead of importing them again. Either way a rank sees the environment of this
process as it is when the pool starts, plus `env`.
"""

from __future__ import annotations

import datetime
import os
import queue
import shutil
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

POOL_TIMEOUT_ENV = "HYBRID_EP_POOL_TIMEOUT_S"
DEFAULT_POOL_TIMEOUT_S = 300.0
START_METHODS = ("spawn", "forkserver")


def preload_for_forkserver(modules: list[str]) -> None:
    """Modules the fork server imports before it forks ranks (a name that does not import is
    skipped). Takes effect only if no pool with start_method="forkserver" has started yet in
    this process: the fork server starts with the first one and lives as long as this process."""
    mp.get_context("forkserver").set_forkserver_preload(list(modules))


def pool_timeout_s() -> float:
    """HYBRID_EP_POOL_TIMEOUT_S from the environment, or the default; ValueError naming it."""
    raw = os.environ.get(POOL_TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_POOL_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{POOL_TIMEOUT_ENV} must be a number of seconds, got {raw!r}") from None
    if not value > 0:
        raise ValueError(f"{POOL_TIMEOUT_ENV} must be > 0 seconds, got {raw!r}")
    return value


def _late_message(what: str, ranks: list[int], waited: float, limit: float) -> str:
    """Why ranks may not have answered and what to do; the message of a pool timeout."""
    if what == "start":
        cause = ("they were still starting (each process imports torch and joins the process group, which "
                 "takes much longer on a loaded machine) or one could not join")
    else:
        cause = (f"task {what} had not finished: a rank is slow (a loaded machine) or waits in a collective "
                 "for a peer that never joined it")
    return (f"ranks {ranks} did not answer after {waited:.0f} s (limit {limit:.0f} s): {cause}. If the machine "
            f"is busy, raise the limit, e.g. export {POOL_TIMEOUT_ENV}=900, and run again "
            "(docs/troubleshooting.md, process group pool)")


def _worker(rank, world_size, backend, init_file, env, tasks, results, left):
    # the parent's environment when the pool started (a forked rank has the fork server's)
    os.environ.clear()
    os.environ.update(env)
    torch.set_num_threads(int(env.get("HYBRID_EP_THREADS_PER_RANK", "1")))
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=float(env[POOL_TIMEOUT_ENV])),
        )
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
        return
    results.put((rank, True, "ready"))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            reply = (rank, True, fn(*args))
        except BaseException:
            reply = (rank, False, traceback.format_exc())
        if not dist.is_initialized():  # the task destroyed the group (as a crashed peer would)
            left.set()  # before the reply: once run() returns, `usable` says so
        results.put(reply)
    if dist.is_initialized():
        dist.destroy_process_group()


class ProcessGroupPool:
    """W ranks on this machine; `run(fn, per_rank_args)` calls fn(*args) on every rank."""

    def __init__(self, world_size: int, backend: str = "gloo", env: dict[str, str] | None = None,
                 start_timeout_s: float | None = None, start_method: str = "spawn"):
        """start_timeout_s: how long the ranks may take to start (default HYBRID_EP_POOL_TIMEOUT_S);
        start_method: "spawn" or "forkserver" (the module docstring)."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if start_method not in START_METHODS:
            raise ValueError(f"start_method must be one of {', '.join(START_METHODS)}, got {start_method!r}")
        self.timeout_s = pool_timeout_s()
        self._tasks_at_least_timeout = POOL_TIMEOUT_ENV in os.environ
        self.world_size = world_size
        self.backend = backend
        self._dir = tempfile.mkdtemp(prefix="hybrid_ep_pool_")
        self.start_method = start_method
        ctx = mp.get_context(start_method)
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        self._left = ctx.Event()  # set by a rank whose task destroyed its process group
        env = dict(os.environ) | {POOL_TIMEOUT_ENV: str(self.timeout_s)} | {k: str(v) for k, v in
                                                                             (env or {}).items()}
        self._procs = [
            ctx.Process(
                target=_worker,
                args=(r, world_size, backend, os.path.join(self._dir, "store"), env, self._tasks[r], self._results,
                      self._left),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self.closed = False
        self._collect(self.timeout_s if start_timeout_s is None else start_timeout_s, "start")

    def _collect(self, timeout_s: float, what: str) -> list:
        out: list = [None] * self.world_size
        errors: dict[int, str] = {}
        pending = set(range(self.world_size))
        started = time.monotonic()
        deadline = started + timeout_s
        while pending:
            left = deadline - time.monotonic()
            try:
                rank, ok, value = self._results.get(timeout=max(0.05, min(left, 1.0)))
            except queue.Empty:
                dead = [r for r in pending if not self._procs[r].is_alive()]
                if dead or left <= 0:
                    waited = time.monotonic() - started
                    self.close()
                    if dead:
                        codes = ", ".join(f"rank {r}: {self._procs[r].exitcode}" for r in dead)
                        why = (f"ranks {dead} died (exit codes {codes}; a negative code is the signal that "
                               "ended it, e.g. -9 when the system ran out of memory)")
                    else:
                        why = _late_message(what, sorted(pending), waited, timeout_s)
                    details = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
                    raise RuntimeError(f"process group pool ({what}): {why}{details}")
                continue
            pending.discard(rank)
            if ok:
                out[rank] = value
            else:
                errors[rank] = value
                # Peers of a failed rank may wait in a collective; give them a moment, not forever.
                deadline = min(deadline, time.monotonic() + float(os.environ.get("HYBRID_EP_POOL_GRACE_S", "20")))
        if errors:
            self.close()
            details = "".join(f"\n--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
            raise RuntimeError(f"process group pool ({what}): ranks {sorted(errors)} raised{details}")
        return out

    @property
    def usable(self) -> bool:
        """Open, every rank alive and still in the process group (a task that destroyed a
        rank's group, as a crashed peer would, leaves the pool unusable: `run` refuses it)."""
        return not self.closed and not self._left.is_set() and all(p.is_alive() for p in self._procs)

    def run(self, fn, per_rank_args: list[tuple] | None = None, timeout_s: float = 300.0) -> list:
        """fn must be importable by name (a module-level function); returns one result per rank.

        The wait is timeout_s, or HYBRID_EP_POOL_TIMEOUT_S when that is set and larger.
        """
        if self.closed:
            raise RuntimeError("process group pool is closed")
        if not self.usable:
            dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
            self.close()
            why = f"ranks {dead} have exited" if dead else "a rank left the process group in an earlier task"
            raise RuntimeError(f"process group pool: {why}; the pool is closed, start a new one")
        if per_rank_args is None:
            per_rank_args = [()] * self.world_size
        if len(per_rank_args) != self.world_size:
            raise ValueError(f"per_rank_args has {len(per_rank_args)} entries, expected {self.world_size}")
        for r, args in enumerate(per_rank_args):
            self._tasks[r].put((fn, tuple(args)))
        if self._tasks_at_least_timeout:
            timeout_s = max(timeout_s, self.timeout_s)
        return self._collect(timeout_s, getattr(fn, "__name__", "task"))

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for q, p in zip(self._tasks, self._procs):
            if p.is_alive():
                try:
                    q.put(None)
                except (OSError, ValueError):
                    pass
        for p in self._procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
