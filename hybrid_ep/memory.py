"""Memory plans: how many bytes a backend registers or needs, known before it allocates."""

from __future__ import annotations

import dataclasses


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


@dataclasses.dataclass(frozen=True)
class BufferSpec:
    name: str
    nbytes: int
    registered: bool  # True: allocated once and exchanged with peers; False: per-call allocator
    purpose: str


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    backend: str
    buffers: tuple[BufferSpec, ...]
    # Which data path the buffer's calls take, and why where it matters (the cuda backend's;
    # "" for a plan made before a buffer exists, or a backend with one way only).
    data_path: str = ""

    @property
    def registered_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if b.registered)

    @property
    def held_bytes(self) -> int:
        """Bytes per GPU the buffer holds (its registered regions, and peer memory as held
        now): what a user plans a job's memory by, with the per-call part (workspace_bytes)."""
        return self.registered_bytes

    def held_by_region(self) -> dict[str, int]:
        """held_bytes by region, regions that hold nothing left out."""
        return {b.name: b.nbytes for b in self.buffers if b.registered and b.nbytes}

    def summary(self) -> str:
        """One line for a log: the bytes held per GPU and the largest regions."""
        regions = sorted(self.held_by_region().items(), key=lambda kv: -kv[1])
        parts = ", ".join(f"{name} {_mib(n)}" for name, n in regions[:4])
        more = f", {len(regions) - 4} more" if len(regions) > 4 else ""
        return f"{self.backend} backend holds {_mib(self.held_bytes)} per GPU ({parts}{more})"

    @property
    def workspace_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if not b.registered)

    def as_dict(self) -> dict[str, int]:
        return {b.name: b.nbytes for b in self.buffers}

    def __str__(self) -> str:
        lines = [f"memory plan ({self.backend} backend)"]
        for b in self.buffers:
            kind = "registered" if b.registered else "per call"
            lines.append(f"  {b.name:<16} {b.nbytes / 2**20:12.2f} MiB  {kind:<10}  {b.purpose}")
        lines.append(
            f"  held {self.held_bytes / 2**20:.2f} MiB, per-call worst case {self.workspace_bytes / 2**20:.2f} MiB"
        )
        if self.data_path:
            lines.append(f"  data path: {self.data_path}")
        return "\n".join(lines)
