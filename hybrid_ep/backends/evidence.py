"""The user's own measurement that `backend="auto"` follows where it has one: the evidence file.

`hybrid-ep-bench --calibrate`, run on the job's allocation, times `reference` against `cuda`
at the job's shape and topology and writes one entry per (device, versions, topology, shape)
into a JSON file: `$HYBRID_EP_AUTO_EVIDENCE`, else `path_default()`
($XDG_CACHE_HOME/hybrid-ep/auto-evidence.json, ~/.cache/... without it). An entry is a
measurement (both backends' times, or reference's alone with why cuda could not run) or a
failure: why the calibration gave no result (a rank's error, its time bound, or that it did not
finish: written when it starts, replaced by its result), with reference's time where that was
measured before the failure. When a buffer is made with `auto`, `find()` looks in that file for
an entry of the buffer's topology (nodes x ranks per node) made on the same device with the same
hybrid_ep, torch and NCCL versions, the buffer's own shape first; `choice.choose_auto` follows it
(cuda only where a measurement shows it faster; a failure keeps reference) and its log line names it.

Without the file auto keeps its rule (choice.AUTO_RULES), silently. A file that cannot be
read or holds no entries of this schema, and an entry of this topology made on another device
or with other versions (stale: rerun the calibration), are ignored with a warning naming the
file and the reason. Entries of other topologies are not this buffer's and are passed over.

`reusable()` is the calibration's own look-up: the entry of exactly its device, versions,
topology and shape, which a recipe's later jobs reuse instead of measuring again (a failure
too: it names the file to delete to measure again). Several processes may write one file (the
ranks of a failed calibration, jobs of one recipe): each writes a whole new file under a name of
its own and renames it into place, so a reader never sees half a file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

ENV = "HYBRID_EP_AUTO_EVIDENCE"
SCHEMA = "hybrid-ep-auto-evidence/2"
# Schema 1 held measurements only: the same entries without `failure`.
READABLE = (SCHEMA, "hybrid-ep-auto-evidence/1")
UNFINISHED = "did not finish"  # how the failure of a calibration that started and has no result yet begins


def path_default() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "hybrid-ep", "auto-evidence.json")


def evidence_path() -> str:
    """Where auto reads, and --calibrate writes by default: $HYBRID_EP_AUTO_EVIDENCE, else path_default()."""
    return os.environ.get(ENV) or path_default()


@dataclasses.dataclass(frozen=True)
class Identity:
    """What a measurement must share with the process that follows it."""

    device: str  # metadata.describe_device: the GPU's name, or "CPU: <model> (<n> cores)"
    hybrid_ep: str
    torch: str
    nccl: str | None  # torch's NCCL, None without CUDA

    def differences(self, other: Identity) -> list[str]:
        """'device A, here B' for each field that differs."""
        return [f"{field.name} {getattr(self, field.name)}, here {getattr(other, field.name)}"
                for field in dataclasses.fields(self) if getattr(self, field.name) != getattr(other, field.name)]


def identity_here(device_type: str) -> Identity:
    """This process's Identity on `device_type` ("cuda": the current GPU, "cpu")."""
    import torch

    from .. import __version__
    from ..metadata import describe_device

    nccl = None
    if device_type == "cuda" and torch.cuda.is_available():
        version = torch.cuda.nccl.version()
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    return Identity(describe_device(device_type), __version__, torch.__version__, nccl)


def describe_shape(shape: dict) -> str:
    """'H 7168, 4096 tokens/rank, top-8, bf16': a calibration's shape as its lines print it."""
    return f"H {shape['hidden']}, {shape['tokens_per_rank']} tokens/rank, top-{shape['topk']}, {shape['dtype']}"


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One calibration: both backends' dispatch + combine time (the slowest rank's medians), or
    why it has none (`failure`)."""

    identity: Identity
    nodes: int
    ranks_per_node: int
    shape: dict  # hidden, tokens_per_rank, topk, experts, dtype, routing
    reference_ms: float | None  # None: not measured (only with a failure)
    cuda_ms: float | None  # None: cuda could not run there (cuda_unavailable says why) or failed
    cuda_unavailable: str | None
    date: str
    driver: str | None = None
    failure: str | None = None  # why the calibration has no result; auto keeps reference
    file: str = ""  # where it was read from (not stored)

    @property
    def faster(self) -> str:
        if self.failure is not None or self.cuda_ms is None or self.reference_ms is None:
            return "reference"
        return "cuda" if self.cuda_ms < self.reference_ms else "reference"

    def times(self) -> str:
        """Both backends' times in one clause, or what there is of them."""
        if self.cuda_ms is not None and self.reference_ms is not None:
            return f"cuda {self.cuda_ms:.3g} ms, reference {self.reference_ms:.3g} ms per dispatch + combine"
        if self.reference_ms is None:
            return "nothing timed"
        reference = f"reference {self.reference_ms:.3g} ms per dispatch + combine"
        return reference if self.failure is not None else f"{reference}, cuda unavailable"

    def summary(self) -> str:
        """The entry in one clause, for auto's log line."""
        at = f"at {describe_shape(self.shape)}"
        if self.failure is not None:
            return (f"the calibration here failed: {self.failure}; {self.times()} {at}; {self.date} ({self.file}; "
                    "delete it to measure again)")
        return f"{self.times()} {at}; measured {self.date} ({self.file})"

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        del out["file"]
        return out

    @classmethod
    def from_json(cls, entry: dict, file: str) -> Measurement:
        """Raises ValueError (or KeyError / TypeError) for an entry that is not a measurement."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"file"}
        if not isinstance(entry, dict) or not (fields - {"failure"} <= set(entry) <= fields):
            raise ValueError(f"a measurement has the fields {sorted(fields)}")
        m = cls(**{**entry, "identity": Identity(**entry["identity"])}, file=file)
        numbers = [v for v in (m.reference_ms, m.cuda_ms) if v is not None]
        if not all(isinstance(v, (int, float)) and v > 0 for v in numbers) or m.nodes < 1 or m.ranks_per_node < 1:
            raise ValueError("times must be > 0 ms and the topology at least 1 node x 1 rank")
        if m.reference_ms is None and m.failure is None:
            raise ValueError("an entry without reference's time must say why (failure)")
        return m

    def same_slot(self, other: Measurement) -> bool:
        """Whether `other` measures what this one does (a new calibration replaces it)."""
        return (self.identity, self.nodes, self.ranks_per_node, self.shape) == \
            (other.identity, other.nodes, other.ranks_per_node, other.shape)


def read(path: str) -> list[Measurement]:
    """The measurements in the file; OSError / ValueError (naming the problem) when it cannot be read."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("schema") not in READABLE:
        raise ValueError(f"not an evidence file of schema {SCHEMA}")
    try:
        return [Measurement.from_json(entry, path) for entry in doc["measurements"]]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"a measurement cannot be read ({err})") from None


