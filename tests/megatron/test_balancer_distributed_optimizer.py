"""The expert balancer with Megatron-Core's DistributedOptimizer on CPU gloo ranks.

EP 2 x expert-DP 2 (4 processes; 12 slots for 8 experts: 4 replicas) in fp32 and bf16 mixed
precision, each also with overlapped grad reduce and param gather (several buckets, so
parameters straddle the members' shard boundaries); EP 4 x expert-DP 2 (8 processes; 12 slots)
in fp32 (also planning on a window of three reductions) and bf16. Every balanced run trains 20
steps, rebalances every 5 and is compared with the same run without the balancer. bf16 runs as
Megatron-LM runs it by default: fp32 main grads with gradient-accumulation fusion (weight
gradients added in fp32 straight into main_grad); bf16 without the fusion rounds each replica's
weight gradient to bf16 and is held to its measured bf16 bound (docs/balancer.md, invariance).
Checkpoints are saved after a migration in the legacy and torch_dist formats and resumed in a
fresh layer, at EP 2 (after step 10) and at EP 4 x expert-DP 2 (legacy after step 10, also with
a statistics window of three reductions; torch_dist after step 12 with two steps of counts not
yet reduced, and that run also compared with the same run never saved); a torch_dist checkpoint
saved at EP 2 loads at EP 4.
"""

from __future__ import annotations

import collections

import pytest
import torch

from helpers import assert_migration_kept_output

pytest.importorskip("megatron.core")

from harness.megatron.balancer_checkpoints import load_other_ep  # noqa: E402
from harness.megatron.balancer_runs import TrainRun, migrate_with_gather_in_flight, train_moe_layer  # noqa: E402
from megatron_patches.local.layer import LayerCase  # noqa: E402

pytestmark = [pytest.mark.megatron, pytest.mark.slow]  # training runs behind every test: the full tier

E, STEPS, INTERVAL = 8, 20, 5
EP2 = LayerCase(world_size=2, num_experts=E, topk=2, hidden=16, ffn=12, seq=8, batch=4)
EP4 = LayerCase(world_size=4, num_experts=E, topk=2, hidden=16, ffn=12, seq=8, batch=4)
BF16 = dict(bf16=True, gradient_accumulation_fusion=True)  # Megatron-LM's bf16 default
BF16_UNFUSED = dict(bf16=True)                               # --no-gradient-accumulation-fusion


def _runs(pool, case, ranks, **runs):
    return {name: pool.run(train_moe_layer, [(case, run)] * ranks, timeout_s=900) for name, run in runs.items()}


@pytest.fixture(scope="module")
def ep2(pool_for, new_checkpoint_dir):
    pool = pool_for(4)
    dist_ckpt = new_checkpoint_dir()
    out = _runs(
        pool, EP2, 4,
        plain=TrainRun(STEPS, optimizer="distributed"),
        balanced=TrainRun(STEPS, INTERVAL, 6, "distributed", checkpoint_dir=new_checkpoint_dir()),
        overlap=TrainRun(STEPS, INTERVAL, 6, "distributed", overlap=True, checkpoint_dir=dist_ckpt,
                         checkpoint_format="torch_dist"),
        bf16_plain=TrainRun(STEPS, optimizer="distributed", **BF16),
        bf16=TrainRun(STEPS, INTERVAL, 6, "distributed", checkpoint_dir=new_checkpoint_dir(),
                      checkpoint_format="torch_dist", **BF16),
        bf16_overlap=TrainRun(STEPS, INTERVAL, 6, "distributed", overlap=True, **BF16),
        bf16_unfused_plain=TrainRun(STEPS, optimizer="distributed", **BF16_UNFUSED),
        bf16_unfused_placement=TrainRun(STEPS, INTERVAL, 4, "distributed", **BF16_UNFUSED),
        bf16_unfused=TrainRun(STEPS, INTERVAL, 6, "distributed", **BF16_UNFUSED),
    )
    out["other_ep"] = pool.run(load_other_ep, [(EP4, TrainRun(interval=INTERVAL, slots_per_rank=3), dist_ckpt)] * 4,
                               timeout_s=900)
    return out


