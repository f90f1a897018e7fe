"""CudaBackend: HybridEPBuffer's `cuda` backend, one rank per process: NVLink peers inside a
node, NVSHMEM between nodes (when the build has it)."""

from __future__ import annotations

import dataclasses

import torch

from ...config import BufferConfig, KernelConfig
from ...dtypes import combine_dtype_for
from ...fp8 import is_fp8
from ...handle import DispatchHandle
from ...memory import BufferSpec, MemoryPlan
from ...refusals import InputRefused, code_of, refused_here
from ...routing import Routing, max_output_rows
from ..base import Backend
from . import agreement, launch, load_extension
from .arena import call_bytes
from .engine import Engine
from .errors import RoutingError
from .layout import MAX_TOPK, check_geometry, rdma_layout, registered_regions
from .nvshmem import heap_spec
from .peer_memory import CHUNK, round_up
from .peer_setup import agreement_failure, close_peer_memory, process_agreement
from .registered import NvshmemRegions, RegisteredBuffers
from .workspace import CudaReceiveTable, CudaSendTable


def memory_plan(config: BufferConfig, name: str = "cuda", peer_held: int | None = None,
                dtype: torch.dtype = torch.bfloat16) -> MemoryPlan:
    """Bytes each rank holds (registered regions, the NVSHMEM heap, peer memory) and needs per
    call, known before allocation.

    The direct path's outputs live in peer memory, which holds `peer_held` bytes now (None: what
    it starts with, peer_memory_bytes rounded up to peer_memory.CHUNK) and grows to the peak of live
    direct outputs plus one expert-out block, in CHUNK steps. The per-call part says by how much
    a call can make it grow: its output (dispatch_out, the worst case), the expert-out block of
    an expert_out from outside peer memory (expert_out_block) and the rounding of a growth
    (peer_rounding, less than a CHUNK). dtype: of the rows dispatched (x's; bf16 as in training),
    which sizes a call's output and, at the width of the expert output (bf16 for fp8 rows), its
    expert-out block."""
    fp8 = is_fp8(dtype)
    # the registered buffer's regions as csrc builds them (layout.registered_regions)
    specs = [BufferSpec(r.name, r.bytes, True, r.purpose) for r in registered_regions(config)]
    if config.num_nodes > 1:
        specs.append(heap_spec(rdma_layout(config).total))  # NVSHMEM_SYMMETRIC_SIZE, set before init
    worst_rows = max_output_rows(config, min(config.experts_per_rank, MAX_TOPK))
    held = round_up(config.peer_memory_bytes or 0, CHUNK) if peer_held is None else peer_held
    specs.append(BufferSpec("peer_memory", held, True,
                            "held now: peer-mapped memory of the direct path's outputs, grown on demand to the "
                            "peak of live outputs plus one expert-out block (peer_memory_bytes pre-sizes it, "
                            "release_unused() returns a free tail)"))
    dtype_name = str(dtype).removeprefix("torch.")
    specs.append(BufferSpec("dispatch_out", call_bytes(worst_rows, config.hidden_dim, dtype, fp8), False,
                            f"expert-major output of one call of {dtype_name} rows, the worst case: a block of peer "
                            "memory while the output or its handle lives (the receive path's: from PyTorch's "
                            "allocator)"))
    width = str(combine_dtype_for(dtype)).removeprefix("torch.")
    block = agreement.expert_out_block_bytes(worst_rows, config.hidden_dim, dtype, fp8)
    specs.append(BufferSpec("expert_out_block", block,
                            False, f"one per rank, sized by the largest direct call so far, held from then on: the "
                            f"expert-out block, where a direct combine copies a {width} expert_out that lies "
                            "outside peer memory (in training: the experts' output)"))
    specs.append(BufferSpec("peer_rounding", CHUNK, False,
                            "peer memory grows in steps of this size: at most this much above the rest"))
    return MemoryPlan(name, tuple(specs))


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB" if nbytes else "0 B"


