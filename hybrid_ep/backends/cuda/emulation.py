"""Single-GPU emulation: W = N x G virtual ranks of one EP group in one process (tests, benchmarks).

Each virtual rank has its own registered buffer and a peer table pointing at the others'; the
ranks address each other's tensors as they are, so the direct path's outputs come from
PyTorch's allocator (paths.AllocatorOutputs). Every call launches each kernel once for all W
ranks (W x SMs-per-rank blocks, cooperative, so all are resident together) through
EmulatedEngine: production's Engine (one rank per process) with the per-rank steps over lists
of the W ranks (dispatch_ranks, combine_ranks, return_row_values), which hand HostPath a list
of one struct per rank; the call sequence and the kernels are exactly the production ones.
Results come back as one list entry per rank, with handles like HybridEPBuffer's.

device="cuda" runs the kernels on the GPU (hybrid_ep._C); device="cpu" runs the same
kernel sources on the CPU model of the device layer (hybrid_ep._model), on CPU tensors.
With ranks_per_node < world_size the virtual ranks form several nodes: NVLink peer tables
reach only a rank's own node, and everything between nodes goes through the loopback
transport, exactly where a cluster uses NVSHMEM.

separate_processes=True emulates what a job of one process per GPU does instead: each virtual
rank gets its own growable peer memory and maps its node peers' at addresses of its own
(peer_memory.py, over the same sockets and file descriptors as separate processes), every
dispatch is agreed on the count kernel's count exchange (agreement.py), and the direct path's
kernels translate every published offset with the rank's own table of bases, as separate
processes do. peer_memory_bytes pre-sizes that peer memory (without separate_processes it is unused).
"""

from __future__ import annotations

import itertools

import torch

from ... import inputs
from ...config import BufferConfig, KernelConfig
from ...fp8 import scales_from_wire, wire_scales
from ...handle import DispatchHandle, DispatchResult
from ...routing import Routing, normalize_routing
from . import load_extension
from .backend import at_routes, column_slice, row_value_columns, value_columns
from .engine import DispatchCall, Engine, input_tensors
from .layout import MAX_LAUNCH_RANKS, check_geometry, rdma_layout, registered_layout
from .peer_setup import close_peer_memory, peer_agreement
from .registered import LoopbackRegions, RegisteredBuffers
from .workspace import CudaReceiveTable, CudaSendTable, RankDispatch

_owner_ids = itertools.count(1_000_000)


