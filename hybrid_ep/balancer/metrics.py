"""Balance metrics of a placement: tokens per rank and per slot, imbalance, a summary.

Imbalance = (max - mean) / mean (docs/balancer.md): the slowest rank sets the step time,
so this is the fraction of time the others wait. A replicated expert's tokens split evenly
over its replicas; with the replica choice by locality over N nodes (`nodes=N`, slots.py),
each node's share of an expert's tokens (1 / N of them: every node's ranks send alike)
stays on that node's copies, and the primary node's copies also take the shares of the
nodes without one. Loads may be [L, E] or [E] (one layer), torch or numpy, int or float.
Legend: L layers, E experts, S slots, W ranks, N nodes.
"""

from __future__ import annotations

import numpy as np
import torch

from ..checks import is_int
from .placement import Placement, primary_nodes

# Per-layer entries of a summary, in table order.
SUMMARY_KEYS = ("imbalance_rank_before", "imbalance_rank_after", "imbalance_slot_before",
                "imbalance_slot_after", "std_rank_before", "std_rank_after", "std_slot_before",
                "std_slot_after", "moves")
# Units of a summary's fields (the metadata block of the balancer's JSON files).
SUMMARY_UNITS = {
    "imbalance_rank_before": "(max - mean) / mean of tokens per rank, per layer; 0 = even",
    "imbalance_rank_after": "(max - mean) / mean of tokens per rank, per layer; 0 = even",
    "imbalance_slot_before": "(max - mean) / mean of tokens per slot, per layer; 0 = even",
    "imbalance_slot_after": "(max - mean) / mean of tokens per slot, per layer; 0 = even",
    "std_rank_before": "tokens", "std_rank_after": "tokens", "std_slot_before": "tokens", "std_slot_after": "tokens",
    "moves": "slots whose expert changed, per layer", "total_tokens": "tokens routed per layer",
}
SUMMARY_CONFIG_KEYS = ("num_layers", "num_experts", "num_slots", "num_ranks", "num_nodes")


def imbalance_ratio(x, dim: int = -1):
    """(max - mean) / mean along dim, 0 where the mean is 0; torch in, torch out (else numpy)."""
    if isinstance(x, torch.Tensor):
        x = x.to(torch.float64)
        mean = x.mean(dim=dim)
        out = (x.amax(dim=dim) - mean) / torch.where(mean == 0, 1.0, mean)
        return torch.where(mean == 0, 0.0, out)
    x = np.asarray(x, dtype=np.float64)
    mean = x.mean(axis=dim)
    return np.where(mean == 0, 0.0, (x.max(axis=dim) - mean) / np.where(mean == 0, 1.0, mean))


def _load_LE(load) -> torch.Tensor:
    t = load.detach().cpu() if isinstance(load, torch.Tensor) else torch.as_tensor(np.asarray(load))
    t = t.to(torch.float64)
    return t[None, :] if t.dim() == 1 else t


def _s2e_LS(slot_to_expert) -> torch.Tensor:
    if isinstance(slot_to_expert, Placement):
        slot_to_expert = slot_to_expert.slot_to_expert
    t = torch.as_tensor(np.asarray(slot_to_expert)) if not isinstance(slot_to_expert, torch.Tensor) \
        else slot_to_expert
    t = t.to(torch.int64)
    return t[None, :] if t.dim() == 1 else t


