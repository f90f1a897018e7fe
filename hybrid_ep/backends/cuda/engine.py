"""The call sequence of the cuda backend for the ranks one process drives.

Production drives one rank per process; the single-GPU emulation drives all W virtual
ranks of a group in one process. Both go through this class, and each kernel is one launch
covering every rank it drives, so the kernels are the same and only the launcher differs.

Per dispatch: the layout kernel (counts, send slots, ordinals, count exchange, offsets),
then, in dynamic mode only, one host read of the output size, then the dispatch kernel.
Static mode (num_out_tokens) never reads anything back, so it can be captured in a graph.

The host path per call: Python checks the arguments and allocates what the caller gets
(output rows, probs, scales: on the direct path from each rank's arena, arena.py, or the call
takes the receive path; combine's y; a direct combine's expert_out from outside the arena is
copied into the rank's staging region, staging.py) and one workspace for the call's per-rank tables
(CallWorkspace, reused once nothing refers to it); one call into the extension
(ext.HostPath) then fills every rank's launch arguments and launches the kernel sequence:
both dispatch kernels when the output size is known, else the layout kernel, the host read,
then the dispatch kernel. Between that read and the dispatch launch (a GPU idles there) only
what needs the output sizes runs: the path, the arena blocks' ranges or the receive path's
outputs; the arena's tensors (made by the extension, arena.py) and the per-rank results are
made after the launch. The handle's tensors are views of the workspace made when read.

`ext` is hybrid_ep._C (the GPU) or hybrid_ep._model (the CPU model of the device layer, on
CPU tensors); both expose the same launchers, so nothing here depends on which it is.

Legend: T tokens, K routes per token, W ranks, L local experts, R output rows, H hidden.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import logging
import sys
from typing import Callable

import torch

from ...config import FP8_BLOCK, BufferConfig, timeout_seconds
from ...routing import Routing, bad_route_text
from . import launch
from .arena import Arena, arena_take, call_bytes
from .layout import (
    BAD_ROUTE_WORDS,
    CHUNK_TOKENS,
    COMPILED_CONSTANTS,
    ERROR_RECORD_EPOCH_OFFSET,
    ERROR_RECORD_PHASE_OFFSET,
    MAX_TOPK,
    buffer_layouts,
    compiled,
    info_layout,
)
from .registered import LoopbackRegions, NvshmemRegions
from .staging import CombineStaging

BAD_ROUTE_READS = 1000  # reads of a bad-route record being written before a call leaves it to the next

# What a kernel waited for when it gave up, by the name of its phase: the codes are csrc's
# (common/params.h, Phase), read from the loaded module as ext.PHASES {name: code};
# check_extension makes sure this table names every phase there but "none".
PHASE_TEXT = {
    "bad_routing": "routing check",
    "dispatch_flow": "dispatch flow control (waiting for the peer to finish reading the previous dispatch)",
    "counts": "dispatch count exchange",
    "dispatch_rows": "dispatch rows",
    "combine_flow": "combine flow control (waiting for the peer to finish reading the previous combine)",
    "combine_rows": "combine partial sums",
    "pipeline": "its shared-memory pipeline",
    "rdma_flow": "inter-node flow control (waiting for its rail peer on that node to finish reading the previous call)",
    "rdma_counts": "inter-node count exchange",
    "rdma_rows": "forwarding (waiting for the rail peer's rows from that node, by RDMA)",
    "node_partials": "the node partial sums (waiting for a rank of its own node to store its partials of a forwarded "
                     "chunk)",
    "rdma_partials": "combine node partials (waiting for the rail peer on that node, by RDMA)",
    "direct_tensors": "the direct path (waiting for the peer to publish its tensors of the call)",
    "direct_rows": "the direct path's dispatch (waiting for the peer to finish writing this rank's rows)",
    "direct_reads": "the direct path's combine (waiting for the peer to finish reading this rank's expert_out)",
    # the rings between ranks (csrc/kernels/peer_ring.cuh): a wait's expected and saw are slot tags
    "recv_ring": "the dispatch's receive ring (waiting for the peer to read a chunk and free its slot; expected and "
                 "saw are slot tags, the call and the chunk read there: csrc/kernels/peer_ring.cuh)",
    "partial_ring": "the combine's partial-sum ring (waiting for the source to free the chunk slot its next partials "
                    "go to; expected and saw are slot tags, as for recv_ring)",
    "forward_ring": "the combine's forwarding ring (waiting for the source's rail peer on this node to free the chunk "
                    "slot its next partials go to; expected and saw are slot tags, as for recv_ring)",
    "node_part_ring": "the combine's node-partial ring (waiting for the source on that node to free the chunk slot "
                      "its next node partials go to, by RDMA; expected and saw are slot tags, as for recv_ring)",
    "staged_ring": "the dispatch's staging for that node (waiting for the rail peer to forward a chunk and free its "
                   "slot; expected and saw are slot tags, as for recv_ring)",
}

# The rings of a block's shared memory a pipeline wait names (ErrorRecord.site; the codes and
# which warps fill and free each ring: PipeSite in csrc/common/params.h): (the ring, what fills
# a stage, what frees it).
PIPE_SITE_TEXT = {
    "none": ("a ring", "its producer", "its consumer"),
    "send_fifo": ("the dispatch's send FIFO", "the bulk loads of this rank's token rows",
                  "the send warp's stores to the destinations"),
    "expand_fifo": ("the dispatch's expand FIFO", "the bulk loads of the received rows",
                    "the expand warp's stores to the output rows"),
    "send_entries": ("the dispatch's routing-entry ring", "the warps writing a chunk's routing entries",
                     "the send warp signalling the chunk"),
    "expand_tables": ("the dispatch's position-table ring", "the warps building a received chunk's positions",
                      "the expand load and store warps"),
    "staged_rows": ("the dispatch's staged-rows ring", "the send warp staging rows for other nodes",
                    "the RDMA warps"),
    "host_inputs": ("the combine's expert-output ring", "the bulk loads of the expert outputs",
                    "the expert host's reducers"),
    "host_partials": ("the combine's partial-sum ring", "the expert host's reducers",
                      "the store warp sending partials to the sources"),
    "source_partials": ("the combine's source ring", "the bulk loads of the partials", "the source's reducers"),
    "forward_puts": ("the combine's forward-put ring", "the reducers of the node partials",
                     "the warp putting node partials to other nodes"),
    "direct_rows": ("the direct dispatch's FIFO", "the bulk loads of this rank's token rows",
                    "the store warps writing each route's row"),
    "direct_tables": ("the direct dispatch's route-table ring", "the warp building a chunk's route table",
                      "the store warps"),
    "pull_routes": ("the direct combine's route ring", "the bulk loads of the routes' expert outputs",
                    "the reducers"),
    "direct_done": ("the direct dispatch's done ring", "the store warps finishing a chunk",
                    "the RDMA warp putting staged rows to other nodes"),
    "pull_puts": ("the direct combine's node-partial put ring", "the reducers of the node partials",
                  "the warp putting node partials to other nodes"),
}


# Workspaces kept per call layout for reuse: two, because a buffer's last_call keeps the last
# dispatch's count tables (views of its workspace) while the next call runs; one more would serve only
# callers that keep handles, which keep their own tables anyway.
KEPT_WORKSPACES = 2


_log = logging.getLogger("hybrid_ep")
_fallbacks_logged: set[str] = set()  # the reason of the first call that left the direct path (once per process)


# How to size the arena, in the fallback line: what a training step keeps there.
ARENA_SIZING = ("The arena (HybridEPBuffer(arena_bytes=...), opt-in, for ranks in separate processes) holds "
                "each dispatch output kept alive (in training, one per MoE layer in flight until its backward): "
                "arena.call_bytes(rows, hidden, dtype) each, arena.training_bytes(layers_in_flight, rows, hidden, "
                "dtype) for a training step")


def _log_fallback(reason: str) -> None:
    if not _fallbacks_logged:
        _fallbacks_logged.add(reason)
        _log.warning("hybrid_ep: a dispatch took the receive path instead of the direct path (%s); "
                     "logged once per process", reason)


class RoutingError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class AbsentRanks:
    """Test hook (Engine.absent, set by hybrid_ep.testing.faults.ranks_absent): ranks whose
    kernels are launched with RankArgs.absent, so they never arrive, as a crashed peer would.
    `ranks` launch none of a call's kernels; `after_layout` launch a dispatch's layout kernel
    (their counts are exchanged) but not its dispatch kernel."""

    ranks: frozenset[int] = frozenset()
    after_layout: frozenset[int] = frozenset()


class CallWorkspace:
    """The per-rank tables of one dispatch call (csrc CallLayout): one allocation of
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


