"""Row tables of the reference backend that never read a device value on the host.

Sizes come from the caller: the counts that the routing's one exchange brought to the host,
or, with a static output size, the buffer's max_tokens_per_rank and num_out_tokens. On a GPU
every function here only queues kernels, so the table of a routing is built while its counts
are still on their way (and with a static size nothing waits at all).

Two orders of send rows (one row per (token, destination rank)):
- exact: rank-major, then token, packed (what the counts say), at most T x min(K, W) rows;
- static: rank d's block has rows_per_rank rows, row d * rows_per_rank + t for token t, so
  every rank sends and receives the same number of rows whatever the routing.
A dummy index past the end (num_rows_max for rows, T for tokens, V for received rows) stands
for "none" wherever a fixed-size tensor has fewer real entries than places.

Legend: T tokens, K routes per token, E experts, W ranks, N nodes, G ranks per node,
L = E / W local experts, S send rows, V received rows, R output rows.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import BufferConfig
from ..routing import Routing


@dataclasses.dataclass(frozen=True)
class ReferenceSendTable:
    """Where this rank's routed tokens go: one row per (token, destination rank)."""

    rows_per_rank: int | None  # static: rows of every rank's block; None: exact counts
    num_rows_max: int  # send rows the table can hold (the dummy row index)
    send_counts_W: torch.Tensor  # int64 real rows to each rank
    node_counts_N: torch.Tensor  # int64 tokens that reach each node (one RDMA row per node)
    expert_counts_E: torch.Tensor  # int64 routes to each expert
    route_row_TK: torch.Tensor  # int64 send row of each route, num_rows_max where not routed
    route_local_TK: torch.Tensor  # int64 local expert of each route at its destination (0 where not routed)
    route_weight_TK: torch.Tensor  # float32 routing weight of each route, 0 where not routed
    token_of_row: torch.Tensor  # [num_rows_max + 1] int64 token of each send row, T where none
    block_rows_W: tuple[int, ...] = ()  # rows of each rank's block on the host, once known
    memo: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)  # indices derived per call kind

    @property
    def num_tokens(self) -> int:
        return self.route_row_TK.shape[0]


