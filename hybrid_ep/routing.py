"""Routing metadata: the one place that turns routing into the send and receive tables.

Every backend uses these functions; backends only move bytes.

Legend for shape suffixes:
  T tokens on this rank, K routes per token, E experts, W ranks in the EP group,
  N nodes, L = E / W experts per rank, S rows this rank sends (one per token and
  destination rank), V rows this rank receives, M (row, local expert) entries kept in
  the output, R output rows (expert-major, padded).
"""

from __future__ import annotations

import dataclasses

import torch

from .config import BufferConfig
from .limits import MAX_TOPK, check_topk

_INT_DTYPES = (torch.int32, torch.int64)


class Routing:
    """Normalised routing of one rank: K routes per token, -1 where there is no route.

    topk_weights_TK is float32 with 0 where there is no route. Made from the caller's
    weights (`given`), it is masked when first read, not per call: the cuda kernels never read
    an unused route's weight, so they take the weights as given (weights_as_given_TK) and a
    static-size call runs no tensor operation for its routing; nor does autograd's dispatch,
    whose gradient there is 0 by return_row_values' contract. Read-only, like the frozen
    objects around it."""

    __slots__ = ("_idx", "_weights", "_given")

    def __init__(self, topk_idx_TK: torch.Tensor, topk_weights_TK: torch.Tensor | None = None, *,
                 given: torch.Tensor | None = None):
        """topk_idx_TK: int64, -1 = not routed. Either topk_weights_TK (float32, 0 where not
        routed) or `given`: floating [T, K] as the caller passed them, or None for 1.0 per
        route; either way unused routes read as 0 through topk_weights_TK."""
        self._idx, self._weights, self._given = topk_idx_TK, topk_weights_TK, given

    @property
    def topk_idx_TK(self) -> torch.Tensor:
        """int64 [T, K] expert of each route, -1 = no route."""
        return self._idx

    @property
    def topk_weights_TK(self) -> torch.Tensor:
        """float32 [T, K] routing weights, 0 where not routed (differentiable in the given ones)."""
        if self._weights is None:
            valid = self._idx >= 0
            given = self._given
            self._weights = valid.to(torch.float32) if given is None else torch.where(valid, given.to(torch.float32),
                                                                                        0.0)
        return self._weights

    @property
    def weights_as_given_TK(self) -> torch.Tensor:
        """[T, K] weights for readers that skip unused routes (the cuda kernels, autograd): the
        caller's as given where there are some (any floating dtype, unused routes as passed),
        else topk_weights_TK."""
        return self._given if self._given is not None else self.topk_weights_TK

    @property
    def given_weights_TK(self) -> torch.Tensor | None:
        """weights_as_given_TK where there are weights, None where the caller gave none (1.0 per
        route) and none were made yet: the cuda engine then reads ones it keeps, with no
        tensor operation per call."""
        return self._given if self._given is not None else self._weights

    @property
    def num_tokens(self) -> int:
        return self._idx.shape[0]


def _check_tensor(name: str, value, dims: int) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if value.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(value.shape)}")


def _out_of_range(num_experts: int) -> str:
    return f"topk_idx values must be in [-1, {num_experts - 1}] (num_experts={num_experts})"


def _twice(token: int) -> str:
    return f"topk_idx routes token {token} to the same expert twice"


def bad_route_text(num_experts: int, rank: int, token: int, expert: int) -> str:
    """The error of a bad route the device found (the count kernel's first bad route of the
    lowest bad rank, csrc/kernels/count.cuh): an expert id in [-1, num_experts) can only be
    bad as a token's second route to that expert."""
    if -1 <= expert < num_experts:
        return f"{_twice(token)} on rank {rank}: expert {expert}"
    return f"{_out_of_range(num_experts)}, got {expert} at token {token} on rank {rank}"


def check_topk_values(idx: torch.Tensor, num_experts: int) -> None:
    """Expert ids [T, K] in [-1, num_experts) and no token routed to one expert twice (host
    reads). Also before a balancer maps ids to expert slots: there two routes to one replicated
    expert would become two distinct expert slots, past any later check."""
    if idx.numel() == 0:
        return
    # One host read for all three facts: on a GPU each read waits for every kernel queued
    # before it, and the host work after it runs while the GPU idles.
    facts = [idx.min(), idx.max()]
    if idx.shape[1] > 1:
        srt = idx.sort(dim=1).values
        dup_T = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(dim=1)
        facts.append(dup_T.any().to(idx.dtype))
    lo, hi, *dup = torch.stack(facts).tolist()
    if lo < -1 or hi >= num_experts:
        raise ValueError(f"{_out_of_range(num_experts)}, got min {lo} max {hi}")
    if dup and dup[0]:
        row = int(dup_T.nonzero()[0, 0])
        raise ValueError(f"{_twice(row)}: {idx[row].tolist()}")