class CudaSendLayout:
    """What the source side of a dispatch computed on the device: rank `part`'s part of the
    call's workspace; its tensors are views made when first read."""

    def __init__(self, call: CallWorkspace, part: int, num_tokens: int, topk: int, world_size: int,
                 topk_idx_TK: torch.Tensor | None):
        self.call, self.part, self.num_tokens, self.topk, self.world_size = call, part, num_tokens, topk, world_size
        self.topk_idx_TK = topk_idx_TK  # direct path: the routing's experts (int64), combine reads them

    @property
    def data_path(self) -> str:
        """Which path the dispatch took; its combine takes the same."""
        return "receive" if self.topk_idx_TK is None else "direct"

    @functools.cached_property
    def send_slot_TW(self) -> torch.Tensor:
        """int32 position of token t among the rows sent to d, -1 if none."""
        return self.call.int32(self.part, self.call.layout.send_slot, (self.num_tokens, self.world_size))

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


class CudaRecvLayout:
    """The device-side layout of a dispatch output, in the same part of the call's workspace
    as its CudaSendLayout; names follow routing.DestLayout. Views made when first read."""

    def __init__(self, call: CallWorkspace, part: int, engine_shape: _Shape, num_rows: int):
        self.call, self.part, self.shape, self.num_rows = call, part, engine_shape, num_rows  # num_rows: R

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
class _Shape:
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

    def __init__(self, rows_RH, scales_RB, probs_R, send: CudaSendLayout, recv: CudaRecvLayout):
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


def check_extension(ext) -> None:
    """The loaded module and the one the layout plan took csrc's sizes from (layout.compiled)
    must agree (a module built from other sources is stale), and the Python tables keyed by
    the names of csrc's codes (dtypes, transports, phases) must name the same codes."""
    rebuild = "rebuild the extension (pip install --no-build-isolation -e .)"
    for name in COMPILED_CONSTANTS:
        value = getattr(compiled, name)
        if not hasattr(ext, name):
            raise RuntimeError(f"{ext.__name__} has no {name}; {rebuild}")
        if getattr(ext, name) != value:
            raise RuntimeError(f"{ext.__name__} has {name}={getattr(ext, name)} but the package expects {value}; "
                               f"{rebuild}")
    named = {"DTYPE_CODES": (set(launch.ELEM_BYTES), "launch.ELEM_BYTES"),
             "TRANSPORTS": ({LoopbackRegions.kind, NvshmemRegions.kind}, "the RDMA region kinds"),
             "PHASES": ({"none"} | set(PHASE_TEXT), "engine.PHASE_TEXT"),
             "PIPE_SITES": (set(PIPE_SITE_TEXT), "engine.PIPE_SITE_TEXT")}
    for name, (keys, where) in named.items():
        codes = getattr(ext, name, None)
        if codes is None:
            raise RuntimeError(f"{ext.__name__} has no {name}; {rebuild}")
        if set(codes) != keys:
            raise RuntimeError(f"{ext.__name__}.{name} names {sorted(codes)} but {where} names {sorted(keys)}; "
                               f"{rebuild}, or name the new code there")


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """float32 and contiguous, for a kernel to read: a no-op (no detach either) for what
    already is; a conversion is made from the detached tensor, so it records no graph."""
    if t.dtype != torch.float32:
        return t.detach().float().contiguous()
    return t if t.is_contiguous() else t.detach().contiguous()