def send_table(routing: Routing, config: BufferConfig, rows_per_rank: int | None = None) -> ReferenceSendTable:
    """The send rows of a routing, exact (rows_per_rank None) or in fixed blocks per rank."""
    idx = routing.topk_idx_TK
    T, K = idx.shape
    W, L, N, G, E = (config.world_size, config.experts_per_rank, config.num_nodes, config.ranks_per_node,
                     config.num_experts)
    device = idx.device
    valid = idx >= 0
    rank_TK = torch.where(valid, idx // L, W)
    mask_TW = torch.zeros(T, W + 1, dtype=torch.bool, device=device).scatter_(1, rank_TK, True)[:, :W]
    send_counts = mask_TW.sum(dim=0, dtype=torch.int64)
    node_counts = mask_TW.view(T, N, G).any(dim=2).sum(dim=0, dtype=torch.int64)
    expert_counts = torch.zeros(E + 1, dtype=torch.int64, device=device)
    expert_counts.index_add_(0, torch.where(valid, idx, E).reshape(-1),
                             torch.ones(T * K, dtype=torch.int64, device=device))
    if rows_per_rank is None:
        num_rows_max = T * min(K, W)
        row_WT = mask_TW.t().reshape(-1).cumsum(0).view(W, T) - 1  # rank-major, then token
    else:
        num_rows_max = W * rows_per_rank
        row_WT = (torch.arange(W, device=device)[:, None] * rows_per_rank
                  + torch.arange(T, device=device)[None, :])
    row_TW = torch.where(mask_TW, row_WT.t(), num_rows_max)
    route_row = torch.where(valid, row_TW.gather(1, rank_TK.clamp(max=W - 1)), num_rows_max)
    flat = row_TW.reshape(-1)
    token_of_row = torch.full((num_rows_max + 1,), T, dtype=torch.int64, device=device)
    token_of_row.scatter_(0, flat, torch.arange(T, device=device)[:, None].expand(T, W).reshape(-1))
    # The dummy row took the last of the tokens sent nowhere. fill_, not token_of_row[num_rows_max] = T:
    # on a GPU that copies the number from a CPU tensor to the device (a host sync).
    token_of_row[num_rows_max].fill_(T)
    return ReferenceSendTable(
        rows_per_rank, num_rows_max, send_counts, node_counts, expert_counts[:E], route_row,
        torch.where(valid, idx % L, 0), routing.topk_weights_TK.detach().float(), token_of_row,
    )


def assert_routing_on_device(routing: Routing, num_experts: int) -> None:
    """The rule of routing.check_topk_values (expert ids in [-1, E), no token routed to one expert
    twice), checked by the device without a host read: a broken rule stops the process with a
    device-side assert (on a GPU the error surfaces at a later CUDA call)."""
    idx = routing.topk_idx_TK
    in_range = ((idx >= -1) & (idx < num_experts)).all()
    srt = idx.sort(dim=1).values
    twice = ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any()
    torch._assert_async(in_range & ~twice, f"hybrid_ep: topk_idx must hold expert ids in [-1, {num_experts - 1}] "
                                          "and route no token to one expert twice")


def routes_per_row(table: ReferenceSendTable, num_local: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_rows_max + 1, L] float32 routing weights and uint8 marks of each send row's local
    experts at its destination (the dummy row collects the unused routes)."""
    rows = table.num_rows_max + 1
    device = table.route_row_TK.device
    probs_SL = torch.zeros(rows, num_local, dtype=torch.float32, device=device)
    mask_SL = torch.zeros(rows, num_local, dtype=torch.uint8, device=device)
    where = (table.route_row_TK.reshape(-1), table.route_local_TK.reshape(-1))
    probs_SL.index_put_(where, table.route_weight_TK.reshape(-1))
    mask_SL.index_put_(where, torch.ones((), dtype=torch.uint8, device=device))
    return probs_SL, mask_SL


def padded_rows(counts_L: torch.Tensor, pad_multiple: int, min_rows_per_expert: int) -> torch.Tensor:
    """Rows of each local expert's block: roundup(max(n, min_rows_per_expert), pad_multiple)."""
    rows = counts_L.clamp(min=min_rows_per_expert)
    return (rows + pad_multiple - 1) // pad_multiple * pad_multiple


def padded_row_count(count: int, pad_multiple: int, min_rows_per_expert: int) -> int:
    """padded_rows of one expert's count, on the host."""
    rows = max(count, min_rows_per_expert)
    return (rows + pad_multiple - 1) // pad_multiple * pad_multiple


@dataclasses.dataclass(frozen=True)
class ReferenceReceiveTable:
    """Where each received row lands in the expert-major output of this rank. Field names
    beside the output's follow routing.ReceiveTable (what handles expose)."""

    src_of_row_R: torch.Tensor  # int64 received row of each output row, V for padding and unused rows
    expert_of_row_R: torch.Tensor  # int64 local expert of each output row
    tokens_per_expert_L: torch.Tensor  # int64 output rows per local expert, padding included
    num_rows: int  # R
    num_recv_rows: int  # V
    num_needed_rows: torch.Tensor  # int64 scalar: rows the unclipped output needs
    num_dropped: torch.Tensor  # int64 scalar: routed entries that did not fit num_out_tokens
    block_rows_W: tuple[int, ...] = ()  # rows of each source rank's block (its real rows; static: rows_per_rank)
    memo: dict = dataclasses.field(default_factory=dict, repr=False, compare=False)  # indices derived per call kind


def receive_table(mask_VL: torch.Tensor, num_rows: int, pad_multiple: int, min_rows_per_expert: int,
                  block_rows_W: tuple[int, ...]) -> ReferenceReceiveTable:
    """The expert-major order of R = num_rows output rows: expert j's rows in received order (source
    rank, then token), then zero padding; entries past R are dropped and counted."""
    V, L = mask_VL.shape
    device = mask_VL.device
    mask = mask_VL if mask_VL.dtype == torch.bool else mask_VL.bool()
    block_L = padded_rows(mask.sum(dim=0, dtype=torch.int64), pad_multiple, min_rows_per_expert)
    ends_L = block_L.cumsum(0)
    starts_L = ends_L - block_L
    pos_VL = starts_L + mask.cumsum(dim=0) - 1  # a bool cumsum counts in int64
    keep = mask & (pos_VL < num_rows)
    target = torch.where(keep, pos_VL, num_rows).reshape(-1)
    src_of_row = torch.full((num_rows + 1,), V, dtype=torch.int64, device=device)
    src_of_row.scatter_(0, target, torch.arange(V, device=device)[:, None].expand(V, L).reshape(-1))
    expert_of_row = torch.zeros(num_rows + 1, dtype=torch.int64, device=device)
    expert_of_row.scatter_(0, target, torch.arange(L, device=device)[None, :].expand(V, L).reshape(-1))
    needed = ends_L[-1] if L else torch.zeros((), dtype=torch.int64, device=device)
    return ReferenceReceiveTable(
        src_of_row[:num_rows], expert_of_row[:num_rows], ends_L.clamp(max=num_rows) - starts_L.clamp(max=num_rows),
        num_rows, V, needed, (mask & ~keep).sum(), tuple(block_rows_W),
    )
