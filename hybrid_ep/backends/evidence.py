"""The user's own measurement that `backend="auto"` follows where it has one: the evidence file.

`hybrid-ep-bench --calibrate`, run on the job's allocation, times `reference` against `cuda`
at the job's shape and topology and writes one measurement per (device, versions, topology)
into a JSON file: `$HYBRID_EP_AUTO_EVIDENCE`, else `path_default()`
($XDG_CACHE_HOME/hybrid-ep/auto-evidence.json, ~/.cache/... without it). When a buffer is
made with `auto`, `find()` looks in that file for a measurement of the buffer's topology (nodes
x ranks per node) made on the same device with the same hybrid_ep, torch and NCCL versions;
`choice.choose_auto` follows it (cuda only where it was faster) and its log line names it.

Without the file auto keeps its rule (choice.AUTO_RULES), silently. A file that cannot be
read or holds no measurements of this schema, and a measurement of this topology made on
another device or with other versions (stale: rerun the calibration), are ignored with a
warning naming the file and the reason. Measurements of other topologies are not this
buffer's and are passed over.
"""

from __future__ import annotations

import dataclasses
import json
import os

ENV = "HYBRID_EP_AUTO_EVIDENCE"
SCHEMA = "hybrid-ep-auto-evidence/1"


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


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One calibration: both backends' dispatch + combine time (the slowest rank's medians)."""

    identity: Identity
    nodes: int
    ranks_per_node: int
    shape: dict  # hidden, tokens_per_rank, topk, experts, dtype, routing
    reference_ms: float
    cuda_ms: float | None  # None: cuda could not run there (cuda_unavailable says why)
    cuda_unavailable: str | None
    date: str
    driver: str | None = None
    file: str = ""  # where it was read from (not stored)

    @property
    def faster(self) -> str:
        return "cuda" if self.cuda_ms is not None and self.cuda_ms < self.reference_ms else "reference"

    def summary(self) -> str:
        """The measurement in one clause, for auto's log line."""
        s = self.shape
        times = (f"cuda {self.cuda_ms:.3g} ms, reference {self.reference_ms:.3g} ms per dispatch + combine"
                 if self.cuda_ms is not None else
                 f"reference {self.reference_ms:.3g} ms per dispatch + combine, cuda unavailable")
        return (f"{times} at H {s['hidden']}, {s['tokens_per_rank']} tokens/rank, top-{s['topk']}, {s['dtype']}; "
                f"measured {self.date} ({self.file})")

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        del out["file"]
        return out

    @classmethod
    def from_json(cls, entry: dict, file: str) -> Measurement:
        """Raises ValueError (or KeyError / TypeError) for an entry that is not a measurement."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"file"}
        if not isinstance(entry, dict) or set(entry) != fields:
            raise ValueError(f"a measurement has the fields {sorted(fields)}")
        m = cls(**{**entry, "identity": Identity(**entry["identity"])}, file=file)
        numbers = [m.reference_ms] + ([m.cuda_ms] if m.cuda_ms is not None else [])
        if not all(isinstance(v, (int, float)) and v > 0 for v in numbers) or m.nodes < 1 or m.ranks_per_node < 1:
            raise ValueError("times must be > 0 ms and the topology at least 1 node x 1 rank")
        return m

    def same_slot(self, other: Measurement) -> bool:
        """Whether `other` measures what this one does (a new calibration replaces it)."""
        return (self.identity, self.nodes, self.ranks_per_node) == (other.identity, other.nodes, other.ranks_per_node)


def read(path: str) -> list[Measurement]:
    """The measurements in the file; OSError / ValueError (naming the problem) when it cannot be read."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"not an evidence file of schema {SCHEMA}")
    try:
        return [Measurement.from_json(entry, path) for entry in doc["measurements"]]
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"a measurement cannot be read ({err})") from None


def write(path: str, measurement: Measurement) -> list[Measurement]:
    """Add `measurement` to the file (replacing one of the same device, versions and topology;
    an unreadable file is replaced). Returns what the file holds."""
    try:
        kept = [m for m in read(path) if not m.same_slot(measurement)]
    except (OSError, ValueError):
        kept = []
    entries = kept + [measurement]
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    partial = f"{path}.partial"
    with open(partial, "w", encoding="utf-8") as f:
        json.dump({"schema": SCHEMA, "measurements": [m.to_json() for m in entries]}, f, indent=2)
        f.write("\n")
    os.replace(partial, path)  # a reader never sees half a file
    return entries


def find(nodes: int, ranks_per_node: int, here: Identity, path: str | None = None) -> tuple[Measurement | None,
                                                                                            list[str]]:
    """(the newest measurement of this topology made here, warnings naming the file and why
    something in it was ignored). No file: (None, [])."""
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
    return (max(matching, key=lambda m: m.date) if matching else None), warnings