def _write_all(path: str, entries: list[Measurement]) -> None:
    """The whole file, written under a name of this process and renamed into place."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".partial")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"schema": SCHEMA, "measurements": [m.to_json() for m in entries]}, f, indent=2)
            f.write("\n")
        os.replace(partial, path)  # a reader never sees half a file
    except BaseException:
        if os.path.exists(partial):
            os.unlink(partial)
        raise


def _readable(path: str) -> list[Measurement]:
    try:
        return read(path)
    except (OSError, ValueError):
        return []


def write(path: str, measurement: Measurement) -> list[Measurement]:
    """Add `measurement` to the file (replacing one of the same device, versions, topology and
    shape; an unreadable file is replaced). Returns what the file holds."""
    entries = [m for m in _readable(path) if not m.same_slot(measurement)] + [measurement]
    _write_all(path, entries)
    return entries


def write_failure(path: str, failure: Measurement) -> bool:
    """Put `failure` in its slot, where the slot holds nothing or the entry of a calibration that
    did not finish (UNFINISHED: what a calibration writes when it starts): the first rank to fail
    names the cause, and a rank that fails after it (its peers gone) leaves it. False where it did."""
    entries = _readable(path)
    for i, m in enumerate(entries):
        if m.same_slot(failure):
            if m.failure is not None and not m.failure.startswith(UNFINISHED):
                return False
            entries[i] = failure
            break
    else:
        entries.append(failure)
    _write_all(path, entries)
    return True


def find(nodes: int, ranks_per_node: int, here: Identity, path: str | None = None,
         shape: dict | None = None) -> tuple[Measurement | None, list[str]]:
    """(the entry of this topology made here, warnings naming the file and why something in it
    was ignored). Of several, the newest whose shape has the values of `shape` (hidden,
    tokens_per_rank, experts: what a buffer knows), else the newest. No file: (None, [])."""
    path = evidence_path() if path is None else path
    if not os.path.exists(path):
        return None, []
    try:
        measurements = read(path)
    except (OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        return None, [f"{path}: ignored, {reason}"]
    warnings, matching = [], []
    for m in measurements:
        if (m.nodes, m.ranks_per_node) != (nodes, ranks_per_node):
            continue
        differences = m.identity.differences(here)
        if differences:
            warnings.append(f"{path}: the measurement of {m.date} for {nodes} node(s) x {ranks_per_node} ranks is "
                            f"ignored, it was made with {'; '.join(differences)} (rerun hybrid-ep-bench --calibrate)")
        else:
            matching.append(m)
    same_shape = [m for m in matching if all(m.shape.get(k) == v for k, v in (shape or {}).items())]
    pool = same_shape or matching
    return (max(pool, key=lambda m: m.date) if pool else None), warnings


def reusable(path: str, wanted: Measurement) -> tuple[Measurement | None, str]:
    """(the entry of `wanted`'s device, versions, topology and shape in the file, or None;
    why there is none, in a few words)."""
    if not os.path.exists(path):
        return None, f"{path} does not exist yet"
    try:
        entries = read(path)
    except (OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        return None, f"{path} cannot be read ({reason}) and is replaced"
    for m in entries:
        if m.same_slot(wanted):
            return m, ""
    topology = [m for m in entries if (m.nodes, m.ranks_per_node) == (wanted.nodes, wanted.ranks_per_node)]
    if not topology:
        return None, f"{path} holds none for {wanted.nodes} node(s) x {wanted.ranks_per_node} ranks"
    newest = max(topology, key=lambda m: m.date)
    changed = newest.identity.differences(wanted.identity) + [
        f"{k} {newest.shape.get(k)}, here {v}" for k, v in wanted.shape.items() if newest.shape.get(k) != v]
    return None, f"the entry of {newest.date} was made with {'; '.join(changed)}"
