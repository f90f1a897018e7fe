"""The read-only records a dispatch returns; combine and backward consume them unchanged.

Legend: T tokens on this rank, K routes per token, W ranks, N nodes, R output rows,
H hidden, V rows received.
"""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch

from .config import BufferConfig
from .routing import Routing
from .traffic.model import RowCounts, row_counts


def read_only(name: str) -> Any:
    """A field of a slotted record, kept in the slot `_name`: reading it is one C getter, about
    as cheap as a slot; assigning or deleting it raises FrozenInstanceError, as on a frozen
    dataclass. The record's __init__ fills the slots with plain stores: a frozen dataclass
    pays an object.__setattr__ per field instead (1.6 us for a handle's 14 fields against
    0.45 us, Python 3.12, 2-core machine, timeit best of 7 x 200000)."""

    def refuse(self, value=None):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    return property(operator.attrgetter("_" + name), refuse, refuse)


class _CountTables:
    """The count tables of a dispatch, each the tensor the backend gave or, where it gave None,
    dest's attribute of the same name read when asked for (the cuda backend's are views of
    its per-call workspace, which a call need not make); and the rows per link made from them,
    computed once."""

    __slots__ = ("_dest", "_config", "_recv_counts_W", "_count_matrix_WW", "_node_counts_WN", "_row_counts")
    _dest: Any
    _config: BufferConfig
    _recv_counts_W: torch.Tensor | None
    _count_matrix_WW: torch.Tensor | None
    _node_counts_WN: torch.Tensor | None
    _row_counts: RowCounts | None

    @property
    def recv_counts_W(self) -> torch.Tensor:
        value = self._recv_counts_W
        return self._dest.recv_counts_W if value is None else value

    @property
    def count_matrix_WW(self) -> torch.Tensor:
        value = self._count_matrix_WW
        return self._dest.count_matrix_WW if value is None else value

    @property
    def node_counts_WN(self) -> torch.Tensor:
        value = self._node_counts_WN
        return self._dest.node_counts_WN if value is None else value

    @property
    def row_counts(self) -> RowCounts:
        """Rows per rank on each link (traffic model), computed once per routing."""
        if self._row_counts is None:
            self._row_counts = row_counts(self.count_matrix_WW, self.node_counts_WN, self._config.ranks_per_node)
        return self._row_counts


class CallCounts(_CountTables):
    """A handle's count tables without the handle: what a record of a call keeps to report its
    traffic later. Not the handle itself, whose send layout may hold memory a later call needs
    (the cuda backend's direct path: the arena block of the dispatch's probs)."""

    __slots__ = ()
    dest: Any = read_only("dest")
    config: BufferConfig = read_only("config")

    def __init__(self, *, dest: Any, config: BufferConfig, recv_counts_W: torch.Tensor | None,
                 count_matrix_WW: torch.Tensor | None, node_counts_WN: torch.Tensor | None):
        self._dest, self._config, self._recv_counts_W = dest, config, recv_counts_W
        self._count_matrix_WW, self._node_counts_WN, self._row_counts = count_matrix_WW, node_counts_WN, None

    @staticmethod
    def note(handle: "DispatchHandle") -> tuple:
        """What CallCounts keeps of `handle`, as a tuple (from_note makes the object later):
        a buffer notes every call and makes its record only when asked for it."""
        return handle._dest, handle._config, handle._recv_counts_W, handle._count_matrix_WW, handle._node_counts_WN

    @classmethod
    def from_note(cls, note: tuple) -> "CallCounts":
        dest, config, recv_counts_W, count_matrix_WW, node_counts_WN = note
        return cls(dest=dest, config=config, recv_counts_W=recv_counts_W, count_matrix_WW=count_matrix_WW,
                   node_counts_WN=node_counts_WN)


