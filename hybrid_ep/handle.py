"""The frozen objects a dispatch returns; combine and backward consume them unchanged.

Legend: T tokens on this rank, K routes per token, W ranks, N nodes, R output rows,
H hidden, V rows received.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from .config import BufferConfig
from .routing import DestLayout, Routing, SourceLayout
from .traffic.model import RowCounts, row_counts


class _CountTable:
    """A count table of a handle: the tensor the backend gave, or, where it gave None, the
    dest layout's attribute of the same name, read when first asked for (the cuda backend's
    are views of its per-call workspace, which a call need not make)."""

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.slot = name, "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            raise AttributeError(self.name)  # no class-level default: the field stays required
        value = obj.__dict__[self.slot]
        if value is None:
            value = obj.__dict__[self.slot] = getattr(obj.dest, self.name)
        return value

    def __set__(self, obj, value) -> None:
        obj.__dict__[self.slot] = value


@dataclasses.dataclass(frozen=True, eq=False)
class DispatchHandle:
    """Everything combine and backward need; reusable for another dispatch of the same routing."""

    owner: int  # id of the buffer that made it; a handle is not valid on another buffer
    config: BufferConfig
    rank: int
    routing: Routing
    source: SourceLayout  # or the backend's own layout of the same rows
    dest: DestLayout  # or the backend's own layout, with the fields the properties below read
    # The count tables: None takes dest's attribute of the same name when read (_CountTable).
    recv_counts_W: torch.Tensor | None = _CountTable()  # int64 rows received from each rank
    num_recv_rows: int  # V
    count_matrix_WW: torch.Tensor | None = _CountTable()  # int64 rows sent from rank s to rank d (all ranks)
    node_counts_WN: torch.Tensor | None = _CountTable()  # int64 tokens of rank s that reach node n (all ranks)
    probs_R: torch.Tensor  # float32 routing weight of each output row, 0 on padding
    num_out_tokens: int | None
    serial: int = 0  # which dispatch with a routing of its buffer made it (1, 2, ...); compared on reuse
    checksum: int = 0  # crc32 of count_matrix_WW, taken where the counts reached the host; compared on reuse

    @property
    def num_tokens(self) -> int:
        return self.routing.num_tokens

    @property
    def num_rows(self) -> int:
        return self.dest.num_rows

    @functools.cached_property
    def row_counts(self) -> RowCounts:
        """Rows per rank on each link (traffic model), computed once per routing."""
        return row_counts(self.count_matrix_WW, self.node_counts_WN, self.config.ranks_per_node)

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self.dest.tokens_per_expert_L

    @property
    def data_path(self) -> str | None:
        """How the cuda kernels moved this dispatch's rows, and how its combine will: "direct"
        (each route's row straight to and from its final row) or "receive" (through receive
        buffers); None for backends without kernels."""
        return getattr(self.source, "data_path", None)

    @property
    def num_dropped(self) -> torch.Tensor:
        """Routed rows that did not fit num_out_tokens (int64 scalar on the device)."""
        return self.dest.num_dropped

    @property
    def num_needed_rows(self) -> torch.Tensor:
        """Rows the unclipped layout needs (int64 scalar on the device)."""
        return self.dest.num_needed_rows


@dataclasses.dataclass(frozen=True, eq=False)
class DispatchResult:
    tokens: torch.Tensor  # [R, H] expert-major rows, dtype of x
    scales: torch.Tensor | None  # [R, H/128] float32 for fp8 input
    probs: torch.Tensor  # [R] float32 routing weight of each row, 0 on padding
    tokens_per_expert: torch.Tensor  # [L] int64 rows per local expert, padding included
    handle: DispatchHandle