def normalize_routing(
    num_tokens: int,
    num_experts: int,
    device: torch.device,
    *,
    topk_idx=None,
    topk_weights=None,
    routing_map=None,
    probs=None,
    check_values: bool = True,
) -> Routing:
    """Validate either (topk_idx, topk_weights) or Megatron's (routing_map, probs).

    The gather from probs[T, E] to weights[T, K] is differentiable, so routing-weight
    gradients reach Megatron's probs when this runs inside autograd.
    check_values=False skips the checks that read values (they synchronise with the host):
    for a backend that checks the ids on the device (the cuda backend's count kernel).
    """
    if topk_idx is not None and routing_map is not None:
        raise ValueError("pass either topk_idx (with topk_weights) or routing_map (with probs), not both")
    if topk_idx is None and routing_map is None:
        raise ValueError("routing is missing: pass topk_idx (with topk_weights) or routing_map (with probs)")
    if routing_map is not None:
        if topk_weights is not None:
            raise ValueError("topk_weights goes with topk_idx; with routing_map pass probs")
        return _from_routing_map(num_tokens, num_experts, device, routing_map, probs)
    if probs is not None:
        raise ValueError("probs goes with routing_map; with topk_idx pass topk_weights")

    _check_tensor("topk_idx", topk_idx, 2)
    idx_dtype, idx_shape = topk_idx.dtype, topk_idx.shape  # each read makes a Python object
    if idx_dtype not in _INT_DTYPES:
        raise TypeError(f"topk_idx must be int32 or int64, got {idx_dtype}")
    if idx_shape[0] != num_tokens:
        raise ValueError(
            f"topk_idx has {idx_shape[0]} rows but x has {num_tokens} tokens"
        )
    check_topk("topk_idx", idx_shape[1])
    if topk_idx.device != device:
        raise ValueError(f"topk_idx is on {topk_idx.device} but x is on {device}")
    idx = topk_idx if idx_dtype == torch.int64 else topk_idx.to(torch.int64)  # .to costs a microsecond
    if check_values:
        check_topk_values(idx, num_experts)
    if topk_weights is not None:
        _check_tensor("topk_weights", topk_weights, 2)
        if not topk_weights.is_floating_point():
            raise TypeError(f"topk_weights must be a floating dtype, got {topk_weights.dtype}")
        if topk_weights.shape != idx_shape:
            raise ValueError(
                f"topk_weights shape {tuple(topk_weights.shape)} must equal topk_idx shape "
                f"{tuple(idx_shape)}"
            )
        if topk_weights.device != device:
            raise ValueError(f"topk_weights is on {topk_weights.device} but x is on {device}")
    return Routing(idx, given=topk_weights)  # masked when first read (Routing.topk_weights_TK)


def _from_routing_map(num_tokens, num_experts, device, routing_map, probs) -> Routing:
    _check_tensor("routing_map", routing_map, 2)
    if routing_map.dtype != torch.bool:
        raise TypeError(f"routing_map must be torch.bool, got {routing_map.dtype}")
    if tuple(routing_map.shape) != (num_tokens, num_experts):
        raise ValueError(
            f"routing_map must have shape [num_tokens, num_experts] = [{num_tokens}, {num_experts}], "
            f"got {tuple(routing_map.shape)}"
        )
    if routing_map.device != device:
        raise ValueError(f"routing_map is on {routing_map.device} but x is on {device}")
    if probs is not None:
        _check_tensor("probs", probs, 2)
        if not probs.is_floating_point():
            raise TypeError(f"probs must be a floating dtype, got {probs.dtype}")
        if probs.shape != routing_map.shape:
            raise ValueError(
                f"probs shape {tuple(probs.shape)} must equal routing_map shape {tuple(routing_map.shape)}"
            )
        if probs.device != device:
            raise ValueError(f"probs is on {probs.device} but x is on {device}")
    routes_T = routing_map.sum(dim=1)
    k = int(routes_T.max()) if num_tokens > 0 else 0
    if k > MAX_TOPK:
        token = int((routes_T == k).nonzero()[0, 0])
        check_topk("routing_map", k, token)
    k = max(k, 1)
    # Stable sort puts routed experts first, in expert order.
    order = torch.sort(routing_map.to(torch.int8), dim=1, descending=True, stable=True)
    cols = order.indices[:, :k]
    valid = order.values[:, :k] > 0
    idx = torch.where(valid, cols, -1)
    if probs is None:
        weights = valid.to(torch.float32)
    else:
        weights = torch.where(valid, probs.gather(1, cols).to(torch.float32), 0.0)
    return Routing(idx, weights)


@dataclasses.dataclass(frozen=True)
class SendTable:
    """What this rank sends: one row per (token, destination rank), ordered by rank then token."""

    send_token_idx_S: torch.Tensor  # int64 token of each sent row
    send_counts_W: torch.Tensor  # int64 rows sent to each rank
    node_counts_N: torch.Tensor  # int64 tokens that reach each node (one RDMA row per node)
    row_expert_mask_SL: torch.Tensor  # bool: row goes to these local experts of its destination
    row_probs_SL: torch.Tensor  # float32 routing weight per local expert of the row
    route_send_row_TK: torch.Tensor  # int64 sent row of each route, -1 if not routed
    route_local_expert_TK: torch.Tensor  # int64 local expert index of each route (valid where routed)

    @property
    def num_rows(self) -> int:
        return self.send_token_idx_S.shape[0]


