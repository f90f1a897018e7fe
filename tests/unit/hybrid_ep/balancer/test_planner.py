"""Planner and metrics: validation, structure of plans, hand-computed cases, quality, moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hybrid_ep import _planner
from hybrid_ep.balancer.metrics import default_rank_loads, imbalance_ratio, rank_loads, scalars, slot_loads, summarize
from hybrid_ep.balancer.planner import DEFAULT_TOLERANCE, Placement, peak, plan_placement
from tools.balancer_study.baselines import eplb, eplb_hierarchical, greedy
from tools.balancer_study.quality import PATTERNS, imbalance, sample_load
from tools.balancer_study.refit_bound import over_loaded_ranks, refit_lower_bound

pytestmark = pytest.mark.unit


def _zipf_load(num_layers: int, num_experts: int, exponent: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, num_experts + 1) ** exponent
    return rng.poisson(np.stack([rng.permutation(w) for _ in range(num_layers)]) * 1e5).astype(np.float64)


def _rank_experts(p: Placement) -> torch.Tensor:
    return p.slot_to_expert.view(p.num_layers, p.num_ranks, p.slots_per_rank)


# ----------------------------------------------------------------------------- validation

@pytest.mark.parametrize("kwargs, match", [
    (dict(num_slots=6), "num_slots"),                       # fewer slots than experts
    (dict(num_slots=9), "num_slots .* multiple of num_ranks"),
    (dict(num_ranks=4, num_nodes=3), "num_ranks .* multiple of num_nodes"),
    (dict(num_ranks=6, num_nodes=3, num_slots=12), "num_nodes"),  # 3 nodes do not divide 8 experts
    (dict(num_slots=0), "num_slots"),
    (dict(num_slots=8.0), "num_slots must be a positive integer, got 8.0"),  # passed, then a pybind TypeError
    (dict(num_ranks=True), "num_ranks must be a positive integer, got True"),
])
def test_invalid_sizes_name_the_argument(kwargs, match):
    args = dict(load=np.ones(8), num_slots=8, num_nodes=1, num_ranks=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_placement(**args)


@pytest.mark.parametrize("load, match", [
    (np.array([1.0, -1.0, 1.0, 1.0]), "non-negative"),
    (np.array([1.0, np.nan, 1.0, 1.0]), "finite"),
    (np.ones((2, 2, 2)), "load must be"),
    (np.array([[1.0, 1, 1, 1], [1e300, 1e300, 1, 1]]), "layer 1 sums to 2e"),  # finite, but sums past 1e300
])
def test_invalid_load_is_named(load, match):
    with pytest.raises(ValueError, match=match):
        plan_placement(load, 4, 1, 2)


def test_no_layers_plan_with_and_without_previous():
    """A load of zero layers plans to zero rows, and that plan serves as previous (the rank
    loads' reshape failed on 0 elements)."""
    fresh = plan_placement(np.ones((0, 8)), 12, 1, 2)
    assert tuple(fresh.slot_to_expert.shape) == (0, 12)
    again = plan_placement(np.ones((0, 8)), 12, 1, 2, previous=fresh)
    assert tuple(again.slot_to_expert.shape) == (0, 12)


def test_invalid_previous_is_named():
    prev = plan_placement(np.ones((2, 8)), 8, 1, 2)
    with pytest.raises(ValueError, match="previous.shape"):
        plan_placement(np.ones((3, 8)), 8, 1, 2, previous=prev)
    with pytest.raises(ValueError, match="previous.num_ranks"):
        plan_placement(np.ones((2, 8)), 8, 1, 4, previous=prev)
    for bad in (-1, float("inf"), float("nan"), True):  # the rule every caller shares (knobs.py)
        with pytest.raises(ValueError, match="tolerance must be a finite number >= 0"):
            plan_placement(np.ones((2, 8)), 8, 1, 2, previous=prev, tolerance=bad)


def test_placement_validate_names_fields():
    with pytest.raises(ValueError, match="slot_to_expert: layer 0 has no slot for expert 3"):
        Placement(torch.tensor([[0, 1, 2, 2]]), 2, 1, 4).validate()
    with pytest.raises(ValueError, match="num_ranks"):
        Placement(torch.tensor([[0, 1, 2]]), 2, 1, 3).validate()
    with pytest.raises(ValueError, match="num_nodes"):
        Placement(torch.tensor([[0, 1, 2, 3]]), 2, 4, 4).validate()
    with pytest.raises(ValueError, match="fewer than num_experts"):
        Placement(torch.tensor([[0, 1]]), 2, 1, 4).validate()
    with pytest.raises(ValueError, match="int64"):
        Placement(torch.tensor([[0.0, 1.0]]), 2, 1, 2).validate()


# ----------------------------------------------------------------------------- structure

@pytest.mark.parametrize("E, W, N, S", [(16, 4, 2, 16), (16, 4, 2, 24), (32, 8, 2, 48), (8, 2, 1, 12)])
def test_every_expert_placed_and_slots_per_rank(E, W, N, S):
    load = _zipf_load(5, E, 1.0, seed=E + S)
    p = plan_placement(load, S, N, W)
    assert p.slot_to_expert.shape == (5, S) and p.slot_to_expert.dtype == torch.int64
    assert (p.num_ranks, p.num_nodes, p.num_experts, p.slots_per_rank, p.ranks_per_node) == (W, N, E, S // W, W // N)
    reps = p.expert_replicas
    assert reps.shape == (5, E) and bool((reps >= 1).all()) and bool((reps.sum(1) == S).all())
    per_rank = _rank_experts(p)
    assert per_rank.shape == (5, W, S // W)
    if S == E:  # without replicas no rank can hold an expert twice
        assert all(len(set(per_rank[layer, rank].tolist())) == S // W for layer in range(5) for rank in range(W))
    # expert_to_slots agrees with slot_to_expert, ascending, padded with -1
    e2s = p.expert_to_slots
    assert e2s.shape == (5, E, int(reps.max()))
    for layer in range(5):
        for e in range(E):
            slots = [s for s in e2s[layer, e].tolist() if s >= 0]
            assert slots == sorted(slots) and len(slots) == int(reps[layer, e])
            assert all(int(p.slot_to_expert[layer, s]) == e for s in slots)


def test_placement_only_is_a_permutation():
    load = _zipf_load(3, 64, 1.2, seed=1)
    p = plan_placement(load, 64, 2, 8)
    for layer in range(3):
        assert sorted(p.slot_to_expert[layer].tolist()) == list(range(64))


def test_deterministic_and_input_types_agree():
    load = _zipf_load(4, 32, 1.0, seed=2)
    a = plan_placement(load, 40, 2, 8)
    b = plan_placement(torch.from_numpy(load.astype(np.int64)), 40, 2, 8)
    c = plan_placement(load.tolist(), 40, 2, 8)
    assert torch.equal(a.slot_to_expert, b.slot_to_expert) and torch.equal(a.slot_to_expert, c.slot_to_expert)
    # ties (all loads equal) are broken by index, reproducibly
    assert torch.equal(plan_placement(np.ones(8), 12, 1, 4).slot_to_expert,
                       plan_placement(np.ones(8), 12, 1, 4).slot_to_expert)


def test_one_dimensional_load_is_one_layer_and_zero_load_plans():
    p = plan_placement(np.zeros(8), 8, 1, 2)
    assert p.slot_to_expert.shape == (1, 8)
    assert sorted(p.slot_to_expert[0].tolist()) == list(range(8))


def test_identity_layout():
    p = Placement.identity(2, 8, 12, 4, 2)
    # rank r: its own experts 2r, 2r + 1, then one copy of an expert of rank r + 1
    assert p.slot_to_expert[0].tolist() == [0, 1, 2, 2, 3, 5, 4, 5, 6, 6, 7, 1]
    assert torch.equal(p.slot_to_expert[0], p.slot_to_expert[1])
    per_rank = _rank_experts(p)
    assert all(len(set(per_rank[0, r].tolist())) == 3 for r in range(4))
    assert Placement.identity(1, 8, 8, 4, 2).slot_to_expert[0].tolist() == list(range(8))
    with pytest.raises(ValueError, match="num_experts .* multiple of num_ranks"):
        Placement.identity(1, 6, 8, 4, 2)


def test_moves_counts_changed_slots():
    a = Placement(torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]]), 2, 1, 4)
    b = Placement(torch.tensor([[0, 1, 3, 2], [0, 1, 2, 3]]), 2, 1, 4)
    assert a.moves(b).tolist() == [2, 0]


# ----------------------------------------------------------------------------- hand-computed

def test_placement_only_small_case():
    # 10 must share a rank with one 1: ranks carry 11 and 2, mean 6.5
    p = plan_placement(np.array([10.0, 1.0, 1.0, 1.0]), 4, 1, 2)
    ranks = rank_loads(np.array([10.0, 1.0, 1.0, 1.0]), p, 2)
    assert sorted(ranks[0].tolist()) == [2.0, 11.0]
    assert float(imbalance_ratio(ranks)[0]) == pytest.approx((11 - 6.5) / 6.5)


def test_replication_small_case():
    # 2 spare slots: expert 0 gets a second copy (at most one per rank: 2 ranks), then the
    # largest load / replicas among the rest (ties: lowest id) is expert 1 -> ranks 6.5 / 6.5
    load = np.array([10.0, 1.0, 1.0, 1.0])
    p = plan_placement(load, 6, 1, 2)
    assert p.expert_replicas[0].tolist() == [2, 2, 1, 1]
    assert rank_loads(load, p, 2)[0].tolist() == [6.5, 6.5]
    assert sorted(slot_loads(load, p)[0].tolist()) == [0.5, 0.5, 1.0, 1.0, 5.0, 5.0]


def test_hot_expert_gets_replicas_across_nodes():
    # one hot expert, 2 nodes of 2 ranks, 4 spare slots: the budget is global, so the hot
    # expert gets a copy on every rank of both nodes (cap: one per rank); the last spare slot
    # splits expert 1: ranks 10 + 1 + 1 twice, 10 + 1 + 0.5 twice
    load = np.array([40.0] + [1.0] * 7)
    p = plan_placement(load, 12, 2, 4)
    assert int(p.expert_replicas[0, 0]) == 4
    owners = (p.expert_to_slots[0, 0] // 3).tolist()
    assert sorted(owners) == [0, 1, 2, 3]
    assert sorted(rank_loads(load, p, 4)[0].tolist()) == [11.5, 11.5, 12.0, 12.0]


# ----------------------------------------------------------------------------- quality

@pytest.mark.parametrize("pattern", ["zipf-0.8", "zipf-1.2"])
def test_zipf_balanced_with_spare_slots(pattern):
    load = sample_load(pattern, 2, 256, 8, 8192, seed=3)
    default = imbalance_ratio(default_rank_loads(load, 32))
    placed = imbalance_ratio(rank_loads(load, plan_placement(load, 256, 4, 32), 32))
    spare = imbalance_ratio(rank_loads(load, plan_placement(load, 288, 4, 32), 32))
    assert bool((placed < default).all())
    assert bool((spare <= 0.05).all()), spare
    assert bool((spare < placed).all())


# ----------------------------------------------------------------------------- baselines

_CASES = [(16, 2, 288), (64, 8, 320), (32, 4, 256), (128, 16, 384)]


@pytest.mark.parametrize("pattern", ["zipf-0.6", "zipf-1.0", "zipf-1.4", "lognormal-2.0", "two-hot", "hot-block",
                                     pytest.param("topk-zipf-1.0", marks=pytest.mark.slow)])  # slow: the full tier
def test_never_worse_than_eplb_or_greedy(pattern):
    for W, N, S in _CASES:
        load = sample_load(pattern, 2, 256, 8, 2048 * W, seed=W).numpy()
        p = plan_placement(load, S, N, W)
        mine = imbalance(load, p.slot_to_expert, W)
        assert (mine <= imbalance(load, eplb(load, S, N, W), W) + 1e-12).all(), (W, N, S)
        assert (mine <= imbalance(load, greedy(load, S, W), W) + 0.005).all(), (W, N, S)
        # exact slot counts, every expert placed
        assert p.slot_to_expert.shape == (2, S) and bool((p.expert_replicas >= 1).all())
        assert p.slots_per_rank * W == S and rank_loads(load, p, W).shape == (2, W)
        assert np.allclose(rank_loads(load, p, W).sum(1).numpy(), load.sum(1))  # every token on one rank


@pytest.mark.parametrize("pattern, W, N, S", [("two-hot", 64, 8, 320), ("two-hot", 128, 16, 384),
                                              ("hot-block", 64, 8, 384), ("hot-block", 128, 16, 384)])
def test_few_hot_experts_among_even_ones_balance_far_below_eplb(pattern, W, N, S):
    # near-equal experts plus a few hot ones: copy counts that split every expert alike (EPLB's
    # rule) leave ranks of coarse copies 4-14% apart; splitting only the heaviest experts keeps
    # the even ones whole as fine filler (measured: 0.002-0.015 here, EPLB 0.045-0.14)
    load = sample_load(pattern, 2, 256, 8, 4096 * W, seed=3).numpy()
    mine = imbalance(load, plan_placement(load, S, N, W).slot_to_expert, W)
    theirs = imbalance(load, eplb(load, S, N, W), W)
    assert (theirs > 0.04).all()
    assert (mine < 0.02).all(), mine


def test_very_hot_expert_gets_replicas_on_many_nodes():
    # 25x and 18x hot experts on 64 ranks in 8 nodes: more copies than a node has ranks
    load = sample_load("two-hot", 1, 256, 8, 4096 * 64, seed=1).numpy()
    p = plan_placement(load, 320, 8, 64)
    hot = int(np.argmax(load[0]))
    assert int(p.expert_replicas[0, hot]) > 8
    nodes = {int(s) // (320 // 8) for s in p.expert_to_slots[0, hot].tolist() if s >= 0}
    assert len(nodes) >= 2
    assert imbalance(load, p.slot_to_expert, 64)[0] < imbalance(load, eplb(load, 320, 8, 64), 64)[0]


def test_native_eplb_and_greedy_match_the_reference_baselines():
    # the planner's own EPLB and greedy candidates (C++) are the benchmark's baselines (numpy)
    # (E and S from 96 up take the planner's radix sort instead of its comparison sort; zero
    # loads and equal counts check that both order ties by index)
    rng = np.random.default_rng(3)
    for E, W, N, S in [(16, 4, 2, 24), (32, 8, 4, 40), (64, 8, 1, 64), (8, 2, 2, 12), (64, 16, 4, 80),
                       (256, 64, 8, 320), (256, 32, 1, 384), (128, 16, 2, 160)]:
        load = np.round(rng.lognormal(0, 1.5, (4, E)) * 50)  # integer counts: ties broken the same way
        load[:, rng.permutation(E)[:E // 16]] = 0.0
        assert np.array_equal(_planner.eplb(load, S, N, W), eplb(load, S, N, W)), (E, W, N, S)
        assert np.array_equal(_planner.greedy(load, S, W), greedy(load, S, W)), (E, W, S)
        lb = _planner.lower_bound(load, S, W)
        assert (peak(load, eplb(load, S, N, W), W) >= lb - 1e-9).all()
        assert (peak(load, plan_placement(load, S, N, W).slot_to_expert.numpy(), W) >= lb - 1e-9).all()


def _copies_sharing_a_node(plan_LS: np.ndarray, E: int, N: int) -> int:
    """Pairs of copies of one expert on one node, over the layers."""
    L, S = plan_LS.shape
    node = np.arange(S) // (S // N)
    count = np.zeros((L, E, N), dtype=np.int64)
    np.add.at(count, (np.arange(L)[:, None], plan_LS, node[None, :]), 1)
    return int((count * (count - 1) // 2).sum())


def test_fresh_plan_orders_its_ranks_onto_nodes_last():
    # plan_placement with previous asks for the plan before that step (only its copies and
    # peak count there) and orders the ranks itself where it matches the plan onto previous
    E, W, N, S = 64, 16, 4, 96
    load = sample_load("zipf-1.0", 3, E, 8, 4096 * W, seed=7).numpy()
    grouped = _planner.plan_fresh(load, S, N, W)
    plain = _planner.plan_fresh(load, S, N, W, onto_nodes=False)
    assert np.array_equal(_planner.group_nodes(plain, E, N, W), grouped)
    assert (grouped != plain).any()  # the step does reorder ranks here
    # a permutation of whole ranks: every rank's load keeps its bits, so the peak does too
    def loads(plan):
        return np.sort(rank_loads(load, torch.from_numpy(plan), W).numpy(), axis=1)

    assert np.array_equal(loads(grouped), loads(plain))
    assert _copies_sharing_a_node(grouped, E, N) > _copies_sharing_a_node(plain, E, N)
    bad = plain.copy()
    bad[-1, -1] = E
    with pytest.raises(ValueError, match="plan holds an expert id"):
        _planner.group_nodes(bad, E, N, W)
    with pytest.raises(ValueError, match="num_ranks must divide"):
        _planner.group_nodes(plain, E, N, 5)


def test_exchanges_run_within_a_budget_per_call():
    # max(8, L / 4) one-slot exchanges per call, layers nearest the move target first: one
    # layer that wants 3 (two count shifts and the exchange; topk-zipf-1.0 at W 64, S 320, the
    # quality benchmark's case) repeated 40 times gets them on its first 3 copies only
    W, S, N, L = 64, 320, 8, 40
    seed = 1000 * PATTERNS.index("topk-zipf-1.0") + W
    load = sample_load("topk-zipf-1.0", 1, 256, 8, 4096 * W, seed).numpy()
    prev = plan_placement(load, S, N, W).slot_to_expert.numpy()
    moved = load * np.random.default_rng(seed).uniform(0.9, 1.1, load.shape)
    fresh = _planner.plan_fresh(moved, S, N, W, onto_nodes=False)
    allowed = peak(moved, fresh, W) + DEFAULT_TOLERANCE * moved.sum(1) / W
    alone, reached = _planner.keep_previous(moved, prev, fresh, allowed, W, S)
    assert reached.all() and (alone != prev).sum() > 0.1 * S  # over the target: all 3 exchanges wanted
    many, reached = _planner.keep_previous(*(np.repeat(a, L, 0) for a in (moved, prev, fresh, allowed)), W, S)
    assert reached.all()
    assert (many[:3] == alone).all()
    assert (many[3:] == many[3]).all()  # the refit without the exchanges
    assert (many[3] != prev).sum() > (alone != prev).sum()  # which they lower on this layer
    assert peak(np.repeat(moved, L, 0), many, W).max() <= allowed[0]


def test_native_planner_refuses_sizes_that_would_index_out_of_bounds():
    load = np.ones((2, 8))
    with pytest.raises(ValueError, match="num_slots"):
        _planner.plan_fresh(load, 6, 1, 2)
    with pytest.raises(ValueError, match="num_nodes must divide"):
        _planner.eplb(load, 12, 3, 3)
    with pytest.raises(ValueError, match="load must be"):
        _planner.greedy(np.ones(8), 8, 2)
    prev = _planner.plan_fresh(load, 8, 1, 2)
    with pytest.raises(ValueError, match="previous holds an expert id"):
        _planner.keep_previous(load, prev + 8, prev, np.ones(2), 2, 8)
    last_bad = prev.copy()
    last_bad[-1, -1] = 8  # only the very last slot: every slot is checked
    with pytest.raises(ValueError, match="fresh holds an expert id"):
        _planner.keep_previous(load, prev, last_bad, np.ones(2), 2, 8)
    with pytest.raises(ValueError, match="allowed_peak"):
        _planner.keep_previous(load, prev, prev, np.ones(3), 2, 8)
    with pytest.raises(ValueError, match="start holds an expert id"):
        _planner.walk_back(load, prev, prev - 1, np.ones(2), 2)
    with pytest.raises(ValueError, match="start and previous"):
        _planner.walk_back(load, prev, prev[:, :4], np.ones(2), 2)


def test_random_small_cases_are_valid_and_never_worse_than_the_baselines():
    # odd sizes, one rank, one slot per rank, zero loads, ties: every plan is a valid placement
    rng = np.random.default_rng(21)
    for _ in range(60):
        W = int(rng.choice([1, 2, 3, 4, 6, 8]))
        N = int(rng.choice([n for n in (1, 2, 3) if W % n == 0]))
        E = W * N * int(rng.integers(1, 4))
        S = E + W * int(rng.integers(0, 3))
        load = rng.choice([0.0, 1.0, 5.0, 40.0], size=(2, E)) * rng.integers(0, 3, size=(2, E))
        p = plan_placement(load, S, N, W)
        assert (p.expert_replicas >= 1).all() and p.slot_to_expert.shape == (2, S)
        mine = peak(load, p.slot_to_expert.numpy(), W)
        assert (mine <= peak(load, eplb(load, S, N, W), W) + 1e-9).all()
        assert (mine <= peak(load, greedy(load, S, W), W) + 1e-9).all()
        moved = load * rng.uniform(0.5, 1.5, load.shape)
        kept = plan_placement(moved, S, N, W, previous=p)
        assert (kept.expert_replicas >= 1).all()
        fresh = peak(moved, plan_placement(moved, S, N, W).slot_to_expert.numpy(), W)
        mean = moved.sum(1) / W
        assert (peak(moved, kept.slot_to_expert.numpy(), W) <= fresh + (DEFAULT_TOLERANCE + 1e-9) * mean).all()


def test_eplb_baseline_hand_checked():
    # global policy: expert 0 (10) gets the 2 spare slots -> 3 copies of 10/3, then packing by
    # weight onto 2 ranks of 3 slots: [10/3, 10/3, 1] and [10/3, 2, 1] ... peak 7.67
    load = np.array([[10.0, 2.0, 1.0, 1.0]])
    flat = eplb_hierarchical(load, 6, 4, 1, 2)
    assert sorted(flat[0].tolist()) == [0, 0, 0, 1, 2, 3]
    assert rank_loads(load, flat, 2).max().item() == pytest.approx(10 / 3 * 2 + 1)
    with pytest.raises(ValueError, match="num_groups"):
        eplb_hierarchical(load, 6, 3, 1, 2)


# ----------------------------------------------------------------------------- previous

def test_same_load_with_previous_moves_nothing():
    load = _zipf_load(4, 64, 1.0, seed=4)
    first = plan_placement(load, 80, 2, 16)
    again = plan_placement(load, 80, 2, 16, previous=first)
    assert again is first
    assert again.moves(first).tolist() == [0, 0, 0, 0]


@pytest.mark.parametrize("W, N, S", [(16, 2, 320), (8, 1, 288)])
def test_perturbed_load_moves_few_slots_within_tolerance(W, N, S):
    load = sample_load("zipf-1.0", 4, 256, 8, 4096 * W, seed=5).numpy()
    first = plan_placement(load, S, N, W)
    new_load = load * np.random.default_rng(6).uniform(0.9, 1.1, load.shape)
    fresh = plan_placement(new_load, S, N, W)
    kept = plan_placement(new_load, S, N, W, previous=first)
    assert int(kept.moves(first).sum()) <= 0.10 * 4 * S
    gap = imbalance(new_load, kept.slot_to_expert, W) - imbalance(new_load, fresh.slot_to_expert, W)
    assert gap.max() <= DEFAULT_TOLERANCE + 1e-9
    # with tolerance 0 the result is as balanced as the fresh plan
    strict = plan_placement(new_load, S, N, W, previous=first, tolerance=0.0)
    assert (imbalance(new_load, strict.slot_to_expert, W) <= imbalance(new_load, fresh.slot_to_expert, W) + 1e-9).all()


@pytest.mark.parametrize("W, N, S", [(64, 8, 320), (32, 4, 288)])
def test_perturbed_load_imbalance_within_tolerance_of_fresh(W, N, S):
    load = sample_load("two-hot", 2, 256, 8, 4096 * W, seed=8).numpy()
    first = plan_placement(load, S, N, W)
    new_load = load * np.random.default_rng(9).uniform(0.9, 1.1, load.shape)
    kept = plan_placement(new_load, S, N, W, previous=first)
    fresh = plan_placement(new_load, S, N, W)
    gap = imbalance(new_load, kept.slot_to_expert, W) - imbalance(new_load, fresh.slot_to_expert, W)
    assert gap.max() <= DEFAULT_TOLERANCE + 1e-9
    assert int(kept.moves(first).sum()) <= 0.25 * 2 * S  # far from a reshuffle
    # a smaller tolerance is met too, with more moves
    tight = plan_placement(new_load, S, N, W, previous=first, tolerance=0.002)
    gap = imbalance(new_load, tight.slot_to_expert, W) - imbalance(new_load, fresh.slot_to_expert, W)
    assert gap.max() <= 0.002 + 1e-9 and int(tight.moves(first).sum()) >= int(kept.moves(first).sum())


@pytest.mark.parametrize("pattern", ["zipf-1.0", "two-hot", "uniform-noise"])
def test_previous_refit_reaches_the_allowed_peak_and_keeps_every_expert(pattern):
    W, S = 32, 288
    load = sample_load(pattern, 3, 256, 8, 4096 * W, seed=11).numpy()
    prev = _planner.plan_fresh(load, S, 4, W)
    new_load = load * np.random.default_rng(12).uniform(0.9, 1.1, load.shape)
    fresh = _planner.plan_fresh(new_load, S, 4, W)
    allowed = peak(new_load, fresh, W) + 0.01 * new_load.sum(1) / W
    kept, reached = _planner.keep_previous(new_load, prev, fresh, allowed, W, S)
    assert reached.all()
    assert (peak(new_load, kept, W) <= allowed).all() and (peak(new_load, prev, W) > allowed).all()
    def repeats(s2e):  # copies that share a rank with another copy of their expert
        return sum(S // W - len(set(r.tolist())) for r in s2e.reshape(W, S // W))

    for layer in range(3):
        assert np.bincount(kept[layer], minlength=256).min() >= 1  # no expert lost
        assert repeats(kept[layer]) <= repeats(prev[layer])  # moves never put an expert twice on a rank
    # a move budget stops the search early, short of the allowed peak
    few, reached_few = _planner.keep_previous(new_load, prev, fresh, allowed, W, 2)
    assert ((few != prev).sum(1) <= 3).all() and not reached_few.any()


def _benchmark_refit(pattern, seed, W, S):
    """The quality benchmark's case (2 layers, one node) re-fitted after its +-10% load change:
    (previous, new load, fresh plan, allowed peak, kept), kept checked to reach the peak."""
    load = sample_load(pattern, 2, 256, 8, 4096 * W, seed=seed).numpy()
    prev = _planner.plan_fresh(load, S, 1, W)
    new_load = load * np.random.default_rng(seed).uniform(0.9, 1.1, load.shape)
    fresh = _planner.plan_fresh(new_load, S, 1, W)
    allowed = peak(new_load, fresh, W) + 0.01 * new_load.sum(1) / W
    kept, reached = _planner.keep_previous(new_load, prev, fresh, allowed, W, S)
    assert reached.all() and (peak(new_load, kept, W) <= allowed).all()
    return prev, new_load, fresh, allowed, kept


@pytest.mark.slow  # the full tier (scripts/test.sh --full): a long search
def test_restarts_reach_where_the_most_loaded_first_refit_is_stuck():
    # the quality benchmark's topk-zipf-1.2 case at W 64, S 320: in layer 0 the search that
    # always fixes the most loaded rank stops short of the allowed peak (35 slots changed) and
    # in layer 1 it changes 70 (over a fifth); restarts that fix one of the three most loaded
    # ranks at each step reach it in both with fewer changed slots
    W, S = 64, 320
    prev, new_load, fresh, allowed, kept = _benchmark_refit("topk-zipf-1.2", 11064, W, S)
    changed = (kept != prev).sum(1)
    assert changed[0] <= 0.15 * S and changed[1] < 70
    for layer in range(2):
        assert np.bincount(kept[layer], minlength=256).min() >= 1
    again, _ = _planner.keep_previous(new_load, prev, fresh, allowed, W, S)
    assert (again == kept).all()  # seeded: the same plan every time


@pytest.mark.parametrize("pattern, seed, most, exchanged",
                         [("zipf-0.8", 1064, (33, 30), [0, 1]), ("hot-block", 8064, (31, 30), [0])])
def test_one_slot_exchange_reaches_the_move_target_where_the_search_does_not(pattern, seed, most, exchanged):
    # the quality benchmark's zipf-0.8 and hot-block cases at W 64, S 320: the refit that fixes
    # one rank at a time changes 36 + 30 and 31 + 36 slots (over 10%); exchanging one slot on
    # every over-loaded rank and on a few ranks with room changes 33 + 30 and 31 + 31 (<= 10%;
    # 32 + 30 and 32 + 31 with the first start alone and a pass of one-rank changes after it).
    # In hot-block's layer 1 a count shift before the exchange changes 30 (the next test)
    W, S = 64, 320
    prev, new_load, _, allowed, kept = _benchmark_refit(pattern, seed, W, S)
    changed = (kept != prev).sum(1)
    assert (changed <= np.array(most)).all() and changed.sum() <= 0.1 * 2 * S
    assert (peak(new_load, kept, W) <= allowed).all()
    _assert_one_slot_exchange(prev, kept, exchanged, W, S)


def test_first_fit_start_reaches_the_move_target_on_uniform_noise():
    # the quality benchmark's uniform-noise case at W 64, S 320: the refit changes 35 + 30
    # slots (10.2%). In layer 0 an exact solve of the one-slot selection takes 25 over-loaded
    # ranks and the 7 ranks with the most room, the over-loaded ones releasing heavy copies;
    # the exchange's start that releases the slot avoiding levels few ranks with room reach
    # leaves demand uncovered, the first fit into the ranks with the most room needs 8
    W, S = 64, 320
    prev, new_load, _, allowed, kept = _benchmark_refit("uniform-noise", 9064, W, S)
    changed = (kept != prev).sum(1)
    assert changed[0] <= 33 and changed.sum() <= 0.1 * 2 * S
    assert (peak(new_load, kept, W) <= allowed).all()
    _assert_one_slot_exchange(prev, kept, [0], W, S)


def test_sparing_cover_finds_an_exchange_where_the_greedy_cover_falls_short():
    # the quality benchmark's uniform-noise case at W 128, S 384, layer 0: 42 over-loaded ranks,
    # and the ranks with room that reach the heaviest levels are few; the greedy cover spends
    # them at lower levels, so no start's cover reaches every level and the refit's 82 changed
    # slots stood. The sparing cover keeps them for the levels that need them: 42 + 34
    W, S = 128, 384
    prev, new_load, _, allowed, kept = _benchmark_refit("uniform-noise", 9128, W, S)
    changed = (kept != prev).sum(1)
    assert changed[0] <= 76
    assert (peak(new_load, kept, W) <= allowed).all()
    _assert_one_slot_exchange(prev, kept, [0], W, S)


@pytest.mark.slow  # the full tier (scripts/test.sh --full): a long search
def test_count_shift_then_exchange_reaches_the_move_target_where_counts_kept_do_not():
    # the quality benchmark's topk-zipf-1.2 case at W 64, S 320: the refit changes 31 + 54
    # slots (13.3%), copy counts kept. One copy moved from a cool replicated expert to a hot
    # one (in layer 0 only the second rated shift helps), then the one-slot exchange: 21 + 35
    # (8.8%), each layer with exactly one expert a copy fewer and one a copy more
    W, S = 64, 320
    prev, _, _, _, kept = _benchmark_refit("topk-zipf-1.2", 11064, W, S)  # kept within the allowed peak
    changed = (kept != prev).sum(1)
    assert changed[0] <= 21 and changed.sum() <= 0.1 * 2 * S
    for layer in range(2):
        counts = np.bincount(kept[layer], minlength=256) - np.bincount(prev[layer], minlength=256)
        assert sorted(counts[counts != 0].tolist()) == [-1, 1]
        assert all(len(set(rank)) == S // W for rank in kept[layer].reshape(W, S // W))  # no expert twice on a rank


def _assert_one_slot_exchange(prev, kept, layers, W, S):
    """kept differs from prev by an exchange of copies: one slot per changed rank, counts kept."""
    for layer in layers:
        assert (kept[layer] != prev[layer]).reshape(W, S // W).sum(1).max() == 1  # one slot per rank
        # copy counts unchanged: every expert keeps its copies
        assert (np.bincount(kept[layer], minlength=256) == np.bincount(prev[layer], minlength=256)).all()
        assert all(len(set(rank)) == S // W for rank in kept[layer].reshape(W, S // W))  # no expert twice on a rank


def test_move_budget_caps_each_layer_and_the_next_rebalance_reaches_the_tolerance():
    # the quality benchmark's hot-block case at W 32, S 288: reaching the tolerance changes
    # more than a tenth of the slots in both layers; with move_budget=0.1 each call changes at
    # most 28 slots per layer, the first leaves the imbalance between previous's and the
    # tolerance, and the second, from the first's plan, gets within the tolerance
    W, S = 32, 288
    prev_LS, new_load, fresh_LS, allowed, _ = _benchmark_refit("hot-block", 8032, W, S)
    prev = Placement(torch.from_numpy(prev_LS), W, 1, 256)
    cap = int(0.1 * S)
    unbudgeted = plan_placement(new_load, S, 1, W, previous=prev)
    assert (unbudgeted.moves(prev) > cap).all()
    first = plan_placement(new_load, S, 1, W, previous=prev, move_budget=0.1)
    assert (first.moves(prev) <= cap).all() and (first.moves(prev) > 0).all()
    first_peak = peak(new_load, first.slot_to_expert.numpy(), W)
    assert (first_peak < peak(new_load, prev_LS, W)).all() and (first_peak > allowed).all()
    second = plan_placement(new_load, S, 1, W, previous=first, move_budget=0.1)
    assert (second.moves(first) <= cap).all()
    assert (peak(new_load, second.slot_to_expert.numpy(), W) <= allowed).all()
    for p in (first, second):  # every expert keeps a slot
        assert (p.expert_replicas >= 1).all()


@pytest.mark.parametrize("pattern, seed", [("zipf-0.6", 128), ("uniform-noise", 9128)])
def test_move_budget_reaches_the_tolerance_in_the_fewest_rebalances(pattern, seed):
    # the quality benchmark's zipf-0.6 (S 384) and uniform-noise (S = E) cases at W 128: one
    # plan within the tolerance changes 17-26% of a layer's slots, so at move_budget=0.1 it
    # takes two rebalances or more; choosing the plan that leaves the fewest gets there in
    # three, where choosing the lowest peak was still 0.004-0.011 beyond the tolerance after three
    W = 128
    S = 384 if pattern == "zipf-0.6" else 256
    prev_LS, new_load, _, allowed, _ = _benchmark_refit(pattern, seed, W, S)
    cap = int(0.1 * S)
    slack = 1e-9 * (new_load.sum(1) / W + 1)
    p = Placement(torch.from_numpy(prev_LS), W, 1, 256)
    assert (plan_placement(new_load, S, 1, W, previous=p).moves(p) > 1.5 * cap).all()
    for _ in range(3):
        nxt = plan_placement(new_load, S, 1, W, previous=p, move_budget=0.1)
        assert (nxt.moves(p) <= cap).all() and (nxt.expert_replicas >= 1).all()
        p = nxt
    assert (peak(new_load, p.slot_to_expert.numpy(), W) <= allowed + slack).all()


def test_move_budget_that_does_not_bind_changes_nothing_and_zero_keeps_previous():
    W, S = 64, 320
    load = sample_load("zipf-1.0", 2, 256, 8, 4096 * W, seed=5).numpy()
    prev = plan_placement(load, S, 8, W)
    new_load = load * np.random.default_rng(6).uniform(0.9, 1.1, load.shape)
    free = plan_placement(new_load, S, 8, W, previous=prev)
    assert torch.equal(plan_placement(new_load, S, 8, W, previous=prev, move_budget=1.0).slot_to_expert,
                       free.slot_to_expert)
    assert plan_placement(new_load, S, 8, W, previous=prev, move_budget=0.0).moves(prev).tolist() == [0, 0]


@pytest.mark.parametrize("pattern, seed, W, S", [("hot-block", 8032, 32, 288), ("two-hot", 7064, 64, 320),
                                                ("uniform-noise", 9064, 64, 256)])
def test_refit_stopped_at_max_moves_never_changes_more(pattern, seed, W, S):
    # the move budget's candidates: refits toward allowed peaks between the tolerance's and
    # previous's own, each stopped at max_moves. A swap, a chain or an ejection chain that would
    # take the count past max_moves is not made (they once did, in about 3 of 10 such calls,
    # and the budget threw those candidates away)
    prev, new_load, fresh, allowed, kept = _benchmark_refit(pattern, seed, W, S)
    own = peak(new_load, prev, W)
    full = (kept != prev).sum(1)
    stopped = 0
    for cap in (1, 2, 3, S // 20, S // 10 - 1, S // 10):
        for frac in (0.0, 0.25, 0.5, 0.75):
            target = allowed + frac * (own - allowed)
            plan, reached = _planner.keep_previous(new_load, prev, fresh, target, W, cap)
            changed = (plan != prev).sum(1)
            assert (changed <= cap).all(), (cap, frac, changed)
            assert ((peak(new_load, plan, W) <= target) == reached).all()
            for layer in range(2):  # a stopped refit is still a placement: every expert keeps a slot
                assert np.bincount(plan[layer], minlength=256).min() >= 1
            stopped += int((~reached & (full > cap)).sum())
    assert stopped >= 12  # most of these calls stop short, so the cap is what binds


def test_any_previous_tolerance_and_budget_give_a_deterministic_placement_within_the_rules():
    # previous as a user may hand it in (a saved placement, another planner's, replicas anywhere,
    # an expert twice on a rank), loads with zeros, one hot expert, or in units far below a token
    # (fractions of a tiny total), every tolerance and move budget: the result keeps every
    # expert, is the same on a second call, stays within the tolerance's peak without a budget,
    # and with one changes at most floor(budget * S) slots per layer and never ends above the
    # larger of previous's peak and the tolerance's
    rng = np.random.default_rng(34)
    for case in range(150):
        N = int(rng.choice([1, 2, 3]))
        W = N * int(rng.integers(1, 16 // N + 1))
        E = N * int(rng.integers(1, 48 // N + 1))
        S = W * (-(-E // W) + int(rng.integers(0, 3)))
        kind = case % 4
        if kind == 0:
            load = rng.integers(0, 100, (2, E)).astype(np.float64)
        elif kind == 1:
            load = np.zeros((2, E))
            load[:, rng.integers(0, E)] = 1000.0
            load += rng.integers(0, 3, (2, E))
        elif kind == 2:
            load = rng.exponential(1.0, (2, E)) * (rng.random((2, E)) < 0.6)
        else:
            load = rng.exponential(1.0, (2, E)) * 1e-290
        rows = [np.concatenate([rng.permutation(E), rng.integers(0, E, S - E)]) for _ in range(2)]
        prev = Placement(torch.from_numpy(np.stack([r[rng.permutation(S)] for r in rows])), W, N, E).validate()
        tol = float(rng.choice([0.0, 0.01, 0.05, 0.3]))
        budget = [None, 0.0, 0.05, 0.2, 1.0][case % 5]
        out = plan_placement(load, S, N, W, previous=prev, tolerance=tol, move_budget=budget)
        out.validate()
        again = plan_placement(load, S, N, W, previous=prev, tolerance=tol, move_budget=budget)
        assert torch.equal(out.slot_to_expert, again.slot_to_expert)
        mean = load.sum(1) / W
        allowed = peak(load, plan_placement(load, S, N, W).slot_to_expert.numpy(), W) + (tol + 1e-9) * mean
        mine = peak(load, out.slot_to_expert.numpy(), W)
        if budget is None:
            assert (mine <= allowed).all(), (case, E, W, N, S, tol)
        else:
            assert (out.moves(prev).numpy() <= np.floor(budget * S + 1e-9)).all(), (case, budget)
            assert (mine <= np.maximum(peak(load, prev.slot_to_expert.numpy(), W), allowed)).all(), case


@pytest.mark.parametrize("scale_exponent", [-1000, -500, -30, 30, 500])
def test_plans_do_not_depend_on_the_load_unit(scale_exponent):
    # tokens, fractions or routing probabilities: scaling by a power of two is exact in floating
    # point, so a planner whose every comparison is relative returns the same slots, with
    # previous and fresh (an absolute slack once kept a previous 1.8 above the mean at 1e-300)
    rng = np.random.default_rng(17)
    load = rng.lognormal(0, 1.5, (3, 128)) * 1000
    moved = load * rng.uniform(0.9, 1.1, load.shape)
    prev = plan_placement(load, 288, 4, 32)
    kept = plan_placement(moved, 288, 4, 32, previous=prev)
    assert int(kept.moves(prev).sum()) > 0  # the refit runs
    c = 2.0 ** scale_exponent
    prev_scaled = plan_placement(load * c, 288, 4, 32)
    assert torch.equal(prev_scaled.slot_to_expert, prev.slot_to_expert)
    assert torch.equal(plan_placement(moved * c, 288, 4, 32, previous=prev_scaled).slot_to_expert, kept.slot_to_expert)


@pytest.mark.parametrize("budget", [-0.1, 1.5, float("nan"), "0.1", True])
def test_invalid_move_budget_is_named(budget):
    prev = plan_placement(np.ones((2, 8)), 8, 1, 2)
    with pytest.raises(ValueError, match="move_budget"):
        plan_placement(np.ones((2, 8)), 8, 1, 2, previous=prev, move_budget=budget)


@pytest.mark.parametrize("pattern, W, S", [("zipf-1.0", 32, 288), ("uniform-noise", 64, 320), ("two-hot", 16, 320)])
def test_walk_back_turns_slots_back_within_the_allowed_peak(pattern, W, S):
    # the fresh plan of a perturbed load (unaligned: most slots differ from previous) walked
    # back toward previous: fewer changed slots, still within the allowed peak, no expert lost
    load = sample_load(pattern, 2, 256, 8, 4096 * W, seed=21).numpy()
    prev = _planner.plan_fresh(load, S, 1, W)
    new_load = load * np.random.default_rng(22).uniform(0.9, 1.1, load.shape)
    fresh = _planner.plan_fresh(new_load, S, 1, W)
    allowed = peak(new_load, fresh, W) + 0.01 * new_load.sum(1) / W
    walked = _planner.walk_back(new_load, prev, fresh, allowed, W)
    assert (peak(new_load, walked, W) <= allowed + 1e-9).all()
    assert ((walked != prev).sum(1) < (fresh != prev).sum(1) // 2).all()
    for layer in range(2):
        assert np.bincount(walked[layer], minlength=256).min() >= 1
    # nothing to turn back: previous itself stays as it is
    same = _planner.walk_back(new_load, prev, prev, np.full(2, np.inf), W)
    assert (same == prev).all()
    # an allowed peak the start already meets exactly: no move may raise any rank above it
    tight = _planner.walk_back(new_load, prev, fresh, peak(new_load, fresh, W), W)
    assert (peak(new_load, tight, W) <= peak(new_load, fresh, W) + 1e-9).all()
    assert ((tight != prev).sum(1) <= (fresh != prev).sum(1)).all()


def test_alignment_permutes_without_changing_balance():
    # a previous placement with the same content but ranks and slots shuffled: the new plan
    # is matched back onto it, so (almost) nothing moves although the fresh plan differs
    load = _zipf_load(2, 32, 1.0, seed=7)
    fresh = plan_placement(load, 48, 2, 8)
    perm = torch.tensor([1, 0, 3, 2, 6, 7, 5, 4])  # ranks permuted within their node
    shuffled = _rank_experts(fresh)[:, perm].flip(-1).reshape(2, 48).contiguous()
    prev = Placement(shuffled, 8, 2, 32)
    out = plan_placement(load * 1.0, 48, 2, 8, previous=prev)
    assert out.moves(prev).tolist() == [0, 0]
    assert torch.allclose(rank_loads(load, out, 8).sort(1).values, rank_loads(load, fresh, 8).sort(1).values)


# ----------------------------------------------------------------------------- metrics

def test_metrics_hand_checked():
    load = torch.tensor([[4, 2, 2, 0]])
    s2e = torch.tensor([[0, 1, 0, 2, 3, 3]])  # expert 0 twice, expert 3 twice
    assert slot_loads(load, s2e).tolist() == [[2.0, 2.0, 2.0, 2.0, 0.0, 0.0]]
    ranks = rank_loads(load, s2e, 3)
    assert ranks.dtype == torch.float64 and ranks.tolist() == [[4.0, 4.0, 0.0]]
    assert float(imbalance_ratio(ranks)[0]) == pytest.approx(0.5)
    assert default_rank_loads(torch.tensor([[1, 2, 3, 4]]), 2).tolist() == [[3.0, 7.0]]
    z = imbalance_ratio(torch.zeros(2, 3))
    assert isinstance(z, torch.Tensor) and z.tolist() == [0.0, 0.0]
    n = imbalance_ratio(np.array([[1.0, 3.0], [2.0, 2.0]]))
    assert isinstance(n, np.ndarray) and n.tolist() == [0.5, 0.0]
    assert imbalance_ratio(torch.tensor([[1.0, 2.0], [3.0, 1.0]]), dim=0).tolist() == pytest.approx([0.5, 1 / 3])


def test_summarize_and_scalars():
    load = np.array([[10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]])
    after = plan_placement(load, 8, 1, 4)
    s = summarize(load, None, after)  # before: identity = default placement (S == E)
    # 17 tokens on 4 ranks: mean 4.25; 10 shares its rank with a 1 either way
    assert s["imbalance_rank_before"] == pytest.approx([(11 - 4.25) / 4.25])
    assert s["imbalance_rank_after"] == pytest.approx([(11 - 4.25) / 4.25])
    assert s["imbalance_slot_before"] == pytest.approx([(10 - 2.125) / 2.125])
    assert s["std_rank_before"] == pytest.approx([np.std([11, 2, 2, 2])])
    assert s["moves"] == [int(after.moves(Placement.identity(1, 8, 8, 4, 1))[0])]
    flat = scalars(s)
    assert flat["balancer/layer_0/imbalance_rank_after"] == pytest.approx(s["imbalance_rank_after"][0])
    assert flat["balancer/mean/imbalance_slot_before"] == pytest.approx(s["imbalance_slot_before"][0])
    assert "balancer/total/moves" in flat and all(isinstance(v, float) for v in flat.values())
    assert set(scalars(s, prefix="moe")) == {k.replace("balancer/", "moe/", 1) for k in flat}
    numbered = scalars(s, layer_numbers=[7])  # the model's layer number, not the index
    assert numbered["balancer/layer_7/imbalance_rank_after"] == flat["balancer/layer_0/imbalance_rank_after"]
    assert not any("layer_0" in k for k in numbered)
    with pytest.raises(ValueError, match="layer_numbers has 2 entries for 1 layers"):
        scalars(s, layer_numbers=[1, 2])


# ----------------------------------------------------------------------------- refit lower bound

def _allowed(load, S, N, W, tolerance=DEFAULT_TOLERANCE):
    """The allowed peak plan_placement(previous=) refits to."""
    mean = load.sum(1) / W
    return peak(load, plan_placement(load, S, N, W).slot_to_expert.numpy(), W) + (tolerance + 1e-9) * mean


def _fewest_changes(load_E, prev_S, W, allowed):
    """Exact (brute force): fewest slots any placement with every expert and peak <= allowed changes,
    and the fewest among those that keep every expert's copy count (S + 1: none)."""
    import itertools

    E, S = load_E.shape[0], prev_S.shape[0]
    counts = np.bincount(prev_S, minlength=E)
    best = kept = S + 1
    for cand in itertools.product(range(E), repeat=S):
        changes = sum(a != b for a, b in zip(cand, prev_S))
        if changes >= max(best, kept):
            continue
        cand = np.array(cand)
        c = np.bincount(cand, minlength=E)
        if c.min() >= 1 and peak(load_E[None], cand[None], W)[0] <= allowed:
            best = min(best, changes)
            if (c == counts).all():
                kept = min(kept, changes)
    return best, kept


def test_refit_bound_hand_checked_without_spare_slots():
    # S = E: copies cannot change, so the over-loaded rank changes a slot and so does a rank
    # with room to take its excess: 2 (one swap)
    load = np.array([[6.0, 5.0, 1.0, 2.0]])
    prev = np.array([[0, 1, 2, 3]])  # ranks 11 and 3, mean 7
    assert refit_lower_bound(load, prev, 2, 8.0).tolist() == [2]
    assert refit_lower_bound(load, prev, 2, 11.0).tolist() == [0]  # nothing over the allowed peak
    # three over-loaded ranks (excess 1 each) and rooms 2, 1, 0.5: |O| + 2 ranks to take 3
    load = np.array([[5.0, 5.0, 5.0, 2.0, 3.0, 3.5]])
    prev = np.array([[0, 1, 2, 3, 4, 5]])
    assert refit_lower_bound(load, prev, 6, 4.0).tolist() == [5]


def test_refit_bound_with_copy_counts_kept():
    # ranks [A, B] [A, C] [D, D]: loads A 4 (2 copies), B 2, C 2, D 2 (2 copies): ranks 4, 4, 2,
    # allowed 3.5. A third copy of A in place of a D relieves both over-loaded ranks (3.33 each,
    # the third rank 3.33): one changed slot. Keeping every copy count, both over-loaded ranks
    # change and so does the third, the only one with room: 3 (here no such plan exists at all)
    load = np.array([[4.0, 2.0, 2.0, 2.0]])
    prev = np.array([[0, 1, 0, 2, 3, 3]])
    assert refit_lower_bound(load, prev, 3, 3.5).tolist() == [1]
    assert refit_lower_bound(load, prev, 3, 3.5, keep_counts=True).tolist() == [3]
    assert _fewest_changes(load[0], prev[0], 3, 3.5) == (1, 7)
    # without spare slots no count can change: both bounds agree
    load = np.array([[5.0, 5.0, 5.0, 2.0, 3.0, 3.5]])
    prev = np.array([[0, 1, 2, 3, 4, 5]])
    assert refit_lower_bound(load, prev, 6, 4.0, keep_counts=True).tolist() == [5]


@pytest.mark.slow  # the full tier (scripts/test.sh --full): an exact search
def test_refit_bound_is_below_the_exact_fewest_changes_and_the_planner_meets_it():
    # tiny layouts solved by enumerating every placement: bound <= exact <= planner's moves, and
    # without spare slots (where the bound counts ranks that must change) the planner is exact
    rng = np.random.default_rng(5)
    checked = exact_hits = kept_count = 0
    for E, W, S in [(4, 2, 4), (6, 3, 6), (4, 2, 6), (3, 3, 6), (4, 4, 8)]:
        for _ in range(6):
            load = rng.integers(1, 20, size=(1, E)).astype(np.float64)
            prev = plan_placement(load, S, 1, W)
            moved = load * rng.uniform(0.6, 1.4, load.shape)
            allowed = _allowed(moved, S, 1, W)
            kept = plan_placement(moved, S, 1, W, previous=prev)
            moves = int(kept.moves(prev)[0])
            exact, exact_kept = _fewest_changes(moved[0], prev.slot_to_expert[0].numpy(), W, allowed[0])
            bound = int(refit_lower_bound(moved, prev.slot_to_expert.numpy(), W, allowed)[0])
            bound_kept = int(refit_lower_bound(moved, prev.slot_to_expert.numpy(), W, allowed, keep_counts=True)[0])
            assert bound <= exact <= moves, (E, W, S, bound, exact, moves)
            assert bound <= bound_kept <= exact_kept and exact <= exact_kept, (E, W, S, bound_kept, exact_kept)
            kept_count += bound_kept > bound
            assert peak(moved, kept.slot_to_expert.numpy(), W)[0] <= allowed[0]
            checked += 1
            exact_hits += moves == exact
    # measured: 29 of 30; the miss needs a second copy of an expert on one rank, never added
    assert checked == 30 and exact_hits >= 29
    assert kept_count >= 1  # keeping the counts raises the bound somewhere: the check above is not vacuous


@pytest.mark.parametrize("pattern, W, S", [("uniform-noise", 64, 256), ("zipf-0.6", 64, 320), ("two-hot", 32, 288)])
def test_refit_bound_never_above_the_planner_moves(pattern, W, S):
    load = sample_load(pattern, 2, 256, 8, 4096 * W, seed=W).numpy()
    first = plan_placement(load, S, 1, W)
    moved = load * np.random.default_rng(W).uniform(0.9, 1.1, load.shape)
    allowed = _allowed(moved, S, 1, W)
    kept = plan_placement(moved, S, 1, W, previous=first)
    bound = refit_lower_bound(moved, first.slot_to_expert.numpy(), W, allowed)
    moves = kept.moves(first).numpy()
    assert (bound <= moves).all() and (bound >= 1).all(), (bound, moves)
    assert (peak(moved, kept.slot_to_expert.numpy(), W) <= allowed).all()
    over = [len(over_loaded_ranks(moved[l], first.slot_to_expert[l].numpy(), W, allowed[l])) for l in range(2)]
    # chains through over-loaded ranks: fewer changed slots than one swap (two) per such rank
    assert (moves < 2 * np.array(over)).all(), (moves, over)
    if S == 256:  # S = E: every over-loaded rank changes a slot
        assert (bound >= np.array(over)).all()