def _aligned(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Contiguous, starting on a 16-byte boundary (the kernels move 16-byte vectors), and its
    address."""
    if not t.is_contiguous():
        t = t.contiguous()
    ptr = t.data_ptr()
    if ptr % 16 != 0:
        t = t.clone()
        ptr = t.data_ptr()
    return t, ptr


def _stream_getter(device: torch.device):
    """A function returning the device's current stream as an integer: torch's raw getter
    where this torch has it (well under a microsecond), else the Stream object's handle."""
    if device.type != "cuda":
        return lambda: 0  # the CPU model runs each launch to completion in the call
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return lambda: raw(index)
    return lambda: torch.cuda.current_stream(index).cuda_stream


def _spans(tensors) -> list[tuple[int, int]]:
    """(address, bytes) of each tensor that has any (the CPU model's launch declarations)."""
    return [(t.data_ptr(), t.numel() * t.element_size()) for t in tensors if t is not None and t.numel() > 0]


# A dispatch's inputs as Engine._dispatch_inputs checked and marshalled them, a plain tuple (a
# record object would cost a construction per call): (dtype, dtype_name, fp8, topk: the most
# routes per token of any driven rank, which sizes the workspace's tables; launch: per rank the
# extension's DispatchInput (T, K, x, x_scales, topk_idx, topk_weights); tensors: per rank the
# tensors behind those addresses (x, scales, topk_idx, weights)).
_DispatchInputs = tuple


# The launch settings of each kind of launch: its pipeline (a function that sets the kind's
# pipeline fields of a LaunchArgs for rows of row_elems values, from the engine's shared memory
# per block and store-queue override, and returns the blocks per SM the kernel's shared memory
# leaves room for), the LaunchArgs field with its pipeline depth (launch_shapes) and its role:
# "dispatch" (fp8 rows carry their scales) or "combine", as the SM count's errors name it.


def _dispatch_pipeline(engine: "Engine", a, row_elems: int, dtype_name: str, wire_name: str | None) -> int:
    """The receive path's dispatch: a send and an expand FIFO of row stages."""
    fifo = launch.fifo_shape(launch.row_bytes_of(row_elems, dtype_name), engine.smem_per_block,
                             pipelines=launch.DISPATCH_PIPELINES)
    a.fifo_stages, a.stage_bytes, a.rows_per_stage = fifo.stages, fifo.stage_bytes, fifo.rows_per_stage
    a.store_groups = launch.store_groups(fifo.stages, engine.store_groups_override)
    smem = launch.DISPATCH_PIPELINES * fifo.smem_bytes
    return engine.ext.dispatch_max_blocks_per_sm(smem)


def _dispatch_direct_pipeline(engine: "Engine", a, row_elems: int, dtype_name: str, wire_name: str | None) -> int:
    """The direct path's dispatch: one FIFO of row stages, each stored once per route."""
    fifo = launch.fifo_shape(launch.row_bytes_of(row_elems, dtype_name), engine.smem_per_block,
                             max_stages=launch.MAX_STAGES)
    a.fifo_stages, a.stage_bytes, a.rows_per_stage = fifo.stages, fifo.stage_bytes, fifo.rows_per_stage
    a.store_groups = launch.direct_store_groups(fifo.stages, fifo.stage_bytes, engine.store_groups_override)
    return engine.ext.dispatch_direct_max_blocks_per_sm(fifo.smem_bytes)


def _combine_pipeline(engine: "Engine", a, row_elems: int, dtype_name: str, wire_name: str | None) -> int:
    """The receive path's combine: the expert host's input and output rings, the source's ring,
    partial sums of wire_name on the wire."""
    shape = launch.combine_shape(row_elems, launch.ELEM_BYTES[dtype_name], launch.ELEM_BYTES[wire_name],
                                 engine.smem_per_block)
    a.wire_dtype = engine.ext.DTYPE_CODES[wire_name]
    a.seg_cols, a.host_stages, a.src_stages = shape.seg_cols, shape.host_stages, shape.src_stages
    a.host_out_stages = shape.out_stages
    a.host_stage_bytes, a.src_stage_bytes = shape.host_stage_bytes, shape.src_stage_bytes
    a.store_groups = launch.combine_store_groups(shape.out_stages, engine.store_groups_override)
    return engine.ext.combine_max_blocks_per_sm(shape.smem_bytes)


def _combine_pull_pipeline(engine: "Engine", a, row_elems: int, dtype_name: str, wire_name: str | None) -> int:
    """The direct path's combine: each route's expert-output segments pulled into two rings
    (several nodes: a stage holds a node partial in the wire dtype too)."""
    wire_bytes = launch.ELEM_BYTES[wire_name] if wire_name and engine.config.num_nodes > 1 else 0
    a.wire_dtype = engine.ext.DTYPE_CODES[wire_name or dtype_name]
    pull = launch.pull_shape(row_elems, max(launch.ELEM_BYTES[dtype_name], wire_bytes), engine.smem_per_block)
    a.seg_cols, a.src_stages, a.src_stage_bytes = pull.seg_cols, pull.stages, pull.stage_bytes
    return engine.ext.combine_pull_max_blocks_per_sm(pull.smem_bytes)


@dataclasses.dataclass(frozen=True)
class _KindSettings:
    pipeline: Callable[..., int]  # (engine, args, row_elems, dtype_name, wire_name) -> blocks per SM
    stages: str  # the LaunchArgs field with the pipeline's depth
    role: str  # "dispatch" or "combine"


_KIND_SETTINGS = {
    "dispatch": _KindSettings(_dispatch_pipeline, "fifo_stages", "dispatch"),
    "dispatch_direct": _KindSettings(_dispatch_direct_pipeline, "fifo_stages", "dispatch"),
    "combine": _KindSettings(_combine_pipeline, "host_out_stages", "combine"),
    "combine_pull": _KindSettings(_combine_pull_pipeline, "src_stages", "combine"),
}


class Engine:
    """Kernels of one buffer for the ranks this process drives (`ranks`, with their tables)."""

    def __init__(self, ext, config: BufferConfig, ranks: list[int], tables: list[torch.Tensor],
                 device: torch.device, rdma=None, data_path: str | None = None, arenas=None, vote=None):
        """rdma: the inter-node transport's regions (registered.LoopbackRegions, or NVSHMEM's),
        for groups of several nodes. data_path: "direct" or "receive" (launch.data_path; None:
        HYBRID_EP_DATA_PATH, else direct wherever it can run). arenas: the registered
        buffers' arenas (registered.RegisteredBuffers: arena_bases, own, arena_bytes); vote:
        where this process drives only some ranks of the group, the agreement of every rank
        on each dispatch's path (agreement.PathVote), else None."""
        self.ext, self.config, self.ranks, self.tables, self.device = ext, config, ranks, tables, device
        if config.num_nodes > 1 and rdma is None:
            raise ValueError(f"a group of {config.num_nodes} nodes needs an inter-node transport (rdma)")
        self.rdma = rdma
        check_extension(ext)
        layouts = buffer_layouts(config, ext)  # built by this module, so its Geometry takes them
        self.reg, self.rdma_layout = layouts.reg, layouts.rdma
        self.info = info_layout(config)
        self.geo = self._geometry()
        self.error = ext.ErrorRecord()
        # Its phase word (common/params.h ErrorRecord; 0 while no kernel failed), in host memory:
        # each call polls it here, without a call into the extension.
        self._error_phase = ctypes.c_int32.from_address(self.error.host_ptr + ERROR_RECORD_PHASE_OFFSET)
        self._phase_names = {code: name for name, code in ext.PHASES.items()}
        # The last bad route a layout kernel recorded without a host read (a static size): not a
        # failure; each call compares its epoch word with the last one raised, without a sync.
        self.bad_route = ext.ErrorRecord()
        self._bad_route_epoch = ctypes.c_uint64.from_address(self.bad_route.host_ptr + ERROR_RECORD_EPOCH_OFFSET)
        self._bad_route_raised = 0
        self._site_names = {code: name for name, code in ext.PIPE_SITES.items()}
        self.abort = torch.zeros(1, dtype=torch.int32, device=device)
        self.device_sms, self.smem_per_block = ext.device_properties(device.index or 0)
        self.failure: str | None = None
        self.absent = AbsentRanks()  # every rank arrives, unless a test says otherwise
        self.timeout_ns = int(timeout_seconds() * 1e9)  # HYBRID_EP_TIMEOUT_S, read once per buffer
        self.store_groups_override = launch.store_groups_override()  # HYBRID_EP_STORE_GROUPS, likewise
        # The direct path writes a rank's outputs and reads its expert_out from every rank of
        # the node, and every rank must choose the same path per call. Ranks that share this
        # process (the single-GPU emulation) address each other's tensors as they are: outputs
        # come from PyTorch's allocator at the call's size, and combine reads expert_out where
        # it lies, so the direct path holds no memory. Ranks in other processes reach a rank's
        # tensors only in an arena their peers mapped (BufferConfig.arena_bytes, opt-in), with
        # a vote per call; without one the buffer takes the receive path, whose rings are
        # bounded. Published tensors are offsets from each rank's arena base (0 in one process).
        arena = arenas is not None and arenas.arena_bytes > 0 and all(arenas.arena_bases)
        in_process = len(ranks) == config.world_size
        self.vote = vote
        self.data_path = launch.data_path((config.num_nodes == 1 or rdma is not None)
                                          and (in_process or (arena and vote is not None)), data_path)
        direct_ok = self.data_path == "direct" and arena
        self.arena_bases = torch.tensor(arenas.arena_bases if direct_ok else [0] * config.world_size,
                                        dtype=torch.int64, device=device)
        # With an arena, each rank's peer-mapped tail: the combine staging region, then the arena.
        self.staging = CombineStaging(config, arenas.own, device) if direct_ok else None
        split = self.staging.nbytes if direct_ok else 0
        self.arenas = [Arena(b + split, arenas.arena_bytes - split, device) for b in arenas.own] if direct_ok else []
        # Launch arguments per (kind, SMs, dtype, width, wire dtype, apply_probs): built and checked
        # once, then only the per-rank part changes (the launchers copy the struct when they launch).
        self._launch_cache: dict[tuple, object] = {}
        # Tensors the last launch of each kind read that the caller may not hold (contiguous
        # or aligned copies, fp32 casts): kept until the next call of that kind, so they
        # outlive the kernels also when the caller moves on to another stream.
        self._in_flight: dict[str, list[torch.Tensor]] = {}
        # The CPU model checks every bulk copy against the tensors of the launch; on a GPU
        # that is compute-sanitizer's job and the call is skipped.
        self._declares_tensors = bool(getattr(ext, "IS_MODEL", False))
        # The per-call host path: what stays fixed per rank is set once here.
        fixed = []
        for i, r in enumerate(ranks):
            ra = ext.RankArgs()
            ra.rank, ra.peers = r, tables[i].data_ptr()
            self._set_transport(ra, i)
            fixed.append(ra)
        self.host = ext.HostPath(fixed, self.arena_bases.data_ptr())
        self._stream = _stream_getter(device)
        self._shape = _Shape(W=config.world_size, N=config.num_nodes, G=config.ranks_per_node,
                             L=config.experts_per_rank, max_tokens=config.max_tokens_per_rank,
                             max_chunks=int(self.reg.max_chunks), kd=int(self.reg.meta_entries), info=self.info)
        # (K, route rows, receive tables) -> ext.CallLayout, and the last workspaces of each, for reuse
        self._call_layouts: dict[tuple[int, bool, bool], object] = {}
        self._workspaces: dict[tuple[int, bool, bool], list[CallWorkspace]] = {}
        # (dtype, columns) -> dtype name, for row widths already checked (_check_rows)
        self._row_dtypes: dict[tuple[torch.dtype, int], str] = {}
        self._ones: torch.Tensor | None = None  # _unit_weights

    def _geometry(self):
        c, g = self.config, self.ext.Geometry()
        g.world_size, g.ranks_per_node, g.num_nodes = c.world_size, c.ranks_per_node, c.num_nodes
        g.num_experts, g.local_experts = c.num_experts, c.experts_per_rank
        g.max_tokens, g.hidden = c.max_tokens_per_rank, c.hidden_dim
        g.pad_multiple = c.pad_multiple
        g.min_rows_per_expert = c.min_rows_per_expert
        g.reg, g.rdma = self.reg, self.rdma_layout
        for name, value in dataclasses.asdict(self.info).items():
            setattr(g.info, name, value)
        g.transport = self.ext.TRANSPORTS[self.rdma.kind if self.rdma is not None else "loopback"]
        return g

    def _set_transport(self, ra, i: int) -> None:
        if self.rdma is not None:
            ra.rdma_regions, ra.rdma_base, ra.rdma_pes = self.rdma.rank_args(i)

    # -- errors --------------------------------------------------------------------------

    def _reported(self) -> bool:
        """Whether a kernel recorded something the host has not raised (pinned host memory)."""
        return (self.failure is not None or self._error_phase.value != 0
                or self._bad_route_epoch.value != self._bad_route_raised)

    def raise_if_failed(self) -> None:
        """Raise the first failure a kernel recorded, else a bad route of a static-size call not
        raised yet (reads pinned host memory; no sync)."""
        if self.failure is None:
            record = self.error.read()
            if record is not None:
                self.failure = self._describe(record)
        if self.failure is not None:
            raise RuntimeError(self.failure)
        self._raise_bad_route()

    def _raise_bad_route(self) -> None:
        """The route the last refused static-size call recorded, once: that call moved no rows and
        completed on every rank, so the buffer stays usable. The device zeroes the epoch before
        the fields and writes it after them: a read between two equal non-zero readings of the
        epoch is one call's route. A record still being written after BAD_ROUTE_READS reads is
        left to the next call: the host never waits on a kernel here."""
        for _ in range(BAD_ROUTE_READS):
            epoch = self._bad_route_epoch.value
            if epoch == self._bad_route_raised:
                return
            rec = self.bad_route.read()
            if epoch == 0 or rec is None or rec["epoch"] != epoch or self._bad_route_epoch.value != epoch:
                continue  # a layout kernel is writing it
            self._bad_route_raised = epoch
            expert = ctypes.c_int64(rec["observed"]).value  # the record holds it as u64
            raise RoutingError(bad_route_text(rec["expected"], rec["rank"], rec["peer"], expert))

    def _describe(self, rec: dict) -> str:
        code = rec["phase"]
        phase = self._phase_names.get(code)
        what = PHASE_TEXT.get(phase, f"phase {code}")
        if rec["peer"] < 0:  # a wait on this rank's own pipeline, no peer involved
            return self._describe_pipeline(rec, what)
        where = f" on node {rec['peer'] // self.config.ranks_per_node}" if self.config.num_nodes > 1 else ""
        return (f"hybrid_ep cuda backend: rank {rec['rank']} gave up after {self.timeout_ns / 1e9:g} s "
                f"(HYBRID_EP_TIMEOUT_S) waiting for peer rank {rec['peer']}{where} in "
                f"{what} (call {rec['epoch']}, expected {rec['expected']}, "
                f"saw {rec['observed']}): a peer did not make the same call. The buffer can not be used "
                f"after this error; create a new one.")

    def _describe_pipeline(self, rec: dict, what: str) -> str:
        """A wait between the warps of a block ran out (it has twice the bound of a peer's wait,
        so no peer's wait gave up first): name the ring and the side that stopped."""
        ring, fills, frees = PIPE_SITE_TEXT[self._site_names.get(rec.get("site", 0), "none")]
        free_slot = rec["observed"] == 1  # PipeSide: kWaitedForFreeSlot
        waited = f"for a free stage of {ring}" if free_slot else f"for data in {ring}"
        stalled = frees if free_slot else fills
        return (f"hybrid_ep cuda backend: rank {rec['rank']} gave up after {self.timeout_ns / 1e9:g} s "
                f"(HYBRID_EP_TIMEOUT_S) waiting in {what} {waited} (call {rec['epoch']}): {stalled} "
                f"stopped making progress while no wait on another rank ran out (a bulk copy that never "
                f"completed, or a warp of this block stalled). The buffer can not be used after this "
                f"error; create a new one.")

    # -- launch arguments ------------------------------------------------------------------

    def launch_shapes(self, num_sms: int) -> dict:
        """The pipeline shape each kernel launched with at num_sms SMs per rank ({kind: {stages,
        store_groups}}), for benchmark records: the store queue is chosen per launch."""
        shapes = {}
        for (kind, launched_sms, *_), a in self._launch_cache.items():
            if launched_sms == num_sms:
                stages = getattr(a, _KIND_SETTINGS[kind].stages)
                shapes[kind] = {"stages": int(stages), "store_groups": int(a.store_groups)}
        return shapes

    def _launch_args(self, num_sms: int, dtype_name: str, row_elems: int, kind: str, wire_name: str | None = None,
                     apply_probs: bool = False):
        """The LaunchArgs of a kind of launch (_KIND_SETTINGS) at num_sms SMs per rank, rows of
        row_elems values of dtype_name (combine: partial sums of wire_name between ranks,
        apply_probs): what every kind sets, then the kind's pipeline; built and checked once per
        key, the key the callers look up first."""
        key = (kind, num_sms, dtype_name, row_elems, wire_name, apply_probs)
        cached = self._launch_cache.get(key)
        if cached is not None:
            return cached
        settings = _KIND_SETTINGS[kind]
        a = self.ext.LaunchArgs()
        a.geo = self.geo
        a.num_ranks = len(self.ranks)
        a.num_sms = num_sms
        a.dtype = self.ext.DTYPE_CODES[dtype_name]
        a.row_elems = row_elems
        a.kd = int(self.reg.meta_entries)
        a.chunk_tokens = CHUNK_TOKENS
        if settings.role == "dispatch" and dtype_name == "float8_e4m3fn":
            a.scale_cols = row_elems // FP8_BLOCK  # fp8 rows carry their scales
        a.apply_probs = int(apply_probs)
        a.timeout_ns = self.timeout_ns
        a.abort_flag = self.abort.data_ptr()
        a.error = self.error.device_ptr
        a.bad_route = self.bad_route.device_ptr
        per_sm = settings.pipeline(self, a, row_elems, dtype_name, wire_name)
        launch.check_coresident(f"num_sms ({settings.role})", num_sms, len(self.ranks), self.device_sms, per_sm)
        self._launch_cache[key] = a
        return a

    def _declaring(self) -> bool:
        """Whether the next launches declare their tensors: on the CPU model, launches on. The
        callers ask first, so that neither a GPU nor the launches-off host bench builds the lists."""
        return self._declares_tensors and self.ext.launches_enabled()

    def _declare(self, tensors, regions=()) -> None:
        """The CPU model's check: the tensors and (address, bytes) regions of the next launches."""
        self.ext.note_launch_tensors(_spans(tensors) + list(regions) + self._fixed_spans())

    def _fixed_spans(self) -> list[tuple[int, int]]:
        """What every launch may touch besides its call's tensors: peer tables, RDMA regions,
        the abort flag."""
        return ([(t.data_ptr(), t.numel() * t.element_size()) for t in self.tables] +
                (self.rdma.declared() if self.rdma is not None else []) + [(self.abort.data_ptr(), 4)])

    def _workspace(self, topk: int, direct: bool, receive: bool, stream: int) -> CallWorkspace:
        """A workspace for a call of up to `topk` routes per token with the tables of the direct
        path, the receive path or both: one of the last KEPT_WORKSPACES of this layout that
        nothing refers to any more (no handle, no view; on a GPU, last used on `stream`, so
        it is reused in stream order), else a new one."""
        key = (topk, direct, receive)
        kept = self._workspaces.get(key)
        if kept is None:
            kept = self._workspaces[key] = []
        for ws in kept:
            if ws.free(stream):
                return ws
        layout = self._call_layouts.get(key)
        if layout is None:
            layout = self._call_layouts[key] = self.ext.call_layout(self.geo, self._shape.kd, topk, direct, receive)
        ws = CallWorkspace(len(self.ranks), layout, self.device, stream)
        kept.append(ws)
        if len(kept) > KEPT_WORKSPACES:
            del kept[0]  # still referenced by its handles, which free it
        return ws

    def _check_rows(self, name: str, cols: int, dtype: torch.dtype) -> str:
        """dtype's name, once rows of `cols` values of it are known to move in 16-byte units
        (launch.check_row_bytes, raising with `name` otherwise); remembered per (dtype, cols)."""
        dtype_name = _dtype_name(dtype)
        launch.check_row_bytes(name, cols, dtype_name)
        self._row_dtypes[(dtype, cols)] = dtype_name
        return dtype_name

    def _absent_mask(self, ranks) -> int:
        return sum(1 << i for i, r in enumerate(self.ranks) if r in ranks) if ranks else 0

    # -- dispatch --------------------------------------------------------------------------

    def dispatch(self, xs: list[torch.Tensor], scales: list[torch.Tensor | None], routings: list[Routing],
                 num_out_tokens: int | None, num_sms: int | None,
                 known_rows: list[int] | None = None) -> list[RankDispatch]:
        """Every driven rank's dispatch: the inputs checked and marshalled (_dispatch_inputs),
        then the kernels. With the output size known before the layout kernel (num_out_tokens,
        or known_rows: a handle's) both kernels go in one call (_dispatch_known); else the
        layout kernel, the one host read of the sizes, and the dispatch kernel
        (_dispatch_dynamic). Either chooses the data path where the sizes are known
        (_choose_path). num_sms: SMs per rank (None: launch.DEFAULT_NUM_SMS_DISPATCH)."""
        if self._reported():
            self.raise_if_failed()
        if num_sms is None:
            num_sms = launch.DEFAULT_NUM_SMS_DISPATCH
        given = self._dispatch_inputs(xs, scales, routings)
        if num_out_tokens is not None:
            launched = self._dispatch_known(given, [num_out_tokens] * len(self.ranks), num_out_tokens, num_sms)
        elif known_rows is not None:
            launched = self._dispatch_known(given, list(known_rows), -1, num_sms)
        else:
            launched = self._dispatch_dynamic(given, num_sms)
        _, _, fp8, _, inputs, tensors = given
        self._in_flight["dispatch"] = tensors
        call, rows, direct, made = launched
        shape = self._shape
        return [RankDispatch(t[0], t[2] if fp8 else None, t[1],
                             CudaSendLayout(call, i, inp[0], inp[1], shape.W, k[2] if direct else None),
                             CudaRecvLayout(call, i, shape, R))
                for i, (R, inp, k, t) in enumerate(zip(rows, inputs, tensors, made))]

    def _dispatch_inputs(self, xs: list[torch.Tensor], scales: list[torch.Tensor | None],
                         routings: list[Routing]) -> _DispatchInputs:
        """Validation and marshalling: one dtype and K <= MAX_TOPK on every rank, fp8 scales of
        the right shape; each rank's tensors as the kernels read them (contiguous, 16-byte
        aligned, fp32 scales and weights) and their addresses."""
        H = self.config.hidden_dim
        first = xs[0]  # the first rank's x sets the call's dtype
        dtype = first.dtype
        dtype_name = self._row_dtypes.get((dtype, H)) or self._check_rows("x", H, dtype)
        fp8 = dtype_name == "float8_e4m3fn"
        inputs, keep, topk = [], [], 0
        for r, routing, x, sc in zip(self.ranks, routings, xs, scales):
            idx = routing.topk_idx_TK
            T, K = idx.shape
            if K > MAX_TOPK:
                raise ValueError(f"topk_idx has {K} routes per token on rank {r}; "
                                 f"the cuda backend supports up to {MAX_TOPK}")
            if x is not first and x.dtype != dtype:
                raise TypeError(f"x on rank {r} is {x.dtype} but rank {self.ranks[0]}'s is {dtype}; "
                                f"one call moves one dtype")
            sc_ptr = 0
            if fp8:
                if sc is None:
                    raise ValueError(f"scales: fp8 x on rank {r} needs its float32 scales [num_tokens, "
                                     f"hidden_dim / {FP8_BLOCK}] (a re-dispatch with a reused handle too)")
                if tuple(sc.shape) != (x.shape[0], H // FP8_BLOCK):
                    raise ValueError(f"scales on rank {r} must have shape [{x.shape[0]}, {H // FP8_BLOCK}], "
                                     f"got {list(sc.shape)}")
                sc = _fp32(sc)
                sc_ptr = sc.data_ptr()
            if not idx.is_contiguous():
                idx = idx.contiguous()
            w = routing.given_weights_TK  # unrouted slots are never read
            if w is None:  # 1.0 per route: the first T * K of the engine's ones, no tensor op
                w = self._unit_weights(T * K)
                w_ptr = w.data_ptr()
            else:
                if w.dtype != torch.float32 or not w.is_contiguous():
                    w = _fp32(w)
                w_ptr = w.data_ptr()
            if K > topk:
                topk = K
            if not x.is_contiguous():
                x = x.contiguous()
            x_ptr = x.data_ptr()
            if x_ptr % 16:
                x, x_ptr = _aligned(x)
            inputs.append((T, K, x_ptr, sc_ptr, idx.data_ptr(), w_ptr))
            keep.append((x, sc, idx, w))
        return dtype, dtype_name, fp8, topk, inputs, keep

    def _unit_weights(self, count: int) -> torch.Tensor:
        """float32 ones, at least `count` (a dispatch whose caller gave no routing weights reads
        its T x K from the start), made once and grown to the largest call's: no tensor
        operation per call, which on a GPU is a kernel launch and a cast per rank."""
        ones = self._ones
        if ones is None or ones.numel() < count:
            ones = self._ones = torch.ones(max(count, 1), dtype=torch.float32, device=self.device)
        return ones

    @property
    def absent(self) -> AbsentRanks:
        """The test hook (AbsentRanks); setting it computes the bit masks a call passes on once
        (_absent_bits: absent, absent after the layout kernel)."""
        return self._absent

    @absent.setter
    def absent(self, ranks: AbsentRanks) -> None:
        self._absent = ranks
        self._absent_bits = (self._absent_mask(ranks.ranks), self._absent_mask(ranks.after_layout))

    def _dispatch_known(self, given: _DispatchInputs, rows: list[int], static_rows: int, num_sms: int) -> tuple:
        """Both kernels in one call into the extension, the output size known (rows per rank;
        static_rows: num_out_tokens, or -1 for a handle's sizes): (workspace, rows, direct,
        output tensors per rank)."""
        dtype, dtype_name, fp8, topk, inputs, tensors = given
        stream = self._stream()
        absent, after_layout = self._absent_bits
        direct, taken = self._choose_path(rows, dtype, fp8, stream)
        call = self._workspace(topk, direct, not direct, stream)
        kind = "dispatch_direct" if direct else "dispatch"
        H = self.config.hidden_dim
        args = (self._launch_cache.get((kind, num_sms, dtype_name, H, None, False))
                or self._launch_args(num_sms, dtype_name, H, kind))
        declaring = self._declaring()
        if declaring or taken is None:
            outputs, made = self._outputs(rows, taken, dtype, fp8)
        if declaring:
            self._declare(self._dispatch_tensors(tensors), [(call.ptr, call.i64.numel() * 8)] +
                          self._output_spans(outputs, dtype))
        if taken is not None:  # the launch and the arena blocks' tensors in one call
            made = self.host.dispatch_into(args, stream, call.ptr, call.layout, static_rows, inputs, taken,
                                           absent, after_layout)
        else:
            self.host.dispatch(args, direct, stream, call.ptr, call.layout, static_rows, inputs, outputs,
                               absent, after_layout)
        return call, rows, direct, made

    def _dispatch_dynamic(self, given: _DispatchInputs, num_sms: int) -> tuple:
        """The layout kernel on a workspace with the tables of both paths, the one host read of
        the output sizes (and of a bad route, raised here), then the dispatch kernel on the path
        those sizes allow: (workspace, rows, direct, output tensors per rank)."""
        dtype, dtype_name, fp8, topk, inputs, tensors = given
        stream = self._stream()
        absent, after_layout = self._absent_bits
        prefer = self.data_path == "direct"
        H = self.config.hidden_dim
        call = self._workspace(topk, prefer, True, stream)
        args = self._launch_args(num_sms, dtype_name, H, "dispatch_direct" if prefer else "dispatch")
        first = call.layout.info // 8 + self.info.needed  # needed, then bad_route: one read
        sizes = call.i64[:, first:first + 1 + BAD_ROUTE_WORDS]
        declared = None
        if self._declaring():  # the outputs are added after the read
            declared = (_spans(self._dispatch_tensors(tensors)) + [(call.ptr, call.i64.numel() * 8)] +
                        self._fixed_spans())
            self.ext.note_launch_tensors(declared)
        self.host.dispatch_layout(args, stream, call.ptr, call.layout, -1, inputs, absent, True)
        # From the host read to the dispatch launch the GPU idles: only what needs the
        # output sizes runs here (the outputs' memory, the path); the tensors over the
        # arena blocks and the results are made after the launch.
        read = sizes.cpu().tolist()  # the one host sync
        self.raise_if_failed()
        if read[0][1] >= 0:  # every rank holds the lowest bad rank's route; no dispatch kernel follows
            raise RoutingError(bad_route_text(self.config.num_experts, *read[0][1:]))
        rows = [r[0] for r in read]
        direct, taken = self._choose_path(rows, dtype, fp8, stream)
        if prefer and not direct:  # the layout kernel's per-rank arguments, for the receive kernel
            args = self._receive_args(args, num_sms, dtype_name, H)
        outputs, made = self._outputs(rows, taken, dtype, fp8)
        if declared is not None:
            self.ext.note_launch_tensors(declared + self._output_spans(outputs, dtype))
        self.host.dispatch_rows(args, direct, stream, call.ptr, call.layout, outputs, absent | after_layout)
        if made is None:
            made = taken.tensors()  # (rows, probs[, scales]) per rank
        return call, rows, direct, made

    def _outputs(self, rows: list[int], taken, dtype: torch.dtype, fp8: bool) -> tuple[list, list | None]:
        """The launcher's output tuple per rank, and the tensors (rows, probs, scales) per rank:
        with arena blocks their addresses now and None (the tensors are made after the launch:
        taken.tensors()), else new tensors from PyTorch's allocator."""
        if taken is not None:
            if fp8:
                return [(R, out, sc, probs) for R, (out, probs, sc) in zip(rows, taken.addresses())], None
            return [(R, out, 0, probs) for R, (out, probs) in zip(rows, taken.addresses())], None
        H, dev = self.config.hidden_dim, self.device
        made = [(torch.empty(R, H, dtype=dtype, device=dev), torch.empty(R, dtype=torch.float32, device=dev),
                 torch.empty(R, H // FP8_BLOCK, dtype=torch.float32, device=dev) if fp8 else None) for R in rows]
        return [(R, out.data_ptr(), sc.data_ptr() if fp8 else 0, probs.data_ptr())
                for R, (out, probs, sc) in zip(rows, made)], made

    def _receive_args(self, laid, num_sms: int, dtype_name: str, H: int):
        """The receive kernel's launch arguments with the per-rank part the layout kernel ran with."""
        args = self._launch_args(num_sms, dtype_name, H, "dispatch")
        for i in range(laid.num_ranks):
            args.set_rank(i, laid.get_rank(i))
        args.num_ranks = laid.num_ranks
        args.scale_cols = laid.scale_cols
        return args

    def _dispatch_tensors(self, keep) -> list[torch.Tensor]:
        return [t for k in keep for t in k] + [self.arena_bases]

    def _output_spans(self, outputs: list[tuple], dtype: torch.dtype) -> list[tuple[int, int]]:
        """(address, bytes) of the outputs of a dispatch, from the launcher's output tuples."""
        H = self.config.hidden_dim
        spans = []
        for R, out, sc, probs in outputs:
            if R > 0:
                spans += [(out, R * H * dtype.itemsize), (probs, R * 4)]
                if sc:
                    spans.append((sc, R * (H // FP8_BLOCK) * 4))
        return spans

    def _choose_path(self, rows: list[int], dtype: torch.dtype, fp8: bool, stream: int) -> tuple[bool, object]:
        """(direct, the arena blocks of a direct dispatch or None) for a call of `rows` output
        rows per rank: the buffer's data path. With arenas, every driven rank's arena block
        (arena.arena_take: the tensors are made after the launch), unless some rank's arena can
        not hold it, or its combine could not be staged (more rows than the staging region
        holds): the call then takes the receive path, on every rank of the group (the vote,
        where this process drives only some), with one log line per process."""
        if self.data_path != "direct":
            return False, None
        if not self.arenas:  # ranks in one process: outputs from PyTorch's allocator
            return True, None
        H = self.config.hidden_dim
        taken, reason = None, None
        if max(rows) > self.staging.rows:
            i = next(i for i, R in enumerate(rows) if not self.staging.holds(R))
            reason = (f"rank {self.ranks[i]}'s combine staging region holds {self.staging.rows} fp32 rows (as many "
                      f"as a bf16 call the arena holds); the call has {rows[i]}. {ARENA_SIZING}")
        else:
            taken = arena_take(self.arenas, rows, H, dtype, fp8, stream)
            if taken.failed >= 0:
                i, taken = taken.failed, None
                arena, R = self.arenas[i], rows[i]
                reason = (f"rank {self.ranks[i]}'s arena can not hold {R} output rows: "
                          f"{call_bytes(R, H, dtype, fp8)} bytes needed, {arena.used} of {arena.capacity} in use, "
                          f"largest free range {arena.largest_free(stream)}. {ARENA_SIZING}")
        ok = reason is None
        if self.vote is not None and self.vote(ok) != ok:
            ok, reason = False, "another rank's arena could not hold its output of the call"
        if not ok:
            _log_fallback(reason)
            return False, None
        return True, taken

    # -- combine ---------------------------------------------------------------------------

    def combine(self, rows: list[torch.Tensor], sends: list[CudaSendLayout], recvs: list[CudaRecvLayout],
                probs: list[torch.Tensor], apply_probs: bool, num_sms: int | None,
                wire_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """num_sms: SMs per rank (None: launch.DEFAULT_NUM_SMS_COMBINE); wire_dtype: of the partial
        sums between ranks (None: the dtype of the rows)."""
        if self._reported():
            self.raise_if_failed()
        if num_sms is None:
            num_sms = launch.DEFAULT_NUM_SMS_COMBINE
        first = rows[0]  # the first rank's rows set the call's dtype and width
        dtype = first.dtype
        dtype_name = _DTYPE_NAMES.get(dtype) or _dtype_name(dtype)
        wire_name = dtype_name if wire_dtype is None or wire_dtype == dtype else _dtype_name(wire_dtype)
        if wire_name not in (dtype_name, "float32"):
            raise ValueError(f"wire_dtype must be the dtype of expert_out ({dtype_name}) or float32, got {wire_name}")
        C = first.shape[1]
        if (dtype, C) not in self._row_dtypes:
            self._check_rows("expert_out", C, dtype)
        if C > self.config.hidden_dim:
            raise ValueError(f"expert_out rows have {C} columns; the buffer holds {self.config.hidden_dim}")
        direct = sends[0].topk_idx_TK is not None  # the path of the dispatch that made the handles (data_path)
        kind = "combine_pull" if direct else "combine"
        args = (self._launch_cache.get((kind, num_sms, dtype_name, C, wire_name, apply_probs))
                or self._launch_args(num_sms, dtype_name, C, kind, wire_name, apply_probs))
        stream = self._stream()
        inputs, keep, outs, staged, order = [], [], [], [], None
        for r, x, send, recv, p in zip(self.ranks, rows, sends, recvs, probs):
            if x is not first and (x.dtype != dtype or x.shape[1] != C):
                raise ValueError(f"expert_out on rank {r} is {x.dtype} [{x.shape[1]} columns] but rank "
                                 f"{self.ranks[0]}'s is {dtype} [{C}]; one call moves one dtype and width")
            x_ptr = x.data_ptr()
            if x_ptr % 16 or not x.is_contiguous():
                x, x_ptr = _aligned(x)
            if p.dtype is not torch.float32 or not p.is_contiguous():
                p = _fp32(p)
            if direct and self.arenas:
                # Arena tensors stay out of _in_flight: the arena reuses a block only on the
                # stream it was used on, and one kept here would split the arena until the next
                # combine. What lies outside the arena is copied into the staging region.
                arena = self.arenas[len(outs)]
                x_out = not arena.contains(x)
                p_out = apply_probs and not arena.contains(p)  # probs are read only then
                if x_out or p_out:
                    keep += [t for t, out in ((x, x_out), (p, p_out)) if out]
                    if order is None:
                        order = self.staging.order
                        order.before(stream)
                    x, p = self.staging.stage(len(outs), x, p, x_out, p_out)
                    x_ptr = x.data_ptr()
                staged += (x, p)
            else:
                keep += (x, p)
            T = send.num_tokens
            y = torch.empty(T, C, dtype=dtype, device=self.device)
            call = send.call
            inputs.append((T, send.topk, call.part(send.part), call.layout,
                           send.topk_idx_TK.data_ptr() if direct else 0, x_ptr, p.data_ptr(), y.data_ptr(),
                           recv.num_rows))
            outs.append(y)
        self._in_flight["combine"] = keep
        if self._declaring():
            self._declare(keep + staged + outs + [self.arena_bases] + [s.topk_idx_TK for s in sends],
                          [(s.call.part(s.part), s.call.layout.bytes) for s in sends])
        self.host.combine(args, direct, stream, inputs, self._absent_bits[0])
        if order is not None:
            order.after(stream)
            self.staging.uses += 1
        return outs

    # -- backward of the probs -------------------------------------------------------------

    def return_row_values(self, values: list[torch.Tensor], routings: list[Routing],
                          sends: list[CudaSendLayout], recvs: list[CudaRecvLayout],
                          num_sms: int | None = None) -> list[torch.Tensor]:
        """One fp32 value per output row back to its routing slot, [T, K] per rank.

        Each row's value is placed in the column of its global expert, so a combine over
        expert columns brings every value back unsummed; columns are sent in slices of at
        most hidden_dim so the registered partial buffers suffice.
        """
        c = self.config
        E, L = c.num_experts, c.experts_per_rank
        width_all = (E + 3) // 4 * 4
        step = c.hidden_dim // 4 * 4
        mats, cols_of = [], []
        for r, v, recv in zip(self.ranks, values, recvs):
            R = recv.num_rows
            pos = torch.arange(R, device=self.device)
            j = torch.searchsorted(recv.expert_start_L, pos, right=True) - 1
            j = j.clamp(min=0)
            real = (pos - recv.expert_start_L[j]) < recv.expert_rows_L[j]
            mats.append(torch.where(real, v.detach().to(torch.float32), 0.0))
            cols_of.append(r * L + j)
        full = [torch.zeros(s.send_slot_TW.shape[0], width_all, dtype=torch.float32, device=self.device) for s in sends]
        ones = [torch.ones(recv.num_rows, dtype=torch.float32, device=self.device) for recv in recvs]
        for c0 in range(0, width_all, step):
            width = min(step, width_all - c0)
            slices = []
            for vals, cols in zip(mats, cols_of):
                m = torch.zeros(vals.shape[0], width, dtype=torch.float32, device=self.device)
                inside = (cols >= c0) & (cols < c0 + width)
                m.scatter_(1, (cols - c0).clamp(0, width - 1)[:, None], torch.where(inside, vals, 0.0)[:, None])
                slices.append(m)
            got = self.combine(slices, sends, recvs, ones, False, num_sms, torch.float32)
            for f, g in zip(full, got):
                f[:, c0:c0 + width] = g
        out = []
        for f, routing in zip(full, routings):
            idx = routing.topk_idx_TK
            vals = f.gather(1, idx.clamp(min=0))
            out.append(torch.where(idx >= 0, vals, 0.0))
        return out