class CudaBackend(Backend):
    name = "cuda"
    checks_routing_on_device = True
    reports_dynamic_routing = True  # the count kernel's bad route, read with `needed` (engine.dispatch)

    def __init__(self, config, group, rank, owner):
        super().__init__(config, group, rank, owner)
        ext = load_extension("cuda")
        several_nodes = config.num_nodes > 1
        check_geometry(config, inter_node=several_nodes and ext.has_nvshmem())
        self._device = torch.device("cuda", torch.cuda.current_device())
        self._buffers = RegisteredBuffers.exchanged(ext, config, group, rank, self._device)
        self._rdma = (NvshmemRegions(ext, rdma_layout(config).total, group, self._device) if several_nodes
                      else None)
        # One process per rank: the direct path's outputs in growable peer memory, every call's
        # path agreed on the count kernel's count exchange (agreement.py), pre-sized by
        # peer_memory_bytes where given.
        self._peer = process_agreement(ext, config, group, rank, self._device)
        self._engine = Engine(ext, config, [rank], self._buffers.tables, self._device, self._rdma, peer=self._peer)

    @classmethod
    def on_group(cls, config: BufferConfig, rank: int, owner: int, group) -> "CudaBackend":
        """This backend over the buffers of an EmulatedGroup of one rank (on the CPU model),
        with an Engine of its own, as production's: the host-time bench (hybrid_ep.bench.host)
        times the one-rank-per-process API path with it, where no GPU and no peer processes are
        at hand."""
        if group.world_size != 1:
            raise ValueError(f"on_group: a group of one rank, got {group.world_size}")
        self = cls.__new__(cls)
        Backend.__init__(self, config, None, rank, owner)
        engine = Engine(group.ext, group.config, [0], group.buffers.tables, group.device, group.rdma,
                        group.engine.data_path, peer=group.peer)
        self._device, self._buffers, self._rdma, self._engine = engine.device, None, None, engine
        self._peer = None
        return self

    @property
    def device(self) -> torch.device:
        return self._device

    def memory_plan(self, dtype: torch.dtype = torch.bfloat16) -> MemoryPlan:
        """The plan with the peer memory this rank holds now and the path its calls take."""
        plan = memory_plan(self.config, peer_held=self.peer_memory_held() if self._peer is not None else None,
                           dtype=dtype)
        return dataclasses.replace(plan, data_path=self._data_path_note())

    def _data_path_note(self) -> str:
        """Which path the buffer's calls take, on what (peer memory held now), or why the
        receive path."""
        engine = self._engine
        if engine.data_path == "direct" and self._peer is not None:
            return f"direct path, peer memory {_size(self.peer_memory_held())} now"
        if engine.data_path == "direct":
            return "direct path"
        if self._peer is None:
            return f"receive path: no peer memory ({agreement_failure[0] or 'not set up'})"
        return f"receive path: {launch.DATA_PATH_ENV}=receive"

    def dispatch(self, x_TH, scales_TB, routing, handle, num_out_tokens, kernel_config: KernelConfig):
        known = None
        if handle is not None:
            routing, num_out_tokens = handle.routing, handle.num_out_tokens
            known = handle.num_rows
        engine = self._engine
        try:
            given = engine.inputs(x_TH, scales_TB, routing)  # the kernels' own limits (MAX_TOPK, scales)
        except (ValueError, TypeError) as error:
            refused = self.refuse_dispatch(error, num_out_tokens, handle, kernel_config)
            if refused is error:
                raise
            raise refused from error
        res = engine.dispatch(given, num_out_tokens, kernel_config.num_sms_dispatch, known,
                              handle.dest.bounds if handle is not None else None)
        # owner, config, rank, routing, source, dest, probs_R, num_out_tokens; the count tables
        # are views of the call's workspace, read from dest when asked for.
        new = DispatchHandle(self.owner, self.config, self.rank, routing, res.send, res.recv, res.probs_R,
                             num_out_tokens)
        return res.rows_RH, res.scales_RB, new

    def refuse_dispatch(self, error, num_out_tokens, handle, kernel_config: KernelConfig):
        """The dispatch its peers make, with no tokens and the refusal in the count row (Engine.refuse):
        theirs end at once with the same refusals.InputRefused. num_out_tokens and a handle of this
        buffer set the kind of size as on the peers; where they are the refused argument, the call
        reads (a dynamic size)."""
        if self.config.world_size == 1:
            return error  # no peer waits
        mine = refused_here(self.rank, "dispatch", error)
        static = num_out_tokens if isinstance(num_out_tokens, int) and num_out_tokens >= 0 else None
        ours = isinstance(handle, DispatchHandle) and handle.owner == self.owner and static is None
        try:
            self._engine.refuse(code_of(mine.argument), static if not ours else handle.num_out_tokens,
                                kernel_config.num_sms_dispatch, handle.num_rows if ours else None,
                                handle.dest.bounds if ours else None)
        except (InputRefused, RoutingError):
            pass  # what every rank read: this rank's refusal, or a lower rank's
        except RuntimeError as peers_failed:  # the exchange itself failed: say so beside the refusal
            mine.add_note(f"telling the peers failed: {peers_failed}")
        return mine

    def combine(self, rows_RH, handle, apply_probs, kernel_config: KernelConfig):
        return self._engine.combine(rows_RH, handle.source, handle.dest, handle.probs_R, apply_probs,
                                    kernel_config.num_sms_combine, kernel_config.wire_dtype_for(rows_RH.dtype))

    def expert_out_view(self, handle, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """In the rank's expert-out block where the handle's combine takes the direct path
        through peer memory and the block holds it, else a plain tensor."""
        if handle.source.data_path == "direct" and self._peer is not None:
            view = self._engine.expert_out_view(0, shape, dtype)
            if view is not None:
                return view
        return super().expert_out_view(handle, shape, dtype)

    def is_in_peer_memory(self, t: torch.Tensor) -> bool:
        """Whether t lies in this rank's peer memory (the test a direct combine makes before it
        copies an expert_out into the expert-out block: Engine._combine_inputs)."""
        engine = self._engine
        return engine.peer is not None and engine.outputs.arenas[0].contains(t)

    def release_unused(self) -> None:
        """Retire the free tail of this rank's peer memory at the next dispatch (every rank must
        ask before the same call: agreement.py)."""
        if self._peer is not None:
            self._peer.trim_requested = True

    def peer_memory_held(self) -> int:
        """Bytes of peer memory this rank holds (its own chunks)."""
        return self._peer.held() if self._peer is not None else 0

    def close(self) -> None:
        if getattr(self, "_engine", None) is not None:
            self._engine.release_in_flight()
        if getattr(self, "_peer", None) is not None:
            close_peer_memory(self._peer)
            self._peer = None

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown
            pass

    def return_row_values(self, values_R, handle):
        return return_row_values(self._engine, values_R, handle.routing, handle.source, handle.dest)


def return_row_values(engine: Engine, values_R: torch.Tensor, routing: Routing, send: CudaSendTable,
                      recv: CudaReceiveTable, num_sms: int | None = None) -> torch.Tensor:
    """One fp32 value per output row back to its routing slot, [T, K].

    Each row's value is placed in the column of its global expert, so a combine over
    expert columns brings every value back unsummed; columns are sent in slices of at
    most hidden_dim so the registered partial buffers suffice (value_columns).
    """
    width_all, step = value_columns(engine.config)
    vals, cols = row_value_columns(engine, 0, values_R, recv)
    full = torch.zeros(send.send_ord_TW.shape[0], width_all, dtype=torch.float32, device=engine.device)
    ones = torch.ones(recv.num_rows, dtype=torch.float32, device=engine.device)
    for c0 in range(0, width_all, step):
        width = min(step, width_all - c0)
        full[:, c0:c0 + width] = engine.combine(column_slice(vals, cols, c0, width), send, recv, ones, False, num_sms,
                                                torch.float32)
    return at_routes(full, routing)


def value_columns(c: BufferConfig) -> tuple[int, int]:
    """(columns of return_row_values' combine: one per global expert, rounded up to 4; the
    most columns one combine moves)."""
    return (c.num_experts + 3) // 4 * 4, c.hidden_dim // 4 * 4


def row_value_columns(engine: Engine, i: int, values_R: torch.Tensor, recv: CudaReceiveTable) -> tuple:
    """Driven rank i's row values as fp32, padding rows 0, and the global expert column of each."""
    R, L = recv.num_rows, engine.config.experts_per_rank
    pos = torch.arange(R, device=engine.device)
    j = (torch.searchsorted(recv.expert_start_L, pos, right=True) - 1).clamp(min=0)
    real = (pos - recv.expert_start_L[j]) < recv.expert_rows_L[j]
    return torch.where(real, values_R.detach().to(torch.float32), 0.0), engine.ranks[i] * L + j


def column_slice(vals: torch.Tensor, cols: torch.Tensor, c0: int, width: int) -> torch.Tensor:
    """[R, width] rows with each value in its column, for the columns c0 .. c0 + width."""
    m = torch.zeros(vals.shape[0], width, dtype=torch.float32, device=vals.device)
    inside = (cols >= c0) & (cols < c0 + width)
    m.scatter_(1, (cols - c0).clamp(0, width - 1)[:, None], torch.where(inside, vals, 0.0)[:, None])
    return m


def at_routes(full: torch.Tensor, routing: Routing) -> torch.Tensor:
    """[T, K]: each route's value from its expert's column of the combined [T, columns]."""
    idx = routing.topk_idx_TK
    return torch.where(idx >= 0, full.gather(1, idx.clamp(min=0)), 0.0)
