"""Synthetic routings for tests, the traffic model and benchmarks.

All sample K distinct experts per token without replacement (Gumbel top-k over log
popularity), so the same code gives uniform, Zipf-skewed and group-limited routing.
Legend: T tokens, E experts, K routes per token.
"""

from __future__ import annotations

import torch

ROUTINGS = ("uniform", "zipf", "group-limited")
# Nodes a group-limited token may reach unless told (DeepSeek-V3 limits a token to 4 nodes).
DEFAULT_GROUP_LIMIT = 4
# torch generators take seeds in [0, 2^64 - 1] (negative ones alias large ones: -1 is 2^64 - 1).
MAX_SEED = 2**64 - 1


def seed_problem(seed: int) -> str | None:
    """Why `seed` cannot seed the generators of a run (the rule of every CLI's --seed); None when it can."""
    if not 0 <= seed <= MAX_SEED:
        return f"must be in [0, 2^64 - 1] = [0, {MAX_SEED}] (a torch generator seed), got {seed}"
    return None


def derived_seed(value: int) -> int:
    """A seed computed from --seed (per rank, per stream: seed x a + b) folded into [0, MAX_SEED],
    so that it fits a torch generator whatever --seed is; values already in range are kept."""
    return value % (MAX_SEED + 1)


def default_group_limit(num_nodes: int) -> int:
    """DEFAULT_GROUP_LIMIT, capped at the node count so small clusters still route."""
    return min(DEFAULT_GROUP_LIMIT, num_nodes)


def zipf_popularity(num_experts: int, exponent: float, generator: torch.Generator) -> torch.Tensor:
    """p[e] proportional to 1 / rank(e)^exponent, with ranks shuffled over experts."""
    weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** exponent
    perm = torch.randperm(num_experts, generator=generator)
    return (weights / weights.sum())[perm]


def _scores(T: int, popularity: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    u = torch.rand(T, popularity.numel(), generator=generator, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    return popularity.log()[None, :] - torch.log(-torch.log(u))


def sample_topk(num_tokens: int, num_experts: int, topk: int, generator: torch.Generator,
                popularity: torch.Tensor | None = None, num_groups: int | None = None,
                topk_groups: int | None = None) -> torch.Tensor:
    """[T, K] int64 distinct experts per token.

    With num_groups and topk_groups, DeepSeek-V3's group-limited routing: experts form
    num_groups contiguous groups (one per node when groups == nodes); a token first picks
    its topk_groups best groups (sum of the group's two best scores), then K experts there.
    """
    if not 1 <= topk <= num_experts:
        raise ValueError(f"topk must be in [1, {num_experts}], got {topk}")
    if popularity is None:
        popularity = torch.full((num_experts,), 1.0 / num_experts, dtype=torch.float64)
    scores = _scores(num_tokens, popularity, generator)
    if num_groups is not None:
        if num_experts % num_groups != 0:
            raise ValueError(f"num_groups ({num_groups}) must divide num_experts ({num_experts})")
        per_group = num_experts // num_groups
        if topk_groups is None or not 1 <= topk_groups <= num_groups:
            raise ValueError(f"topk_groups must be in [1, {num_groups}], got {topk_groups}")
        if topk > topk_groups * per_group:
            raise ValueError(f"topk ({topk}) exceeds the experts in {topk_groups} groups")
        grouped = scores.view(num_tokens, num_groups, per_group)
        best = grouped.topk(min(2, per_group), dim=2).values.sum(dim=2)
        keep = torch.zeros(num_tokens, num_groups, dtype=torch.bool)
        keep.scatter_(1, best.topk(topk_groups, dim=1).indices, True)
        scores = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, num_experts)
    return scores.topk(topk, dim=1).indices.to(torch.int64)


def iter_rank_routings(kind: str, tokens_per_rank, num_experts: int, topk: int, seed: int,
                       zipf_exponent: float = 1.2, num_groups: int | None = None,
                       topk_groups: int | None = None):
    """Yield [T_r, K] int64 topk_idx for ranks 0, 1, ... of one synthetic routing (ROUTINGS).

    One generator draws the ranks in order and Zipf's popularity once, so all ranks share the
    same hot experts and the same seed gives the same routing in the tests, the benchmark and
    the traffic CLI. group-limited needs num_groups and topk_groups.
    """
    if kind not in ROUTINGS:
        raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {kind!r}")
    problem = seed_problem(seed)
    if problem:
        raise ValueError(f"seed {problem}")
    gen = torch.Generator().manual_seed(seed)
    options: dict = {}
    if kind == "zipf":
        options["popularity"] = zipf_popularity(num_experts, zipf_exponent, gen)
    elif kind == "group-limited":
        options.update(num_groups=num_groups, topk_groups=topk_groups)
    for num_tokens in tokens_per_rank:
        yield sample_topk(num_tokens, num_experts, topk, gen, **options)


def random_weights(topk_idx_TK: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Positive float32 weights summing to 1 over a token's routed slots, 0 on -1 slots."""
    w = torch.rand(topk_idx_TK.shape, generator=generator) + 0.05
    w = torch.where(topk_idx_TK >= 0, w, 0.0)
    return (w / w.sum(dim=1, keepdim=True).clamp(min=1e-6)).to(torch.float32)


def drop_routes(topk_idx_TK: torch.Tensor, fraction: float, generator: torch.Generator) -> torch.Tensor:
    """Set about `fraction` of the slots to -1 (not routed), as a capacity-dropping router does."""
    drop = torch.rand(topk_idx_TK.shape, generator=generator) < fraction
    return torch.where(drop, -1, topk_idx_TK)
