"""Expert -> slot routing tables of one MoE layer, and the router-output remap.

A placement gives every layer S slots (S / W per EP rank, S / N per node); an expert may sit
in several slots (replicas). Before dispatch, each routed (token, expert) pair is sent to one
replica, chosen by locality: a route from a rank of node o takes the expert's copies on node
o when it has some (no RDMA: the row stays in the node), else the copies on the expert's
primary node (its home node e // (E / N), where the node-limited router's group sends the
token, when a copy is there; else the node holding most of its copies, the lowest on a tie).
Among the copies chosen, the k-th token of this rank routed to expert e (k counted in token
order) takes copy (k + rank) mod their number: each gets an equal share to within one token
per source rank, and the rank offset spreads the remainders. With one node, or where all of
an expert's copies share a node, this is the spreading rule over all its copies. The choice
depends only on the routing and the rank, so it is deterministic and needs no communication
or host read; the node choice is fixed per (expert, rank) and kept in a table.

The tables live on the device with fixed shapes (`max_replicas` = S - E + 1, the most any
placement can give one expert), so a migration updates them in place and CUDA graphs that
captured them stay valid.

Legend: T tokens, E experts, S slots, N nodes, R max replicas.
"""

from __future__ import annotations

import torch

from ..checks import is_int
from ..routing import check_topk_values
from .placement import primary_nodes


