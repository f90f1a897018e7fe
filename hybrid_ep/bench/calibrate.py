"""`hybrid-ep-bench --calibrate`: the measurement `backend="auto"` follows on this allocation.

Run it as the job runs (torchrun or srun, one process per GPU; or spawned ranks on this
machine) with the job's shape (--hidden, --tokens, --topk, --experts, --dtype): it times
`reference` and, where it can run, `cuda` (each backend's default SMs; dispatch + combine, the
slowest rank's median), and adds the result to the evidence file auto reads
(hybrid_ep/backends/evidence.py: --evidence, else $HYBRID_EP_AUTO_EVIDENCE, else its default
path) with the device, driver, NCCL and package versions, topology, shape and date. Where
cuda cannot run (CPU processes, no extension), it records reference alone and why cuda could
not run; auto then keeps reference for that topology and says so.
"""

from __future__ import annotations

import time

from ..backends import evidence
from ..metadata import now
from ..paths import output_problem
from ..wording import plural
from .launch import open_launcher
from .metrics import build_run
from .spec import BACKENDS_WITHOUT_SMS, BenchArgError, BenchSpec

CALIBRATED = ("reference", "cuda")


# Flags a calibration decides itself: (dest, flag, why).
_NOT_WITH_CALIBRATE = (
    ("sms", "--sms", "each backend runs with its default SMs, as a buffer made by auto does"),
    ("backends", "--backends", "it times reference and, where it can run, cuda"),
    ("emulate", "--emulate", "auto follows one process per GPU, not emulated ranks"),
    ("out", "--out", "it writes the evidence file (--evidence)"),
)


def check_flags(args) -> None:
    """BenchArgError for a flag a calibration would ignore, or --evidence without --calibrate."""
    if not args.calibrate:
        if args.evidence is not None:
            raise BenchArgError("--evidence", "only applies with --calibrate")
        return
    for dest, flag, why in _NOT_WITH_CALIBRATE:
        if getattr(args, dest) not in (None, []):
            raise BenchArgError(flag, f"does not apply with --calibrate: {why}")


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


def measurement(spec: BenchSpec, probes: list[dict], times: dict[str, float]) -> evidence.Measurement:
    """The evidence entry for one calibration run (called on the reporting rank)."""
    devices = sorted({p["device"] for p in probes})
    here = evidence.identity_here(spec.device)
    identity = evidence.Identity("; ".join(devices), here.hybrid_ep, here.torch, here.nccl)
    unavailable = None if "cuda" in times else (probes[0]["unavailable"].get("cuda") or "not available on every rank")
    shape = {"hidden": spec.hidden, "tokens_per_rank": spec.tokens, "topk": spec.topk, "experts": spec.experts,
             "dtype": spec.dtype, "routing": spec.routing}
    return evidence.Measurement(identity, spec.num_nodes, spec.ranks_per_node, shape, times["reference"],
                                times.get("cuda"), unavailable, now(), probes[0]["driver"])


def run(spec: BenchSpec, path: str, note) -> int:
    """Time both backends on `spec`'s ranks and add the result to the evidence file at `path`."""
    from . import worker

    started = time.monotonic()
    note(f"calibrating auto: {plural(spec.world_size, 'rank')} ({spec.num_nodes} x {spec.ranks_per_node}, "
         f"{spec.device}) ...")
    launcher = open_launcher(spec)
    try:
        probes = launcher.run(worker.probe, spec)
        usable = [b for b in CALIBRATED if all(b in p["backends"] for p in probes)]
        times = {}
        for backend in usable:
            raw = launcher.run(worker.run_backend, spec, backend)
            sms = "no SM setting" if backend in BACKENDS_WITHOUT_SMS else "backend default SMs"
            times[backend] = per_call_ms(build_run(backend, None, sms, [r[0] for r in raw], spec.ranks_per_node,
                                                   probes))
    finally:
        launcher.close()
    if not launcher.is_reporter:
        return 0
    entry = measurement(spec, probes, times)
    evidence.write(path, entry)
    print(f"auto's evidence for {entry.nodes} node(s) x {entry.ranks_per_node} ranks on {entry.identity.device}: "
          f"{entry.summary().replace(f' ({entry.file})', '')}; auto picks {entry.faster} there", flush=True)
    print(f"written to {path} ({time.monotonic() - started:.1f} s)", flush=True)
    return 0
