"""`hybrid-ep-bench --calibrate`: the measurement `backend="auto"` follows on this allocation.

Run it as the job runs (torchrun or srun, one process per GPU; or spawned ranks on this
machine) with the job's shape (--hidden, --tokens, --topk, --experts, --dtype): it times
`reference` and, where it can run, `cuda` (each backend's default SMs; dispatch + combine, the
slowest rank's median), and adds the result to the evidence file auto reads
(hybrid_ep/backends/evidence.py: --evidence, else $HYBRID_EP_AUTO_EVIDENCE, else its default
path) with the device, driver, NCCL and package versions, topology, shape and date. Where
cuda cannot run (CPU processes, no extension, several nodes without NVSHMEM), it records
reference alone and why cuda could not run; auto then keeps reference for that topology.

--reuse: where the file already holds an entry of this device, versions, topology and shape,
nothing is measured; the entry is printed and kept, so a recipe's later jobs start training at
once. --time-limit S bounds the whole calibration, and its result line says how much of S it took.

A calibration that fails leaves a failure in the file, never a job that cannot train: the
reporting rank writes an entry saying the calibration did not finish before it measures (what
stays where the ranks are killed or crash); a rank whose backend raises replaces it by its
error (the first rank to fail: its peers' errors follow from it), and the bound replaces it by
a timeout. Auto keeps reference for a failure and its log line gives the reason. Exit status:
0 with a result (measured or reused), 1 for a failure, 2 for bad flags. Under torchrun (srun)
a failing rank leaves at once, without tearing the group down (its peers may wait in a
collective that will not complete), so the launcher ends the others.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from ..backends import evidence
from ..metadata import now
from ..paths import output_problem
from ..wording import plural
from .launch import open_launcher
from .metrics import build_run
from .spec import BACKENDS_WITHOUT_SMS, BenchArgError, BenchSpec

CALIBRATED = ("reference", "cuda")
FAILED = 1  # the exit status of a calibration with a failure (recorded in the evidence)
# Ranks other than the reporter leave this long after the bound, so that it records the timeout first.
_PEER_GRACE_S = 10.0
_ERROR_CHARS = 400  # of a rank's error, in the evidence and the log


# Flags a calibration decides itself: (dest, flag, why).
_NOT_WITH_CALIBRATE = (
    ("sms", "--sms", "each backend runs with its default SMs, as a buffer made by auto does"),
    ("backends", "--backends", "it times reference and, where it can run, cuda"),
    ("emulate", "--emulate", "auto follows one process per GPU, not emulated ranks"),
    ("out", "--out", "it writes the evidence file (--evidence)"),
)
_ONLY_WITH_CALIBRATE = (("evidence", "--evidence"), ("reuse", "--reuse"), ("time_limit", "--time-limit"))


def check_flags(args) -> None:
    """BenchArgError for a flag a calibration would ignore, a calibration's flag without
    --calibrate, or a time limit that is not a positive number of seconds."""
    if not args.calibrate:
        for dest, flag in _ONLY_WITH_CALIBRATE:
            if getattr(args, dest) not in (None, False):
                raise BenchArgError(flag, "only applies with --calibrate")
        return
    for dest, flag, why in _NOT_WITH_CALIBRATE:
        if getattr(args, dest) not in (None, []):
            raise BenchArgError(flag, f"does not apply with --calibrate: {why}")
    if args.time_limit is not None and not args.time_limit > 0:
        raise BenchArgError("--time-limit", f"must be > 0 seconds, got {args.time_limit:g}")


def evidence_file(args) -> str:
    """--evidence, else where auto reads; BenchArgError when it cannot be written (checked before the run)."""
    path = args.evidence or evidence.evidence_path()
    problem = output_problem(path, folder=False)
    if problem:
        raise BenchArgError("--evidence", problem)
    return path


def per_call_ms(run: dict) -> float:
    """Dispatch + combine of the slowest rank (medians), as auto compares them."""
    return run["summary"]["dispatch"]["max_ms"] + run["summary"]["combine"]["max_ms"]


def shape_of(spec: BenchSpec) -> dict:
    return {"hidden": spec.hidden, "tokens_per_rank": spec.tokens, "topk": spec.topk, "experts": spec.experts,
            "dtype": spec.dtype, "routing": spec.routing}


def _same(value):
    """What every rank said (launch.Launcher.run gathers it)."""
    return value


class Calibration:
    """One calibration: what it knows so far (the group's devices, reference's time), the phase it
    is in, and the entries it writes to the evidence file at `path`."""

    def __init__(self, spec: BenchSpec, path: str, limit_s: float | None, reporter: bool):
        self.spec, self.path, self.limit_s, self.reporter = spec, path, limit_s, reporter
        self.started = time.monotonic()
        self.phase = "starting the ranks"
        self.identity: evidence.Identity | None = None
        self.driver: str | None = None
        self.times: dict[str, float] = {}
        self.cuda_unavailable: str | None = None

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float | None:
        return None if self.limit_s is None else self.limit_s - self.elapsed()

    def bound(self) -> str:
        """'in 41 s of its 300 s bound' (or 'in 41 s' without one)."""
        took = f"in {self.elapsed():.0f} s"
        return took if self.limit_s is None else f"{took} of its {self.limit_s:g} s bound"

    def learn(self, probes: list[dict]) -> None:
        devices = sorted({p["device"] for p in probes})
        here = evidence.identity_here(self.spec.device)
        self.identity = evidence.Identity("; ".join(devices), here.hybrid_ep, here.torch, here.nccl)
        self.driver = probes[0]["driver"]

    def entry(self, failure: str | None = None) -> evidence.Measurement:
        identity = self.identity or evidence.identity_here(self.spec.device)
        return evidence.Measurement(identity, self.spec.num_nodes, self.spec.ranks_per_node, shape_of(self.spec),
                                    self.times.get("reference"), self.times.get("cuda"), self.cuda_unavailable, now(),
                                    self.driver, failure)

    def start(self) -> None:
        """The entry that stays where the ranks are killed or crash before a result."""
        bound = f" (bound {self.limit_s:g} s)" if self.limit_s is not None else ""
        evidence.write(self.path, self.entry(f"{evidence.UNFINISHED}: started {now()}{bound}; its ranks were "
                                             "killed, crashed or timed out before a result: the job's log has their "
                                             "output"))

    def fail(self, why: str) -> None:
        """Record `why` (first failure wins) and say it."""
        failure = f"{why} ({self.phase}, after {self.elapsed():.1f} s)"
        written = evidence.write_failure(self.path, self.entry(failure))
        where = f"recorded in {self.path}" if written else f"{self.path} already holds the first failure"
        print(f"hybrid-ep calibration: {failure}; {where}: auto keeps reference", flush=True)


def _watch(calibration: Calibration) -> threading.Timer | None:
    """Under torchrun: past the bound, the reporter records the timeout and every rank leaves
    (the others a little later, so the reporter writes first). The timer, to cancel on a result."""
    if calibration.limit_s is None:
        return None

    def expire():
        if calibration.reporter:
            calibration.fail(f"no result within its bound of {calibration.limit_s:g} s")
        _leave(FAILED)

    delay = calibration.limit_s + (0.0 if calibration.reporter else _PEER_GRACE_S)
    timer = threading.Timer(max(0.0, delay - calibration.elapsed()), expire)
    timer.daemon = True
    timer.start()
    return timer


def _leave(status: int) -> None:
    """Leave this process now: its peers may wait in a collective that will never complete."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _error_text(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return f"{type(err).__name__}: {text[:_ERROR_CHARS]}"


