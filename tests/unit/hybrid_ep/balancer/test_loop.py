"""ExpertBalancer's loop in one process: interval counting, reports, writers, state dicts,
and the errors of a bad configuration; on two CPU ranks, the planner's tolerance and move
budget."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from hybrid_ep.balancer import (
    BalancedLayer,
    ExpertBalancer,
    SlotTable,
    TorchOptimizerView,
    route_topk_to_slots,
    slot_parameters,
)
from hybrid_ep.balancer.report import load_statistics

pytestmark = pytest.mark.unit


def make_layers(num_layers, experts, slots):
    layers, modules = [], []
    for _ in range(num_layers):
        module = torch.nn.Module()
        module.local_experts = torch.nn.ModuleList(torch.nn.Linear(3, 3, bias=False) for _ in range(slots))
        modules.append(module)
        layers.append(BalancedLayer(SlotTable(experts, slots), slot_parameters(module, slots)))
    return layers, modules


def test_writers_write_on_every_rank_given_them(single_rank_group, tmp_path):
    """Megatron-LM creates its TensorBoard and wandb writers on its last rank, which is not the
    rank that writes the report files: a rank with writers writes the scalars (named by the
    model's layer numbers) whether or not it reports, and a reporter without writers still
    writes its files."""
    for is_reporter, writers in ((False, True), (True, False)):
        layers, modules = make_layers(2, 4, 6)
        seen = []
        report_dir = tmp_path / f"reporter_{is_reporter}"
        bal = ExpertBalancer(layers, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=1,
                             report_dir=str(report_dir), is_reporter=is_reporter, layer_numbers=[3, 7],
                             writers=[lambda values, step: seen.append((step, values))] if writers else [])
        bal.setup()
        for i in range(2):
            bal.record(i, torch.tensor([8, 1, 1, 2]))
        for p in (p for m in modules for p in m.parameters()):
            p.grad = torch.ones_like(p)
        bal.before_optimizer_step()
        bal.after_optimizer_step(1)
        assert [step for step, _ in seen] == ([1] if writers else [])
        if writers:
            names = set(seen[0][1])
            assert {"balancer/layer_3/imbalance_rank_after", "balancer/layer_7/imbalance_rank_after"} <= names
            assert not any(k.startswith(("balancer/layer_0/", "balancer/layer_1/")) for k in names)
        assert (report_dir / "iter_0000001").is_dir() == is_reporter


def test_loop_reports_and_writers(single_rank_group, tmp_path):
    layers, modules = make_layers(2, 4, 6)
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=0.1)
    seen = []
    bal = ExpertBalancer(layers, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=3,
                         optimizer_view=TorchOptimizerView(opt), report_dir=str(tmp_path),
                         writers=[lambda values, step: seen.append((step, values))])
    moved = bal.setup()
    assert moved["slots_changed"] == 4  # per layer, the two spare slots got replicas
    rows = bal.placement_rows()
    for layer, module in zip(range(2), modules):
        for j, e in enumerate(rows[layer].tolist()):
            torch.testing.assert_close(module.local_experts[j].weight, module.local_experts[e].weight)
    events = []
    for step in range(1, 7):
        for i in range(2):
            bal.record(i, torch.tensor([8, 1, 1, 2 * step]))
        for p in params:
            p.grad = torch.ones_like(p)
        bal.before_optimizer_step()
        opt.step()
        events.append(bal.after_optimizer_step(step))
    assert [e is None for e in events] == [True, True, False, True, True, False]
    assert [step for step, _ in seen] == [3, 6]
    assert any(k.endswith("imbalance_rank_after") for k in seen[0][1])
    # a Linear(3, 3) slot in fp32 with torch's AdamW: 9 parameters x (4 + 8) bytes, and the
    # step count Adam keeps as a 4-byte tensor per parameter, which moves too
    assert bal.bytes_per_slot() == 9 * 12 + 4
    assert [v["balancer/moved_bytes"] for _, v in seen] == [float(e["moved_bytes"]) for e in events if e]
    out = tmp_path / "iter_0000006"
    stats = load_statistics(str(out / "statistics.npz"))
    np.testing.assert_array_equal(stats["load"][0], [24, 3, 3, 30])  # window 1: steps 4..6
    # each rebalance's folder holds the reductions since the last report; the report dir's top
    # file the whole history (a full copy per rebalance grew with the square of the run)
    assert stats["history"].shape == (1, 2, 4) and stats["steps"].tolist() == [6]
    np.testing.assert_array_equal(stats["history"][0, 0], [24, 3, 3, 30])
    assert load_statistics(str(tmp_path / "iter_0000003" / "statistics.npz"))["steps"].tolist() == [3]
    whole = load_statistics(str(tmp_path / "statistics.npz"))
    assert whole["history"].shape == (2, 2, 4) and whole["steps"].tolist() == [3, 6]
    np.testing.assert_array_equal(whole["load"], stats["load"])
    assert not any(f.endswith(".tmp") for f in os.listdir(tmp_path))
    assert stats["layer_numbers"].tolist() == [1, 2]  # counted from 1, as Megatron numbers its layers
    pngs = [f for f in os.listdir(out) if f.endswith(".png")]
    assert pngs and all(open(out / f, "rb").read(8) == b"\x89PNG\r\n\x1a\n" for f in pngs)
    jsons = [f for f in os.listdir(out) if f.endswith(".json")]
    assert jsons and json.load(open(out / jsons[0]))
    # a moved slot carries its fp32 3 x 3 weight, Adam's two moments and step (no separate master)
    assert bal.bytes_per_slot() == 9 * (4 + 8) + 4
    summary = json.load(open(out / jsons[0]))
    assert summary["bytes_per_slot"] == 112
    assert summary["moved_bytes"] == [m * 112 for m in summary["moves"]]
    state = bal.state_dict()
    assert state["steps"] == 6 and state["placement"].shape == (2, 6)


def test_state_dict_refuses_other_shapes(single_rank_group):
    layers, _ = make_layers(1, 4, 6)
    bal = ExpertBalancer(layers, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=2)
    bal.setup()
    state = bal.state_dict()
    other_layers, _ = make_layers(1, 4, 5)
    other = ExpertBalancer(other_layers, num_experts=4, slots_per_rank=5, ep_group=single_rank_group, interval=2)
    with pytest.raises(ValueError, match="num_slots=6"):
        other.load_state_dict(state)


@pytest.mark.parametrize("kwargs, message", [
    ({"slots_per_rank": 3}, "fewer than the 4 experts"),
    ({"interval": 0}, "interval"),
    ({"num_nodes": 3}, "num_nodes"),
    ({"tolerance": -0.1}, "tolerance"),
    ({"tolerance": float("nan")}, "tolerance"),
    ({"move_budget": -0.1}, "move_budget"),
    ({"move_budget": 1.5}, "move_budget"),
    ({"move_budget": float("nan")}, "move_budget"),
    ({"layer_numbers": [1, 2]}, "layer_numbers has 2 entries for 1 MoE layers"),
])
def test_bad_configuration_is_named(single_rank_group, kwargs, message):
    layers, _ = make_layers(1, 4, 4)
    args = dict(num_experts=4, slots_per_rank=4, ep_group=single_rank_group, interval=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        ExpertBalancer(layers, **args)


def _rebalance_once(tolerance, move_budget=None):
    """On each of 2 ranks: E = S = 4 (identity: experts 0, 1 on rank 0), every rank counts
    tokens [26, 27, 25, 22]; the reduced load [52, 54, 50, 44] leaves the identity at rank
    imbalance 0.06, the fresh plan ({0, 2} | {1, 3}) at 0.02."""
    import torch.distributed as dist

    module = torch.nn.Module()
    module.local_experts = torch.nn.ModuleList(torch.nn.Linear(3, 3, bias=False) for _ in range(2))
    layers = [BalancedLayer(SlotTable(4, 4), slot_parameters(module, 2))]
    bal = ExpertBalancer(layers, num_experts=4, slots_per_rank=2, ep_group=dist.group.WORLD, interval=1,
                         tolerance=tolerance, move_budget=move_budget)
    bal.setup()
    bal.record(0, torch.tensor([26, 27, 25, 22]))
    event = bal.after_optimizer_step(1)
    return event, bal.placement_rows()[0].tolist()


def test_tolerance_reaches_the_planner(pool_for):
    """The identity is 0.04 more imbalanced than the fresh plan: kept at tolerance 0.05,
    replanned (two slots swapped) at 0.01 and at the default."""
    pool = pool_for(2)
    (kept, kept_row), _ = pool.run(_rebalance_once, [(0.05,)] * 2)
    assert not kept["applied"] and kept["slots_changed"] == 0 and kept["moved_bytes"] == 0 and kept_row == [0, 1, 2, 3]
    assert kept["imbalance_rank_before"] == kept["imbalance_rank_after"] == pytest.approx(0.06)
    for tolerance in (0.01, None):  # None: the planner's default, 0.01
        (moved, moved_row), other = pool.run(_rebalance_once, [(tolerance,)] * 2)
        assert moved["applied"] and moved["slots_changed"] == 2 and moved_row == [0, 2, 1, 3] == other[1]
        assert moved["moved_bytes"] == 2 * 9 * 4  # two Linear(3, 3) slots in fp32, no optimizer state to move
        assert moved["imbalance_rank_before"] == pytest.approx(0.06)
        assert moved["imbalance_rank_after"] == pytest.approx(0.02)


def test_move_budget_reaches_the_planner(pool_for):
    """At the default tolerance the rebalance swaps 2 of the 4 slots: a budget of 0 keeps the
    identity (no slot changed), a budget of half the slots lets both swaps through."""
    pool = pool_for(2)
    (held, held_row), other = pool.run(_rebalance_once, [(None, 0.0)] * 2)
    assert not held["applied"] and held["slots_changed"] == 0 and held_row == [0, 1, 2, 3] == other[1]
    assert held["imbalance_rank_before"] == held["imbalance_rank_after"] == pytest.approx(0.06)
    (moved, moved_row), _ = pool.run(_rebalance_once, [(None, 0.5)] * 2)
    assert moved["applied"] and moved["slots_changed"] == 2 and moved_row == [0, 2, 1, 3]


@pytest.mark.gpu
def test_no_host_sync_on_cuda():
    """With CUDA's sync debug mode set to error, statistics and slot routing raise on any sync."""
    from hybrid_ep.balancer import LoadStatistics, route_to_slots

    dev = torch.device("cuda")
    table = SlotTable(8, 12, device=dev).load_(torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 0, 1, 5]))
    stats = LoadStatistics(1, 8, device=dev)
    rm = torch.rand(64, 8, device=dev) > 0.7
    probs = torch.rand(64, 8, device=dev, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        stats.record(0, rm.sum(0))
        map_TS, probs_TS = route_to_slots(rm, probs, table, rank=1)
        probs_TS.sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert int(map_TS.sum()) == int(rm.sum())


def test_statistics_flush_pack_unpack_round_trip(single_rank_group):
    """Counts since the last reduction survive a checkpoint (flushed into the carry); the
    window, the average and the carry pack per layer and unpack into the same planning load."""
    from hybrid_ep.balancer import LoadStatistics

    stats = LoadStatistics(2, 3, window=2)
    for counts in ([1, 2, 3], [4, 0, 1], [2, 2, 2]):
        stats.record(0, torch.tensor(counts))
        stats.record(1, torch.tensor(counts[::-1]))
        stats.reduce([single_rank_group])
    stats.record(0, torch.tensor([5, 0, 0]))
    stats.flush([single_rank_group])
    assert stats.carry_LE[0].tolist() == [5, 0, 0] and int(stats.counts_LE.sum()) == 0
    packed = [stats.pack(i) for i in range(2)]
    assert packed[0][1] == 2 and not packed[0][2]
    np.testing.assert_array_equal(packed[0][0], [[4, 0, 1], [2, 2, 2], [0, 0, 0], [5, 0, 0]])
    other = LoadStatistics(2, 3, window=2)
    other.unpack([p[0] for p in packed], packed[0][1], packed[0][2])
    np.testing.assert_array_equal(other.load(), stats.load())
    np.testing.assert_array_equal(other.reduce([single_rank_group]), stats.reduce([single_rank_group]))
    shorter = LoadStatistics(2, 3, window=1)  # another window length keeps the newest reduction
    shorter.unpack([p[0] for p in packed], packed[0][1], packed[0][2])
    np.testing.assert_array_equal(shorter.load()[0], [2, 2, 2])
    with pytest.raises(ValueError, match="statistics of 1 layers"):
        other.unpack([packed[0][0]], 2, False)


def test_balancer_checkpoint_buffers_restore_steps_and_statistics(single_rank_group):
    layers, _ = make_layers(1, 4, 6)
    for layer in layers:
        layer.saved_stats = torch.zeros(3, 4, dtype=torch.float64)
        layer.saved_meta = torch.zeros(4, dtype=torch.int64)
    bal = ExpertBalancer(layers, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=2)
    bal.setup()
    assert not bal.restore_saved()  # nothing written yet
    for step in range(1, 4):
        bal.record(0, torch.tensor([3, 1, 0, step]))
        bal.after_optimizer_step(step)
    bal.prepare_checkpoint()
    assert layers[0].saved_meta.tolist() == [1, 0, 3, 1]
    fresh_layers, _ = make_layers(1, 4, 6)
    fresh_layers[0].saved_stats = layers[0].saved_stats.clone()
    fresh_layers[0].saved_meta = layers[0].saved_meta.clone()
    fresh = ExpertBalancer(fresh_layers, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=2)
    assert fresh.restore_saved() and fresh.steps == 3
    np.testing.assert_array_equal(fresh.stats.load(), bal.stats.load())
    np.testing.assert_array_equal(fresh.stats.carry_LE, [[3, 1, 0, 3]])


def test_bad_rows_and_knobs_change_nothing(single_rank_group, tmp_path):
    """A placement that breaks a rule, or a saved state of another layer count, is refused
    before any slot's weights move or any table changes; knobs of the wrong kind name themselves."""
    from hybrid_ep.balancer.placement_file import save_placement_yaml
    from hybrid_ep.balancer.planner import Placement

    layers, modules = make_layers(2, 4, 6)
    bal = ExpertBalancer(layers, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=1)
    bal.setup()
    rows = bal.placement_rows()
    weights = [[m.weight.clone() for m in module.local_experts] for module in modules]
    bad = rows.clone()
    bad[1] = torch.tensor([0, 0, 1, 1, 2, 2])  # expert 3 without a slot
    with pytest.raises(ValueError, match=r"placement layer 1: slot_to_expert leaves experts \[3\]"):
        bal.apply_placement(bad)
    with pytest.raises(ValueError, match=r"placement has shape \(1, 6\)"):
        bal.apply_placement(rows[:1])
    state = bal.state_dict()
    other = make_layers(3, 4, 6)[0]
    three = ExpertBalancer(other, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=1)
    three.setup()
    with pytest.raises(ValueError, match="2 balanced MoE layers"):
        bal.load_state_dict({**three.state_dict(), "steps": 5})
    assert torch.equal(bal.placement_rows(), rows) and bal.steps == state["steps"]
    assert all(torch.equal(m.weight, w)
               for module, ws in zip(modules, weights) for m, w in zip(module.local_experts, ws))
    for kwargs, needle in (({"interval": 2.5}, "interval must be an integer"), ({"interval": True}, "interval"),
                           ({"min_gain": float("nan")}, "min_gain must be a finite"),
                           ({"num_nodes": 0}, "num_nodes must be an integer >= 1")):
        with pytest.raises(ValueError, match=needle):
            ExpertBalancer(make_layers(1, 4, 6)[0], num_experts=4, slots_per_rank=6, ep_group=single_rank_group,
                           **kwargs)
    path = tmp_path / "placement.yaml"
    placement = Placement(rows, 1, 1, 4)
    save_placement_yaml(placement, str(path))
    kept = path.read_text()
    with pytest.raises(ValueError, match="extra values must be plain"):
        save_placement_yaml(placement, str(path), extra={"layer_numbers": np.array([1, 2])})
    assert path.read_text() == kept


def test_replica_without_a_gradient_takes_the_sum(single_rank_group):
    """A replica its rank's forward did not use has no .grad under a torch optimizer: it takes
    part in the replica sum as zeros, so both copies read the same gradient and stay equal
    (before, the first slot's pieces set the layout, so a missing one failed or shifted)."""
    layers, modules = make_layers(1, 4, 6)
    params = list(modules[0].parameters())
    opt = torch.optim.Adam(params, lr=0.1)
    bal = ExpertBalancer(layers, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=100,
                         optimizer_view=TorchOptimizerView(opt))
    bal.setup()
    assert bal.placement_rows()[0].tolist() == [0, 1, 2, 3, 0, 1]  # experts 0 and 1 twice
    experts = modules[0].local_experts
    for j, m in enumerate(experts):  # slot 0 (expert 0) and slot 5 (expert 1) unused
        m.weight.grad = None if j in (0, 5) else torch.full_like(m.weight, float(j + 1))
    bal.before_optimizer_step()
    for a, b, value in ((0, 4, 5.0), (1, 5, 2.0)):
        torch.testing.assert_close(experts[a].weight.grad, torch.full_like(experts[a].weight, value))
        torch.testing.assert_close(experts[b].weight.grad, experts[a].weight.grad)
    opt.step()
    for a, b in ((0, 4), (1, 5)):
        torch.testing.assert_close(experts[a].weight, experts[b].weight)


def test_replan_before_the_first_reduction_plans_on_the_carry(single_rank_group):
    """A checkpoint saved before the first reduction holds its counts in the carry only; a
    re-plan (after loading it into another EP size) plans on them instead of on zeros."""
    layers, modules = make_layers(1, 4, 6)
    bal = ExpertBalancer(layers, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=100)
    bal.setup()
    bal.record(0, torch.tensor([40, 1, 1, 1]))
    bal.prepare_checkpoint()  # folds the counts into the carry, as before a save
    assert not bal.stats.load().any() and bal.stats.carry_LE.sum() == 43
    planned = []
    bal._plan_and_apply = lambda load, iteration, t0: planned.append(load)  # what the re-plan plans on
    bal.replan()
    np.testing.assert_array_equal(planned[0], [[40, 1, 1, 1]])
    bal.stats.reduce()  # once a reduction is held, the re-plan plans on the window as before
    bal.record(0, torch.tensor([0, 9, 0, 0]))
    bal.prepare_checkpoint()
    bal.replan()
    np.testing.assert_array_equal(planned[1], [[40, 1, 1, 1]])


@pytest.mark.slow  # the full tier (scripts/test.sh --full): a training run resumed
def test_resumed_run_keeps_the_whole_run_history(single_rank_group, tmp_path):
    """A checkpoint carries the statistics window, not the history: a run resumed into the same
    report dir keeps the earlier run's reductions before its own first one in statistics.npz
    (the file for `hybrid-ep-balance plan`), instead of restarting it at the resume. A new run
    from step 0 into the same folder keeps none of them."""

    def run(steps, state=None, replan=False):
        layers, modules = make_layers(2, 4, 6)
        bal = ExpertBalancer(layers, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=2,
                             report_dir=str(tmp_path))
        bal.setup()
        if state is not None:
            bal.load_state_dict(state)
        if replan:  # as attach does on a resume into another EP size: a report before any reduction
            bal.replan()
            assert load_statistics(str(tmp_path / "statistics.npz"))["steps"].tolist() == [2, 4]
        saved = None
        for step in steps:
            for i in range(2):
                bal.record(i, torch.tensor([8, 1, 1, step]))
            bal.before_optimizer_step()
            bal.after_optimizer_step(step)
            if step == 5:
                saved = bal.state_dict()
        return saved

    at_5 = run(range(1, 8))  # reports at 2, 4, 6; "crashed" after step 7, checkpoint of step 5
    assert load_statistics(str(tmp_path / "statistics.npz"))["steps"].tolist() == [2, 4, 6]
    run(range(6, 9), at_5)  # resumed from step 5: its own reductions at 6 and 8
    whole = load_statistics(str(tmp_path / "statistics.npz"))
    assert whole["steps"].tolist() == [2, 4, 6, 8]
    np.testing.assert_array_equal(whole["history"][:, 0, 3], [1 + 2, 3 + 4, 5 + 6, 7 + 8])  # step 5's count in 6
    run(range(1, 5))  # a new run from the start: nothing of the earlier runs
    assert load_statistics(str(tmp_path / "statistics.npz"))["steps"].tolist() == [2, 4]
    at_5 = run(range(1, 8))
    run(range(6, 9), at_5, replan=True)  # the earlier file was wiped by the re-plan's report
    assert load_statistics(str(tmp_path / "statistics.npz"))["steps"].tolist() == [2, 4, 6, 8]


def test_wrapped_step_follows_the_training_loops_iteration(single_rank_group):
    """Megatron-LM's --iterations-to-skip passes iterations without an optimizer step: with the
    loop's iteration known (the training hook's source), the balancer rebalances at the loop's
    iterations 5 and 10, not after its own 5th and 10th steps (iterations 7 and 12)."""
    pytest.importorskip("megatron.core")
    import types

    from megatron_patches.balancer import _wrap_step

    layers, _ = make_layers(1, 4, 6)
    bal = ExpertBalancer(layers, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=5)
    bal.setup()
    bal.hybrid_ep_replan_pending = False
    optimizer = types.SimpleNamespace(step=lambda: None)
    _wrap_step(optimizer, bal)
    loop = [i for i in range(12) if i not in (2, 3)]  # the loop's iteration before each step taken
    current = iter(loop)
    bal.hybrid_ep_iteration = lambda: next(current)
    for _ in loop:
        bal.record(0, torch.tensor([8, 1, 1, 1]))
        optimizer.step()
    assert [e["iteration"] for e in bal.events] == [5, 10] and bal.steps == 12
    bal.hybrid_ep_iteration = None  # unknown (a library loop): the balancer counts its own steps
    for _ in range(3):
        optimizer.step()
    assert [e["iteration"] for e in bal.events] == [5, 10, 15]


def test_megatron_iteration_reads_the_loops_current_iteration(monkeypatch):
    pytest.importorskip("megatron.training")
    import types

    from megatron.training import global_vars

    from megatron_patches.balancer import _megatron_iteration

    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", types.SimpleNamespace())
    assert _megatron_iteration() is None  # before the loop sets it
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", types.SimpleNamespace(curr_iteration=41))
    assert _megatron_iteration() == 41


@pytest.mark.parametrize("make_optimizer, per_parameter", [
    (lambda params: torch.optim.SGD(params, lr=0.1), 4),                  # weights only
    (lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9), 8),    # + the momentum buffer
    (lambda params: torch.optim.AdamW(params), 12),                       # + two moments (+ step)
])
def test_bytes_per_slot_counts_what_the_optimizer_keeps(single_rank_group, make_optimizer, per_parameter):
    """Moved bytes came from a fixed Adam-with-fp32-master formula, whatever the optimizer:
    108 B for a fp32 3 x 3 slot under plain SGD, which moves 36."""
    layers, modules = make_layers(1, 4, 6)
    params = [p for m in modules for p in m.parameters()]
    opt = make_optimizer(params)
    bal = ExpertBalancer(layers, num_experts=4, slots_per_rank=6, ep_group=single_rank_group, interval=3,
                         optimizer_view=TorchOptimizerView(opt))
    bal.setup()
    assert bal.bytes_per_slot() == 9 * 4  # before the first step: no optimizer state yet
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    step_tensor = 4 if isinstance(opt, torch.optim.AdamW) else 0
    assert bal.bytes_per_slot() == 9 * per_parameter + step_tensor


