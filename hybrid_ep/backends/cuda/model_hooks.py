"""What the CPU model of the device layer and the fault tests need of an engine, behind one
object (Engine.model), so that production's path reads past it in one line:

- the declarations of each launch's tensors: the CPU model checks every bulk copy against the
  tensors of its launch (on a GPU that is compute-sanitizer's job, and nothing is declared);
- the test hook that launches some ranks' kernels absent (AbsentRanks, set by
  tests/harness/faults.py: ranks_absent), as a crashed peer would be.

The launch counters the tests read are the extension's (ext.launches_made)."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class AbsentRanks:
    """Ranks whose kernels are launched with RankArgs.absent, so they never arrive, as a crashed
    peer would. `ranks` launch none of a call's kernels; `after_count` launch a dispatch's count
    kernel (their counts are exchanged) but not its dispatch kernel."""

    ranks: frozenset[int] = frozenset()
    after_count: frozenset[int] = frozenset()


def spans(tensors) -> list[tuple[int, int]]:
    """(address, bytes) of each tensor that has any."""
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t is not None and t.numel() > 0]


class ModelHooks:
    """One engine's declarations to the CPU model and its absent ranks."""

    def __init__(self, ext, ranks: list[int], host, tables: list[torch.Tensor], rdma, abort: torch.Tensor):
        """ranks: the engine's driven ranks; host: its ext.HostPath; tables, rdma, abort: what
        every launch may touch besides its call's tensors (peer tables, RDMA regions, the abort
        flag)."""
        self.ext, self.ranks, self.host = ext, ranks, host
        self._is_model = bool(getattr(ext, "IS_MODEL", False))
        self._tables, self._rdma, self._abort = tables, rdma, abort
        self.absent = AbsentRanks()  # every rank arrives, unless a test says otherwise

    def declaring(self) -> bool:
        """Whether the next launch declares its tensors: on the CPU model with launches on, so
        that neither a GPU nor the launches-off host bench builds the lists."""
        return self._is_model and self.ext.launches_enabled()

    def declare(self, tensors, regions=()) -> None:
        """The tensors and (address, bytes) regions of the next launches, with the fixed ones."""
        self.ext.note_launch_tensors(spans(tensors) + list(regions) + self.fixed_spans())

    def note(self, regions) -> None:
        """(address, bytes) regions of the next launches, as they are (fixed_spans included)."""
        self.ext.note_launch_tensors(regions)

    def fixed_spans(self) -> list[tuple[int, int]]:
        """What every launch may touch besides its call's tensors."""
        return (spans(self._tables) + (self._rdma.declared() if self._rdma is not None else []) +
                [(self._abort.data_ptr(), 4)])

    @property
    def absent(self) -> AbsentRanks:
        """The test hook; setting it sets the host path's bit masks once (HostPath.set_absent:
        absent, absent after the count kernel), not passed per call."""
        return self._absent

    @absent.setter
    def absent(self, ranks: AbsentRanks) -> None:
        self._absent = ranks
        self.host.set_absent(self._mask(ranks.ranks), self._mask(ranks.after_count))

    def _mask(self, ranks) -> int:
        return sum(1 << i for i, r in enumerate(self.ranks) if r in ranks) if ranks else 0
