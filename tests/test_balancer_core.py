"""Expert balancer pieces that need no Megatron: slot routing, statistics, migration,
replica gradient sums, what a slot holds, and the absence of per-step host syncs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

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
from hybrid_ep.testing import migration as mig

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
