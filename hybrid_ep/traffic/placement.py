"""Traffic of a routing through an expert placement: what the balancer's slots change on the links.

A placement (hybrid_ep.balancer) puts S slots on W ranks, slot s on rank s // (S / W); the
router's expert ids become slot ids by the balancer's replica choice (the spreading rule, or
the choice by locality: hybrid_ep.balancer.slots), and the traffic model counts those rows
as it counts experts (a slot is an expert of its rank). So RDMA and NVLink bytes per token
come out for the default placement and for any plan, on any routing.

Legend: T tokens, K routes per token, E experts, S slots, W ranks, N nodes.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import BufferConfig
from ..synthetic import sample_topk
from .summary import summarize

ROUTINGS = ("group-limited", "top-k")


def slot_routings(topk_idx_per_rank: list[torch.Tensor], slot_to_expert_S, num_ranks: int, num_nodes: int,
                  locality: bool = True) -> list[torch.Tensor]:
    """[T, K] slot ids per rank (-1 kept) of [T, K] expert ids per rank (rank r = entry r):
    the replica choice by locality over num_nodes nodes, or with locality=False the spreading
    rule over every copy (hybrid_ep.balancer.slots)."""
    from ..balancer.slots import SlotTable, route_topk_to_slots

    row = torch.as_tensor(slot_to_expert_S, dtype=torch.int64)
    if row.dim() != 1:
        raise ValueError(f"slot_to_expert must be one layer's row [slots], got shape {tuple(row.shape)}")
    if len(topk_idx_per_rank) != num_ranks:
        raise ValueError(f"topk_idx_per_rank has {len(topk_idx_per_rank)} entries, expected num_ranks={num_ranks}")
    num_experts = int(row.max()) + 1 if row.numel() else 0
    table = SlotTable(num_experts, row.numel()).set_shape(num_ranks, num_nodes if locality else 1).load_(row)
    return [route_topk_to_slots(idx.to(torch.int64), table, rank=r) for r, idx in enumerate(topk_idx_per_rank)]


@dataclasses.dataclass(frozen=True)
class PlacementShape:
    """Where the slots of a placement live: W ranks, G per node, S slots (slot s on rank s // (S / W))."""

    num_ranks: int
    ranks_per_node: int
    num_slots: int
    hidden: int

    def buffer_config(self, max_tokens: int) -> BufferConfig:
        """The traffic model's config with one 'expert' per slot."""
        return BufferConfig(hidden_dim=self.hidden, max_tokens_per_rank=max(max_tokens, 1),
                            num_experts=self.num_slots, world_size=self.num_ranks,
                            ranks_per_node=self.ranks_per_node).validate()


def placement_traffic(topk_idx_per_rank: list[torch.Tensor], slot_to_expert_S, shape: PlacementShape,
                      dispatch_dtype: torch.dtype = torch.bfloat16, combine_dtype: torch.dtype = torch.bfloat16,
                      locality: bool = True) -> dict:
    """hybrid_ep.traffic.cli.summarize of the routing through the placement row, plus
    `tokens_per_rank_routed`: routes each rank receives (the load the balancer evens out)."""
    nodes = shape.num_ranks // shape.ranks_per_node
    slots = slot_routings(topk_idx_per_rank, slot_to_expert_S, shape.num_ranks, nodes, locality)
    config = shape.buffer_config(max(int(s.shape[0]) for s in slots))
    report = summarize(slots, config, dispatch_dtype, combine_dtype,
                       tables=destination_counts(slots, shape.num_slots, shape.num_ranks, shape.ranks_per_node))
    per_rank = shape.num_slots // shape.num_ranks
    routed = torch.cat([s.reshape(-1) for s in slots])
    routed = routed[routed >= 0]
    report["routes_per_rank"] = torch.bincount(routed // per_rank, minlength=shape.num_ranks).tolist()
    return report


def destination_counts(idx_per_rank: list[torch.Tensor], num_experts: int, num_ranks: int,
                       ranks_per_node: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(count_WW, node_counts_WN) of model.count_tables, counted straight from the ids (expert x
    on rank x // (num_experts / W)): tokens of each source rank with a route to each rank and
    to each node. count_tables builds every rank's whole send table to get them, which at
    64 ranks of thousands of tokens takes seconds per routing."""
    W, N = num_ranks, num_ranks // ranks_per_node
    per_rank = num_experts // W
    rows, nodes = [], []
    for idx in idx_per_rank:
        idx = idx.to(torch.int64)
        valid = idx >= 0
        rank_TK = torch.where(valid, idx // per_rank, W)  # W: a dropped route's own column
        hit = torch.zeros(idx.shape[0], W + 1, dtype=torch.bool).scatter_(1, rank_TK, True)[:, :W]
        rows.append(hit.sum(0))
        nodes.append(hit.view(-1, N, ranks_per_node).any(2).sum(0))
    return torch.stack(rows).to(torch.int64), torch.stack(nodes).to(torch.int64)


def routing_from_load(load_E, num_ranks: int, tokens_per_rank: int, topk: int, seed: int, routing: str = "top-k",
                      num_groups: int | None = None, group_limit: int | None = None) -> list[torch.Tensor]:
    """[T, K] expert ids per rank drawn with the popularity of a layer's tokens per expert
    (a statistics file's load): Gumbel top-K, and with routing "group-limited" DeepSeek-V3's
    node-limited routing (num_groups contiguous groups, a token's routes in its group_limit
    best ones; hybrid_ep.synthetic.sample_topk). Experts without tokens are never drawn."""
    if routing not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")
    p = torch.as_tensor(load_E, dtype=torch.float64)
    if p.dim() != 1 or not bool((p >= 0).all()) or float(p.sum()) <= 0:
        raise ValueError("load must be [experts], non-negative, with tokens")
    groups = dict(num_groups=num_groups, topk_groups=group_limit) if routing == "group-limited" else {}
    gen = torch.Generator().manual_seed(seed)
    popularity = (p / p.sum()).clamp(min=1e-300)  # log(0) would make the Gumbel scores -inf ties
    return [sample_topk(tokens_per_rank, p.numel(), topk, gen, popularity=popularity, **groups)
            for _ in range(num_ranks)]