@pytest.fixture(scope="module")
def ep4(pool_for, new_checkpoint_dir):
    # Checkpointed after a migration: the fp32 run at step 10 (legacy), the bf16 run at step
    # 12 (torch_dist; two steps of counts not yet reduced, folded into the carry that the
    # plan at step 15 adds in) and an fp32 run planning on a window of three reductions at
    # step 10 (legacy; its plan at step 15 needs both saved reductions, of steps 5 and 10).
    # bf16_uninterrupted: the bf16 run never checkpointed (the save folds counts into the carry).
    pool = pool_for(8)
    return _runs(pool, EP4, 8, plain=TrainRun(STEPS, optimizer="distributed"),
                 balanced=TrainRun(STEPS, INTERVAL, 3, "distributed", checkpoint_dir=new_checkpoint_dir()),
                 window3=TrainRun(STEPS, INTERVAL, 3, "distributed", window=3, checkpoint_dir=new_checkpoint_dir()),
                 bf16_plain=TrainRun(STEPS, optimizer="distributed", **BF16),
                 bf16=TrainRun(STEPS, INTERVAL, 3, "distributed", checkpoint_dir=new_checkpoint_dir(),
                               checkpoint_format="torch_dist", checkpoint_step=12, **BF16),
                 bf16_uninterrupted=TrainRun(STEPS, INTERVAL, 3, "distributed", **BF16))


def rel_diff(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / a.abs().clamp_min(1e-12)).max())


# (fixture, balanced run, plain run, loss bound, grad-norm bound). bf16 without
# gradient-accumulation fusion, with replicas: each replica's weight gradient is a bf16 matmul
# over its share of the tokens, rounded to bf16 before the fp32 replica sum, where the run
# without the balancer rounds one matmul over all of them (measured 2.9e-4 on the loss, 1.2e-3
# on the grad norm); placement only (no replicas) matches to 1e-6 even so, and with the fusion
# (the weight gradient never rounded to bf16) replicas match to 1e-6 too.
EXACT = (1e-6, 1e-5)
CASES = [("ep2", "balanced", "plain", *EXACT), ("ep2", "overlap", "plain", *EXACT),
         ("ep2", "bf16", "bf16_plain", *EXACT), ("ep2", "bf16_overlap", "bf16_plain", *EXACT),
         ("ep2", "bf16_unfused_placement", "bf16_unfused_plain", *EXACT),
         ("ep2", "bf16_unfused", "bf16_unfused_plain", 1e-3, 1e-2),
         ("ep4", "balanced", "plain", *EXACT), ("ep4", "window3", "plain", *EXACT),
         ("ep4", "bf16", "bf16_plain", *EXACT)]


@pytest.mark.slow
@pytest.mark.parametrize("fixture, name, plain, loss_bound, grad_norm_bound", CASES)
def test_losses_and_grad_norms_match_training_without_balancer(request, fixture, name, plain, loss_bound,
                                                                grad_norm_bound):
    runs = request.getfixturevalue(fixture)
    a, b = runs[plain][0], runs[name][0]
    assert len(a["losses"]) == len(b["losses"]) == STEPS and a["losses"][-1] < a["losses"][0]  # it trains
    loss_diff, norm_diff = rel_diff(a["losses"], b["losses"]), rel_diff(a["grad_norms"], b["grad_norms"])
    # Megatron-LM's --log-params-norm: replica copies left out, so each expert counts once (with
    # overlapped param gather it reads the weights before the next forward gathers them: other
    # numbers than the plain run's, with or without the balancer)
    assert len(a["params_norms"]) == len(b["params_norms"]) == STEPS
    params_diff = None if "overlap" in name else rel_diff(a["params_norms"], b["params_norms"])
    print(f"{fixture} {name} vs {plain}: losses {loss_diff:.1e}, grad norms {norm_diff:.1e}, "
          f"params norms {'not compared' if params_diff is None else f'{params_diff:.1e}'}")
    assert loss_diff <= loss_bound
    assert norm_diff <= grad_norm_bound
    assert params_diff is None or params_diff <= grad_norm_bound
    events = b["events"]
    assert [e["iteration"] for e in events] == list(range(INTERVAL, STEPS + 1, INTERVAL))
    assert any(e["applied"] and e["slots_changed"] > 0 for e in events)