def send_table(routing: Routing, config: BufferConfig) -> SendTable:
    idx = routing.topk_idx_TK
    T, K = idx.shape
    W, L, N, G = config.world_size, config.experts_per_rank, config.num_nodes, config.ranks_per_node
    device = idx.device
    valid = idx >= 0
    dest_rank_TK = torch.where(valid, idx // L, W)
    dest_mask_TW = torch.zeros(T, W + 1, dtype=torch.bool, device=device)
    dest_mask_TW.scatter_(1, dest_rank_TK, True)
    dest_mask_TW = dest_mask_TW[:, :W]

    # Rows in (rank, token) order: the transposed mask's nonzeros come out sorted that way.
    pairs = dest_mask_TW.t().nonzero()
    send_token_idx = pairs[:, 1]
    send_counts = dest_mask_TW.sum(dim=0, dtype=torch.int64)
    S = send_token_idx.shape[0]
    row_of_TW = torch.full((T, W), -1, dtype=torch.int64, device=device)
    row_of_TW[pairs[:, 1], pairs[:, 0]] = torch.arange(S, device=device)

    route_rank = torch.where(valid, dest_rank_TK, 0)
    route_send_row = torch.where(valid, row_of_TW.gather(1, route_rank), -1)
    route_local = torch.where(valid, idx % L, 0)

    mask_SL = torch.zeros(S, L, dtype=torch.bool, device=device)
    probs_SL = torch.zeros(S, L, dtype=torch.float32, device=device)
    rows = route_send_row[valid]
    cols = route_local[valid]
    mask_SL[rows, cols] = True
    probs_SL[rows, cols] = routing.topk_weights_TK.detach()[valid]

    node_counts = dest_mask_TW.view(T, N, G).any(dim=2).sum(dim=0, dtype=torch.int64)
    return SendTable(send_token_idx, send_counts, node_counts, mask_SL, probs_SL, route_send_row, route_local)


@dataclasses.dataclass(frozen=True)
class ReceiveTable:
    """Where each received row lands in the expert-major output of this rank."""

    out_pos_M: torch.Tensor  # int64 output row of each kept (received row, local expert) entry
    out_src_M: torch.Tensor  # int64 received row of that entry
    out_expert_M: torch.Tensor  # int64 local expert of that entry
    tokens_per_expert_L: torch.Tensor  # int64 output rows per local expert, padding included
    num_rows: int  # R
    num_needed_rows: torch.Tensor  # int64 scalar: rows the full output needs
    num_dropped: torch.Tensor  # int64 scalar: routed entries that did not fit num_out_tokens


def max_output_rows(config: BufferConfig, entries_per_row: int) -> int:
    """Most expert-major rows one rank can receive: every source's tokens, each routed to
    `entries_per_row` of this rank's experts, plus per expert at most min_rows + pad - 1
    rows of padding (roundup(max(n, min_rows), pad) <= n + min_rows + pad - 1)."""
    L = config.experts_per_rank
    real = config.world_size * config.max_tokens_per_rank * entries_per_row
    return real + L * (config.min_rows_per_expert + config.pad_multiple - 1)


def receive_table(
    recv_expert_mask_VL: torch.Tensor,
    pad_multiple: int,
    num_out_tokens: int | None,
    min_rows_per_expert: int = 0,
) -> ReceiveTable:
    """Expert-major order: expert j's rows in received order (source rank, then token), padded.

    Expert j's block has roundup(max(n_j, min_rows_per_expert), pad_multiple) rows; the rows
    past its n_j real ones are zero padding (min_rows_per_expert > 0 keeps grouped GEMMs
    from ever seeing an empty group).
    """
    mask = recv_expert_mask_VL
    device = mask.device
    counts_L = mask.sum(dim=0, dtype=torch.int64)
    padded_L = counts_L.clamp(min=min_rows_per_expert)
    padded_L = (padded_L + pad_multiple - 1) // pad_multiple * pad_multiple
    ends_L = padded_L.cumsum(0)
    starts_L = ends_L - padded_L
    needed = ends_L[-1] if ends_L.numel() else torch.zeros((), dtype=torch.int64, device=device)

    entries = mask.nonzero()
    src, expert = entries[:, 0], entries[:, 1]
    rank_in_expert = mask.to(torch.int64).cumsum(dim=0) - 1
    pos = starts_L[expert] + rank_in_expert[src, expert]

    if num_out_tokens is None:
        num_rows = int(needed)
        tokens_per_expert = padded_L
        dropped = torch.zeros((), dtype=torch.int64, device=device)
    else:
        num_rows = num_out_tokens
        keep = pos < num_rows
        dropped = (~keep).sum()
        src, expert, pos = src[keep], expert[keep], pos[keep]
        tokens_per_expert = ends_L.clamp(max=num_rows) - starts_L.clamp(max=num_rows)
    return ReceiveTable(pos, src, expert, tokens_per_expert, num_rows, needed, dropped)
