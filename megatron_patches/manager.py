"""HybridEPManager: hybrid_ep under Megatron-Core's flex token dispatcher, as one of its backends.

Megatron's `MoEFlexTokenDispatcher` drives a communication backend through `_DispatchManager`
(token_dispatcher.py, Megatron-Core 0.19.x and main alike) and does the rest of a dispatcher's
work itself: it flattens [S, B, H] to [T, H], expands the routing map over the expert-tensor-
parallel ranks ([T, E] -> [T, EP x ETP, L]), runs the shared experts between the phases, asks
`get_expert_zero_copy_buffers` for the experts' output buffer, and Megatron's EP-overlap
schedule, its expert padding and its input frees treat `flex` + `hybridep` by name. hybrid_ep
already returns what Megatron's experts want (rows grouped by local expert, zero-padded, the
routing weight of each row, rows per local expert), so the manager's five methods are thin:

  setup_metadata                      routing map and probs [T, C], C = ETP x E (or the balancer's slots)
  dispatch                            hep.dispatch (autograd): rows [R, H], row probs [R] in dispatched_probs
  get_permuted_hidden_states_by_experts   the rows as they are, with dispatched_probs
  get_restored_hidden_states_by_experts   the experts' output as it is
  combine                             hep.combine (autograd): [T, H], fp32 accumulation

The experts multiply by the row probs (as with every Megatron dispatcher), so combine runs
with apply_probs=False; router gradients flow back through the row probs to `token_probs`.
`megatron_patches.selection` makes `--moe-token-dispatcher-type hybrid_ep` build it.

Legend: T tokens on this rank, E experts, C routing columns, L local experts, H hidden,
R dispatched rows.
"""

from __future__ import annotations

import math

import torch

import hybrid_ep as hep
from hybrid_ep.fp8 import FP8_DTYPE

from . import buffers, expert_out, expert_rows, te_grouped_rows, wire_fp8
from .options import HybridEPOptions, options_for, static_size_factor

try:
    from megatron.core.transformer.moe.token_dispatcher import _DispatchManager
except ImportError as _err:  # keeps `import megatron_patches` working without Megatron
    _MEGATRON_IMPORT_ERROR = _err

    class _DispatchManager:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs):
            raise ImportError(f"HybridEPManager needs megatron-core: {_MEGATRON_IMPORT_ERROR}")

DISPATCHER_TYPE = "hybrid_ep"
REFUSAL = "moe_token_dispatcher_type='hybrid_ep' does not support: "


def refuse(reasons: list[str]) -> None:
    if reasons:
        raise ValueError(REFUSAL + "; ".join(reasons))


def config_unsupported_reasons(config) -> list[str]:
    """The refusals the config alone decides, also checked at config validation (selection.py),
    before Megatron's own checks could give a misleading message.

    moe_paged_stash: Megatron's PagedStashRunner reruns a step that overflowed with the flex
    manager's rank capacity factor turned off; hybrid_ep's static size would follow it, but the
    runner has not run with it (it needs Transformer Engine's op fuser)."""
    reasons = []
    if getattr(config, "moe_paged_stash", False):
        reasons.append(
            "moe_paged_stash=True (--moe-paged-stash): Megatron's paged-stash runner reruns "
            "overflowing steps with the rank capacity factor turned off, which has not been run with hybrid_ep; "
            "turn moe_paged_stash off (moe_expert_rank_capacity_factor alone gives the static size; rows that "
            "do not fit are dropped and flagged by check_over_budget())"
        )
    return reasons


def unsupported_reasons(config, tp_size: int, balancer: bool) -> list[str]:
    """Config combinations this dispatcher cannot run, each with what to use instead."""
    reasons = config_unsupported_reasons(config)
    if balancer and tp_size > 1:
        reasons.append(
            f"the expert balancer with expert_tensor_parallel_size={tp_size}: use "
            "expert_tensor_parallel_size=1 with --hybrid-ep-balancer-interval, or turn the balancer off"
        )
    if balancer and getattr(config, "moe_pad_expert_input_to_capacity", False):
        reasons.append(
            "the expert balancer with moe_pad_expert_input_to_capacity=True: use "
            "moe_expert_rank_capacity_factor for a static size with the balancer, or turn the balancer off"
        )
    if getattr(config, "moe_pad_expert_input_to_capacity", False) and config.moe_expert_capacity_factor is None:
        reasons.append(
            "moe_pad_expert_input_to_capacity=True without moe_expert_capacity_factor: set "
            "moe_expert_capacity_factor (the capacity each expert is padded to)"
        )
    return reasons