class SlotTable:
    """Device tables of one layer's placement, updated in place by `load_`."""

    def __init__(self, num_experts: int, num_slots: int, device=None):
        if num_slots < num_experts:
            raise ValueError(f"num_slots ({num_slots}) must be >= num_experts ({num_experts})")
        self.num_experts = num_experts
        self.num_slots = num_slots
        self.max_replicas = num_slots - num_experts + 1
        self.slot_to_expert_S = torch.full((num_slots,), -1, dtype=torch.int64, device=device)
        self.replicas_E = torch.ones(num_experts, dtype=torch.int64, device=device)
        self.expert_slots_ER = torch.zeros(num_experts, self.max_replicas, dtype=torch.int64, device=device)
        # set by load_ (host flag, no device read): until then every expert maps to slot 0
        self.installed = False
        self.set_shape(1, 1)

    def set_shape(self, num_ranks: int, num_nodes: int) -> "SlotTable":
        """The EP ranks and nodes the slots are spread over (slot s on rank s // (S / W), node
        s // (S / N)), for the replica choice by locality; before any routing (it allocates the
        per-node tables). One node, the default: every copy is local."""
        if not is_int(num_ranks, 1) or not is_int(num_nodes, 1) or num_ranks % num_nodes or self.num_slots % num_ranks:
            raise ValueError(f"num_ranks ({num_ranks}) must divide the {self.num_slots} slots and be a multiple of "
                             f"num_nodes ({num_nodes}), both >= 1")
        self.num_ranks, self.num_nodes = num_ranks, num_nodes
        device = self.slot_to_expert_S.device
        width = min(self.max_replicas, self.num_slots // num_nodes)  # most copies of one expert on one node
        # per node o of the source rank: the copies a route to each expert picks from, and how many
        self.route_slots_NER = torch.zeros(num_nodes, self.num_experts, width, dtype=torch.int64, device=device)
        self.route_count_NE = torch.ones(num_nodes, self.num_experts, dtype=torch.int64, device=device)
        if self.installed:
            self.load_(self.slot_to_expert_S)
        return self

    @staticmethod
    def tables_for(slot_to_expert_S: torch.Tensor, num_experts: int, max_replicas: int):
        """(replicas [E], expert_slots [E, R]) on the CPU; unused replica columns repeat slot 0."""
        s2e = slot_to_expert_S.detach().to("cpu", torch.int64)
        if s2e.dim() != 1:
            raise ValueError(f"slot_to_expert must be 1-D [slots], got shape {tuple(s2e.shape)}")
        if s2e.numel() and (int(s2e.min()) < 0 or int(s2e.max()) >= num_experts):
            raise ValueError(f"slot_to_expert holds ids outside [0, {num_experts})")
        replicas = torch.bincount(s2e, minlength=num_experts)
        if int(replicas.min()) < 1:
            missing = torch.nonzero(replicas == 0).flatten().tolist()
            raise ValueError(f"slot_to_expert leaves experts {missing[:8]} without a slot")
        if int(replicas.max()) > max_replicas:
            raise ValueError(f"an expert has {int(replicas.max())} replicas, more than {max_replicas}")
        order = torch.argsort(s2e * s2e.numel() + torch.arange(s2e.numel()))  # by expert, then slot
        first = torch.cumsum(replicas, 0) - replicas
        slots = torch.zeros(num_experts, max_replicas, dtype=torch.int64)
        for e in range(num_experts):
            mine = order[first[e] : first[e] + replicas[e]]
            slots[e, : mine.numel()] = mine
            slots[e, mine.numel() :] = mine[0]
        return replicas, slots

    @staticmethod
    def route_tables_for(slot_to_expert_S: torch.Tensor, num_experts: int, num_nodes: int, width: int):
        """(route_slots [N, E, width], route_count [N, E]) on the CPU: for a route from node o to
        expert e, its copies on o if any, else those on its primary node (placement.primary_nodes);
        ascending, unused columns repeat the first."""
        s2e = slot_to_expert_S.detach().to("cpu", torch.int64)
        S, E, N = s2e.numel(), num_experts, num_nodes
        node_S = torch.arange(S) // (S // N)
        group_S = s2e * N + node_S  # (expert, node) of every slot
        count_EN = torch.bincount(group_S, minlength=E * N).reshape(E, N)
        if int(count_EN.max()) > width:
            raise ValueError(f"an expert has {int(count_EN.max())} copies on one node, more than {width}")
        order = torch.argsort(group_S * S + torch.arange(S))  # by expert, node, then slot
        start = torch.cumsum(count_EN.reshape(-1), 0) - count_EN.reshape(-1)
        column = torch.arange(S) - start[group_S[order]]
        first = order[start.clamp(max=S - 1)]  # lowest slot of each (expert, node) group that has one
        slots_ENR = first[:, None].repeat(1, width)  # unused columns repeat it
        slots_ENR[group_S[order], column] = order
        slots_ENR = slots_ENR.reshape(E, N, width)
        pick_NE = torch.where(count_EN.t() > 0, torch.arange(N)[:, None], primary_nodes(count_EN)[None, :])
        expert_NE = torch.arange(E)[None, :].expand(N, E)
        return slots_ENR[expert_NE, pick_NE], count_EN[expert_NE, pick_NE]

    def load_(self, slot_to_expert_S: torch.Tensor) -> "SlotTable":
        """Install a placement row [S] (in place: same storage as before)."""
        replicas, slots = self.tables_for(slot_to_expert_S, self.num_experts, self.max_replicas)
        route_slots, route_count = self.route_tables_for(slot_to_expert_S, self.num_experts, self.num_nodes,
                                                         self.route_slots_NER.shape[2])
        self.slot_to_expert_S.copy_(slot_to_expert_S.to(torch.int64))
        self.replicas_E.copy_(replicas)
        self.expert_slots_ER.copy_(slots)
        self.route_slots_NER.copy_(route_slots)
        self.route_count_NE.copy_(route_count)
        self.installed = True
        return self

    def node_of_rank(self, rank: int) -> int:
        """Node of EP rank `rank` (a host integer: the layout is set on the host); 0 on one node."""
        if self.num_nodes == 1:
            return 0
        if not is_int(rank, 0) or rank >= self.num_ranks:
            raise ValueError(f"rank must be in [0, {self.num_ranks}) (the EP ranks of set_shape), got {rank!r}")
        return rank // (self.num_ranks // self.num_nodes)

    def check_installed(self) -> None:
        """Refuse routing through a table no placement was loaded into."""
        if not self.installed:
            raise RuntimeError(
                "this MoE layer's expert slots have no placement yet, so every route would go to slot 0: "
                "the expert balancer installs one in megatron_patches.balancer.attach(model, optimizer) "
                "(Megatron-LM's training hook calls it after setup_model_and_optimizer), or a checkpoint "
                "saved with the balancer brings one; run the forward after either"
            )


def route_to_slots(routing_map_TE: torch.Tensor, probs_TE: torch.Tensor, table: SlotTable, rank: int):
    """Router output over experts -> over slots: (routing_map [T, S] bool, probs [T, S]).

    `rank`: the EP rank routing (its node picks the copies, module docstring). Differentiable
    in probs (each slot column receives at most one expert's prob).
    """
    table.check_installed()
    T, E = routing_map_TE.shape
    if E != table.num_experts:
        raise ValueError(f"routing_map has {E} expert columns, the slot table {table.num_experts}")
    S = table.num_slots
    node = table.node_of_rank(rank)
    routed_TE = routing_map_TE.to(torch.int64)
    ordinal_TE = torch.cumsum(routed_TE, dim=0) - routed_TE
    replica_TE = torch.remainder(ordinal_TE + rank, table.route_count_NE[node])
    expert_TE = torch.arange(E, device=routing_map_TE.device).expand(T, E)
    slot_TE = table.route_slots_NER[node][expert_TE, replica_TE]
    slot_TE = torch.where(routing_map_TE, slot_TE, torch.full_like(slot_TE, S))  # column S: discarded
    map_TS = torch.zeros(T, S + 1, dtype=torch.bool, device=routing_map_TE.device)
    map_TS = map_TS.scatter(1, slot_TE, routing_map_TE)[:, :S]
    kept_TE = torch.where(routing_map_TE, probs_TE, torch.zeros_like(probs_TE))
    probs_TS = torch.zeros(T, S + 1, dtype=probs_TE.dtype, device=probs_TE.device)
    probs_TS = probs_TS.scatter(1, slot_TE, kept_TE)[:, :S]
    return map_TS, probs_TS


def route_topk_to_slots(topk_idx_TK: torch.Tensor, table: SlotTable, rank: int) -> torch.Tensor:
    """topk expert ids [T, K] (-1: dropped) -> slot ids [T, K] (-1 kept), same replica choice.
    The ids are checked first (routing.check_topk_values, host reads)."""
    table.check_installed()
    if topk_idx_TK.dim() != 2:
        raise ValueError(f"topk_idx must be 2-D [tokens, k], got shape {tuple(topk_idx_TK.shape)}")
    check_topk_values(topk_idx_TK.to(torch.int64), table.num_experts)
    T, K = topk_idx_TK.shape
    E = table.num_experts
    valid = topk_idx_TK >= 0
    expert = torch.where(valid, topk_idx_TK, torch.zeros_like(topk_idx_TK)).to(torch.int64)
    # Token order first, then k: the ordinal of (t, k) among routes to its expert, from a sort of
    # (expert, position) (dropped routes in a group of their own, E)
    group = torch.where(valid, expert, E).reshape(-1)
    n = group.numel()
    order = torch.argsort(group * n + torch.arange(n, device=group.device))
    size = torch.bincount(group, minlength=E + 1)
    start = torch.cumsum(size, 0) - size
    ordinal = torch.empty_like(group)
    ordinal[order] = torch.arange(n, device=group.device) - start[group[order]]
    ordinal = ordinal.reshape(T, K)
    node = table.node_of_rank(rank)
    replica = torch.remainder(ordinal + rank, table.route_count_NE[node][expert])
    slot = table.route_slots_NER[node][expert, replica]
    return torch.where(valid, slot, torch.full_like(slot, -1))