def test_unfused_bf16_differs_by_the_replicas_weight_gradient_rounding(ep2):
    """The same bf16 run with replicas goes beyond 1e-6 only without the fusion: the rounding of
    each replica's weight gradient to bf16 is the whole difference."""
    unfused = rel_diff(ep2["bf16_unfused_plain"][0]["losses"], ep2["bf16_unfused"][0]["losses"])
    fused = rel_diff(ep2["bf16_plain"][0]["losses"], ep2["bf16"][0]["losses"])
    assert unfused > 1e-5 and fused <= 1e-6


def test_fused_weight_gradient_accumulates_in_fp32():
    """The host stand-in for Apex's wgrad_gemm_accum_fp32: bf16 inputs, products and sums in
    fp32, added into the fp32 main_grad (no bf16 rounding of the weight gradient)."""
    if torch.cuda.is_available():
        pytest.skip("the host stand-in is installed only without a GPU")
    import megatron_patches

    megatron_patches.apply(cpu_compat=True)
    from megatron.core.tensor_parallel import layers

    assert layers._grad_accum_fusion_available
    g = torch.Generator().manual_seed(3)
    x, dy = torch.randn(24, 16, generator=g).bfloat16(), torch.randn(24, 12, generator=g).bfloat16()
    main_grad = torch.randn(12, 16, generator=g)
    exact = dy.double().t() @ x.double()
    expected = main_grad.double() + exact
    layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(x, dy, main_grad)
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-6, atol=1e-6)
    assert ((dy.t() @ x).double() - exact).abs().max() > 1e-3  # a bf16 weight gradient is this far off


def test_gradient_accumulation_fusion_needs_megatron_ddp():
    with pytest.raises(ValueError, match="gradient_accumulation_fusion needs optimizer"):
        TrainRun(optimizer="torch", gradient_accumulation_fusion=True)


@pytest.mark.parametrize("fixture, name", [case[:2] for case in CASES])
def test_each_migration_leaves_the_layer_output_unchanged(request, fixture, name):
    runs = request.getfixturevalue(fixture)
    applied = sum(e["applied"] for e in runs[name][0]["events"])
    for rank_result in runs[name]:
        assert len(rank_result["around_migration"]) == applied
        for probe in rank_result["around_migration"]:
            assert_migration_kept_output(probe["before"], probe["after"], bf16=name.startswith("bf16"))


def _assembled(results) -> dict:
    """(expert, slot) -> per parameter: the whole weight and the master weights and moments
    assembled from every expert-DP member's pieces."""
    pieces = collections.defaultdict(list)
    weights = {}
    for rank_result in results:
        for slot in rank_result["slots"]:
            key = (slot["expert"], slot["slot"])
            weights.setdefault(key, slot["tensors"])
            assert all(torch.equal(x, y) for x, y in zip(weights[key], slot["tensors"]))  # same on every member
            pieces[key].append(slot["pieces"])
    out = {}
    for key, members in pieces.items():
        params = []
        for k, weight in enumerate(weights[key]):
            parts = sorted((m[k][0], m[k][1]) for m in members if m[k][0][1] > m[k][0][0])
            assert [r for r, _ in parts][0][0] == 0 and parts[-1][0][1] == weight.numel()
            assert all(a[0][1] == b[0][0] for a, b in zip(parts, parts[1:]))  # the pieces tile the parameter
            count = len(parts[0][1])
            params.append((weight, [torch.cat([p[1][i] for p in parts]) for i in range(count)]))
        out[key] = params
    return out


@pytest.mark.parametrize("fixture, name", [("ep2", "balanced"), ("ep2", "overlap"), ("ep2", "bf16"),
                                           ("ep2", "bf16_overlap"), ("ep2", "bf16_unfused"), ("ep4", "balanced"),
                                           ("ep4", "window3"), ("ep4", "bf16")])