def slot_loads(load, slot_to_expert, *, nodes: int = 1) -> torch.Tensor:
    """[L, S] float64 tokens of each slot. nodes=1: load[e] / replicas(e) of its expert e (the
    spreading rule); nodes=N: the replica choice by locality over N nodes of S / N slots
    (module docstring), which is the same wherever all of an expert's copies share a node.

    slot_to_expert [L, S] (or a Placement) may have one layer and broadcast over load's.
    """
    load_LE, s2e = _load_LE(load), _s2e_LS(slot_to_expert)
    if s2e.shape[0] == 1 and load_LE.shape[0] > 1:
        s2e = s2e.expand(load_LE.shape[0], -1)
    if s2e.shape[0] != load_LE.shape[0]:
        raise ValueError(f"slot_to_expert has {s2e.shape[0]} layers, load has {load_LE.shape[0]}")
    if s2e.numel() and int(s2e.max()) >= load_LE.shape[1]:
        raise ValueError(f"slot_to_expert holds expert {int(s2e.max())}, load has {load_LE.shape[1]} experts")
    L, S = s2e.shape
    E = load_LE.shape[1]
    if not is_int(nodes, 1) or S % nodes or E % nodes:
        raise ValueError(f"nodes must be a positive integer dividing the {S} slots and {E} experts, got {nodes!r}")
    if nodes == 1:
        reps = torch.zeros_like(load_LE).scatter_add_(1, s2e, torch.ones_like(s2e, dtype=torch.float64))
        return torch.gather(load_LE / reps.clamp(min=1), 1, s2e)
    group = s2e * nodes + (torch.arange(S) // (S // nodes)).expand(L, S)  # (expert, node) of each slot
    count_LEN = _copies_LEN(s2e, E, nodes)
    held_LE = (count_LEN > 0).sum(-1)
    primary_LE = torch.stack([primary_nodes(c) for c in count_LEN]) if L else torch.zeros(0, E, dtype=torch.int64)
    count_LEN = count_LEN.to(torch.float64)
    share_LEN = torch.where(count_LEN > 0, load_LE[..., None] / nodes, 0.0)
    share_LEN.scatter_add_(2, primary_LE[..., None], (load_LE * (nodes - held_LE) / nodes)[..., None])
    per_copy = (share_LEN / count_LEN.clamp(min=1)).view(L, E * nodes)
    return torch.gather(per_copy, 1, group)


def rank_loads(load, slot_to_expert, num_ranks: int, *, nodes: int = 1) -> torch.Tensor:
    """[L, W] float64 tokens of each rank: the sum over its S / W slots of slot_loads (nodes: as there)."""
    s = slot_loads(load, slot_to_expert, nodes=nodes)
    if s.shape[1] % num_ranks != 0:
        raise ValueError(f"num_ranks ({num_ranks}) must divide the number of slots ({s.shape[1]})")
    return s.view(s.shape[0], num_ranks, s.shape[1] // num_ranks).sum(-1)  # no -1: L may be 0


def _copies_LEN(s2e: torch.Tensor, E: int, nodes: int) -> torch.Tensor:
    """[L, E, N] copies of each expert on each node (node n: slots n S/N .. (n+1) S/N - 1)."""
    L, S = s2e.shape
    group = s2e * nodes + (torch.arange(S) // (S // nodes)).expand(L, S)
    return torch.zeros(L, E * nodes, dtype=torch.int64).scatter_add_(1, group, torch.ones_like(group)).view(L, E, nodes)


def off_home(load, slot_to_expert, nodes: int) -> torch.Tensor:
    """[L, E] float64 routes of each expert that the replica choice by locality serves on a node
    other than its home node e // (E / N) and other than their own: those of the nodes without
    a copy, where its primary node is not its home. Node-limited routing (groups = nodes)
    sends a token only to its groups' home nodes, so these are the routes that may reach a
    node beyond the token's limit, each at most one RDMA row (the planner's cost, rdma_weight)."""
    load_LE, s2e = _load_LE(load), _s2e_LS(slot_to_expert)
    if s2e.shape[0] == 1 and load_LE.shape[0] > 1:
        s2e = s2e.expand(load_LE.shape[0], -1)
    L, E = load_LE.shape
    if not is_int(nodes, 1) or s2e.shape[1] % nodes or E % nodes:
        raise ValueError(f"nodes must be a positive integer dividing the slots and experts, got {nodes!r}")
    count = _copies_LEN(s2e, E, nodes)
    primary = torch.stack([primary_nodes(c) for c in count]) if L else torch.zeros(0, E, dtype=torch.int64)
    away = primary != (torch.arange(E) // (E // nodes))[None, :]
    return torch.where(away, load_LE * (nodes - (count > 0).sum(-1)) / nodes, 0.0)


def default_rank_loads(load, num_ranks: int) -> torch.Tensor:
    """[L, W] float64 tokens per rank without balancing: expert e on rank e // (E / W)."""
    load_LE = _load_LE(load)
    if load_LE.shape[1] % num_ranks != 0:
        raise ValueError(f"num_ranks ({num_ranks}) must divide the number of experts ({load_LE.shape[1]})")
    return load_LE.view(load_LE.shape[0], num_ranks, -1).sum(-1)


def summarize(load, placement_before: Placement | None, placement_after: Placement, *, nodes: int = 1) -> dict:
    """Per-layer balance before and after, as plain lists (JSON-ready), plus the sizes.

    placement_before None means the identity placement of the same shape (what a run starts
    with, Placement.identity; without spare slots that is the default placement). nodes: the
    nodes the replica choice spreads by locality over (slot_loads; 1: the spreading rule).
    """
    after = placement_after
    before = placement_before if placement_before is not None else Placement.identity(
        after.num_layers, after.num_experts, after.num_slots, after.num_ranks, after.num_nodes)
    out: dict = {"num_layers": after.num_layers, "num_experts": after.num_experts,
                 "num_slots": after.num_slots, "num_ranks": after.num_ranks, "num_nodes": after.num_nodes,
                 "total_tokens": _load_LE(load).sum(1).tolist()}
    for name, p in (("before", before), ("after", after)):
        ranks, slots = rank_loads(load, p, p.num_ranks, nodes=nodes), slot_loads(load, p, nodes=nodes)
        out[f"imbalance_rank_{name}"] = imbalance_ratio(ranks).tolist()
        out[f"imbalance_slot_{name}"] = imbalance_ratio(slots).tolist()
        out[f"std_rank_{name}"] = ranks.std(dim=1, unbiased=False).tolist()
        out[f"std_slot_{name}"] = slots.std(dim=1, unbiased=False).tolist()
    out["moves"] = after.moves(before).tolist()
    return out


def scalars(summary: dict, prefix: str = "balancer", layer_numbers=None) -> dict[str, float]:
    """Flat {name: value} for TensorBoard / wandb: every per-layer entry, mean and max over layers.

    Names: f"{prefix}/layer_{n}/{key}", f"{prefix}/mean/{key}", f"{prefix}/max/{key}" and
    f"{prefix}/total/moves", where n is the layer's entry of layer_numbers (the model's layer
    numbers, so runs split over pipeline stages name each layer alike), else its index.
    """
    out: dict[str, float] = {}
    for key in SUMMARY_KEYS:
        values = [float(v) for v in summary.get(key, [])]
        if not values:
            continue
        numbers = range(len(values)) if layer_numbers is None else list(layer_numbers)
        if len(numbers) != len(values):
            raise ValueError(f"layer_numbers has {len(numbers)} entries for {len(values)} layers")
        for n, v in zip(numbers, values):
            out[f"{prefix}/layer_{int(n)}/{key}"] = v
        out[f"{prefix}/mean/{key}"] = sum(values) / len(values)
        out[f"{prefix}/max/{key}"] = max(values)
    if summary.get("moves"):
        out[f"{prefix}/total/moves"] = float(sum(summary["moves"]))
    return out
