"""The per-call workspace of a dispatch and the handle's views of it.

A dispatch's count and dispatch kernels write every driven rank's per-call tables (counts,
send and entry ordinals, row positions or route rows: csrc WorkspaceLayout) into one workspace
allocation, rank i's part in row i. The handle keeps the workspace; its tables are views made
when first read (CudaSendTable, CudaReceiveTable). A workspace nothing refers to any more
serves a later call of the same layout (WorkspacePool).
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import torch

from .layout import CHUNK_TOKENS

# dispatch's count tables (views of its workspace) while the next call runs; one more would serve only
# callers that keep handles, which keep their own tables anyway.
KEPT_WORKSPACES = 2


class CallWorkspace:
    """The per-rank tables of one dispatch call (csrc WorkspaceLayout): one allocation of
    [ranks, layout.bytes / 8] int64, rank i's part in row i. The call's handles keep it; the
    engine hands it to a later call once nothing refers to it any more (Engine._workspace)."""

    __slots__ = ("i64", "layout", "ptr", "stream", "__weakref__", "_i32", "_storage", "_storage_ptr")

    def __init__(self, ranks: int, layout, device: torch.device, stream: int):
        self.i64 = torch.empty(ranks, layout.bytes // 8, dtype=torch.int64, device=device)
        self.layout, self.ptr, self.stream, self._i32 = layout, self.i64.data_ptr(), stream, None
        # The memory's storage object, kept, and its address: the storage's use count is the
        # tensors sharing the memory, views included, and this object.
        self._storage = self.i64.untyped_storage()
        self._storage_ptr = self._storage._cdata

    def free(self, stream: int) -> bool:
        """Whether nothing but the engine refers to it (no handle, no view) and it was last used
        on `stream`: the object is held by the engine's list, the engine's loop variable, this
        call's self and getrefcount's argument; the memory by its own tensors (i64, and the
        int32 view once made) and storage object."""
        return (self.stream == stream and sys.getrefcount(self) == 4
                and torch._C._storage_Use_Count(self._storage_ptr) == (2 if self._i32 is None else 3))

    @property
    def i32(self) -> torch.Tensor:
        """The same memory as int32 [ranks, layout.bytes / 4] (made when first read)."""
        if self._i32 is None:
            self._i32 = self.i64.view(torch.int32)
        return self._i32

    def part(self, i: int) -> int:
        """Address of rank i's part."""
        return self.ptr + i * self.layout.bytes

    def int32(self, i: int, offset: int, shape: tuple[int, ...]) -> torch.Tensor | None:
        """The int32 tensor of `shape` at byte `offset` of rank i's part (None: offset -1)."""
        if offset < 0:
            return None
        return self.i32.as_strided(shape, _strides(shape), (i * self.layout.bytes + offset) // 4)

    def int64(self, i: int, offset: int, shape: tuple[int, ...]) -> torch.Tensor:
        return self.i64.as_strided(shape, _strides(shape), (i * self.layout.bytes + offset) // 8)


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return tuple(reversed(strides))


class CudaSendTable:
    """What the source side of a dispatch computed on the device: rank `part`'s part of the
    call's workspace; its tensors are views made when first read."""

    def __init__(self, call: CallWorkspace, part: int, num_tokens: int, topk: int, world_size: int,
                 topk_idx_TK: torch.Tensor | None, expert_out_width: int = 4):
        self.call, self.part, self.num_tokens, self.topk, self.world_size = call, part, num_tokens, topk, world_size
        self.topk_idx_TK = topk_idx_TK  # direct path: the routing's experts (int64), combine reads them
        # bytes a value of the expert_out its combine may copy into the expert-out block
        # (agreement.expert_out_width: the dispatch's dtype, bf16 for fp8)
        self.expert_out_width = expert_out_width

    @property
    def data_path(self) -> str:
        """Which path the dispatch took; its combine takes the same."""
        return "receive" if self.topk_idx_TK is None else "direct"

    @functools.cached_property
    def send_ord_TW(self) -> torch.Tensor:
        """int32 position of token t among the rows sent to d, -1 if none."""
        return self.call.int32(self.part, self.call.layout.send_ord, (self.num_tokens, self.world_size))

    @functools.cached_property
    def entry_ord_TK(self) -> torch.Tensor:
        """int32 ordinal of (t, k) among this rank's tokens of expert e."""
        return self.call.int32(self.part, self.call.layout.entry_ord, (self.num_tokens, self.topk))

    @functools.cached_property
    def route_rows_TK(self) -> torch.Tensor | None:
        """Direct path: int32 output row of (t, k) at its expert's rank, -1 none; else None."""
        if self.data_path != "direct":
            return None
        return self.call.int32(self.part, self.call.layout.route_rows, (self.num_tokens, self.topk))


class CudaReceiveTable:
    """The device-side layout of a dispatch output, in the same part of the call's workspace
    as its CudaSendTable; names follow routing.ReceiveTable. Views made when first read."""

    def __init__(self, call: CallWorkspace, part: int, engine_shape: EngineShape, num_rows: int,
                 bounds: list[int] | None = None):
        self.call, self.part, self.shape, self.num_rows = call, part, engine_shape, num_rows  # num_rows: R
        # With peer memory: every rank's rows its block was sized for (agreement.py), which a
        # re-dispatch with this handle's sizes decides its path from without a read.
        self.bounds = bounds

    def _info(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.call.int64(self.part, self.call.layout.info + 8 * getattr(self.shape.info, name), shape)

    @functools.cached_property
    def info(self) -> torch.Tensor:
        """int64, offsets in csrc InfoLayout / layout.InfoLayout."""
        return self.call.int64(self.part, self.call.layout.info, (self.shape.info.total,))

    @functools.cached_property
    def row_pos(self) -> torch.Tensor | None:
        """int32 [W, Tmax, kd] output row of each entry of a received row (receive path)."""
        s = self.shape
        return self.call.int32(self.part, self.call.layout.row_pos, (s.W, s.max_tokens, s.kd))

    @functools.cached_property
    def recv_spans(self) -> torch.Tensor | None:
        """int32 [W, max_chunks, 2] receive slots (first, rows) of each chunk (receive path)."""
        return self.call.int32(self.part, self.call.layout.recv_spans, (self.shape.W, self.shape.max_chunks, 2))

    @functools.cached_property
    def fwd_slots(self) -> torch.Tensor | None:
        """int32 [N, max_chunks * 32, G] several nodes: forwarded rows' slots."""
        s = self.shape
        return self.call.int32(self.part, self.call.layout.fwd_slots, (s.N, s.max_chunks * CHUNK_TOKENS, s.G))

    @functools.cached_property
    def fwd_rows(self) -> torch.Tensor | None:
        """int32 [N, max_chunks] several nodes: rows of each forwarded chunk."""
        return self.call.int32(self.part, self.call.layout.fwd_rows, (self.shape.N, self.shape.max_chunks))

    @functools.cached_property
    def tokens_per_expert_L(self) -> torch.Tensor:
        return self._info("tokens_per_expert", (self.shape.L,))

    @functools.cached_property
    def num_needed_rows(self) -> torch.Tensor:
        return self._info("needed", ())

    @functools.cached_property
    def num_dropped(self) -> torch.Tensor:
        return self._info("dropped", ())

    @functools.cached_property
    def expert_start_L(self) -> torch.Tensor:
        return self._info("expert_start", (self.shape.L,))

    @functools.cached_property
    def expert_rows_L(self) -> torch.Tensor:
        return self._info("expert_rows", (self.shape.L,))

    @functools.cached_property
    def recv_counts_W(self) -> torch.Tensor:
        return self._info("recv_count", (self.shape.W,))

    @functools.cached_property
    def count_matrix_WW(self) -> torch.Tensor:
        return self._info("count_matrix", (self.shape.W, self.shape.W))

    @functools.cached_property
    def node_counts_WN(self) -> torch.Tensor:
        return self._info("node_counts", (self.shape.W, self.shape.N))


@dataclasses.dataclass(frozen=True)
class EngineShape:
    """What the views of a handle need of its engine."""

    W: int
    N: int
    G: int
    L: int
    max_tokens: int
    max_chunks: int
    kd: int
    info: object  # layout.InfoLayout


class RankDispatch:
    """One rank's dispatch: its outputs, and its part of the call's workspace (send, recv)."""

    __slots__ = ("rows_RH", "scales_RB", "probs_R", "send", "recv")

    def __init__(self, rows_RH, scales_RB, probs_R, send: CudaSendTable, recv: CudaReceiveTable):
        self.rows_RH, self.scales_RB, self.probs_R, self.send, self.recv = rows_RH, scales_RB, probs_R, send, recv

    @property
    def recv_counts_W(self) -> torch.Tensor:
        return self.recv.recv_counts_W

    @property
    def count_matrix_WW(self) -> torch.Tensor:
        return self.recv.count_matrix_WW

    @property
    def node_counts_WN(self) -> torch.Tensor:
        return self.recv.node_counts_WN


class WorkspacePool:
    """The last KEPT_WORKSPACES workspaces of each call layout (K, route rows, receive tables)."""

    def __init__(self, ext, geo, kd: int, num_ranks: int, device: torch.device):
        self.ext, self.geo, self.kd, self.num_ranks, self.device = ext, geo, kd, num_ranks, device
        # (K, route rows, receive tables) -> ext.WorkspaceLayout, and the last workspaces of each
        self.layouts: dict[tuple[int, bool, bool], object] = {}
        self.kept: dict[tuple[int, bool, bool], list[CallWorkspace]] = {}

    def get(self, topk: int, direct: bool, receive: bool, stream: int) -> CallWorkspace:
        """A workspace for a call of up to `topk` routes per token with the tables of the direct
        path, the receive path or both: one of the last KEPT_WORKSPACES of this layout that
        nothing refers to any more (no handle, no view; on a GPU, last used on `stream`, so
        it is reused in stream order), else a new one."""
        key = (topk, direct, receive)
        kept = self.kept.get(key)
        if kept is None:
            kept = self.kept[key] = []
        for ws in kept:
            if ws.free(stream):
                return ws
        layout = self.layouts.get(key)
        if layout is None:
            layout = self.layouts[key] = self.ext.workspace_layout(self.geo, self.kd, topk, direct, receive)
        ws = CallWorkspace(self.num_ranks, layout, self.device, stream)
        kept.append(ws)
        if len(kept) > KEPT_WORKSPACES:
            del kept[0]  # still referenced by its handles, which free it
        return ws