def test_replicas_bit_identical_in_weights_and_optimizer_shards(request, fixture, name):
    results = request.getfixturevalue(fixture)[name]
    by_expert = collections.defaultdict(list)
    for (expert, _), params in _assembled(results).items():
        by_expert[expert].append(params)
    assert sorted(by_expert) == list(range(E))
    assert sum(len(v) for v in by_expert.values()) == 12 and max(len(v) for v in by_expert.values()) > 1
    moved = 3 if name.startswith("bf16") else 2  # bf16: fp32 master weights, exp_avg, exp_avg_sq
    for copies in by_expert.values():
        for params in copies:
            assert all(len(states) == moved for _, states in params)
        for other in copies[1:]:
            for (w0, s0), (w1, s1) in zip(copies[0], other):
                assert torch.equal(w0, w1) and all(torch.equal(x, y) for x, y in zip(s0, s1))


def _untimed(event: dict) -> dict:
    return {k: v for k, v in event.items() if not k.endswith("_seconds")}


# (fixture, run, format, step saved after, reductions in the statistics window at the save)
CHECKPOINTS = [("ep2", "balanced", "legacy", 10, 1), ("ep2", "overlap", "torch_dist", 10, 1),
               ("ep2", "bf16", "torch_dist", 10, 1),
               ("ep4", "balanced", "legacy", 10, 1), ("ep4", "window3", "legacy", 10, 2),
               ("ep4", "bf16", "torch_dist", 12, 1)]


@pytest.mark.parametrize("fixture, name, fmt, step, window_held", CHECKPOINTS)
def test_checkpoint_after_a_migration_resumes_bit_identically(request, fixture, name, fmt, step, window_held):
    results = request.getfixturevalue(fixture)[name]
    assert len(results) == (4 if fixture == "ep2" else 8)
    for rank_result in results:
        resumed = rank_result["resumed"]
        restored = resumed["restored"]
        before = [e for e in rank_result["events"] if e["iteration"] <= step]
        after = [e for e in rank_result["events"] if e["iteration"] > step]
        assert before[-1]["iteration"] == 10 and before[-1]["applied"] and before[-1]["slots_changed"] > 0
        assert restored["placement_equal"] and restored["load_equal"] and restored["carry_equal"]
        assert restored["steps"] == (step, step) and restored["window_held"] == window_held
        assert (resumed["saved"]["carry"].sum() > 0) == (step % INTERVAL != 0)  # counts since the last reduction
        assert resumed["losses"] == rank_result["losses"][step:]
        assert resumed["grad_norms"] == rank_result["grad_norms"][step:]
        assert [e["iteration"] for e in resumed["events"]] == [e["iteration"] for e in after] == [15, 20]
        # the same rebalances: planned from the same load (imbalances), the same slots moved
        assert [_untimed(e) for e in resumed["events"]] == [_untimed(e) for e in after]
        placements = [p for p in rank_result["placements"] if p[0] > step]
        assert [i for i, _ in resumed["placements"]] == [i for i, _ in placements] == [15, 20]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(resumed["placements"], placements))
        _assert_same_slots(rank_result["slots"], resumed["slots"], 6 if fixture == "ep2" else 3)


def _assert_same_slots(got: list[dict], want: list[dict], count: int) -> None:
    """`count` slots each way, holding the same expert, tensors and optimizer pieces bit for bit."""
    assert len(got) == len(want) == count
    for a, b in zip(got, want):
        assert a["expert"] == b["expert"]
        assert all(torch.equal(x, y) for x, y in zip(a["tensors"], b["tensors"]))
        for (ra, xa), (rb, xb) in zip(a["pieces"], b["pieces"]):
            assert ra == rb and all(torch.equal(x, y) for x, y in zip(xa, xb))


def test_checkpointed_run_is_the_uninterrupted_run(ep4):
    """Saving (with counts not yet reduced, after step 12) leaves the run that saved as it
    would have been without the save, so the resumed run matches the uninterrupted one too."""
    for saved, plain in zip(ep4["bf16"], ep4["bf16_uninterrupted"]):
        assert saved["losses"] == plain["losses"] and saved["grad_norms"] == plain["grad_norms"]
        assert [_untimed(e) for e in saved["events"]] == [_untimed(e) for e in plain["events"]]
        assert all(i == j and torch.equal(a, b) for (i, a), (j, b) in zip(saved["placements"], plain["placements"]))
        _assert_same_slots(saved["slots"], plain["slots"], 3)


