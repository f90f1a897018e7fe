"""HybridEPBuffer: the public entry point (docs/architecture.md, Public API).

Legend: T tokens on this rank, K routes per token, E experts, H hidden, B = H / 128,
R output rows, L experts per rank.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
import weakref

import torch
import torch.distributed as dist

from . import inputs
from .backends import choose_backend, create_backend
from .checks import require_int
from .config import BufferConfig, KernelConfig, check_wire_dtype
from .fp8 import scales_from_wire, wire_scales
from .handle import CallCounts, DispatchHandle, DispatchResult
from .memory import MemoryPlan
from .routing import normalize_routing
from .rows import check_hidden_dim
from .topology import group_ranks_per_node
from .traffic import Traffic, combine_row_bytes, dispatch_row_bytes, rank_traffic

_owner_ids = itertools.count(1)


@dataclasses.dataclass(frozen=True, slots=True)
class CallRecord:
    """One dispatch or combine call; its traffic is computed when asked for, not per call:
    the row counts live on the device, and reading them on every call would synchronise
    with the host and break CUDA graph capture. kind: "dispatch" | "combine"; dtype: of the
    rows on the wire (x's for a dispatch, the wire dtype for a combine). It keeps the call's
    count tables, and the handle only as long as the caller does (handle_ref): a buffer's last
    record must not keep memory the next call needs (the direct path's arena block). Made only
    when HybridEPBuffer.last_call is read (from_note), so a frozen dataclass costs no call."""

    kind: str
    rank: int
    counts: CallCounts
    handle_ref: weakref.ref[DispatchHandle]
    hidden_dim: int
    dtype: torch.dtype

    @classmethod
    def from_note(cls, note: tuple, rank: int, hidden_dim: int) -> "CallRecord":
        """The record of a call noted as (kind, weak reference to the handle, CallCounts.note,
        dtype): HybridEPBuffer notes each call and makes its record when last_call is read."""
        kind, handle_ref, counts, dtype = note
        return cls(kind=kind, rank=rank, counts=CallCounts.from_note(counts), handle_ref=handle_ref,
                   hidden_dim=hidden_dim, dtype=dtype)

    @property
    def handle(self) -> DispatchHandle | None:
        """The call's handle while anything else keeps it, else None."""
        return self.handle_ref()

    @property
    def row_bytes(self) -> int:
        row_bytes = dispatch_row_bytes if self.kind == "dispatch" else combine_row_bytes
        return row_bytes(self.hidden_dim, self.dtype)

    def traffic(self) -> Traffic:
        return rank_traffic(self.kind, self.rank, self.counts.row_counts, self.row_bytes)


def _renamed_peer_memory_bytes(peer_memory_bytes: int | None, arena_bytes: int | None) -> int | None:
    """peer_memory_bytes, or the deprecated arena_bytes it replaced (with a DeprecationWarning)."""
    if arena_bytes is None:
        return peer_memory_bytes
    if peer_memory_bytes is not None:
        raise ValueError("pass peer_memory_bytes only: arena_bytes is its deprecated former name")
    warnings.warn("HybridEPBuffer(arena_bytes=...) is deprecated: it is peer memory's initial size, now "
                  "peer_memory_bytes=...", DeprecationWarning, stacklevel=3)
    return arena_bytes


class HybridEPBuffer:
    """Dispatch and combine for one EP group. The memory it holds for its life is bounded
    independently of the routing (memory_plan() says how much, by region, before allocating);
    outputs come from PyTorch's allocator at each call's size.

    group: the EP ProcessGroup (None: the default group). ranks_per_node: NVLink domain
    size (None: from the launcher's LOCAL_WORLD_SIZE and the group's members, topology.py).
    backend: "auto" | "cuda" | "reference" (backends.BACKEND_NAMES). pad_multiple: rows per local expert are
    padded with zero rows to a multiple.
    min_rows_per_expert: every local expert gets at least this many rows (zero rows with
    prob 0 past its real ones) before rounding up to pad_multiple, so grouped GEMMs never
    see an empty group (0: experts without tokens get no rows). combine_wire_dtype: the dtype
    of combine's partial sums between ranks (None: the dtype of expert_out; torch.float32:
    twice the bytes, rounded once); combine(wire_dtype=...) overrides it per call.
    ring_chunks: cuda backend: chunks of 32 tokens one rank may have in each peer's rings before
    it waits for the peer to free one (memory against slack; default 8). ring_dtype: the widest
    value the rings carry, dispatched rows and combine's partial sums (torch.float32 by default;
    torch.bfloat16 halves the rings, for runs that move bf16 or fp8 rows and combine in bf16; a
    wider call is refused by name on every backend).
    peer_memory_bytes: cuda backend, optional: bytes of peer memory each rank holds from the start for
    the direct path's outputs (None: it starts empty and grows on demand). arena_bytes: its former
    name, deprecated.
    """

    def __init__(
        self,
        group,
        hidden_dim: int,
        max_tokens_per_rank: int,
        num_experts: int,
        *,
        ranks_per_node: int | None = None,
        backend: str = "auto",
        pad_multiple: int = 1,
        min_rows_per_expert: int = 0,
        num_sms_dispatch: int | None = None,
        num_sms_combine: int | None = None,
        peer_memory_bytes: int | None = None,
        combine_wire_dtype: torch.dtype | None = None,
        ring_chunks: int = BufferConfig.ring_chunks,
        ring_dtype: torch.dtype = BufferConfig.ring_dtype,
        arena_bytes: int | None = None,
    ):
        peer_memory_bytes = _renamed_peer_memory_bytes(peer_memory_bytes, arena_bytes)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("HybridEPBuffer needs torch.distributed to be initialised (init_process_group)")
        if group is None:
            group = dist.group.WORLD
        # new_group hands processes outside the group a sentinel instead of a group
        if group is dist.GroupMember.NON_GROUP_MEMBER or (isinstance(group, dist.ProcessGroup)
                                                          and dist.get_rank(group) < 0):
            raise ValueError(f"group: this process (global rank {dist.get_rank()}) is not a member of the EP group; "
                             "only its members build its buffer")
        if not isinstance(group, dist.ProcessGroup):
            raise TypeError(f"group must be a torch.distributed ProcessGroup or None, got {type(group).__name__}")
        world_size = dist.get_world_size(group)
        ranks_per_node = group_ranks_per_node(group, ranks_per_node)
        self.config = BufferConfig(
            hidden_dim=hidden_dim,
            max_tokens_per_rank=max_tokens_per_rank,
            num_experts=num_experts,
            world_size=world_size,
            ranks_per_node=ranks_per_node,
            pad_multiple=pad_multiple,
            min_rows_per_expert=min_rows_per_expert,
            peer_memory_bytes=peer_memory_bytes,
            ring_chunks=ring_chunks,
            ring_dtype=ring_dtype,
        ).validate()
        check_hidden_dim(hidden_dim)
        self.kernel_config = KernelConfig(num_sms_dispatch, num_sms_combine, combine_wire_dtype).validate()
        if combine_wire_dtype is not None:
            inputs.check_wire_dtype_fits(combine_wire_dtype, "combine_wire_dtype", self.config)
        self.group = group
        self.rank = dist.get_rank(group)
        self._owner = next(_owner_ids)
        # what runs and why (auto: backends/choice.py), logged once on the group's rank 0
        self.backend_choice = choose_backend(backend, self.config, group)
        self._backend = create_backend(backend, self.config, group, self.rank, self._owner, self.backend_choice)
        # The last call: a note (CallRecord.from_note) until last_call is read, then its record.
        self._last: tuple | CallRecord | None = None

    @property
    def last_call(self) -> CallRecord | None:
        """The record of this rank's last dispatch or combine (None before the first)."""
        last = self._last
        if isinstance(last, tuple):
            last = self._last = CallRecord.from_note(last, self.rank, self.config.hidden_dim)
        return last

    @property
    def last_traffic(self) -> Traffic | None:
        """NVLink / RDMA bytes of the last dispatch or combine of this rank."""
        return None if self.last_call is None else self.last_call.traffic()

    @property
    def backend(self) -> str:
        return self._backend.name

    @property
    def device(self) -> torch.device:
        return self._backend.device

    def memory_plan(self, dtype: torch.dtype = torch.bfloat16) -> MemoryPlan:
        """The bytes the buffer holds, by region, and what a call may add, for calls that
        dispatch `dtype` rows (bf16 by default, as in training; fp8 rows combine in bf16)."""
        return self._backend.memory_plan(dtype)

    def expert_out_view(self, handle: DispatchHandle, columns: int | None = None,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
        """An uninitialised [handle's rows, columns (hidden_dim)] tensor of `dtype` (bf16, the
        experts' output after bf16 and fp8 dispatches) for the experts to write the next
        combine's expert_out into. On the cuda backend's direct path with one process per GPU
        it lies in the rank's expert-out block, so the combine reads it in place instead of
        copying it there; elsewhere it is a plain tensor. Valid for that one combine, taken
        after the handle's dispatch and any dispatch after it."""
        inputs.check_handle(handle, self._owner)
        shape = (handle.num_rows, self.config.hidden_dim if columns is None else columns)
        return self._backend.expert_out_view(handle, shape, torch.bfloat16 if dtype is None else dtype)

    def is_in_peer_memory(self, t: torch.Tensor) -> bool:
        """Whether t lies in this rank's peer memory, where a direct combine reads its expert_out
        in place (an expert_out_view there does; one elsewhere is a plain tensor, copied)."""
        return self._backend.is_in_peer_memory(t)

    def release_unused(self) -> None:
        """Give back the free tail of the memory the buffer grew for its outputs (the cuda
        backend's peer memory with one process per GPU; nothing elsewhere). Collective: every
        rank calls it before the same dispatch, which takes the receive path."""
        self._backend.release_unused()

    def _kernel_config(self, num_sms_dispatch=None, num_sms_combine=None, wire_dtype=None) -> KernelConfig:
        """The buffer's KernelConfig with a call's num_sms (of a dispatch or a combine) and
        wire_dtype, each checked under the name the call takes it by."""
        base = self.kernel_config
        if num_sms_dispatch is None and num_sms_combine is None and wire_dtype is None:
            return base  # validated when the buffer was built (callers test for this case first)
        for num_sms in (num_sms_dispatch, num_sms_combine):
            if num_sms is not None:
                require_int("num_sms", num_sms, 1)
        check_wire_dtype("wire_dtype", wire_dtype)
        return dataclasses.replace(
            base,
            num_sms_dispatch=base.num_sms_dispatch if num_sms_dispatch is None else num_sms_dispatch,
            num_sms_combine=base.num_sms_combine if num_sms_combine is None else num_sms_combine,
            combine_wire_dtype=base.combine_wire_dtype if wire_dtype is None else wire_dtype,
        )

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor | None = None,
        topk_weights: torch.Tensor | None = None,
        *,
        scales: torch.Tensor | None = None,
        handle: DispatchHandle | None = None,
        num_out_tokens: int | None = None,
        routing_map: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        num_sms: int | None = None,
    ) -> DispatchResult:
        """Send each token to the ranks of its experts; rows come back expert-major.

        x: [T, H] bf16 / fp16 / fp32 / float8_e4m3fn (then scales: [T, H/128] fp32, blockwise,
        or [T, H/32] uint8 / float8_e8m0fnu, MXFP8; they come back in the same format).
        Routing: topk_idx [T, K] int (-1 = not routed) with topk_weights [T, K] (None: 1.0),
        or routing_map [T, E] bool with probs [T, E], or handle= from an earlier dispatch of
        the same routing. num_out_tokens: static number of output rows (overflow dropped and
        counted on handle.num_dropped).
        """
        routing, handle = self._check_dispatch(x, scales, topk_idx, topk_weights, routing_map, probs,
                                               handle, num_out_tokens, num_sms)
        kernel_config = self.kernel_config if num_sms is None else self._kernel_config(num_sms_dispatch=num_sms)
        if scales is None:  # bf16 rows: no scales to convert (two calls less on every call's host path)
            rows, scales_out, handle = self._backend.dispatch(x, None, routing, handle, num_out_tokens, kernel_config)
        else:
            rows, scales_out, handle = self._backend.dispatch(x, wire_scales(scales), routing, handle, num_out_tokens,
                                                              kernel_config)
            scales_out = scales_from_wire(scales_out, scales)
        self._last = ("dispatch", weakref.ref(handle), CallCounts.note(handle), x.dtype)
        # tokens_per_expert: the handle's, when read
        return DispatchResult(rows, scales_out, handle.probs_R, handle)

    def combine(
        self,
        expert_out: torch.Tensor,
        handle: DispatchHandle,
        *,
        apply_probs: bool = False,
        num_sms: int | None = None,
        wire_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """Sum each token's expert rows back on its source rank: [T, H], dtype of expert_out.

        Accumulates in fp32; padding and dropped rows are ignored. apply_probs multiplies each
        row by its routing weight first (Megatron applies probs inside the experts instead).
        wire_dtype overrides the buffer's combine_wire_dtype for this call.
        """
        self._check_combine(expert_out, handle, apply_probs)
        return self._run_combine(expert_out, handle, apply_probs, num_sms, wire_dtype)

    # -- shared by the autograd functions ---------------------------------------------------

    def _check_dispatch(self, x, scales, topk_idx, topk_weights, routing_map, probs, handle, num_out_tokens,
                        num_sms=None):
        """(routing, handle) of a dispatch whose arguments pass the checks. Where they do not, the
        peers already in the call hear of it through the call's exchange and every rank raises the
        same refusals.InputRefused (Backend.refuse_dispatch)."""
        try:
            if num_sms is not None:
                require_int("num_sms", num_sms, 1)
            return self._checked_dispatch(x, scales, topk_idx, topk_weights, routing_map, probs, handle,
                                          num_out_tokens)
        except (ValueError, TypeError) as error:
            refused = self._backend.refuse_dispatch(error, num_out_tokens, handle, self.kernel_config)
            if refused is error:
                raise
            raise refused from error

    def _checked_dispatch(self, x, scales, topk_idx, topk_weights, routing_map, probs, handle, num_out_tokens):
        backend = self._backend
        device = backend.device
        num_tokens = inputs.check_dispatch_input(x, scales, self.config, device)
        inputs.check_num_out_tokens(num_out_tokens)
        if handle is not None:
            inputs.check_handle(handle, self._owner)
            if any(a is not None for a in (topk_idx, topk_weights, routing_map, probs)):
                raise ValueError("pass either handle= or routing (topk_idx / routing_map), not both")
            inputs.check_reused_handle(handle, num_tokens, num_out_tokens)
            return None, handle
        routing = normalize_routing(
            num_tokens, self.config.num_experts, device,  # x's, checked above
            topk_idx=topk_idx, topk_weights=topk_weights, routing_map=routing_map, probs=probs,
            check_values=not (backend.reports_dynamic_routing if num_out_tokens is None
                              else backend.checks_routing_on_device),
        )
        return routing, None

    def _check_combine(self, expert_out, handle, apply_probs) -> None:
        """Raises for a combine this rank cannot make, after telling the peers where its backend
        can (Backend.refuse_combine: every rank raises the same refusals.InputRefused)."""
        try:
            self._checked_combine(expert_out, handle, apply_probs)
        except (ValueError, TypeError) as error:
            refused = self._backend.refuse_combine(error, handle, apply_probs, self.kernel_config)
            if refused is error:
                raise
            raise refused from error

    def _checked_combine(self, expert_out, handle, apply_probs) -> None:
        inputs.check_handle(handle, self._owner)
        inputs.check_combine_input(expert_out, handle, self.config)
        if not isinstance(apply_probs, bool):
            kind = type(apply_probs)
            raise TypeError(f"apply_probs must be a Python bool, got {kind.__module__}.{kind.__qualname__}"
                            if kind.__module__ != "builtins" else
                            f"apply_probs must be a Python bool, got {kind.__qualname__}")

    def _run_dispatch(self, x, scales, routing, handle, num_out_tokens, num_sms):
        """dispatch's calls past its checks, for autograd (dispatch makes them itself: one frame
        less between the API and the launch)."""
        kernel_config = self.kernel_config if num_sms is None else self._kernel_config(num_sms_dispatch=num_sms)
        if scales is None:
            rows, scales_out, handle = self._backend.dispatch(x, None, routing, handle, num_out_tokens, kernel_config)
        else:
            rows, scales_out, handle = self._backend.dispatch(x, wire_scales(scales), routing, handle, num_out_tokens,
                                                              kernel_config)
            scales_out = scales_from_wire(scales_out, scales)
        self._last = ("dispatch", weakref.ref(handle), CallCounts.note(handle), x.dtype)
        return rows, scales_out, handle

    def _run_combine(self, expert_out, handle, apply_probs, num_sms, wire_dtype=None):
        kernel_config = (self.kernel_config if num_sms is None and wire_dtype is None else
                         self._kernel_config(num_sms_combine=num_sms, wire_dtype=wire_dtype))
        inputs.check_combine_wire(expert_out.dtype, wire_dtype, self.kernel_config.combine_wire_dtype, self.config)
        y = self._backend.combine(expert_out, handle, apply_probs, kernel_config)
        self._record_combine(handle, kernel_config, expert_out.dtype)
        return y

    def _record_combine(self, handle, kernel_config: KernelConfig, dtype: torch.dtype) -> None:
        self._last = ("combine", weakref.ref(handle), CallCounts.note(handle), kernel_config.wire_dtype_for(dtype))

    def _return_row_values(self, values_R, handle):
        return self._backend.return_row_values(values_R, handle)

    def _combine_and_return_row_values(self, rows_RH, values_R, handle):
        """Dispatch's backward when both x and the routing weights need gradients."""
        kernel_config = self._kernel_config()
        y, values_TK = self._backend.combine_and_return_row_values(rows_RH, values_R, handle, kernel_config)
        self._record_combine(handle, kernel_config, rows_RH.dtype)
        return y, values_TK
