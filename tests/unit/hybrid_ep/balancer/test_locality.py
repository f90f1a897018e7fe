"""The node-aware plan (plan_placement's rdma_weight), the load model of the replica choice by
locality (metrics, nodes=N) and the traffic of a routing through a placement: the node bound
of node-limited routing holds after any plan except for the experts the report names, the
model is what routing measures, RDMA bytes follow the plan."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from hybrid_ep.balancer.cli import main as balance_main
from hybrid_ep.balancer.knobs import DEFAULT_RDMA_WEIGHT
from hybrid_ep.balancer.metrics import imbalance_ratio, off_home, rank_loads, slot_loads
from hybrid_ep.balancer.placement import Placement
from hybrid_ep.balancer.planner import objective, plan_placement
from hybrid_ep.balancer.report import save_statistics
from hybrid_ep.synthetic import sample_topk, zipf_popularity
from hybrid_ep.traffic.cli import main as traffic_main
from hybrid_ep.traffic.placement import PlacementShape, placement_traffic, routing_from_load, slot_routings

pytestmark = pytest.mark.unit

E, K = 64, 4


def group_limited(W: int, N: int, T: int, exponent: float, seed: int, limit: int = 2) -> list[torch.Tensor]:
    """[T, K] per rank: Zipf popularity, groups = nodes, a token's routes in its `limit` best groups."""
    gen = torch.Generator().manual_seed(seed)
    pop = zipf_popularity(E, exponent, gen)
    return [sample_topk(T, E, K, gen, popularity=pop, num_groups=N, topk_groups=limit) for _ in range(W)]


def counts(routing) -> np.ndarray:
    return np.bincount(torch.cat(routing).reshape(-1).numpy(), minlength=E).astype(np.float64)


def test_slot_loads_by_locality_hand_checked():
    """E = 4 on 2 nodes of one rank, 3 slots each (node 0: slots 0-2), row 0 1 1 | 0 3 2. Expert
    0 (home node 0): a copy on both nodes, so each node's half stays on it: 5 and 5. Expert 1
    (home 0): two copies on node 0, none on 1: all 8 on node 0, 4 per copy. Experts 2 and 3
    (home 1): one copy each on node 1: 6 and 4. Every expert's routes stay on its home node or
    their own."""
    load = torch.tensor([10.0, 8.0, 6.0, 4.0])
    row = torch.tensor([0, 1, 1, 0, 3, 3])
    with pytest.raises(ValueError, match="slot_to_expert: layer 0 has no slot for expert 2"):
        Placement(row[None], 2, 2, 4).validate()
    row = torch.tensor([0, 1, 2, 0, 3, 3])
    assert slot_loads(load, row).tolist() == [[5.0, 8.0, 6.0, 5.0, 2.0, 2.0]]  # spreading: load / copies
    row = torch.tensor([0, 1, 1, 0, 3, 2])
    assert slot_loads(load, row, nodes=2).tolist() == [[5.0, 4.0, 4.0, 5.0, 4.0, 6.0]]
    assert rank_loads(load, row, 2, nodes=2).tolist() == [[13.0, 15.0]]
    # experts 1 (home 0) on node 1 only, 2 and 3 (home 1) on node 0 only: the other node's half
    # of each is served off its home node
    moved = torch.tensor([0, 2, 3, 0, 1, 1])
    assert off_home(load, moved, 2).tolist() == [[0.0, 4.0, 3.0, 2.0]]
    assert off_home(load, row, 2).tolist() == [[0.0, 0.0, 0.0, 0.0]]


