"""HybridEPTokenDispatcher: Megatron-Core's MoETokenDispatcher on top of hybrid_ep.

hybrid_ep already returns what Megatron's experts want: rows grouped by local expert
(expert-major, zero-padded), the routing weight of each row, and rows per local expert.
So the six phases are thin:

  dispatch_preprocess   flatten [S, B, H] -> [T, H]; keep routing_map and probs [T, E]
  token_dispatch        hep.dispatch (autograd): rows [R, H] and row probs [R]
  dispatch_postprocess  hand rows, tokens_per_expert [L] and row probs to the experts
  combine_preprocess    nothing to undo: expert outputs are already in row order
  token_combine         hep.combine (autograd): [T, H], fp32 accumulation
  combine_postprocess   reshape to the input shape

The experts multiply by the row probs (as with every Megatron dispatcher), so combine runs
with apply_probs=False; router gradients flow back through the row probs to `probs` [T, E].

Legend: T tokens on this rank, E experts, L local experts, H hidden, R dispatched rows.
"""

from __future__ import annotations

import math

import torch

import hybrid_ep as hep

from . import buffers
from .options import HybridEPOptions, options_for

try:
    from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher
except ImportError as _err:  # keeps `import megatron_patches` working without Megatron
    _MEGATRON_IMPORT_ERROR = _err

    class MoETokenDispatcher:  # type: ignore[no-redef]
        def __init__(self, *args, **kwargs):
            raise ImportError(f"HybridEPTokenDispatcher needs megatron-core: {_MEGATRON_IMPORT_ERROR}")

DISPATCHER_TYPE = "hybrid_ep"

def quantization_alignment(config) -> int:
    """Row alignment the experts' quantized GEMMs need (1 when not quantizing)."""
    if not (getattr(config, "fp8", None) or getattr(config, "fp4", None)):
        return 1
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    return int(get_align_size_for_quantization(config))


def grouped_gemm_alignment(config) -> int:
    """Minimum rows per local expert for the grouped-GEMM path (0: not a grouped path)."""
    if not getattr(config, "moe_grouped_gemm", False):
        return 0
    from .grouped_gemm import alignment_for_config  # the one alignment table (docs/grouped_gemm.md)

    return alignment_for_config(config)


def unsupported_reasons(config, tp_size: int) -> list[str]:
    """Config combinations this dispatcher cannot run, each with what to do instead."""
    reasons = []
    if getattr(config, "moe_pad_expert_input_to_capacity", False):
        reasons.append(
            "moe_pad_expert_input_to_capacity=True (fixed-capacity expert inputs): use "
            "--hybrid-ep-static-size-factor for a static dispatch size, or the alltoall dispatcher"
        )
    if getattr(config, "moe_shared_expert_overlap", False):
        reasons.append("moe_shared_expert_overlap=True: run shared experts without overlap")
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        reasons.append("overlap_moe_expert_parallel_comm=True (1F1B EP overlap)")
    if tp_size > 1:
        reasons.append(
            f"expert tensor parallelism (expert_tensor_parallel_size={tp_size}): use "
            "expert_tensor_parallel_size=1"
        )
    return reasons