def run(spec: BenchSpec, path: str, note, reuse: bool = False, time_limit_s: float | None = None) -> int:
    """Time both backends on `spec`'s ranks and add the result to the evidence file at `path`
    (see the module docstring: --reuse, the bound, failures)."""
    from . import worker

    torchrun_rank = os.environ.get("RANK")
    calibration = Calibration(spec, path, time_limit_s, reporter=torchrun_rank in (None, "0"))
    limit = f", within {time_limit_s:g} s" if time_limit_s is not None else ""
    note(f"calibrating auto: {plural(spec.world_size, 'rank')} ({spec.num_nodes} x {spec.ranks_per_node}, "
         f"{spec.device}) at {evidence.describe_shape(shape_of(spec))}, {spec.experts} experts{limit}; "
         f"evidence {path} ...")
    try:
        launcher = open_launcher(spec)
    except Exception as err:  # a rank that cannot join the group: the others wait until the bound
        calibration.fail(f"the ranks could not start: {_error_text(err)}")
        return FAILED
    spawned = launcher.name != "torchrun"
    timer = None if spawned else _watch(calibration)
    try:
        calibration.phase = "probing the ranks"
        probes = launcher.run(worker.probe, spec, timeout_s=calibration.left())
        calibration.learn(probes)
        found, why = evidence.reusable(path, calibration.entry()) if reuse else (None, "")
        if reuse and not all(launcher.gather(found is not None)):  # every rank read the same entry, or all measure
            found = None
        if found is not None:
            if calibration.reporter:
                print(f"hybrid-ep calibration: reused the entry of {found.date} in {path}: {_outcome(found)}",
                      flush=True)
            return 0
        if calibration.reporter:
            if reuse:
                note(f"measuring: {why}")
            calibration.start()
        usable = [b for b in CALIBRATED if all(b in p["backends"] for p in probes)]
        if "cuda" not in usable:
            calibration.cuda_unavailable = probes[0]["unavailable"].get("cuda") or "not available on every rank"
        for backend in usable:
            calibration.phase = f"timing {backend}"
            raw = launcher.run(worker.run_backend, spec, backend, timeout_s=calibration.left())
            sms = "no SM setting" if backend in BACKENDS_WITHOUT_SMS else "backend default SMs"
            calibration.times[backend] = per_call_ms(build_run(backend, None, sms, [r[0] for r in raw],
                                                               spec.ranks_per_node, probes))
    except Exception as err:
        left = calibration.left()
        if spawned and left is not None and left <= 0:
            calibration.fail(f"no result within its bound of {time_limit_s:g} s")
        else:
            rank = f"rank {torchrun_rank}" if torchrun_rank is not None else "a rank"
            calibration.fail(f"{rank} failed: {_error_text(err)}")
        if not spawned:
            _leave(FAILED)
        return FAILED
    finally:
        if timer is not None:
            timer.cancel()
        launcher.close()
    if not calibration.reporter:
        return 0
    entry = calibration.entry()
    evidence.write(path, entry)
    print(f"hybrid-ep calibration: measured {calibration.bound()}: {_outcome(entry)}; written to {path}", flush=True)
    return 0


def _outcome(entry: evidence.Measurement) -> str:
    """What the entry says, and what auto takes for the EP groups of its topology."""
    groups = f"EP groups of {plural(entry.nodes, 'node')} x {entry.ranks_per_node} ranks"
    if entry.failure is not None:
        return f"the calibration failed: {entry.failure}; auto takes reference for {groups} here"
    unavailable = f" ({entry.cuda_unavailable})" if entry.cuda_ms is None and entry.cuda_unavailable else ""
    return (f"{entry.times()}{unavailable} at {evidence.describe_shape(entry.shape)} on {entry.identity.device}; "
            f"auto takes {entry.faster} for {groups} here")
