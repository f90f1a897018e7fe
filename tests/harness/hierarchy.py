"""The forwarding arithmetic of a hierarchical dispatch, computed on the CPU for every rank at
once, so kernel tests can check what each rail peer stages and forwards (docs/traffic.md,
"The forward plan").

W = N nodes x G ranks; rank r = (node r // G, local r % G). Source s sends each token whose
routes reach a remote node n once, to its rail peer f = n * G + s % G. In f's staging area
for source node node(s), chunk c of s (chunk_tokens consecutive tokens) occupies slots
c * chunk_tokens + q, q the token's ordinal among the chunk's tokens for node n. f forwards
the row to every rank d of its node the token is routed to, into d's receive slot for s: the
token's ordinal among the tokens s sends to d (the single-node receive order).

Legend: T tokens of a source, N nodes, G ranks per node, C chunks per source
(ceil(max_tokens_per_rank / chunk_tokens), at least 1), Q = C x chunk_tokens staging slots.
"""

from __future__ import annotations

import dataclasses

import torch

from hybrid_ep.checks import require_int
from hybrid_ep.config import BufferConfig
from hybrid_ep.routing import SendTable, normalize_routing, send_table


@dataclasses.dataclass(frozen=True)
class ForwarderPlan:
    """What rank f receives by RDMA and forwards over NVLink, per source node sn (the rail
    peer of f there, s = sn * G + f % G, is the source). Rows of f's own node stay empty."""

    rank: int
    staged_rows: torch.Tensor  # int32 [N, C]: tokens of chunk c of s that reach f's node
    staged_token: torch.Tensor  # int32 [N, Q]: token of s in each staging slot, -1 if unused
    fwd_slots: torch.Tensor  # int32 [N, Q, G]: receive slot at rank node(f) * G + g, -1 if not routed there


@dataclasses.dataclass(frozen=True)
class ForwardPlan:
    chunk_tokens: int
    num_chunks: int  # C
    forwarders: list[ForwarderPlan]  # one per rank
    node_slot: list[torch.Tensor]  # per source: int32 [T, N] staging slot at node n's forwarder, -1 if none
    send_ord: list[torch.Tensor]  # per source: int64 [T, W] ordinal among the rows sent to d (its slot), -1: none


def send_ords(table: SendTable, world_size: int) -> torch.Tensor:
    """int64 [T, W]: the ordinal of token t among the rows the source sends to rank d, -1 if
    none: the table's rows are in (rank, token) order, so a row's ordinal is its index minus the
    first row of its rank."""
    rows = table.send_token_idx_S
    dest = torch.repeat_interleave(torch.arange(world_size, device=rows.device), table.send_counts_W)
    first = table.send_counts_W.cumsum(0) - table.send_counts_W
    num_tokens = table.route_send_row_TK.shape[0]
    slots = torch.full((num_tokens, world_size), -1, dtype=torch.int64, device=rows.device)
    slots[rows, dest] = torch.arange(rows.shape[0], device=rows.device) - first[dest]
    return slots


def _check_args(topk_idx_per_rank, config: BufferConfig, chunk_tokens) -> None:
    require_int("chunk_tokens", chunk_tokens, 1)
    if len(topk_idx_per_rank) != config.world_size:
        raise ValueError(f"topk_idx_per_rank has {len(topk_idx_per_rank)} entries, expected world_size="
                         f"{config.world_size}")
    for s, idx in enumerate(topk_idx_per_rank):
        if idx.dim() == 2 and idx.shape[0] > config.max_tokens_per_rank:
            raise ValueError(f"topk_idx_per_rank[{s}] has {idx.shape[0]} tokens, more than "
                             f"max_tokens_per_rank={config.max_tokens_per_rank}")


def _staging_slots(to_node_TN: torch.Tensor, num_chunks: int, chunk_tokens: int) -> torch.Tensor:
    """int64 [T, N]: c * chunk_tokens + (ordinal of t among chunk c's tokens for node n), -1 if
    the token does not go to node n."""
    T, N = to_node_TN.shape
    padded = torch.zeros(num_chunks * chunk_tokens, N, dtype=torch.int64)
    padded[:T] = to_node_TN.to(torch.int64)
    ordinal = padded.view(num_chunks, chunk_tokens, N).cumsum(dim=1).view(-1, N)[:T] - 1
    chunk_start = (torch.arange(T) // chunk_tokens * chunk_tokens)[:, None]
    return torch.where(to_node_TN, chunk_start + ordinal, -1)


def forward_plan(topk_idx_per_rank: list[torch.Tensor], config: BufferConfig, chunk_tokens: int = 32) -> ForwardPlan:
    """The forward plan of one dispatch with these routings (topk_idx of every rank, -1 =
    not routed); on the CPU."""
    _check_args(topk_idx_per_rank, config, chunk_tokens)
    W, N, G, E = config.world_size, config.num_nodes, config.ranks_per_node, config.num_experts
    C = max(1, -(-config.max_tokens_per_rank // chunk_tokens))
    Q = C * chunk_tokens
    staged_rows = torch.zeros(W, N, C, dtype=torch.int32)
    staged_token = torch.full((W, N, Q), -1, dtype=torch.int32)
    fwd_slots = torch.full((W, N, Q, G), -1, dtype=torch.int32)
    node_slots, all_send_ords = [], []
    for s, idx in enumerate(topk_idx_per_rank):
        idx = idx.cpu()
        routing = normalize_routing(idx.shape[0], E, idx.device, topk_idx=idx)
        send_ord = send_ords(send_table(routing, config), W)
        to_node = (send_ord >= 0).view(-1, N, G).any(dim=2)
        to_node[:, config.node_of(s)] = False  # the source's own node is reached over NVLink directly
        slot_TN = _staging_slots(to_node, C, chunk_tokens)
        for n in range(N):
            tokens = to_node[:, n].nonzero()[:, 0]
            if tokens.numel() == 0:
                continue
            f, sn, slots = n * G + s % G, config.node_of(s), slot_TN[tokens, n]
            staged_rows[f, sn] = torch.bincount(tokens // chunk_tokens, minlength=C).to(torch.int32)
            staged_token[f, sn, slots] = tokens.to(torch.int32)
            fwd_slots[f, sn, slots] = send_ord[tokens, n * G:(n + 1) * G].to(torch.int32)
        node_slots.append(slot_TN.to(torch.int32))
        all_send_ords.append(send_ord)
    forwarders = [ForwarderPlan(f, staged_rows[f], staged_token[f], fwd_slots[f]) for f in range(W)]
    return ForwardPlan(chunk_tokens, C, forwarders, node_slots, all_send_ords)


def forwarded_rows(plan: ForwardPlan, config: BufferConfig) -> torch.Tensor:
    """int64 [W]: NVLink rows each rank sends as a forwarder (to ranks of its node other
    than itself), the traffic model's forwarding term."""
    G = config.ranks_per_node
    out = torch.zeros(config.world_size, dtype=torch.int64)
    for fp in plan.forwarders:
        to_others = (fp.fwd_slots >= 0).clone()
        to_others[:, :, fp.rank % G] = False
        out[fp.rank] = int(to_others.sum())
    return out