class HybridEPTokenDispatcher(MoETokenDispatcher):
    """Token dispatcher for `moe_token_dispatcher_type="hybrid_ep"` (see module docstring).

    Constructor signature of Megatron's stock dispatchers. Knobs come from
    `options.options_for(config)`; the buffer is shared per EP group and shape
    (`buffers.BUFFERS`), created on the first dispatch.

    With the expert balancer on (docs/balancer.md), rows go to expert slots: the router's
    [T, E] routing is mapped to [T, S] slots through `slot_table`, and the local "experts"
    are this rank's S / EP slots.

    After each forward dispatch, `last_dispatch_traffic` gives hybrid_ep's traffic record
    (NVLink / RDMA bytes of this rank, read from the device only when asked for) and `last_routed_per_expert` the [E] routed-token
    counts of this rank (for load statistics).
    """

    def __init__(self, num_local_experts, local_expert_indices, config, pg_collection=None):
        if pg_collection is None:
            from megatron.core.transformer.moe.moe_utils import get_default_pg_collection

            pg_collection = get_default_pg_collection()
        super().__init__(config=config, pg_collection=pg_collection)
        # Megatron-Core 0.16's base class sets ep_size but not ep_rank.
        self.ep_rank = self.ep_group.rank()
        reasons = unsupported_reasons(config, self.tp_size)
        if reasons:
            raise ValueError(
                "moe_token_dispatcher_type='hybrid_ep' does not support: " + "; ".join(reasons)
            )
        if config.num_moe_experts is None or config.num_moe_experts % self.ep_size != 0:
            raise ValueError(
                f"num_moe_experts ({config.num_moe_experts}) must be a multiple of the EP size ({self.ep_size})"
            )
        self.num_local_experts = num_local_experts
        self.local_expert_indices = list(local_expert_indices)
        self.num_experts = config.num_moe_experts
        expected = [self.ep_rank * num_local_experts + j for j in range(num_local_experts)]
        if self.local_expert_indices != expected:
            raise ValueError(
                f"local_expert_indices must be {expected} (experts r*L .. r*L+L-1 on EP rank r), "
                f"got {self.local_expert_indices}"
            )
        self.options: HybridEPOptions = options_for(config)
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
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
            self.slot_table = SlotTable(self.num_experts, self.num_slots, device=device)
        # Grouped GEMMs want every group at least `align` rows and a multiple of it.
        self.min_rows_per_expert = grouped_gemm_alignment(config)
        self.pad_multiple = math.lcm(
            self.options.pad_multiple, quantization_alignment(config), max(1, self.min_rows_per_expert)
        )
        self._buffer: hep.HybridEPBuffer | None = None
        self.handle = None
        self.last_dispatch_call = None  # hybrid_ep.buffer.CallRecord of the forward dispatch
        self.last_routed_per_expert = None
        self.last_num_dropped = None

    @property
    def last_dispatch_traffic(self):
        """Traffic of the last forward dispatch; backward calls on the buffer do not replace it."""
        return None if self.last_dispatch_call is None else self.last_dispatch_call.traffic()

    # -- buffer -----------------------------------------------------------------------------

    def buffer(self, num_tokens: int, hidden_dim: int, device) -> hep.HybridEPBuffer:
        """The shared buffer for this EP group and shape (created on the first call)."""
        if self._buffer is None or num_tokens > self._buffer.config.max_tokens_per_rank:
            opts = self.options
            key = buffers.BufferKey(
                group_id=id(self.ep_group),
                hidden_dim=hidden_dim,
                num_experts=self.num_slots,
                pad_multiple=self.pad_multiple,
                min_rows_per_expert=self.min_rows_per_expert,
                ranks_per_node=opts.ranks_per_node,
                backend=opts.backend,
                num_sms_dispatch=opts.num_sms_dispatch,
                num_sms_combine=opts.num_sms_combine,
            )
            self._buffer = buffers.BUFFERS.get(self.ep_group, key, num_tokens, opts.max_tokens_per_rank, device)
        return self._buffer

    def _num_out_tokens(self, num_tokens: int) -> int | None:
        factor = self.options.static_size_factor
        if factor is None:
            return None
        L = self.num_local_experts
        rows = math.ceil(factor * num_tokens * self.config.moe_router_topk)
        rows += L * (self.pad_multiple - 1) + L * self.min_rows_per_expert
        return -(-rows // self.pad_multiple) * self.pad_multiple

    # -- the six phases ---------------------------------------------------------------------

    def dispatch_preprocess(self, hidden_states, routing_map, probs):
        """[S, B, H] -> [T, H]; keeps the routing for token_dispatch (no communication)."""
        if routing_map.dim() != 2 or routing_map.dtype != torch.bool:
            raise ValueError(
                f"routing_map must be a [tokens, experts] bool tensor, got {routing_map.dtype} "
                f"of shape {tuple(routing_map.shape)}"
            )
        if probs.shape != routing_map.shape:
            raise ValueError(f"probs shape {tuple(probs.shape)} must equal routing_map shape {tuple(routing_map.shape)}")
        self.hidden_shape = hidden_states.shape
        self.last_routed_per_expert = routing_map.detach().sum(dim=0)
        if self.slot_table is not None:
            if self.load_recorder is not None and torch.is_grad_enabled():
                self.load_recorder(self.last_routed_per_expert)
            from hybrid_ep.balancer import route_to_slots

            routing_map, probs = route_to_slots(routing_map, probs, self.slot_table, self.ep_rank)
        self.routing_map = routing_map
        return hidden_states.reshape(-1, self.hidden_shape[-1]), probs

    def token_dispatch(self, hidden_states, probs):
        """Send rows to the ranks of their experts: rows [R, H] and row probs [R]."""
        x_TH = hidden_states
        buf = self.buffer(x_TH.shape[0], x_TH.shape[1], x_TH.device)
        res = hep.dispatch(
            buf,
            x_TH,
            routing_map=self.routing_map,
            probs=probs,
            num_out_tokens=self._num_out_tokens(x_TH.shape[0]),
            num_sms=self.options.num_sms_dispatch,
        )
        self.handle = res.handle
        self.last_dispatch_call = buf.last_call
        tokens_per_expert = res.tokens_per_expert
        if self.options.static_size_factor is not None:
            self.last_num_dropped = res.handle.num_dropped
            # Static size: rows past the last expert are zero. Give them to the last expert so
            # that the per-expert splits cover every row (combine ignores those rows).
            slack = res.tokens.shape[0] - tokens_per_expert.sum()
            tokens_per_expert = tokens_per_expert.clone()
            tokens_per_expert[-1] += slack
        self.tokens_per_expert = tokens_per_expert
        return res.tokens, res.probs.to(probs.dtype)

    def dispatch_postprocess(self, hidden_states, probs):
        """Rows are already expert-major: return them with rows per local expert."""
        tokens_per_expert, self.tokens_per_expert = self.tokens_per_expert, None
        return hidden_states, tokens_per_expert, probs

    def combine_preprocess(self, hidden_states):
        return hidden_states

    def token_combine(self, hidden_states):
        """Sum each token's expert rows back on its source rank: [T, H]."""
        handle, self.handle = self.handle, None
        if handle is None:
            raise RuntimeError("HybridEPTokenDispatcher.token_combine called without a preceding token_dispatch")
        return hep.combine(self._buffer, hidden_states, handle, num_sms=self.options.num_sms_combine)

    def combine_postprocess(self, hidden_states):
        return hidden_states.view(self.hidden_shape)