def test_torch_dist_checkpoint_loads_into_another_ep_size_and_replans(ep2):
    """Saved at EP 2 (6 slots per rank), loaded at EP 4 (3 per rank, the same 12 slots): the
    saved placement row and statistics load, the balancer re-plans from those statistics at
    once, and the layer computes what the saved one did."""
    for saved_rank, loaded in zip(ep2["overlap"], ep2["other_ep"]):
        saved = saved_rank["resumed"]["saved"]
        assert (loaded["load"] == saved["load"]).all() and loaded["steps"] == 10
        assert torch.equal(loaded["placement_loaded"], saved["placement"][0])
        [event] = loaded["events"]
        assert event["applied"] and event["imbalance_rank_after"] < event["imbalance_rank_before"]
        assert sorted(set(loaded["placement"][0].tolist())) == list(range(E))
        torch.testing.assert_close(loaded["probe_after"], saved["output"], rtol=0, atol=1e-6)
        torch.testing.assert_close(loaded["probe_before"], saved["output"], rtol=0, atol=1e-6)
        for e, (fc1, fc2) in loaded["experts"].items():
            if e in saved["experts"]:
                assert torch.equal(fc1, saved["experts"][e][0]) and torch.equal(fc2, saved["experts"][e][1])


def test_migration_with_a_param_gather_in_flight(pool_for):
    """A migration while an overlapped param all-gather of the old pieces is in flight (Megatron's
    --overlap-param-gather-with-optimizer-step) waits for it first, and every migration re-gathers
    each expert bucket group once (the ChainedOptimizer's dense and expert parts share the model
    chunk: it was gathered twice)."""
    results = pool_for(4).run(migrate_with_gather_in_flight,
                              [(EP2, TrainRun(3, INTERVAL, 6, "distributed", overlap=True))] * 4, timeout_s=600)
    for r in results:
        first, second = r["migrations"]
        assert r["groups"] >= 2  # several buckets
        assert first["in_flight"] == r["groups"] and second["in_flight"] == 0
        for m in (first, second):
            assert m["gathers"] == [1] * r["groups"]
            assert torch.equal(m["before"], m["after"])


@pytest.mark.parametrize("optimizer", ["distributed", "megatron"])
def test_frozen_dense_parameters_leave_a_stub_optimizer(pool_for, optimizer):
    """Frozen router (expert-only training): Megatron chains a stub optimizer for the dense side."""
    pool = pool_for(4)
    plain = pool.run(train_moe_layer, [(EP2, TrainRun(10, optimizer=optimizer, frozen="router"))] * 4,
                     timeout_s=600)[0]
    balanced = pool.run(train_moe_layer, [(EP2, TrainRun(10, INTERVAL, 6, optimizer, frozen="router"))] * 4,
                        timeout_s=600)[0]
    assert rel_diff(plain["losses"], balanced["losses"]) <= 1e-6
    assert rel_diff(plain["grad_norms"], balanced["grad_norms"]) <= 1e-5
    assert any(e["applied"] and e["slots_changed"] > 0 for e in balanced["events"])


def test_frozen_expert_parameter_is_refused_by_name(pool_for):
    with pytest.raises(RuntimeError, match=r"expert slot parameters have requires_grad=False.*balancer.interval"):
        pool_for(4).run(train_moe_layer, [(EP2, TrainRun(10, INTERVAL, 6, "distributed", frozen="linear_fc2"))] * 4,
                        timeout_s=600)


@pytest.mark.parametrize("name, per_element", [("balanced", 4 + 8), ("bf16", 2 + 4 + 8)])
def test_moved_bytes_count_weights_master_and_moments(ep2, name, per_element):
    """fp32: weights and Adam's two moments (the fp32 master is the weights' own piece); bf16:
    bf16 weights, fp32 master and two moments: per element of the slot, after the first step."""
    result = ep2[name][0]
    elements = sum(t.numel() for t in result["slots"][0]["tensors"])
    moved = [e for e in result["events"] if e["applied"] and e["slots_changed"]]
    assert moved
    for e in moved:
        assert e["moved_bytes"] == e["slots_changed"] * elements * per_element