class HybridEPManager(_DispatchManager):
    """hybrid_ep as MoEFlexTokenDispatcher's backend (see module docstring).

    Built by MoEFlexTokenDispatcher with `_HybridEPManager`'s keywords: `group` is its TP x EP
    group (rank = ep_rank x ETP + etp_rank), `num_experts` is ETP x E. Knobs come from
    `options.options_for(config)`; the buffer is shared per communication group and shape
    (`buffers.BUFFERS`), created on the first dispatch. `attach(layer)`, called once MoELayer
    built its experts (the MoELayer patch), pads rows only as far as those experts need.

    Communication group: with expert tensor parallelism (ETP > 1) each token goes to every
    expert-TP rank of its experts (the flex dispatcher's expanded routing map) and combine sums
    their partial outputs.

    Padding rows: only what the experts built by MoELayer need (`attach`, decided by
    `expert_rows.pad_multiple_for`), the user's --hybrid-ep-pad-multiple, router padding for
    quantization, and with moe_pad_expert_input_to_capacity `capacity x EP x ETP` rows per
    local expert (Megatron's count) rounded up to pad_multiple (`_drop_and_pad_rows`: the
    buffer's min_rows_per_expert, tokens_per_expert and the static output size all use it,
    so the experts split the rows where the buffer laid them out; no host sync).

    Buffer size: the largest token count of the group (or --hybrid-ep-max-tokens-per-rank).
    Where token counts may change between micro-batches (`variable_seq_lengths`), that count
    is agreed on every call (one all-reduce) before any data moves, so a larger micro-batch
    on one rank grows the buffer, or fails with the same error, on every rank. With fixed
    shapes nothing is added; a rank that gets more tokens anyway raises alone, naming both
    settings, and its peers stop after HYBRID_EP_TIMEOUT_S.

    With the expert balancer on (docs/balancer.md), rows go to expert slots: the router's
    [T, E] routing is mapped to [T, S] slots through `slot_table`, and the local "experts"
    are this rank's S / EP slots.

    The experts' output in place (megatron_patches.expert_out, --hybrid-ep-expert-out-in-place,
    on by default): on Transformer Engine's op fuser through Megatron's own output buffer
    (`_zc_fwd_token_buf`), on TE's GroupedLinear module through fc2's torch.empty; expert_out's
    docstring says where and when.

    After each forward dispatch, `last_dispatch_traffic` gives hybrid_ep's traffic record
    (NVLink / RDMA bytes of this rank, read from the device only when asked for) and
    `last_routed_per_expert` the [E] routed-token counts of this rank (real tokens: padding
    never appears there; under drop-and-pad the router's capacity fill, routes of weight 0,
    is left out). `over_budget` (static size only) is the [1] bool flag Megatron's
    `check_over_budget()` returns: True once a dispatch dropped rows since the last reset.
    """

    def __init__(self, group, num_local_experts: int, num_experts: int, config):
        self.group = group
        self.config = config
        if config.num_moe_experts is None or num_experts % config.num_moe_experts:
            raise ValueError(f"the flex dispatcher's {num_experts} routing columns are not a multiple of "
                             f"num_moe_experts ({config.num_moe_experts})")
        self.tp_size = num_experts // config.num_moe_experts
        if group.size() % self.tp_size:
            raise ValueError(f"the dispatch group of {group.size()} ranks is not a multiple of ETP {self.tp_size}")
        self.ep_size = group.size() // self.tp_size
        self.ep_rank, self.tp_rank = divmod(group.rank(), self.tp_size)
        self.ep_group = None  # MoELayer's EP group, set by attach (the balancer reduces over it)
        self._combined_in_place = False  # set by attach
        self.options: HybridEPOptions = options_for(config)
        refuse(unsupported_reasons(config, self.tp_size, self.options.balancer_enabled)
               + wire_fp8.unsupported_reasons(config, self.options))
        # fp8 on the wire (options.dispatch_fp8 / combine_grad_fp8): rows quantized once, here.
        self.wire_quantizer = (wire_fp8.quantizer_for(config)
                               if self.options.dispatch_fp8 or self.options.combine_grad_fp8 else None)
        if config.num_moe_experts % self.ep_size != 0:
            raise ValueError(
                f"num_moe_experts ({config.num_moe_experts}) must be a multiple of the EP size ({self.ep_size})"
            )
        self.num_experts = config.num_moe_experts
        self.num_local_experts = num_local_experts
        self.local_expert_indices = [self.ep_rank * num_local_experts + j for j in range(num_local_experts)]
        self.static_size_factor = static_size_factor(config, self.options)
        self.drop_and_pad = bool(config.moe_pad_expert_input_to_capacity)
        # Expert balancer: P local slots instead of E / EP experts, router ids mapped to slots.
        self.slot_table = None
        self.load_recorder = None  # callable(routed_per_expert [E]) set by the balancer
        self.num_slots = self.num_experts
        if self.options.balancer_enabled:
            from hybrid_ep.balancer import SlotTable

            from .balancer import slots_per_rank

            P = slots_per_rank(self.options, self.num_experts, self.ep_size)
            self.num_slots = P * self.ep_size
            self.num_local_experts = P
            self.local_expert_indices = [self.ep_rank * P + j for j in range(P)]
            self.slot_table = SlotTable(self.num_experts, self.num_slots, device=_device())
        self.expert_out: expert_out.ExpertOutInPlace | None = None
        self.set_experts(None)
        self._buffer: hep.HybridEPBuffer | None = None
        self.handle = None
        self._handle_buffer = None  # the buffer self.handle belongs to (combine must use it)
        self.capacity = None
        self.routing_map = self.token_probs = self.dispatched_probs = None
        self.tokens_per_expert = None  # kept until combine: the EP-overlap schedule reads it on another stream
        self.last_dispatch_call = None  # hybrid_ep.buffer.CallRecord of the forward dispatch
        self.last_routed_per_expert = None
        self.last_num_dropped = None
        self._over_budget = None
        self._rows_as = None  # how this dispatch's experts take fp8 rows (te_grouped_rows.rows_as)

    @property
    def over_budget(self) -> torch.Tensor:
        """[1] bool: True once a dispatch dropped rows that did not fit the static size since the
        last reset (Megatron's flex dispatcher reads and resets it). Absent (AttributeError)
        without a static size: nothing is ever dropped."""
        if self.static_size_factor is None:
            raise AttributeError("over_budget: no static size (moe_expert_rank_capacity_factor), nothing is dropped")
        if self._over_budget is None:
            self._over_budget = torch.zeros(1, dtype=torch.bool, device=_device())
        return self._over_budget

    @property
    def _zc_fwd_token_buf(self) -> torch.Tensor | None:
        """The experts' output buffer: the flex dispatcher's get_expert_zero_copy_buffers reads it
        once per forward, after the dispatch, and MoELayer hands it to TEGroupedMLP on Transformer
        Engine's op fuser as output_buffer. The current dispatch's view of the buffer's expert-out
        block, which the combine then reads in place, where one can serve (expert_out), else None."""
        return None if self.expert_out is None else self.expert_out.output_buffer()

    # the experts' input-gradient buffer (the flex dispatcher's grad_input_buffer): none, the
    # dispatch's backward is a combine that takes the gradient where autograd makes it
    _zc_bwd_token_buf = None

    @property
    def last_dispatch_traffic(self):
        """Traffic of the last forward dispatch; backward calls on the buffer do not replace it."""
        return None if self.last_dispatch_call is None else self.last_dispatch_call.traffic()

    @property
    def comm_size(self) -> int:
        """Ranks that send rows to one local expert: EP x expert-TP."""
        return self.ep_size * self.tp_size

    def attach(self, layer) -> None:
        """After MoELayer built its experts: pad for them (set_experts), keep the layer's EP
        group, and let a CUDA graph of moe_preprocess return the routed counts too."""
        self.ep_group = layer.token_dispatcher.ep_group
        # with shared-expert overlap the flex dispatcher adds the shared experts' output into the
        # combine's output in place, which autograd forbids on a view a custom Function made
        self._combined_in_place = layer.token_dispatcher.shared_experts is not None
        self.set_experts(layer.experts)
        layer.token_dispatcher.cudagraph_attrs.append("_comm_manager.last_routed_per_expert")

    def set_experts(self, experts) -> None:
        """Pad rows only as far as `experts` (the module MoELayer built; None: not built yet)
        needs, and install the experts' output in place where it can serve them
        (expert_out.install_reason)."""
        pad, self.padding_reason = expert_rows.pad_multiple_for(experts, self.config)
        if getattr(self.config, "moe_router_padding_for_quantization", False):
            pad = math.lcm(pad, expert_rows.quantization_alignment(self.config))
        self.pad_multiple = math.lcm(self.options.pad_multiple, pad)
        if self.expert_out is not None:
            self.expert_out.remove()
            self.expert_out = None
        self.expert_out_reason = expert_out.install_reason(experts, self.config, self.options)
        if self.expert_out_reason is None:
            self.expert_out = expert_out.ExpertOutInPlace(self, experts)
        self._te_api, self.fp8_rows_reason = None, "no fp8 on the wire"
        if self.wire_quantizer is not None:
            self._te_api = te_grouped_rows.te_api()
            self.fp8_rows_reason = te_grouped_rows.handoff_reason(experts, self.config, self.pad_multiple,
                                                                  self._te_api)
            if experts is not None and self.ep_rank == 0:
                te_grouped_rows.announce(self.fp8_rows_reason, self._te_api)

    # -- buffer -----------------------------------------------------------------------------

    def buffer(self, num_tokens: int, hidden_dim: int, device, min_rows: int,
               group_tokens: int | None = None, dtype: torch.dtype = torch.bfloat16,
               ring_dtype: torch.dtype = torch.float32) -> hep.HybridEPBuffer:
        """The shared buffer for this group, shape and padding (created on the first call;
        looked up on every call so that all layers follow one replaced buffer).
        group_tokens: the group's largest token count, when agreed on this call. dtype: of the
        rows dispatched (the startup line's memory figures); ring_dtype: the widest value its
        rings carry (buffers.ring_dtype_for the hidden states)."""
        opts = self.options
        key = buffers.BufferKey(
            group_id=id(self.group),
            hidden_dim=hidden_dim,
            num_experts=self.num_slots * self.tp_size,
            pad_multiple=self.pad_multiple,
            ranks_per_node=opts.ranks_per_node,
            backend=opts.backend,
            num_sms_dispatch=opts.num_sms_dispatch,
            num_sms_combine=opts.num_sms_combine,
            ring_dtype=ring_dtype,
        )
        self._buffer = buffers.BUFFERS.get(self.group, key, num_tokens, opts.max_tokens_per_rank, device,
                                           min_rows_per_expert=min_rows, group_tokens=group_tokens, dtype=dtype,
                                           expert_out_in_place=self.expert_out is not None)
        return self._buffer

    def _agrees_tokens_per_call(self) -> bool:
        """Whether dispatch all-reduces the token count first: only where micro-batches may
        change their token count (Megatron's variable_seq_lengths). With fixed shapes the first
        call's group maximum holds for every call, and one more collective per MoE layer would
        be paid for nothing."""
        return bool(getattr(self.config, "variable_seq_lengths", False))

    def _capacity(self, num_tokens: int) -> int:
        """Megatron's per-expert capacity for this rank's tokens (get_capacity, as the router)."""
        from megatron.core.transformer.moe.moe_utils import get_capacity

        return get_capacity(num_tokens * self.config.moe_router_topk, self.num_experts,
                            self.config.moe_expert_capacity_factor)

    def _drop_and_pad_rows(self) -> int:
        """Drop-and-pad: rows per local expert. Megatron's capacity x EP x ETP, rounded up to
        pad_multiple because the buffer pads every expert's block to it; the extra rows are
        zero with weight 0, which is what a quantized TEGroupedMLP adds itself under alltoall."""
        rows = self.capacity * self.comm_size
        return -(-rows // self.pad_multiple) * self.pad_multiple

    def _num_out_tokens(self, num_tokens: int) -> int | None:
        """Static output rows (no host sync), or None for the exact size."""
        L = self.num_local_experts
        if self.drop_and_pad:
            return L * self._drop_and_pad_rows()
        factor = self.static_size_factor
        if factor is None:
            return None
        rows = math.ceil(factor * num_tokens * self.config.moe_router_topk)
        rows += L * (self.pad_multiple - 1)
        return -(-rows // self.pad_multiple) * self.pad_multiple

    def _routes(self, routing_map, probs):
        """[T, C] routing map and probs -> (topk_idx [T, K], weights [T, K]) with K fixed on the
        host: the router's top-k (times ETP for the expanded map), or every column with
        drop-and-pad, where a token may fill any expert's capacity. Routed columns first, in
        column order (the order hybrid_ep's own routing-map conversion uses); differentiable
        in probs."""
        columns = routing_map.shape[1]
        K = columns if self.drop_and_pad else min(columns, self.config.moe_router_topk * self.tp_size)
        order = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True)
        cols, valid = order.indices[:, :K], order.values[:, :K] > 0
        idx = torch.where(valid, cols, -1)
        weights = torch.where(valid, probs.gather(1, cols).float(), 0.0)
        return idx, weights

    # -- the five methods MoEFlexTokenDispatcher calls ----------------------------------------

    @torch.compiler.disable  # the flex dispatcher's dispatch_preprocess is compiled; this part is not its
    def setup_metadata(self, routing_map: torch.Tensor, probs: torch.Tensor):
        """Keep the routing for dispatch (no communication): routing_map and probs [T, EP x ETP, L]
        as the flex dispatcher expands them, kept as [T, C] (the balancer's slots: C = S)."""
        T = routing_map.shape[0]
        C = self.tp_size * self.num_experts
        if routing_map.dtype != torch.bool or routing_map.numel() != T * C:
            raise ValueError(f"routing_map must be a bool tensor of [tokens, {C}] routes, got {routing_map.dtype} "
                             f"of shape {tuple(routing_map.shape)}")
        if probs.shape != routing_map.shape:
            raise ValueError(f"probs shape {tuple(probs.shape)} must equal routing_map shape "
                             f"{tuple(routing_map.shape)}")
        routing_map, probs = routing_map.reshape(T, C), probs.reshape(T, C)
        # the router's [T, E] routes: one expert-TP rank's columns of the expanded map
        routed = routing_map.detach().reshape(T, self.ep_size, self.tp_size, -1)[:, :, 0].reshape(T, -1)
        if self.drop_and_pad:  # the router's capacity fill: routes of weight 0, not tokens
            weights = probs.detach().reshape(T, self.ep_size, self.tp_size, -1)[:, :, 0].reshape(T, -1)
            routed = routed & (weights != 0)
        self.last_routed_per_expert = routed.sum(dim=0)
        if self.slot_table is not None:  # the balancer runs with ETP 1: the map is the router's [T, E]
            if self.load_recorder is not None and torch.is_grad_enabled():
                self.load_recorder(self.last_routed_per_expert)
            from hybrid_ep.balancer import route_to_slots

            routing_map, probs = route_to_slots(routing_map, probs, self.slot_table, self.ep_rank)
        self.routing_map, self.token_probs = routing_map, probs

    def dispatch(self, hidden_states: torch.Tensor, async_finish: bool = True,
                 allocate_on_comm_stream: bool = True) -> torch.Tensor:
        """Send rows to the ranks of their experts: rows [R, H]; row probs [R] in dispatched_probs.
        (hybrid_ep runs on the current stream: async_finish and allocate_on_comm_stream, the
        DeepEP manager's, change nothing.)"""
        x_TH, probs = hidden_states, self.token_probs
        if self.expert_out is not None:
            self.expert_out.forget()
        min_rows = 0
        if self.drop_and_pad:
            self.capacity = self._capacity(x_TH.shape[0])
            min_rows = self._drop_and_pad_rows()
        group_tokens = None
        if self._agrees_tokens_per_call():
            group_tokens = buffers.group_max_tokens(self.group, x_TH.shape[0], x_TH.device)
        buf = self.buffer(x_TH.shape[0], x_TH.shape[1], x_TH.device, min_rows, group_tokens,
                          FP8_DTYPE if self.options.dispatch_fp8 else x_TH.dtype, buffers.ring_dtype_for(x_TH.dtype))
        num_out_tokens = self._num_out_tokens(x_TH.shape[0])
        if num_out_tokens is None:
            routing = dict(routing_map=self.routing_map, probs=probs)
        else:  # static shapes: routes per token known on the host, no device read
            routing = dict(zip(("topk_idx", "topk_weights"), self._routes(self.routing_map, probs)))
        if self.options.dispatch_fp8:
            res = wire_fp8.send(buf, x_TH, self.wire_quantizer, num_out_tokens=num_out_tokens,
                                num_sms=self.options.num_sms_dispatch, **routing)
        else:
            res = hep.dispatch(buf, x_TH, num_out_tokens=num_out_tokens, num_sms=self.options.num_sms_dispatch,
                               **routing)
        self.handle, self._handle_buffer = res.handle, buf
        self.last_dispatch_call = buf.last_call
        if self.drop_and_pad:
            # Every local expert holds exactly min_rows rows: known on the host.
            tokens_per_expert = torch.full((self.num_local_experts,), min_rows, dtype=torch.long)
        elif self.static_size_factor is not None:
            self.last_num_dropped = res.handle.num_dropped
            flag = self.over_budget
            flag |= (self.last_num_dropped > 0).reshape(1).to(flag.device)
            # Static size: rows past the last expert are zero. Give them to the last expert so
            # that the per-expert splits cover every row (combine ignores those rows).
            slack = res.tokens.shape[0] - res.tokens_per_expert.sum()
            tokens_per_expert = res.tokens_per_expert.clone()
            tokens_per_expert[-1] += slack
        else:
            tokens_per_expert = res.tokens_per_expert
        self.tokens_per_expert = tokens_per_expert
        if self.wire_quantizer is not None:  # how this layer's experts take fp8 rows, forward and backward
            counts = tokens_per_expert if tokens_per_expert.device == x_TH.device else \
                torch.full_like(tokens_per_expert, min_rows, device=x_TH.device)
            self._rows_as = te_grouped_rows.rows_as(self.fp8_rows_reason, self._te_api, counts)
        if self.options.dispatch_fp8:
            rows = wire_fp8.received_rows(buf, x_TH, res, self._rows_as)
        else:
            rows = res.tokens
        self.dispatched_probs = res.probs.to(probs.dtype)
        return rows

    def get_permuted_hidden_states_by_experts(self, hidden_states: torch.Tensor):
        """Rows are already expert-major: the rows as they are, with their routing weights."""
        return hidden_states, self.dispatched_probs

    def get_number_of_tokens_per_expert(self) -> torch.Tensor:
        return self.tokens_per_expert

    def get_restored_hidden_states_by_experts(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def combine(self, hidden_states: torch.Tensor, async_finish: bool = True,
                allocate_on_comm_stream: bool = True) -> torch.Tensor:
        """Sum each token's expert rows back on its source rank: [T, H]."""
        handle, self.handle = self.handle, None
        buf, self._handle_buffer = self._handle_buffer, None
        if handle is None:
            raise RuntimeError("HybridEPManager.combine called without a preceding dispatch")
        if self.expert_out is not None:  # fc2's output in the expert-out block must be what is combined
            self.expert_out.check_combine(hidden_states, buf)
        if self.options.combine_grad_fp8:
            out = wire_fp8.combine(buf, hidden_states, handle, self.wire_quantizer,
                                   num_sms=self.options.num_sms_combine, as_rows=self._rows_as)
        else:
            out = hep.combine(buf, hidden_states, handle, num_sms=self.options.num_sms_combine)
        self.tokens_per_expert = self.dispatched_probs = self._rows_as = None
        if self._combined_in_place and out._is_view():
            out = out.clone()
        return out


def _device() -> torch.device | None:
    """Where the manager's own small tensors live: the current GPU, else the host."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