class EmulatedEngine(Engine):
    """Engine over the W virtual ranks of a group in one process: each call takes a list of one
    entry per rank and launches every kernel once for all of them (HostPath of the ranks, a list
    of one struct per rank per call). Only the per-rank steps differ from Engine's."""

    def _host_path(self, fixed: list):
        return self.ext.HostPath(fixed)

    @staticmethod
    def _per_rank(known_rows: list[int]) -> list[int]:
        return list(known_rows)

    def inputs_of_ranks(self, xs: list[torch.Tensor], scales: list[torch.Tensor | None],
                        routings: list[Routing]) -> DispatchCall:
        """Every rank's inputs checked and marshalled (Engine._rank_inputs), in one dtype: the
        first rank's x sets the call's."""
        H = self.config.hidden_dim
        first = xs[0]
        dtype = first.dtype
        dtype_name = self._row_dtypes.get((dtype, H)) or self._check_rows("x", H, dtype)
        fp8 = dtype_name == "float8_e4m3fn"
        inputs, kept, topk = [], [], 0
        for r, routing, x, sc in zip(self.ranks, routings, xs, scales):
            if x is not first and x.dtype != dtype:
                raise TypeError(f"x on rank {r} is {x.dtype} but rank {self.ranks[0]}'s is {dtype}; "
                                f"one call moves one dtype")
            one, tensors = self._rank_inputs(r, x, sc, routing, fp8)
            inputs.append(one)
            kept.append(tensors)
            if tensors.topk > topk:
                topk = tensors.topk
        return DispatchCall(dtype, dtype_name, fp8, topk, inputs, kept)

    def dispatch_ranks(self, xs: list[torch.Tensor], scales: list[torch.Tensor | None], routings: list[Routing],
                       num_out_tokens: int | None, num_sms: int | None, known_rows: list[int] | None = None,
                       known_bounds: list[int] | None = None) -> list[RankDispatch]:
        """Engine.dispatch for every rank in one launch: lists of their tensors and of their
        handles' rows, one RankDispatch per rank."""
        return self.dispatch(self.inputs_of_ranks(xs, scales, routings), num_out_tokens, num_sms, known_rows,
                             known_bounds)

    def _results(self, given: DispatchCall, call, rows: list[int], direct: bool, made: list,
                 bounds: list[int] | None) -> list[RankDispatch]:
        self._in_flight["dispatch"] = given.tensors
        return [self._rank_result(given, call, i, R, kept, out, direct, bounds)
                for i, (R, kept, out) in enumerate(zip(rows, given.tensors, made))]

    def _outputs(self, rows: list[int], dtype: torch.dtype, fp8: bool) -> tuple[list, list]:
        addresses, tensors = [], []
        for R in rows:
            at, made = self._new_outputs(R, dtype, fp8)
            addresses.append(at)
            tensors.append(made)
        return addresses, tensors

    def _dispatch_tensors(self, kept: list) -> list[torch.Tensor]:
        return [t for k in kept for t in input_tensors(k)] + list(self.bases_tables)

    def combine_ranks(self, rows: list[torch.Tensor], sends: list[CudaSendTable], recvs: list[CudaReceiveTable],
                      probs: list[torch.Tensor], apply_probs: bool, num_sms: int | None,
                      wire_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """Engine.combine for every rank in one launch, in one dtype and width (the first rank's)."""
        first = rows[0]
        args, direct, stream = self._combine_start(first, sends[0], num_sms, wire_dtype, apply_probs)
        dtype, C = first.dtype, first.shape[1]
        inputs, outs, keep, in_peer, copied = [], [], [], [], False
        for i, (x, send, recv, p) in enumerate(zip(rows, sends, recvs, probs)):
            if x is not first and (x.dtype != dtype or x.shape[1] != C):
                raise ValueError(f"expert_out on rank {self.ranks[i]} is {x.dtype} [{x.shape[1]} columns] but rank "
                                 f"{self.ranks[0]}'s is {dtype} [{C}]; one call moves one dtype and width")
            one, y, kept, peer, copied = self._rank_combine(i, x, send, recv, p, apply_probs, direct, stream, copied)
            inputs.append(one)
            outs.append(y)
            keep += kept
            in_peer += peer
        self._launch_combine(args, direct, stream, inputs, outs, sends, keep, in_peer, copied)
        return outs

    def return_row_values(self, values: list[torch.Tensor], routings: list[Routing], sends: list[CudaSendTable],
                          recvs: list[CudaReceiveTable], num_sms: int | None = None) -> list[torch.Tensor]:
        """backend.return_row_values for every rank, each column slice one combine of all."""
        width_all, step = value_columns(self.config)
        per_rank = [row_value_columns(self, i, v, recv) for i, (v, recv) in enumerate(zip(values, recvs))]
        full = [torch.zeros(s.send_ord_TW.shape[0], width_all, dtype=torch.float32, device=self.device) for s in sends]
        ones = [torch.ones(recv.num_rows, dtype=torch.float32, device=self.device) for recv in recvs]
        for c0 in range(0, width_all, step):
            width = min(step, width_all - c0)
            got = self.combine_ranks([column_slice(vals, cols, c0, width) for vals, cols in per_rank], sends, recvs,
                                     ones, False, num_sms, torch.float32)
            for f, g in zip(full, got):
                f[:, c0:c0 + width] = g
        return [at_routes(f, routing) for f, routing in zip(full, routings)]


class EmulatedGroup:
    """W virtual ranks on one GPU; `dispatch` / `combine` take and return per-rank lists."""

    def __init__(self, world_size: int, hidden_dim: int, max_tokens_per_rank: int, num_experts: int, *,
                 pad_multiple: int = 1, min_rows_per_expert: int = 0, num_sms_dispatch: int | None = None,
                 num_sms_combine: int | None = None, device: torch.device | None = None,
                 ranks_per_node: int | None = None, data_path: str | None = None, peer_memory_bytes: int | None = None,
                 ring_chunks: int = BufferConfig.ring_chunks, ring_dtype: torch.dtype = BufferConfig.ring_dtype,
                 separate_processes: bool = False,
                 stage_combines: bool = True, peer_reserve: int = 1 << 30):
        if not 1 <= world_size <= MAX_LAUNCH_RANKS:
            raise ValueError(f"world_size must be in [1, {MAX_LAUNCH_RANKS}] for emulation, got {world_size}")
        self.config = BufferConfig(hidden_dim=hidden_dim, max_tokens_per_rank=max_tokens_per_rank,
                                   num_experts=num_experts, world_size=world_size,
                                   ranks_per_node=world_size if ranks_per_node is None else ranks_per_node,
                                   pad_multiple=pad_multiple, min_rows_per_expert=min_rows_per_expert,
                                   peer_memory_bytes=peer_memory_bytes, ring_chunks=ring_chunks,
                                   ring_dtype=ring_dtype).validate()
        self.kernel_config = KernelConfig(num_sms_dispatch, num_sms_combine).validate()
        check_geometry(self.config, inter_node=True)
        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        ext = load_extension(self.device)
        self.ext = ext
        G = self.config.ranks_per_node
        self.buffers = RegisteredBuffers.emulated(ext, registered_layout(self.config).total, world_size, self.device, G)
        self.rdma = (LoopbackRegions(ext, rdma_layout(self.config).total, world_size, self.device)
                     if self.config.num_nodes > 1 else None)
        self.peer = (peer_agreement(ext, self.config, self.device, peer_reserve, stage_combines)
                     if separate_processes else None)
        self.engine = EmulatedEngine(ext, self.config, list(range(world_size)), self.buffers.tables, self.device,
                                     self.rdma, data_path, peer=self.peer)
        self.owner = next(_owner_ids)

    @property
    def world_size(self) -> int:
        return self.config.world_size

    def synchronize(self) -> None:
        """Wait for the device and raise what a kernel recorded (timeouts, bad routing)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.engine.release_in_flight()  # every launch has finished
        self.engine.raise_if_failed()

    def close(self) -> None:
        self.engine.release_in_flight()
        if self.peer is not None:
            close_peer_memory(self.peer)
            self.peer = None
        self.buffers.close()
        if self.rdma is not None:
            self.rdma.close()

    def in_peer_memory(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """t copied into virtual rank i's expert-out block, where an expert computation would
        leave its expert_out (HybridEPBuffer.empty_expert_out: a direct combine then reads it in
        place instead of copying it in); t itself where the group has no peer memory (ranks in
        one process read it where it lies) or the block no room."""
        if self.peer is not None:
            return self.engine.expert_out_view(i, t.shape, t.dtype, like=t)
        return t

    # -- plain calls ------------------------------------------------------------------------

    def dispatch(self, xs, topk_idx, topk_weights=None, *, scales=None, num_out_tokens=None,
                 num_sms=None) -> list[DispatchResult]:
        W = self.world_size
        topk_weights = topk_weights if topk_weights is not None else [None] * W
        scales = scales if scales is not None else [None] * W
        for name, seq in (("xs", xs), ("topk_idx", topk_idx), ("topk_weights", topk_weights), ("scales", scales)):
            if len(seq) != W:
                raise ValueError(f"{name} must hold one entry per virtual rank ({W}), got {len(seq)}")
        inputs.check_num_out_tokens(num_out_tokens)
        routings = []
        for x, sc, idx, w in zip(xs, scales, topk_idx, topk_weights):
            inputs.check_dispatch_input(x, sc, self.config, self.device)
            routings.append(normalize_routing(x.shape[0], self.config.num_experts, x.device, topk_idx=idx,
                                              topk_weights=w, check_values=False))  # the engine checks
        return self._dispatch(xs, scales, routings, num_out_tokens, num_sms, None)

    def _dispatch(self, xs, scales, routings, num_out_tokens, num_sms, known_rows, known_bounds=None):
        if num_sms is None:
            num_sms = self.kernel_config.num_sms_dispatch
        fp8 = scales.count(None) < len(scales)  # else no scales to convert (no call per rank)
        per_rank = self.engine.dispatch_ranks(list(xs), [wire_scales(s) for s in scales] if fp8 else scales, routings,
                                              num_out_tokens, num_sms, known_rows, known_bounds)
        out = []
        for r, (res, routing, given) in enumerate(zip(per_rank, routings, scales)):
            # owner, config, rank, routing, source, dest, probs_R, num_out_tokens; the count tables
            # are views of the call's workspace, read from dest when asked for; tokens_per_expert
            # likewise, from the handle.
            handle = DispatchHandle(self.owner, self.config, r, routing, res.send, res.recv, res.probs_R,
                                    num_out_tokens)
            out.append(DispatchResult(res.rows_RH, scales_from_wire(res.scales_RB, given) if fp8 else res.scales_RB,
                                      res.probs_R, handle))
        return out

    def redispatch(self, xs, handles, *, scales=None, num_sms=None) -> list[DispatchResult]:
        """Dispatch other rows with the routing of earlier handles (backward of combine).

        fp8 rows need their scales, as in a first dispatch."""
        W = self.world_size
        scales = scales if scales is not None else [None] * W
        for name, seq in (("xs", xs), ("handles", handles), ("scales", scales)):
            if len(seq) != W:
                raise ValueError(f"{name} must hold one entry per virtual rank ({W}), got {len(seq)}")
        for x, sc, h in zip(xs, scales, handles):
            inputs.check_handle(h, self.owner)
            inputs.check_dispatch_input(x, sc, self.config, self.device)
            inputs.check_reused_handle(h, x.shape[0], None)
        return self._dispatch(xs, scales, [h.routing for h in handles], handles[0].num_out_tokens,
                              num_sms, [h.num_rows for h in handles], handles[0].dest.bounds)

    def combine(self, expert_outs, handles, *, apply_probs=False, num_sms=None,
                wire_dtype=None) -> list[torch.Tensor]:
        for h in handles:
            inputs.check_handle(h, self.owner)
        for out, h in zip(expert_outs, handles):
            inputs.check_combine_input(out, h, self.config)
        if expert_outs:
            inputs.check_combine_wire(expert_outs[0].dtype, wire_dtype, None, self.config)
        if num_sms is None:
            num_sms = self.kernel_config.num_sms_combine
        return self.engine.combine_ranks(list(expert_outs), [h.source for h in handles], [h.dest for h in handles],
                                         [h.probs_R for h in handles], apply_probs, num_sms, wire_dtype)

    def return_row_values(self, values, handles) -> list[torch.Tensor]:
        return self.engine.return_row_values(list(values), [h.routing for h in handles], [h.source for h in handles],
                                             [h.dest for h in handles], self.kernel_config.num_sms_combine)

    # -- autograd ---------------------------------------------------------------------------

    def dispatch_autograd(self, xs, topk_idx, topk_weights, *, num_out_tokens=None):
        """Differentiable dispatch: returns (rows per rank, probs per rank, handles)."""
        W = self.world_size
        box: list = []
        outs = _EmuDispatch.apply(self, list(topk_idx), num_out_tokens, box, *xs, *topk_weights)
        return list(outs[:W]), list(outs[W:]), box[0]

    def combine_autograd(self, rows, probs, handles, *, apply_probs=False):
        return list(_EmuCombine.apply(self, handles, apply_probs, *rows, *probs))


class _EmuDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, topk_idx, num_out_tokens, box, *tensors):
        W = group.world_size
        xs, ws = tensors[:W], tensors[W:]
        results = group.dispatch(list(xs), topk_idx, list(ws), num_out_tokens=num_out_tokens)
        ctx.group, ctx.handles = group, [r.handle for r in results]
        ctx.w_dtypes = [w.dtype for w in ws]
        box.append(ctx.handles)
        return (*[r.tokens for r in results], *[r.probs.clone() for r in results])

    @staticmethod
    def backward(ctx, *grads):
        group, handles = ctx.group, ctx.handles
        W = group.world_size
        grad_rows, grad_probs = grads[:W], grads[W:]
        gx = group.combine([g.contiguous() for g in grad_rows], handles)
        gw = group.return_row_values([g.contiguous() for g in grad_probs], handles)
        gw = [g.to(dt) for g, dt in zip(gw, ctx.w_dtypes)]
        return (None, None, None, None, *gx, *gw)


class _EmuCombine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, handles, apply_probs, *tensors):
        W = group.world_size
        rows, probs = tensors[:W], tensors[W:]
        ctx.group, ctx.handles, ctx.apply_probs = group, handles, apply_probs
        ctx.save_for_backward(*rows, *probs)
        return tuple(group.combine(list(rows), handles, apply_probs=apply_probs))

    @staticmethod
    def backward(ctx, *grad_ys):
        group, handles = ctx.group, ctx.handles
        W = group.world_size
        saved = ctx.saved_tensors
        rows, probs = saved[:W], saved[W:]
        grad_out = [r.tokens for r in group.redispatch([g.contiguous() for g in grad_ys], handles)]
        grad_rows, grad_probs = [], []
        for g, r, p in zip(grad_out, rows, probs):
            if ctx.apply_probs:
                grad_rows.append((g.float() * p.float()[:, None]).to(r.dtype))
                grad_probs.append((g.float() * r.float()).sum(dim=1))
            else:
                grad_rows.append(g.to(r.dtype))
                grad_probs.append(None)
        return (None, None, None, *grad_rows, *grad_probs)