def _rebalance_node_aware(rdma_weight):
    """On each of 4 ranks in 2 nodes: E = 8, 3 slots per rank (S = 12); experts 0-3 are at home
    on node 0, 4-7 on node 1; expert 0 carries most tokens. Returns the event, the placement
    and what this rank's table routes expert 0 to."""
    import torch.distributed as dist

    module = torch.nn.Module()
    module.local_experts = torch.nn.ModuleList(torch.nn.Linear(3, 3, bias=False) for _ in range(3))
    layers = [BalancedLayer(SlotTable(8, 12), slot_parameters(module, 3))]
    bal = ExpertBalancer(layers, num_experts=8, slots_per_rank=3, ep_group=dist.group.WORLD, num_nodes=2,
                         interval=1, rdma_weight=rdma_weight)
    bal.setup()
    bal.record(0, torch.tensor([60, 10, 8, 6, 9, 7, 5, 4]))
    event = bal.after_optimizer_step(1)
    rank = dist.get_rank()
    slots = route_topk_to_slots(torch.zeros(16, 1, dtype=torch.int64), layers[0].table, rank=rank)
    return event, bal.placement_rows()[0].tolist(), sorted(set(slots[:, 0].tolist())), layers[0].table.num_nodes


def test_node_aware_rebalance_routes_by_locality(pool_for):
    """With rdma_weight the balancer plans node-aware and its tables route by locality: the hot
    expert 0 gets copies on both nodes and every rank's routes to it stay on its own node;
    without it the tables keep the spreading rule (one node in the layout)."""
    from hybrid_ep.balancer.metrics import off_home

    out = pool_for(4).run(_rebalance_node_aware, [(0.5,)] * 4)
    event, row, _, nodes = out[0]
    assert event["applied"] and nodes == 2
    assert all(o[1] == row for o in out)  # every rank holds the same placement
    holders = {s // 6 for s, e in enumerate(row) if e == 0}
    assert holders == {0, 1}
    for rank, (_, _, used, _) in enumerate(out):
        assert used and all(s // 6 == rank // 2 for s in used), (rank, used, row)
    assert float(off_home(torch.tensor([60, 10, 8, 6, 9, 7, 5, 4.0]), torch.tensor(row), 2).sum()) == 0.0
    plain = pool_for(4).run(_rebalance_node_aware, [(None,)] * 4)
    assert {o[3] for o in plain} == {1}
