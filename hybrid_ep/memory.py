"""Memory plans: how many bytes a backend registers or needs, known before it allocates."""

from __future__ import annotations

import dataclasses


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

    @property
    def registered_bytes(self) -> int:
        return sum(b.nbytes for b in self.buffers if b.registered)

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
            f"  registered total {self.registered_bytes / 2**20:.2f} MiB, "
            f"per-call worst case {self.workspace_bytes / 2**20:.2f} MiB"
        )
        return "\n".join(lines)
