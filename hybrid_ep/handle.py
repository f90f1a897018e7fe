"""The read-only objects a dispatch returns; combine and backward consume them unchanged.

Legend: T tokens on this rank, K routes per token, W ranks, N nodes, R output rows,
H hidden, V rows received.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import torch

from .config import BufferConfig
from .routing import Routing
from .traffic.model import RowCounts, row_counts

_FIELDS = ("owner", "config", "rank", "routing", "source", "dest", "recv_counts_W", "num_recv_rows",
           "count_matrix_WW", "node_counts_WN", "probs_R", "num_out_tokens", "serial", "checksum")
_COUNT_TABLES = ("_recv_counts_W", "_count_matrix_WW", "_node_counts_WN")  # kept under these names
_STORED = {name: "_" + name if "_" + name in _COUNT_TABLES else name for name in _FIELDS}  # field -> key


class ReadOnly:
    """Attributes set once, in __init__, and never again: the frozen dataclasses these classes
    replace cost several microseconds a call to build (one object.__setattr__ per field); a
    plain instance dictionary filled in one update costs well under one."""

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


class _CountTables:
    """The count tables of a dispatch, each the tensor the backend gave or, where it gave None,
    dest's attribute of the same name read when asked for (the cuda backend's are views of
    its per-call workspace, which a call need not make); and the rows per link made from them.
    Needs `dest`, `config` and the raw fields _recv_counts_W, _count_matrix_WW, _node_counts_WN."""

    # The fields, as __init__ stores them in the instance dictionary (annotations only). dest:
    # routing.DestLayout or the backend's own layout of the same rows, whose type is the backend's.
    dest: Any
    config: BufferConfig

    @property
    def recv_counts_W(self) -> torch.Tensor:
        value = self.__dict__["_recv_counts_W"]
        return self.dest.recv_counts_W if value is None else value

    @property
    def count_matrix_WW(self) -> torch.Tensor:
        value = self.__dict__["_count_matrix_WW"]
        return self.dest.count_matrix_WW if value is None else value

    @property
    def node_counts_WN(self) -> torch.Tensor:
        value = self.__dict__["_node_counts_WN"]
        return self.dest.node_counts_WN if value is None else value

    @functools.cached_property
    def row_counts(self) -> RowCounts:
        """Rows per rank on each link (traffic model), computed once per routing."""
        return row_counts(self.count_matrix_WW, self.node_counts_WN, self.config.ranks_per_node)


class CallCounts(ReadOnly, _CountTables):
    """A handle's count tables without the handle: what a record of a call keeps to report its
    traffic later. Not the handle itself, whose send layout may hold memory a later call needs
    (the cuda backend's direct path: the arena block of the dispatch's probs)."""

    def __init__(self, handle: "DispatchHandle"):
        self.__dict__.update(zip(_COUNTS_FIELDS, CallCounts.note(handle)))

    @staticmethod
    def note(handle: "DispatchHandle") -> tuple:
        """What CallCounts keeps of `handle`, as a tuple (from_note makes the object later):
        a buffer notes every call and makes its record only when asked for it."""
        d = handle.__dict__
        return d["dest"], d["config"], d["_recv_counts_W"], d["_count_matrix_WW"], d["_node_counts_WN"]

    @classmethod
    def from_note(cls, note: tuple) -> "CallCounts":
        counts = cls.__new__(cls)
        counts.__dict__.update(zip(_COUNTS_FIELDS, note))
        return counts


_COUNTS_FIELDS = ("dest", "config") + _COUNT_TABLES  # CallCounts.note's order


class DispatchHandle(ReadOnly, _CountTables):
    """Everything combine and backward need; reusable for another dispatch of the same routing.

    owner: id of the buffer that made it (a handle is not valid on another buffer); source,
    dest: routing.SourceLayout / DestLayout or the backend's own layouts of the same rows
    (dest with the fields the properties below read). The count tables (recv_counts_W: int64
    rows received from each rank; count_matrix_WW: rows sent from rank s to rank d, all ranks;
    node_counts_WN: tokens of rank s that reach node n, all ranks): None takes dest's attribute
    of the same name when read (the cuda backend's are views of its per-call workspace, which a
    call need not make). num_recv_rows: V. probs_R: float32 routing weight of each output row,
    0 on padding. serial: which dispatch with a routing of its buffer made it (1, 2, ...),
    compared on reuse; checksum: crc32 of count_matrix_WW, taken where the counts reached the
    host, compared on reuse.
    """

    owner: int
    rank: int
    routing: Routing
    source: Any  # routing.SourceLayout or the backend's own layout of the same rows
    num_recv_rows: int
    probs_R: torch.Tensor
    num_out_tokens: int | None
    serial: int
    checksum: int

    def __init__(self, owner: int, config: BufferConfig, rank: int, routing: Routing, source: Any,
                 dest: Any, recv_counts_W: torch.Tensor | None, num_recv_rows: int,
                 count_matrix_WW: torch.Tensor | None, node_counts_WN: torch.Tensor | None, probs_R: torch.Tensor,
                 num_out_tokens: int | None, serial: int = 0, checksum: int = 0):
        d = self.__dict__  # one store per field: a keyword dict for update() costs a third more per call
        d["owner"], d["config"], d["rank"], d["routing"] = owner, config, rank, routing
        d["source"], d["dest"], d["probs_R"], d["num_out_tokens"] = source, dest, probs_R, num_out_tokens
        d["_recv_counts_W"], d["num_recv_rows"], d["_count_matrix_WW"] = recv_counts_W, num_recv_rows, count_matrix_WW
        d["_node_counts_WN"], d["serial"], d["checksum"] = node_counts_WN, serial, checksum

    def replace(self, **changes) -> "DispatchHandle":
        """A copy with some fields changed (dataclasses.replace's contract). A copy of the
        instance dictionary, not a new __init__: autograd's dispatch makes one per call."""
        new = DispatchHandle.__new__(DispatchHandle)
        fields = new.__dict__
        fields.update(self.__dict__)
        for name, value in changes.items():
            key = _STORED.get(name)
            if key is None:
                raise TypeError(f"DispatchHandle has no field {name!r}")
            fields[key] = value
            if key in _COUNT_TABLES:
                fields.pop("row_counts", None)  # cached from the old tables
        return new

    @property
    def num_tokens(self) -> int:
        return self.routing.num_tokens

    @property
    def num_rows(self) -> int:
        return self.dest.num_rows

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


class DispatchResult(ReadOnly):
    """What dispatch returns. tokens: [R, H] expert-major rows, dtype of x; scales: [R, H/128]
    float32 for fp8 input, else None; probs: [R] float32 routing weight of each row, 0 on
    padding; tokens_per_expert: [L] int64 rows per local expert, padding included (None: the
    handle's, read when first asked for); handle: the DispatchHandle."""

    tokens: torch.Tensor
    scales: torch.Tensor | None
    probs: torch.Tensor
    handle: DispatchHandle

    def __init__(self, tokens: torch.Tensor, scales: torch.Tensor | None, probs: torch.Tensor,
                 tokens_per_expert: torch.Tensor | None, handle: DispatchHandle):
        d = self.__dict__
        d["tokens"], d["scales"], d["probs"], d["handle"] = tokens, scales, probs, handle
        if tokens_per_expert is not None:
            d["tokens_per_expert"] = tokens_per_expert

    @functools.cached_property
    def tokens_per_expert(self) -> torch.Tensor:  # read when the instance dictionary holds none
        return self.handle.tokens_per_expert
