"""The read-only records a dispatch returns; combine and backward consume them unchanged.

Legend: T tokens on this rank, K routes per token, W ranks, N nodes, R output rows,
H hidden, V rows received.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

import torch

from .config import BufferConfig
from .routing import Routing
from .traffic.model import RowCounts, row_counts


def read_only(getter: Callable[[Any], Any]) -> property:
    """A property that reads a field of a slotted record and refuses assignment and deletion
    with FrozenInstanceError, as a frozen dataclass does. The record's __init__ fills its
    private slots with plain stores (a frozen dataclass pays an object.__setattr__ per field
    instead), and the getter is a Python function, which the interpreter inlines: about 15 ns
    a read, against 27 ns for an operator.attrgetter getter (Python 3.12, timeit)."""
    name = getter.__name__

    def refuse(self, value=None):
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")

    return property(getter, refuse, refuse, getter.__doc__)


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

    @read_only
    def dest(self) -> Any:
        """routing.ReceiveTable, or the backend's own table of the same rows (with the fields
        the properties here read)."""
        return self._dest

    @read_only
    def config(self) -> BufferConfig:
        return self._config

    @property
    def recv_counts_W(self) -> torch.Tensor:
        """int64 rows received from each rank."""
        value = self._recv_counts_W
        return self._dest.recv_counts_W if value is None else value

    @property
    def count_matrix_WW(self) -> torch.Tensor:
        """Rows sent from rank s to rank d, all ranks."""
        value = self._count_matrix_WW
        return self._dest.count_matrix_WW if value is None else value

    @property
    def node_counts_WN(self) -> torch.Tensor:
        """Tokens of rank s that reach node n, all ranks."""
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
    traffic later. Not the handle itself, whose send table may hold memory a later call needs
    (the cuda backend's direct path: the arena block of the dispatch's probs)."""

    __slots__ = ()

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

    The constructor takes the fields by position or by name, in the order below: a backend's
    per-call path passes the first eight by position (a class called with keywords builds a
    dictionary: about 0.2 us more for a handle, Python 3.12). The count tables (recv_counts_W,
    count_matrix_WW, node_counts_WN): None (the default) takes dest's attribute of the same
    name when read (the cuda backend's are views of its per-call workspace, which a call need
    not make).
    """

    __slots__ = ("_owner", "_rank", "_routing", "_source", "_probs_R", "_num_out_tokens", "_num_recv_rows", "_serial",
                 "_checksum", "__weakref__")  # and _CountTables'; weakref: a buffer's last call

    def __init__(self, owner: int, config: BufferConfig, rank: int, routing: Routing, source: Any, dest: Any,
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

    @read_only
    def owner(self) -> int:
        """id of the buffer that made it (a handle is not valid on another buffer)."""
        return self._owner

    @read_only
    def rank(self) -> int:
        return self._rank

    @read_only
    def routing(self) -> Routing:
        return self._routing

    @read_only
    def source(self) -> Any:
        """routing.SendTable, or the backend's own table of the same rows."""
        return self._source

    @read_only
    def probs_R(self) -> torch.Tensor:
        """float32 routing weight of each output row, 0 on padding."""
        return self._probs_R

    @read_only
    def num_out_tokens(self) -> int | None:
        return self._num_out_tokens

    @read_only
    def num_recv_rows(self) -> int:
        """V (-1: not counted on the host)."""
        return self._num_recv_rows

    @read_only
    def serial(self) -> int:
        """Which dispatch with a routing of its buffer made it (1, 2, ...), compared on reuse."""
        return self._serial

    @read_only
    def checksum(self) -> int:
        """crc32 of count_matrix_WW, taken where the counts reached the host, compared on reuse."""
        return self._checksum

    def replace(self, **changes) -> "DispatchHandle":
        """A copy with some fields changed (dataclasses.replace's contract); it keeps the rows
        per link computed from the counts unless the counts change."""
        new = self._with_probs(self._probs_R)
        for name, value in changes.items():
            if name not in _HANDLE_FIELDS:
                raise TypeError(f"DispatchHandle has no field {name!r}")
            setattr(new, "_" + name, value)
        if not _COUNT_FIELDS.isdisjoint(changes):
            new._row_counts = None
        return new

    def _with_probs(self, probs_R: torch.Tensor) -> "DispatchHandle":
        """A copy whose probs_R is `probs_R`, the rows per link kept: autograd's dispatch makes
        one per call (the differentiable probs), by position, without replace()'s keywords."""
        new = DispatchHandle(self._owner, self._config, self._rank, self._routing, self._source, self._dest,
                             probs_R, self._num_out_tokens, self._recv_counts_W, self._num_recv_rows,
                             self._count_matrix_WW, self._node_counts_WN, self._serial, self._checksum)
        new._row_counts = self._row_counts
        return new

    @property
    def num_tokens(self) -> int:
        return self._routing.num_tokens

    @property
    def num_rows(self) -> int:
        return self._dest.num_rows

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        return self._dest.tokens_per_expert_L

    @property
    def data_path(self) -> str | None:
        """How the cuda kernels moved this dispatch's rows, and how its combine will: "direct"
        (each route's row straight to and from its final row) or "receive" (through receive
        buffers); None for backends without kernels."""
        return getattr(self._source, "data_path", None)

    @property
    def num_dropped(self) -> torch.Tensor:
        """Routed rows that did not fit num_out_tokens (int64 scalar on the device)."""
        return self._dest.num_dropped

    @property
    def num_needed_rows(self) -> torch.Tensor:
        """Rows the unclipped layout needs (int64 scalar on the device)."""
        return self._dest.num_needed_rows


_HANDLE_FIELDS = frozenset(inspect.signature(DispatchHandle).parameters)  # what replace() may change
_COUNT_FIELDS = frozenset(("recv_counts_W", "count_matrix_WW", "node_counts_WN"))  # row_counts is made from them


class DispatchResult:
    """What dispatch returns, read-only (read_only); the constructor takes the fields by
    position or by name, in the order below."""

    __slots__ = ("_tokens", "_scales", "_probs", "_handle", "_tokens_per_expert")

    def __init__(self, tokens: torch.Tensor, scales: torch.Tensor | None, probs: torch.Tensor,
                 handle: DispatchHandle, tokens_per_expert: torch.Tensor | None = None):
        self._tokens = tokens
        self._scales = scales
        self._probs = probs
        self._handle = handle
        self._tokens_per_expert = tokens_per_expert

    @read_only
    def tokens(self) -> torch.Tensor:
        """[R, H] expert-major rows, dtype of x."""
        return self._tokens

    @read_only
    def scales(self) -> torch.Tensor | None:
        """[R, H/128] float32 for fp8 input, else None."""
        return self._scales

    @read_only
    def probs(self) -> torch.Tensor:
        """[R] float32 routing weight of each row, 0 on padding."""
        return self._probs

    @read_only
    def handle(self) -> DispatchHandle:
        return self._handle

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """[L] int64 rows per local expert, padding included (None given: the handle's, read
        when first asked for)."""
        if self._tokens_per_expert is None:
            self._tokens_per_expert = self._handle.tokens_per_expert
        return self._tokens_per_expert
