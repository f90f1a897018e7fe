"""Expert balancer pieces that need no Megatron: slot routing, statistics, migration,
replica gradient sums, what a slot holds, and the absence of per-step host syncs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness import migration as mig
from hybrid_ep.balancer import (
    LoadStatistics,
    OptimizerView,
    SlotTable,
    TorchOptimizerView,
    native_placement,
    plan_transfers,
    route_to_slots,
    route_topk_to_slots,
    slot_parameters,
)
from hybrid_ep.balancer.migration import migrate_slots_, sum_replica_grads_
from hybrid_ep.balancer.state import MegatronOptimizerView, movable_tensors

pytestmark = pytest.mark.unit


def table(row, E):
    return SlotTable(E, len(row)).load_(torch.tensor(row))


def test_slot_table_replicas_and_in_place_update():
    t = table([0, 1, 2, 3, 0, 0, 2, 1], 4)
    storage = t.expert_slots_ER.data_ptr()
    assert t.replicas_E.tolist() == [3, 2, 2, 1]
    assert t.expert_slots_ER[0].tolist()[:3] == [0, 4, 5]
    assert t.expert_slots_ER[3].tolist()[0] == 3
    t.load_(torch.tensor([3, 2, 1, 0, 1, 1, 1, 1]))
    assert t.expert_slots_ER.data_ptr() == storage
    assert t.replicas_E.tolist() == [1, 5, 1, 1]


@pytest.mark.parametrize("row, message", [
    ([0, 1, 2, 2], "without a slot"),
    ([0, 1, 2, 7], "outside"),
])
def test_slot_table_rejects_bad_rows(row, message):
    with pytest.raises(ValueError, match=message):
        table(row, 4)


def test_route_to_slots_keeps_routes_and_probs():
    g = torch.Generator().manual_seed(0)
    T, E = 37, 6
    row = [0, 1, 2, 3, 4, 5, 0, 0, 3]
    t = table(row, E)
    scores = torch.rand(T, E, generator=g)
    idx = scores.topk(2, dim=1).indices
    rm = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.rand(T, E, generator=g)
    map_TS, probs_TS = route_to_slots(rm, probs, t, rank=1)
    slot_expert = torch.tensor(row)
    # Every route lands in exactly one slot of its expert, with its prob.
    for tok in range(T):
        for e in range(E):
            hits = [s for s in range(len(row)) if map_TS[tok, s] and row[s] == e]
            assert len(hits) == int(rm[tok, e])
            if hits:
                assert probs_TS[tok, hits[0]] == probs[tok, e]
    assert int(map_TS.sum()) == int(rm.sum())
    assert torch.all(probs_TS[~map_TS] == 0)
    assert slot_expert.numel() == map_TS.shape[1]


def test_route_to_slots_splits_replicas_evenly_and_deterministically():
    T, E = 1000, 4
    row = [0, 1, 2, 3, 0, 0]
    t = table(row, E)
    rm = torch.zeros(T, E, dtype=torch.bool)
    rm[:, 0] = True  # every token routes to expert 0 (3 replicas)
    probs = torch.ones(T, E)
    per_slot = route_to_slots(rm, probs, t, rank=2)[0].sum(0)
    assert per_slot[[0, 4, 5]].tolist() in ([334, 333, 333], [333, 334, 333], [333, 333, 334])
    again = route_to_slots(rm, probs, t, rank=2)[0]
    assert torch.equal(again.sum(0), per_slot)
    # Another source rank starts at another replica, so remainders spread.
    other = route_to_slots(rm[:1], probs[:1], t, rank=3)[0]
    first = route_to_slots(rm[:1], probs[:1], t, rank=2)[0]
    assert not torch.equal(other, first)


def test_route_to_slots_gradient_reaches_expert_probs():
    rm = torch.tensor([[True, False, True], [False, True, True]])
    probs = torch.rand(2, 3, requires_grad=True)
    t = table([0, 1, 2, 2, 0, 1], 3)
    _, probs_TS = route_to_slots(rm, probs, t, rank=0)
    (probs_TS * torch.arange(1.0, 7.0)).sum().backward()
    assert torch.all(probs.grad[~rm] == 0)
    assert torch.all(probs.grad[rm] > 0)


def test_route_topk_to_slots_matches_routing_map_form():
    g = torch.Generator().manual_seed(3)
    T, E, K = 50, 8, 3
    t = table(list(range(E)) + [1, 1, 5, 7], E)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    idx[::7, 1] = -1
    slots = route_topk_to_slots(idx, t, rank=1)
    assert torch.equal(slots < 0, idx < 0)
    row = t.slot_to_expert_S
    assert torch.equal(row[slots[idx >= 0]], idx[idx >= 0])
    counts = torch.bincount(slots[slots >= 0], minlength=12)
    ones = counts[[1, 8, 9]]
    assert int(ones.max() - ones.min()) <= 1


def test_topk_to_slots_checks_expert_ids():
    """A token's two routes to one replicated expert would become two distinct slots, past any
    later duplicate check; ids below -1 were taken as dropped, ids >= E failed in one_hot."""
    t = table(list(range(4)) + [0, 0], 4)
    with pytest.raises(ValueError, match=r"routes token 1 to the same expert twice: \[0, 0\]"):
        route_topk_to_slots(torch.tensor([[1, 2], [0, 0]]), t, rank=0)
    for bad in (-5, 4):
        with pytest.raises(ValueError, match=r"topk_idx values must be in \[-1, 3\]"):
            route_topk_to_slots(torch.tensor([[1, bad]]), t, rank=0)
    assert route_topk_to_slots(torch.tensor([[-1, -1], [0, 1]]), t, rank=0)[0].tolist() == [-1, -1]


def test_table_without_a_placement_refuses_to_route():
    """A fresh table maps every expert to slot 0: routes merged silently (a forward before attach)."""
    t = SlotTable(4, 6)
    with pytest.raises(RuntimeError, match="no placement yet.*attach"):
        route_to_slots(torch.eye(4, dtype=torch.bool), torch.rand(4, 4), t, rank=0)
    with pytest.raises(RuntimeError, match="no placement yet"):
        route_topk_to_slots(torch.tensor([[0, 1]]), t, rank=0)
    t.load_(torch.tensor([0, 1, 2, 3, 0, 1]))
    map_TS, _ = route_to_slots(torch.eye(4, dtype=torch.bool), torch.rand(4, 4), t, rank=0)
    assert int(map_TS.sum()) == 4


def test_statistics_window_and_decay():
    s = LoadStatistics(2, 3, window=2)
    for counts in ([1, 0, 2], [3, 3, 0], [0, 0, 6]):
        s.record(0, torch.tensor(counts))
        s.record(1, torch.tensor(counts) * 2)
        load = s.reduce()
    np.testing.assert_array_equal(load[0], [3, 3, 6])  # last two reductions
    np.testing.assert_array_equal(load[1], [6, 6, 12])
    assert s.history_array().shape == (3, 2, 3)
    assert int(s.counts_LE.sum()) == 0
    e = LoadStatistics(1, 2, decay=0.5)
    e.record(0, torch.tensor([4, 0]))
    e.reduce()
    e.record(0, torch.tensor([0, 4]))
    np.testing.assert_allclose(e.reduce()[0], [2.0, 2.0])
    with pytest.raises(ValueError, match="window"):
        LoadStatistics(1, 2, window=0)
    with pytest.raises(ValueError, match="decay"):
        LoadStatistics(1, 2, decay=1.5)


def test_per_step_work_has_no_host_read():
    """Statistics and slot routing run on the meta device, where any host read (.item(),
    .tolist(), bool(), .cpu() of data) raises: the per-step path holds none. (route_topk_to_slots,
    outside the Megatron path, checks its expert ids on the host.)"""
    T, E, S = 16, 8, 12
    t = SlotTable(E, S, device="meta")
    t.installed = True  # as load_ leaves it (meta tensors cannot be loaded)
    rm = torch.empty(T, E, dtype=torch.bool, device="meta")
    probs = torch.empty(T, E, device="meta", requires_grad=True)
    map_TS, probs_TS = route_to_slots(rm, probs, t, rank=1)
    probs_TS.sum().backward()
    assert map_TS.shape == (T, S) and map_TS.device.type == "meta"
    stats = LoadStatistics(3, E, device="meta")
    stats.record(1, rm.sum(dim=0))
    with pytest.raises((NotImplementedError, RuntimeError)):
        rm.sum().item()  # the probe really catches host reads
    # The replica-gradient sum reads only the host placement; grads are device tensors.
    grads = [[torch.empty(4, device="meta") for _ in range(3)]]
    placement = torch.tensor([[0, 1, 0]])
    assert sum_replica_grads_(placement, lambda l, j: [grads[l][j]], rank=0, num_ranks=1) == 1


def test_plan_transfers_prefers_local_copies_and_skips_unchanged():
    old = torch.tensor([[0, 1, 2, 3, 0, 1]])
    new = torch.tensor([[0, 1, 2, 3, 1, 3]])
    transfers = plan_transfers(old, new, num_ranks=2)  # P = 3
    # Slot 4 copies expert 1 from slot 5 on its own rank (before slot 5 is overwritten).
    assert {(t.src_slot, t.dst_slot) for t in transfers} == {(3, 5), (5, 4)}
    assert plan_transfers(old, old, 2) == []
    with pytest.raises(ValueError, match="no holder"):
        plan_transfers(torch.tensor([[0, 0, 1, 1]]), torch.tensor([[0, 2, 1, 1]]), 2)


def test_local_migration_handles_swaps_in_place():
    store = [[[mig.encoded(0, e, k) for k in range(len(mig.SHAPES))] for e in (0, 1, 2, 0)]]
    ids = [[id(x) for x in slot] for slot in store[0]]
    old = torch.tensor([[0, 1, 2, 0]])
    new = torch.tensor([[2, 0, 1, 1]])
    moved = migrate_slots_(lambda l, j: store[l][j], plan_transfers(old, new, 1), rank=0, num_ranks=1,
                           slots_per_rank=4)
    assert moved["local_copies"] == 4
    for j, e in enumerate(new[0].tolist()):
        for k, x in enumerate(store[0][j]):
            assert torch.equal(x, mig.encoded(0, e, k))
    assert ids == [[id(x) for x in slot] for slot in store[0]]


@pytest.mark.parametrize("world, experts, slots_per_rank, layers", [(2, 4, 3, 2), (3, 6, 3, 3), (4, 8, 2, 1)])
def test_migration_across_ranks(pool_for, world, experts, slots_per_rank, layers):
    out = pool_for(world).run(mig.migration_round_trip, [(11 + world, layers, experts, slots_per_rank, 4)] * world)
    assert all(r["bad"] == [] for r in out)
    assert all(r["same_tensors"] for r in out)
    assert sum(r["moved"] for r in out) > 0


@pytest.mark.parametrize("world", [2, 3])
def test_replica_gradients_are_summed(pool_for, world):
    out = pool_for(world).run(mig.replica_grad_sum, [(5, 2, 2 * world, 3)] * world)
    assert all(r["bad"] == [] for r in out)
    assert out[0]["summed"] > 0


def test_native_placement_marks_spare_slots_empty():
    rows = native_placement(2, 4, 6, 2)
    assert rows.tolist() == [[0, 1, -1, 2, 3, -1]] * 2


def test_slot_parameters_groups_sequential_and_grouped_names():
    seq = torch.nn.Module()
    seq.local_experts = torch.nn.ModuleList(torch.nn.Linear(3, 2) for _ in range(3))
    slots = slot_parameters(seq, 3)
    assert [len(s) for s in slots] == [2, 2, 2]
    assert slots[1][0] is seq.local_experts[1].bias
    grouped = torch.nn.Module()
    fc1 = torch.nn.Module()
    for j in range(2):
        fc1.register_parameter(f"weight{j}", torch.nn.Parameter(torch.zeros(4, 3)))
    grouped.linear_fc1 = fc1
    assert slot_parameters(grouped, 2)[1][0] is fc1.weight1
    fused = torch.nn.Module()
    fused.weight1 = torch.nn.Parameter(torch.zeros(3, 8))
    fused.weight = torch.nn.Parameter(torch.zeros(3, 8))
    with pytest.raises(ValueError, match="belongs to no single expert"):
        slot_parameters(fused, 2)


def test_optimizer_views_list_what_moves():
    p = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.Adam([p], lr=0.1)
    before = movable_tensors(p, TorchOptimizerView(opt))
    assert len(before) == 1 and before[0].data_ptr() == p.data_ptr()  # no state before a step
    p.grad = torch.ones(3)
    opt.step()
    moved = movable_tensors(p, TorchOptimizerView(opt))
    state = opt.state[p]
    assert len(moved) == 4  # weight, exp_avg, exp_avg_sq, step
    assert moved[1] is state["exp_avg"] and moved[2] is state["exp_avg_sq"] and moved[3] is state["step"]
    assert len(movable_tensors(p, OptimizerView())) == 1

    class FP32Optimizer:  # Megatron's unsharded fp32 optimizer: the torch optimizer inside
        optimizer = opt

    view = MegatronOptimizerView(FP32Optimizer()).use_for([p])
    assert not view.sharded and view.state(p) is state
    with pytest.raises(NotImplementedError, match="does not shard"):
        view.sharded_slice(p)
    g, offset, numel = view.grad_piece(p)
    assert g is p.grad and offset == 0 and numel == 3


def two_node_table(row, E, W=4):
    """Slots of `row` over W ranks on 2 nodes (node 0: the first half of the slots)."""
    return SlotTable(E, len(row)).set_shape(W, 2).load_(torch.tensor(row))


def test_route_takes_the_copy_on_the_tokens_own_node():
    """E = 4 on 2 nodes of 2 ranks, 3 slots per rank: expert 0 (home node 0) has copies in
    slots 0, 4 (node 0) and 7 (node 1). Ranks 0, 1 route to slots 0 and 4 only, ranks 2, 3
    to slot 7 only; an expert with one copy goes there from every node."""
    row = [0, 1, 2, 3, 0, 1, 2, 0, 3, 1, 2, 3]
    t = two_node_table(row, 4)
    T = 200
    idx = torch.stack([torch.zeros(T, dtype=torch.int64), torch.full((T,), 3)], dim=1)
    for rank in range(4):
        slots = route_topk_to_slots(idx, t, rank=rank)
        used = set(slots[:, 0].tolist())
        assert used == ({0, 4} if rank < 2 else {7}), (rank, used)
        assert set(slots[:, 1].tolist()) <= {3, 8, 11}
        assert torch.equal(t.slot_to_expert_S[slots], idx)  # every route reaches a copy of its expert
    # on node 0 the two local copies share the tokens evenly
    counts = torch.bincount(route_topk_to_slots(idx, t, rank=1)[:, 0], minlength=12)
    assert counts[[0, 4]].tolist() == [100, 100]


def test_route_without_a_local_copy_takes_the_primary_node():
    """Node 0 holds slots 0-5, node 1 slots 6-11; experts 0, 1 are at home on node 0, 2, 3 on
    node 1. Expert 3 lives on node 1 only (slots 8, 11): node 0's routes take its primary
    (home) node's copies, spread evenly. An expert whose home node holds no copy has the node
    with most copies as its primary."""
    row = [0, 1, 2, 0, 1, 0, 1, 0, 3, 2, 0, 3]
    t = two_node_table(row, 4)
    T = 120
    idx = torch.full((T, 1), 3)
    slots = route_topk_to_slots(idx, t, rank=0)[:, 0]
    assert torch.bincount(slots, minlength=12)[[8, 11]].tolist() == [60, 60]  # node 1's copies, primary
    # primary node: the home node when it holds a copy, else the node with most copies
    moved = two_node_table([2, 1, 2, 3, 0, 2, 1, 0, 3, 0, 1, 3], 4)  # expert 2: 3 copies on node 0, none on 1
    assert moved.route_count_NE[1, 2] == 3
    assert set(route_topk_to_slots(torch.full((30, 1), 2), moved, rank=3)[:, 0].tolist()) == {0, 2, 5}


def _old_spreading_rule(idx_TK, row, E, rank):
    """The replica rule before locality: the k-th route of this rank to e takes copy (k + rank) mod copies."""
    copies = [[s for s, x in enumerate(row) if x == e] for e in range(E)]
    seen = [0] * E
    out = torch.full_like(idx_TK, -1)
    for t in range(idx_TK.shape[0]):
        for k in range(idx_TK.shape[1]):
            e = int(idx_TK[t, k])
            if e >= 0:
                out[t, k] = copies[e][(seen[e] + rank) % len(copies[e])]
                seen[e] += 1
    return out


@pytest.mark.parametrize("nodes_row", [
    (1, [0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 3, 5]),  # one node: every copy is local
    (2, [0, 1, 2, 3, 0, 1, 4, 5, 6, 7, 5, 5]),  # 2 nodes, every expert's copies on one node
])
def test_route_is_the_spreading_rule_where_locality_leaves_no_choice(nodes_row):
    """Backward identical: on one node, and where all of an expert's copies share a node, the
    slots are those of the rule before locality, in both forms (topk ids and routing map)."""
    N, row = nodes_row
    E, g = 8, torch.Generator().manual_seed(5)
    t = SlotTable(E, len(row)).set_shape(4, N).load_(torch.tensor(row))
    idx = torch.stack([torch.randperm(E, generator=g)[:3] for _ in range(60)])
    idx[::5, 2] = -1
    for rank in range(4):
        want = _old_spreading_rule(idx, row, E, rank)
        assert torch.equal(route_topk_to_slots(idx, t, rank=rank), want)
        rm = torch.zeros(60, E, dtype=torch.bool)
        for k in range(3):
            ok = idx[:, k] >= 0
            rm[torch.arange(60)[ok], idx[ok, k]] = True
        map_TS, _ = route_to_slots(rm, torch.rand(60, E, generator=g), t, rank=rank)
        from_topk = torch.zeros(60, len(row), dtype=torch.bool)
        from_topk[torch.arange(60)[:, None].expand(-1, 3)[want >= 0], want[want >= 0]] = True
        # the routing map counts routes to an expert in token order, one per token: the same ordinal
        assert torch.equal(map_TS, from_topk)


def test_routing_map_and_topk_forms_agree_across_nodes():
    g = torch.Generator().manual_seed(11)
    E, T, K = 8, 80, 3
    row = [0, 1, 2, 3, 0, 0, 4, 5, 6, 7, 0, 2]  # expert 0 on both nodes, 2 on both, others on one
    t = two_node_table(row, E)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    for rank in range(4):
        slots = route_topk_to_slots(idx, t, rank=rank)
        rm = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
        map_TS, probs_TS = route_to_slots(rm, rm.float(), t, rank=rank)
        want = torch.zeros(T, len(row), dtype=torch.bool).scatter_(1, slots, True)
        assert torch.equal(map_TS, want)
        node = rank // 2
        assert all(s // 6 == node for s in slots[idx == 0].tolist())  # expert 0: always the own node's copies


def test_layout_is_checked_and_kept_across_loads():
    t = SlotTable(4, 8)
    with pytest.raises(ValueError, match="num_ranks .* multiple of num_nodes"):
        t.set_shape(4, 3)
    with pytest.raises(ValueError, match="num_ranks .* divide the 8 slots"):
        t.set_shape(3, 1)
    t.load_(torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])).set_shape(4, 2)  # re-derives the tables of the row in place
    assert t.route_count_NE.tolist() == [[1, 1, 1, 1], [1, 1, 1, 1]]
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        route_topk_to_slots(torch.tensor([[0]]), t, rank=4)


def _locality_routes_on_emulated_cuda():
    from harness.host_sync import emulated_cuda

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    rm, probs = torch.rand(64, 8, generator=g) > 0.6, torch.rand(64, 8, generator=g)
    with emulated_cuda() as recorder:
        t = SlotTable(8, 12, device=dev).set_shape(4, 2).load_(torch.tensor([0, 1, 2, 3, 0, 0, 4, 5, 6, 7, 0, 2]))
        rm_d, probs_d = rm.to(dev), probs.to(dev).requires_grad_()
        with recorder.record():
            map_TS, probs_TS = route_to_slots(rm_d, probs_d, t, rank=3)
            probs_TS.sum().backward()
        kept = int(map_TS.sum()) == int(rm.sum())
        return kept, [str(s) for s in recorder.syncs]


def test_locality_routing_makes_no_host_sync_on_emulated_cuda(pool_for):
    """The replica choice across nodes, forward and backward, on emulated CUDA tensors: no
    operator that would wait for the device (the GPU check is tests/unit/hybrid_ep/balancer/test_loop.py's)."""
    with pool_for(1) as pool:
        kept, syncs = pool.run(_locality_routes_on_emulated_cuda)[0]
    assert kept
    assert not syncs, "host synchronisations of route_to_slots across nodes:\n" + "\n".join(syncs)
