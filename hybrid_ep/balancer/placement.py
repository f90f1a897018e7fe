"""Placement: which expert every slot of every layer holds (the planner's result, the balancer's state).

Its own module so that the planner (which makes placements) and the metrics (which measure
them) both import it without importing each other.
Legend: L layers, E experts, S slots, W ranks, N nodes, P = S / W slots per rank, R most
replicas of one expert.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from ..checks import is_int


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Expert held by every slot of every layer; rank r owns slots r*P .. (r+1)*P - 1."""

    slot_to_expert: torch.Tensor  # [L, S] int64
    num_ranks: int  # W, the EP size
    num_nodes: int
    num_experts: int  # E

    @property
    def num_layers(self) -> int:
        return int(self.slot_to_expert.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.slot_to_expert.shape[1])

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    @property
    def ranks_per_node(self) -> int:
        return self.num_ranks // self.num_nodes

    @property
    def expert_replicas(self) -> torch.Tensor:
        """[L, E] int64 slots holding each expert."""
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64)
        return counts.scatter_add_(1, self.slot_to_expert, torch.ones_like(self.slot_to_expert))

    @property
    def expert_to_slots(self) -> torch.Tensor:
        """[L, E, R] int64 slots of each expert, ascending, padded with -1."""
        return torch.from_numpy(expert_to_slots(self.slot_to_expert.numpy(), self.num_experts))

    def validate(self) -> "Placement":
        """Raise ValueError naming the field that breaks a rule; return self."""
        s2e = self.slot_to_expert
        if not isinstance(s2e, torch.Tensor) or s2e.dim() != 2 or s2e.dtype != torch.int64:
            raise ValueError("slot_to_expert must be a 2-D int64 tensor [layers, num_slots], got "
                             f"{getattr(s2e, 'dtype', type(s2e))} {tuple(getattr(s2e, 'shape', ()))}")
        for name in ("num_ranks", "num_nodes", "num_experts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_slots % self.num_ranks != 0:
            raise ValueError(f"slot_to_expert has {self.num_slots} slots, not a multiple of num_ranks "
                             f"({self.num_ranks})")
        if self.num_ranks % self.num_nodes != 0:
            raise ValueError(f"num_ranks ({self.num_ranks}) must be a multiple of num_nodes ({self.num_nodes})")
        if self.num_slots < self.num_experts:
            raise ValueError(f"slot_to_expert has {self.num_slots} slots, fewer than num_experts "
                             f"({self.num_experts})")
        if s2e.numel() and (int(s2e.min()) < 0 or int(s2e.max()) >= self.num_experts):
            raise ValueError(f"slot_to_expert holds ids outside [0, num_experts={self.num_experts})")
        missing = (self.expert_replicas == 0).nonzero()
        if missing.numel():
            layer, expert = (int(v) for v in missing[0])
            raise ValueError(f"slot_to_expert: layer {layer} has no slot for expert {expert} "
                             f"({missing.shape[0]} (layer, expert) pairs missing)")
        return self

    def moves(self, other: "Placement") -> torch.Tensor:
        """[L] int64 slots whose expert differs between self and other (same shape)."""
        if other.slot_to_expert.shape != self.slot_to_expert.shape:
            raise ValueError(f"other.slot_to_expert has shape {tuple(other.slot_to_expert.shape)}, "
                             f"expected {tuple(self.slot_to_expert.shape)}")
        return (self.slot_to_expert != other.slot_to_expert).sum(dim=1)

    @staticmethod
    def identity(num_layers: int, num_experts: int, num_slots: int, num_ranks: int,
                 num_nodes: int) -> "Placement":
        """The placement before any statistics: expert e in slot r*P + e % (E/W) of rank r = e // (E/W).

        Spare slots (S > E) hold one more copy of experts of other ranks, round robin over
        ranks, so no rank holds an expert twice (while that is possible) and copies spread.
        """
        check_sizes(num_experts, num_slots, num_ranks, num_nodes)
        if num_experts % num_ranks != 0:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_ranks ({num_ranks}) "
                             "for the identity placement")
        per_rank, slots_pr = num_experts // num_ranks, num_slots // num_ranks
        rank_W = np.arange(num_ranks)[:, None]
        own_WP = rank_W * per_rank + np.arange(per_rank)[None, :]
        spare = np.arange(slots_pr - per_rank)[None, :]
        others = max(num_ranks - 1, 1)
        src_rank = (rank_W + 1 + spare % others) % num_ranks
        local = (rank_W + spare // others) % per_rank
        identity_S = np.concatenate([own_WP, src_rank * per_rank + local], axis=1).reshape(-1)
        s2e = torch.from_numpy(np.tile(identity_S, (num_layers, 1)))
        return Placement(s2e.to(torch.int64), num_ranks, num_nodes, num_experts).validate()


def check_sizes(num_experts: int, num_slots: int, num_ranks: int, num_nodes: int) -> None:
    """ValueError unless the sizes can form a placement: every expert a slot, slots even over
    ranks, ranks even over nodes."""
    for name, value in (("num_slots", num_slots), ("num_ranks", num_ranks), ("num_nodes", num_nodes)):
        if not is_int(value, 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if num_slots < num_experts:
        raise ValueError(f"num_slots ({num_slots}) must be >= the number of experts ({num_experts}): "
                         "every expert needs a slot")
    if num_slots % num_ranks != 0:
        raise ValueError(f"num_slots ({num_slots}) must be a multiple of num_ranks ({num_ranks}): "
                         "every rank holds the same number of slots")
    if num_ranks % num_nodes != 0:
        raise ValueError(f"num_ranks ({num_ranks}) must be a multiple of num_nodes ({num_nodes})")


def expert_to_slots(s2e_LS: np.ndarray, E: int) -> np.ndarray:
    """[L, E, R] int64 slots of each expert, ascending, padded with -1 (R most replicas of one expert)."""
    L, S = s2e_LS.shape
    order = np.argsort(s2e_LS, axis=1, kind="stable")  # slots grouped by expert, ascending
    experts = np.take_along_axis(s2e_LS, order, axis=1)
    flat = (s2e_LS + np.arange(L)[:, None] * E).ravel()
    reps = np.bincount(flat, minlength=L * E).reshape(L, E)
    start = np.cumsum(reps, axis=1) - reps
    pos = np.arange(S)[None, :] - np.take_along_axis(start, experts, axis=1)
    out = np.full((L, E, max(int(reps.max()), 1)), -1, dtype=np.int64)
    out[np.arange(L)[:, None], experts, pos] = order
    return out


def primary_nodes(count_EN: torch.Tensor) -> torch.Tensor:
    """[E] int64 the primary node of each expert from its copies per node [E, N] (every expert
    has one): its home node e // (E / N), where node-limited routing sends its tokens, when a
    copy is there; else the node holding most of its copies (the lowest on a tie). A route
    from a node without a copy takes the primary node's copies (slots.py)."""
    E, N = count_EN.shape
    home_E = torch.arange(E) // max(E // N, 1)
    at_home = count_EN.gather(1, home_E[:, None])[:, 0] > 0
    return torch.where(at_home, home_E, count_EN.argmax(dim=1))