class DispatchHandle(_CountTables):
    """Everything combine and backward need; reusable for another dispatch of the same routing.
    Read-only (read_only); replace() makes a changed copy.

    owner: id of the buffer that made it (a handle is not valid on another buffer); source,
    dest: routing.SourceLayout / DestLayout or the backend's own layouts of the same rows
    (dest with the fields the properties below read). probs_R: float32 routing weight of each
    output row, 0 on padding. The count tables (recv_counts_W: int64 rows received from each
    rank; count_matrix_WW: rows sent from rank s to rank d, all ranks; node_counts_WN: tokens
    of rank s that reach node n, all ranks): None (the default) takes dest's attribute of the
    same name when read (the cuda backend's are views of its per-call workspace, which a call
    need not make). num_recv_rows: V (-1: not counted on the host). serial: which dispatch with
    a routing of its buffer made it (1, 2, ...), compared on reuse; checksum: crc32 of
    count_matrix_WW, taken where the counts reached the host, compared on reuse.
    """

    __slots__ = ("_owner", "_rank", "_routing", "_source", "_probs_R", "_num_out_tokens", "_num_recv_rows", "_serial",
                 "_checksum", "__weakref__")  # and _CountTables'; weakref: a buffer's last call
    owner: int = read_only("owner")
    config: BufferConfig = read_only("config")
    rank: int = read_only("rank")
    routing: Routing = read_only("routing")
    source: Any = read_only("source")  # routing.SourceLayout or the backend's own layout of the same rows
    dest: Any = read_only("dest")
    probs_R: torch.Tensor = read_only("probs_R")
    num_out_tokens: int | None = read_only("num_out_tokens")
    num_recv_rows: int = read_only("num_recv_rows")
    serial: int = read_only("serial")
    checksum: int = read_only("checksum")

    def __init__(self, *, owner: int, config: BufferConfig, rank: int, routing: Routing, source: Any, dest: Any,
                 probs_R: torch.Tensor, num_out_tokens: int | None, recv_counts_W: torch.Tensor | None = None,
                 num_recv_rows: int = -1, count_matrix_WW: torch.Tensor | None = None,
                 node_counts_WN: torch.Tensor | None = None, serial: int = 0, checksum: int = 0):
        self._owner = owner
        self._config = config
        self._rank = rank
        self._routing = routing
        self._source = source
        self._dest = dest
        self._probs_R = probs_R
        self._num_out_tokens = num_out_tokens
        self._recv_counts_W = recv_counts_W
        self._num_recv_rows = num_recv_rows
        self._count_matrix_WW = count_matrix_WW
        self._node_counts_WN = node_counts_WN
        self._serial = serial
        self._checksum = checksum
        self._row_counts = None

    def replace(self, **changes) -> "DispatchHandle":
        """A copy with some fields changed (dataclasses.replace's contract); it keeps the rows
        per link computed from the counts unless the counts change."""
        fields = {"owner": self._owner, "config": self._config, "rank": self._rank, "routing": self._routing,
                  "source": self._source, "dest": self._dest, "probs_R": self._probs_R,
                  "num_out_tokens": self._num_out_tokens, "recv_counts_W": self._recv_counts_W,
                  "num_recv_rows": self._num_recv_rows, "count_matrix_WW": self._count_matrix_WW,
                  "node_counts_WN": self._node_counts_WN, "serial": self._serial, "checksum": self._checksum}
        for name in changes:
            if name not in fields:
                raise TypeError(f"DispatchHandle has no field {name!r}")
        fields.update(changes)
        new = DispatchHandle(**fields)
        if "recv_counts_W" not in changes and "count_matrix_WW" not in changes and "node_counts_WN" not in changes:
            new._row_counts = self._row_counts
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


class DispatchResult:
    """What dispatch returns, read-only (read_only). tokens: [R, H] expert-major rows, dtype of
    x; scales: [R, H/128] float32 for fp8 input, else None; probs: [R] float32 routing weight
    of each row, 0 on padding; tokens_per_expert: [L] int64 rows per local expert, padding
    included (None: the handle's, read when first asked for); handle: the DispatchHandle."""

    __slots__ = ("_tokens", "_scales", "_probs", "_handle", "_tokens_per_expert")
    tokens: torch.Tensor = read_only("tokens")
    scales: torch.Tensor | None = read_only("scales")
    probs: torch.Tensor = read_only("probs")
    handle: DispatchHandle = read_only("handle")

    def __init__(self, *, tokens: torch.Tensor, scales: torch.Tensor | None, probs: torch.Tensor,
                 handle: DispatchHandle, tokens_per_expert: torch.Tensor | None = None):
        self._tokens = tokens
        self._scales = scales
        self._probs = probs
        self._handle = handle
        self._tokens_per_expert = tokens_per_expert

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        if self._tokens_per_expert is None:
            self._tokens_per_expert = self._handle.tokens_per_expert
        return self._tokens_per_expert