def test_the_locality_model_is_what_routing_measures():
    """Every rank routes the same tokens, so each node sends exactly 1 / N of every expert's
    routes: the routes each rank receives through the slots equal rank_loads(nodes=N), to
    within one route per source rank and copy (the ordinal rule's remainders)."""
    W, N = 8, 4
    base = group_limited(1, N, 400, 1.0, seed=3)[0]
    routing = [base] * W
    load = counts(routing)
    p = plan_placement(load, E + W, N, W, rdma_weight=DEFAULT_RDMA_WEIGHT)
    slots = slot_routings(routing, p.slot_to_expert[0], W, N)
    got = np.bincount(torch.cat(slots).reshape(-1).numpy() // ((E + W) // W), minlength=W)
    want = rank_loads(load, p, W, nodes=N)[0].numpy()
    assert np.abs(got - want).max() <= W * (E + W) // W
    assert got.sum() == load.sum()


@pytest.mark.parametrize("W, N, S, exponent", [(8, 4, 72, 1.2), (16, 4, 80, 0.8), (16, 8, 64, 1.6)])
def test_node_bound_holds_unless_the_report_names_the_expert(W, N, S, exponent):
    """Groups = nodes, a token's routes in its 2 best groups: under the default placement it reaches
    at most 2 nodes. Through any node-aware plan, routed by locality, a token reaches more only
    by a route to an expert that metrics.off_home (the report's list) names."""
    routing = group_limited(W, N, 300, exponent, seed=W + N)
    load = counts(routing)
    earlier = load * np.random.default_rng(W).uniform(0.5, 1.5, load.shape)  # a previous plan's load
    plans = [plan_placement(load, S, N, W, rdma_weight=w) for w in (0.0, DEFAULT_RDMA_WEIGHT, 4.0)]
    plans += [plan_placement(load, S, N, W, rdma_weight=w, tolerance=t,
                             previous=plan_placement(earlier, S, N, W, rdma_weight=w))
              for w in (0.0, DEFAULT_RDMA_WEIGHT) for t in (0.0, 0.05)]
    for weight, p in enumerate(plans):
        named = set(torch.nonzero(off_home(load, p, N)[0] > 0).flatten().tolist())
        slots = slot_routings(routing, p.slot_to_expert[0], W, N)
        for r, (experts, s) in enumerate(zip(routing, slots)):
            nodes = s // (S // N)
            reached = torch.stack([(nodes == n).any(1) for n in range(N)], 1)
            reached[:, r // (W // N)] = False  # own node: no RDMA
            over = reached.sum(1) > 2
            for t in torch.nonzero(over).flatten().tolist():
                assert named & set(experts[t].tolist()), (weight, r, t, experts[t].tolist(), nodes[t].tolist())


def test_node_aware_plan_keeps_the_node_bound_where_moves_cost_more():
    """A high weight keeps every expert's primary at home (no route leaves its node bound) and
    still lowers the imbalance below the default placement's with satellites; weight 0 moves
    experts where that evens the nodes."""
    W, N, S = 16, 4, 80
    load = counts(group_limited(W, N, 400, 1.2, seed=1))
    identity = Placement.identity(1, E, S, W, N)
    high = plan_placement(load, S, N, W, rdma_weight=1e6)
    assert float(off_home(load, high, N).sum()) == 0.0
    assert float(imbalance_ratio(rank_loads(load, high, W, nodes=N))) < 0.5 * float(
        imbalance_ratio(rank_loads(load, identity, W, nodes=N)))
    free = plan_placement(load, S, N, W, rdma_weight=0.0)
    imb_free, _ = objective(load[None], free.slot_to_expert.numpy(), N, W, 0.0)
    imb_high, _ = objective(load[None], high.slot_to_expert.numpy(), N, W, 0.0)
    assert imb_free[0] <= imb_high[0] + 1e-12


def rdma_per_token(routing, row, W: int, N: int, locality: bool) -> float:
    """Mean RDMA bytes a rank sends per token in dispatch (hierarchical scheme, bf16 rows of 64)."""
    t = placement_traffic(routing, row, PlacementShape(W, W // N, len(row), 64), locality=locality)
    return t["bytes_per_token"]["dispatch"]["hierarchical_rdma"]["mean"]


@pytest.mark.parametrize("W, N, hot", [(16, 4, 2.0), (16, 8, 2.0), (32, 8, 3.0), (16, 4, 1.0)])
def test_permutation_plan_adds_at_most_2_percent_rdma(W, N, hot):
    """No spare slots (S = E): the plan only permutes experts, and an expert off its home node
    costs RDMA rows. Group-limited routing with one node's experts `hot` times as popular (the
    nodes' loads uneven, so balancing them tempts moves): the node-aware plan sends at most
    1.02x the default placement's RDMA bytes per token, where the node-agnostic plan, which
    evens the nodes, sends more than that; and it is no more imbalanced than the default."""
    gen = torch.Generator().manual_seed(W + N)
    pop = zipf_popularity(E, 0.6, gen)
    pop[: E // N] *= hot
    routing = [sample_topk(400, E, K, gen, popularity=pop, num_groups=N, topk_groups=2) for _ in range(W)]
    load = counts(routing)
    identity = Placement.identity(1, E, E, W, N).slot_to_expert[0]
    default = rdma_per_token(routing, identity, W, N, locality=False)
    for weight in (0.0, DEFAULT_RDMA_WEIGHT, 4.0):
        row = plan_placement(load, E, N, W, rdma_weight=weight).slot_to_expert[0]
        assert rdma_per_token(routing, row, W, N, locality=True) <= 1.02 * default, weight
        imbalance = float(imbalance_ratio(rank_loads(load, row, W, nodes=N)))
        assert imbalance <= float(imbalance_ratio(rank_loads(load, identity, W))) + 1e-12
    agnostic = plan_placement(load, E, N, W).slot_to_expert[0]
    assert rdma_per_token(routing, agnostic, W, N, locality=False) > 1.02 * default


def test_node_aware_plan_is_valid_deterministic_and_node_agnostic_on_one_node():
    W, N, S = 16, 4, 80
    load = counts(group_limited(W, N, 200, 1.0, seed=2))
    a = plan_placement(np.stack([load, load[::-1]]), S, N, W, rdma_weight=0.5)
    b = plan_placement(torch.from_numpy(np.stack([load, load[::-1]])), S, N, W, rdma_weight=0.5)
    assert torch.equal(a.slot_to_expert, b.slot_to_expert)
    assert (a.expert_replicas >= 1).all() and a.slot_to_expert.shape == (2, S)
    one = plan_placement(load, S, 1, W, rdma_weight=0.5)  # one node: the plan the weight does not change
    assert torch.equal(one.slot_to_expert, plan_placement(load, S, 1, W).slot_to_expert)
    for bad in (-1.0, float("nan"), float("inf"), "0.5"):
        with pytest.raises(ValueError, match="rdma_weight must be a finite number >= 0"):
            plan_placement(load, S, N, W, rdma_weight=bad)


def test_node_aware_plan_with_previous_keeps_it_and_stays_within_tolerance():
    W, N, S = 16, 4, 80
    load = np.stack([counts(group_limited(W, N, 300, z, seed=i)) for i, z in enumerate((0.8, 1.2, 1.6))])
    first = plan_placement(load, S, N, W, rdma_weight=0.5)
    assert plan_placement(load, S, N, W, previous=first, rdma_weight=0.5) is first
    moved = load * np.random.default_rng(0).uniform(0.9, 1.1, load.shape)
    fresh = plan_placement(moved, S, N, W, rdma_weight=0.5)
    kept = plan_placement(moved, S, N, W, previous=first, rdma_weight=0.5)
    imb_kept, cost_kept = objective(moved, kept.slot_to_expert.numpy(), N, W, 0.5)
    imb_fresh, cost_fresh = objective(moved, fresh.slot_to_expert.numpy(), N, W, 0.5)
    assert (imb_kept <= imb_fresh + 0.01 + 1e-9).all() and (cost_kept <= cost_fresh + 0.01 + 1e-9).all()
    capped = plan_placement(moved, S, N, W, previous=first, rdma_weight=0.5, move_budget=0.1)
    per_node = (capped.slot_to_expert != first.slot_to_expert).view(3, N, S // N).sum(2)
    assert int(per_node.max()) <= int(0.1 * S / N)


def test_traffic_through_the_identity_placement_equals_the_model_without_one():
    """With S = E the identity placement is the placement without a balancer: same bytes."""
    from hybrid_ep.config import BufferConfig
    from hybrid_ep.traffic.cli import summarize

    W, N = 8, 2
    routing = group_limited(W, N, 50, 1.0, seed=4)
    ident = Placement.identity(1, E, E, W, N).slot_to_expert[0]
    t = placement_traffic(routing, ident, PlacementShape(W, W // N, E, 256))
    plain = summarize(routing, BufferConfig(256, 50, E, W, W // N).validate(), torch.bfloat16, torch.bfloat16)
    assert t["bytes_per_token"] == plain["bytes_per_token"]
    assert t["routes_per_rank"] == torch.bincount(torch.cat(routing).reshape(-1) // (E // W), minlength=W).tolist()


def test_locality_takes_rdma_rows_off_a_replicated_expert():
    """Every token routes to expert 0, which has a copy on both nodes: by locality no row of it
    crosses; spread over its copies, a share does."""
    W, N, S = 4, 2, 2 * E
    row = torch.cat([torch.arange(E), torch.arange(E)])  # every expert twice: once per node
    idx = [torch.zeros(30, 1, dtype=torch.int64)] * W
    shape = PlacementShape(W, W // N, S, 128)
    local = placement_traffic(idx, row, shape, locality=True)
    spread = placement_traffic(idx, row, shape, locality=False)
    assert local["bytes_per_token"]["dispatch"]["hierarchical_rdma"]["mean"] == 0
    assert spread["bytes_per_token"]["dispatch"]["hierarchical_rdma"]["mean"] > 0


def test_routing_from_load_follows_it_and_its_groups():
    load = np.zeros(E)
    load[:16] = np.arange(16, 0, -1)  # only the first 16 experts have tokens
    routing = routing_from_load(load, 2, 200, K, seed=0)
    assert int(torch.cat(routing).max()) < 16
    grouped = routing_from_load(np.ones(E), 2, 200, K, seed=0, routing="group-limited", num_groups=8, group_limit=2)
    assert all(len(set((r // 8).tolist())) <= 2 for r in torch.cat(grouped))
    with pytest.raises(ValueError, match="routing must be one of"):
        routing_from_load(load, 2, 10, K, seed=0, routing="zipf")


def test_balance_cli_names_the_experts_off_their_node_and_reports_traffic(tmp_path, capsys):
    W, N = 16, 4
    load = np.stack([counts(group_limited(W, N, 200, z, seed=int(z * 10))) for z in (0.8, 1.6)])
    stats = save_statistics(str(tmp_path / "stats.npz"), load, ep_size=W, layer_numbers=np.array([3, 5]))
    out = str(tmp_path / "plan.yaml")
    assert balance_main(["plan", "--stats", stats, "--slots-per-rank", "5", "--ranks-per-node", "4", "--out", out,
                         "--rdma-weight", "0", "--traffic", "group-limited", "--topk", str(K), "--group-limit", "2",
                         "--traffic-tokens", "50", "--hidden", "128"]) == 0
    text = capsys.readouterr().out
    p = Placement(torch.from_numpy(np.zeros((2, 80), dtype=np.int64)), W, N, E)  # shapes only
    away = off_home(load, plan_placement(load, p.num_slots, N, W, rdma_weight=0.0), N)
    assert (away > 0).any()
    for layer, expert in zip(*np.nonzero(away.numpy() > 0)):
        routes = float(away[layer, expert])
        per_token = routes / (load[layer].sum() / K) * 128 * 2  # at most one bf16 row of 128 per route
        assert (f"layer {(3, 5)[layer]} expert {expert} (home node {expert // (E // N)}): {routes:.0f} routes, "
                f"<= {per_token:,.0f} B per token") in text
    assert "traffic (group-limited routing" in text and "mean RDMA bytes per token: plan" in text
    assert balance_main(["plan", "--stats", stats, "--slots-per-rank", "5", "--out", out, "--rdma-weight", "-1"]) == 2
    assert "--rdma-weight: must be a finite number >= 0" in capsys.readouterr().err


def test_traffic_cli_routes_through_a_placement(tmp_path, capsys):
    from hybrid_ep.balancer.placement_file import save_placement_yaml

    W, N = 8, 2
    load = counts(group_limited(W, N, 100, 1.2, seed=7))
    stats = save_statistics(str(tmp_path / "stats.npz"), load[None], ep_size=W)
    path = str(tmp_path / "p.yaml")
    save_placement_yaml(plan_placement(load, E + W, N, W, rdma_weight=0.5), path)
    common = ["--nodes", "2", "--ranks-per-node", "4", "--experts", str(E), "--topk", str(K), "--hidden", "128",
              "--tokens", "40", "--routing", "group-limited", "--group-limit", "1"]
    assert traffic_main(common + ["--popularity", "stats", "--stats", stats, "--placement", path]) == 0
    text = capsys.readouterr().out
    assert f"placement {path} (first layer, replica choice locality): dispatch RDMA" in text
    ratio = float(re.search(r"bytes per token, ([0-9.]+)x the", text).group(1))
    assert ratio <= 1.0  # one group per token: its home node, or copies on the token's own node
    with pytest.raises(SystemExit):
        traffic_main(common[:2] + ["--ranks-per-node", "2"] + common[4:] + ["--placement", path])
    assert "--placement" in capsys.readouterr().err


def test_destination_counts_equal_the_models_count_tables():
    from hybrid_ep.config import BufferConfig
    from hybrid_ep.traffic.model import count_tables
    from hybrid_ep.traffic.placement import destination_counts

    W, G, S = 8, 4, 96
    gen = torch.Generator().manual_seed(0)
    idx = [torch.stack([torch.randperm(S, generator=gen)[:K] for _ in range(t)]) if t else torch.zeros(0, K).long()
           for t in (30, 0, 17, 25, 30, 2, 9, 30)]
    idx[0][::3, 1] = -1  # dropped routes
    want = count_tables(idx, BufferConfig(128, 30, S, W, G).validate())
    got = destination_counts(idx, S, W, G)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
