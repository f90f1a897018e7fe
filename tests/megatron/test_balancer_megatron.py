"""The expert balancer in a Megatron MoELayer on 4 CPU ranks (EP 4, gloo, fp32 unless noted;
torch AdamW or Megatron's unsharded optimizer): training with rebalancing every 5 steps and
replicas gives the losses of training without it, migrations leave the layer's output
unchanged, replicas stay identical, and a checkpoint saved after a migration resumes
bit-identically. The distributed optimizer: tests/megatron/test_balancer_distributed_optimizer.py."""

from __future__ import annotations

import collections

import pytest
import torch

from helpers import assert_migration_kept_output

pytest.importorskip("megatron.core")

from harness.megatron.balancer_runs import TrainRun, train_moe_layer  # noqa: E402
from megatron_patches.local.layer import LayerCase  # noqa: E402

pytestmark = pytest.mark.megatron

W = 4
CASE = LayerCase(world_size=W, num_experts=8, topk=2, hidden=16, ffn=12, seq=8, batch=4)
STEPS, INTERVAL, SLOTS_PER_RANK = 20, 5, 3  # 12 slots for 8 experts: 4 replicas


@pytest.fixture(scope="module")
def runs(pool_for, new_checkpoint_dir):
    pool = pool_for(W)
    out = {}
    for kind in ("torch", "megatron"):
        out[kind, "plain"] = pool.run(train_moe_layer, [(CASE, TrainRun(STEPS, optimizer=kind))] * W, timeout_s=600)
        ckpt = new_checkpoint_dir() if kind == "megatron" else None
        run = TrainRun(STEPS, INTERVAL, SLOTS_PER_RANK, kind, checkpoint_dir=ckpt)
        out[kind, "balanced"] = pool.run(train_moe_layer, [(CASE, run)] * W, timeout_s=600)
    run = TrainRun(STEPS, INTERVAL, SLOTS_PER_RANK, "megatron", bf16=True, checkpoint_dir=new_checkpoint_dir())
    out["bf16"] = pool.run(train_moe_layer, [(CASE, run)] * W, timeout_s=600)
    run = TrainRun(INTERVAL, INTERVAL, SLOTS_PER_RANK, "torch", tolerance=0.25)
    out["tolerance"] = pool.run(train_moe_layer, [(CASE, run)] * W, timeout_s=600)
    run = TrainRun(INTERVAL, INTERVAL, SLOTS_PER_RANK, "torch", move_budget=0.0)
    out["move_budget"] = pool.run(train_moe_layer, [(CASE, run)] * W, timeout_s=600)
    # two nodes of two ranks: the node-aware plan and the replica choice by locality
    out["nodes", "plain"] = pool.run(train_moe_layer, [(CASE, TrainRun(STEPS, ranks_per_node=2))] * W, timeout_s=600)
    run = TrainRun(STEPS, INTERVAL, SLOTS_PER_RANK, "torch", rdma_weight=0.5, ranks_per_node=2)
    out["nodes", "balanced"] = pool.run(train_moe_layer, [(CASE, run)] * W, timeout_s=600)
    return out


def rel_diff(a, b):
    a, b = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    return float(((a - b).abs() / a.abs().clamp_min(1e-12)).max())


@pytest.mark.parametrize("kind", ["torch", "megatron"])
def test_losses_match_training_without_balancer(runs, kind):
    plain, balanced = runs[kind, "plain"][0], runs[kind, "balanced"][0]
    assert len(plain["losses"]) == STEPS
    assert rel_diff(plain["losses"], balanced["losses"]) <= 1e-5
    assert plain["losses"][-1] < plain["losses"][0]  # it trains
    if kind == "megatron":  # replicas counted once in the gradient norm (clip_grad=1.0 is on)
        assert rel_diff(plain["grad_norms"], balanced["grad_norms"]) <= 1e-5
        # and in Megatron-LM's params norm (its assert refused the optimizer's mark on replicas)
        assert len(balanced["params_norms"]) == STEPS
        assert rel_diff(plain["params_norms"], balanced["params_norms"]) <= 1e-5


@pytest.mark.parametrize("kind", ["torch", "megatron"])
def test_migrations_happen_and_leave_output_unchanged(runs, kind):
    result = runs[kind, "balanced"][0]
    events = result["events"]
    assert [e["iteration"] for e in events] == [5, 10, 15, 20]
    applied = [e for e in events if e["applied"]]
    assert applied and sum(e["slots_changed"] for e in applied) > 0
    assert all(e["imbalance_rank_after"] < e["imbalance_rank_before"] for e in applied)
    for rank_result in runs[kind, "balanced"]:
        probes = rank_result["around_migration"]
        assert len(probes) == len(applied)
        for probe in probes:
            assert_migration_kept_output(probe["before"], probe["after"], bf16=False)


@pytest.mark.parametrize("kind", ["torch", "megatron"])
def test_replicas_identical_and_equal_to_unbalanced_experts(runs, kind):
    by_expert = collections.defaultdict(list)
    for rank_result in runs[kind, "balanced"]:
        for slot in rank_result["slots"]:
            by_expert[slot["expert"]].append(slot["tensors"])
    assert sorted(by_expert) == list(range(CASE.num_experts))
    assert sum(len(v) for v in by_expert.values()) == W * SLOTS_PER_RANK
    for copies in by_expert.values():
        for other in copies[1:]:
            for x, y in zip(copies[0], other):
                assert torch.equal(x, y)  # weights and optimizer state, bit for bit
    plain = {}
    for rank_result in runs[kind, "plain"]:
        plain.update(rank_result["experts"])
    for rank_result in runs[kind, "balanced"]:
        for e, (fc1, fc2) in rank_result["experts"].items():
            torch.testing.assert_close(fc1, plain[e][0], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(fc2, plain[e][1], rtol=1e-5, atol=1e-6)


def test_mixed_precision_migration_moves_master_weights_and_adam_state(runs):
    """bf16 weights with fp32 masters (Megatron's mixed precision): every replica holds the
    same weights, masters and Adam state bit for bit, and a migration keeps the output up to
    rounding (helpers.assert_migration_kept_output says why not bit for bit)."""
    results = runs["bf16"]
    assert any(e["applied"] for e in results[0]["events"])
    by_expert = collections.defaultdict(list)
    for rank_result in results:
        for slot in rank_result["slots"]:
            # per parameter: bf16 weight, fp32 master, exp_avg, exp_avg_sq, step
            assert len(slot["tensors"]) == 10
            by_expert[slot["expert"]].append(slot["tensors"])
    for copies in by_expert.values():
        for other in copies[1:]:
            for x, y in zip(copies[0], other):
                assert torch.equal(x, y)
    for rank_result in results:
        for probe in rank_result["around_migration"]:
            assert_migration_kept_output(probe["before"], probe["after"], bf16=True)


@pytest.mark.parametrize("key", [("megatron", "balanced"), "bf16"])
def test_checkpoint_after_a_migration_resumes_bit_identically(runs, key):
    """Saved after step 10 (a migration), loaded into a fresh layer with scrambled weights:
    the two runs then train and rebalance (at 15 and 20) exactly alike."""
    for rank_result in runs[key]:
        resumed = rank_result["resumed"]
        assert resumed["restored"]["placement_equal"] and resumed["restored"]["load_equal"]
        assert resumed["restored"]["steps"] == (10, 10)
        assert resumed["losses"] == rank_result["losses"][10:]
        assert resumed["grad_norms"] == rank_result["grad_norms"][10:]
        assert [e["iteration"] for e in resumed["events"]] == [15, 20]
        changed = [e["slots_changed"] for e in rank_result["events"][2:]]
        assert [e["slots_changed"] for e in resumed["events"]] == changed
        for a, b in zip(rank_result["slots"], resumed["slots"]):
            assert a["expert"] == b["expert"] and len(a["tensors"]) == len(b["tensors"]) >= 2
            assert all(torch.equal(x, y) for x, y in zip(a["tensors"], b["tensors"]))


def test_attach_passes_the_tolerance(runs):
    """HybridEPOptions.balancer_tolerance reaches the ExpertBalancer that attach() builds: on
    the same load at step 5, the default (the planner's 0.01) migrates, 0.25 keeps the first placement (its
    imbalance is within 0.25 of the fresh plan's)."""
    assert [r["tolerance"] for r in runs["torch", "balanced"]] == [None] * W  # the planner's default
    assert [r["tolerance"] for r in runs["tolerance"]] == [0.25] * W
    first, (kept,) = runs["torch", "balanced"][0]["events"][0], runs["tolerance"][0]["events"]
    assert first["iteration"] == kept["iteration"] == INTERVAL
    assert first["applied"] and first["slots_changed"] > 0
    assert not kept["applied"] and kept["slots_changed"] == 0
    assert kept["imbalance_rank_before"] == first["imbalance_rank_before"]  # the same load
    assert first["imbalance_rank_after"] < kept["imbalance_rank_before"] <= first["imbalance_rank_after"] + 0.25


def test_rdma_weight_plans_for_nodes_and_keeps_the_losses(runs):
    """HybridEPOptions.balancer_rdma_weight reaches the ExpertBalancer on 2 nodes of 2 ranks: it
    plans node-aware and routes by locality (routing_nodes 2), migrates, and the losses and
    gradient norms stay those of the unbalanced run on the same nodes."""
    plain, balanced = runs["nodes", "plain"][0], runs["nodes", "balanced"][0]
    assert [r["rdma_weight"] for r in runs["nodes", "balanced"]] == [0.5] * W
    assert [r["routing_nodes"] for r in runs["nodes", "balanced"]] == [2] * W
    assert [r["routing_nodes"] for r in runs["torch", "balanced"]] == [1] * W  # without it: the spreading rule
    applied = [e for e in balanced["events"] if e["applied"]]
    assert applied and sum(e["slots_changed"] for e in applied) > 0
    assert len(plain["losses"]) == len(balanced["losses"]) == STEPS
    assert rel_diff(plain["losses"], balanced["losses"]) <= 1e-5
    assert rel_diff(runs["torch", "plain"][0]["losses"], plain["losses"]) <= 1e-5  # nodes change no result
    for rank_result in runs["nodes", "balanced"]:
        for probe in rank_result["around_migration"]:
            assert_migration_kept_output(probe["before"], probe["after"], bf16=False)


def test_attach_passes_the_move_budget(runs):
    """HybridEPOptions.balancer_move_budget reaches the ExpertBalancer that attach() builds: on
    the same load at step 5, the default (no cap) migrates, a budget of 0 changes no slot and
    keeps the starting placement (the one the tolerance run kept)."""
    assert [r["move_budget"] for r in runs["torch", "balanced"]] == [None] * W
    assert [r["move_budget"] for r in runs["move_budget"]] == [0.0] * W
    first, (held,) = runs["torch", "balanced"][0]["events"][0], runs["move_budget"][0]["events"]
    assert held["iteration"] == first["iteration"] == INTERVAL
    assert first["applied"] and first["slots_changed"] > 0
    assert not held["applied"] and held["slots_changed"] == 0
    assert held["imbalance_rank_before"] == held["imbalance_rank_after"] == first["imbalance_rank_before"]
    for held_rank, kept_rank, moved_rank in zip(runs["move_budget"], runs["tolerance"], runs["torch", "balanced"]):
        assert torch.equal(held_rank["placement"], kept_rank["placement"])
        assert not torch.equal(held_rank["placement"], moved_rank["placements"][0][1])


def test_attach_takes_a_placement_file_planned_for_this_model(pool_for, tmp_path):
    """--hybrid-ep-balancer-placement: a YAML planned for this model's experts, EP size and slots
    becomes the first placement; one planned for another EP size or expert count with the same
    table shape (12 slots) is refused by name instead of loading as a plan for other ranks."""
    import numpy as np

    from harness.megatron.balancer_runs import attach_placement_file
    from hybrid_ep.balancer import plan_placement
    from hybrid_ep.balancer.placement_file import save_placement_yaml

    load = np.random.default_rng(5).random((1, CASE.num_experts)) * 100
    good = plan_placement(load, W * SLOTS_PER_RANK, 1, W)
    other_ep = plan_placement(load, W * SLOTS_PER_RANK, 1, 2)
    other_experts = plan_placement(np.ones((1, 12)), W * SLOTS_PER_RANK, 1, W)
    paths = {}
    for name, placement in (("good", good), ("other_ep", other_ep), ("other_experts", other_experts)):
        paths[name] = save_placement_yaml(placement, str(tmp_path / f"{name}.yaml"))
    pool = pool_for(W)
    rows = pool.run(attach_placement_file, [(CASE, SLOTS_PER_RANK, paths["good"])] * W, timeout_s=300)
    assert all(torch.equal(r, good.slot_to_expert) for r in rows)
    assert not torch.equal(good.slot_to_expert, plan_placement(np.ones((1, 8)), 12, 1, W).slot_to_expert)
    for name, words in (("other_ep", "ep_size 2 (the model has 4)"),
                        ("other_experts", "num_experts 12 (the model has 8)")):
        messages = pool.run(attach_placement_file, [(CASE, SLOTS_PER_RANK, paths[name])] * W, timeout_s=300)
        assert all(isinstance(m, str) and f"{name}.yaml' was planned for another model: {words}" in m
                   for m in messages), messages[0]


def test_attach_takes_the_rows_of_the_models_layer_numbers(pool_for, tmp_path):
    """A placement file names the model layer of each row (layer_numbers, as the CLI writes them):
    the model (one MoE layer, layer_number 1) takes its row from a file planned for more layers,
    and a file for another layer of the same count is refused naming both layer numbers (before,
    only the count was compared and it loaded rows planned for another layer). A file without
    layer_numbers still loads in order when the counts agree."""
    import numpy as np

    from harness.megatron.balancer_runs import attach_placement_file
    from hybrid_ep.balancer import plan_placement
    from hybrid_ep.balancer.placement_file import save_placement_yaml
    from hybrid_ep.balancer.planner import Placement

    plan = plan_placement(np.random.default_rng(6).random((3, CASE.num_experts)) * 100, W * SLOTS_PER_RANK, 1, W)
    rows = plan.slot_to_expert
    assert not torch.equal(rows[0], rows[1])

    def one(row, name, numbers=None):
        extra = None if numbers is None else {"layer_numbers": numbers}
        return save_placement_yaml(Placement(rows[row:row + 1], W, 1, CASE.num_experts), str(tmp_path / name), extra)

    whole = save_placement_yaml(plan, str(tmp_path / "whole.yaml"), extra={"layer_numbers": [2, 1, 3]})
    pool = pool_for(W)
    for path, want in ((whole, rows[1:2]), (one(0, "unnumbered.yaml"), rows[0:1])):
        got = pool.run(attach_placement_file, [(CASE, SLOTS_PER_RANK, path)] * W, timeout_s=300)
        assert all(isinstance(r, torch.Tensor) and torch.equal(r, want) for r in got), (path, got[0])
    messages = pool.run(attach_placement_file, [(CASE, SLOTS_PER_RANK, one(0, "other.yaml", [2]))] * W, timeout_s=300)
    assert all(isinstance(m, str) and "other.yaml' was planned for another model: layer_numbers [2] (the model has "
               "MoE layers [1]; none for [1]). Plan one for this model: python -m hybrid_ep.balancer plan" in m
               for m in messages), messages[0]


def _attach_on_pipeline_stages(path: str):
    """PP 2 x EP 2: a GPTModel of 4 MoE layers (Megatron numbers them 1-4, 2 per stage)
    attached with --hybrid-ep-balancer-placement path: (stage, its layer numbers, its placement
    rows), or (stage, the ValueError's message)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches import HybridEPOptions
    from megatron_patches import balancer as mbalancer
    from megatron_patches.local.common import PLAIN_FP32_CONFIG, init_megatron

    init_megatron(2, pipeline_parallel=2)
    config = TransformerConfig(
        num_layers=4, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32, moe_ffn_hidden_size=16,
        num_moe_experts=8, moe_router_topk=2, moe_token_dispatcher_type="hybrid_ep", expert_model_parallel_size=2,
        pipeline_model_parallel_size=2, pipeline_dtype=torch.float32, **PLAIN_FP32_CONFIG,
        masked_softmax_fusion=False, bias_dropout_fusion=False, persist_layer_norm=False)
    config.hybrid_ep_options = HybridEPOptions(balancer_interval=5, balancer_slots_per_rank=5, balancer_placement=path)
    model = GPTModel(config, get_gpt_layer_local_spec(num_experts=8, moe_grouped_gemm=False), vocab_size=64,
                     max_sequence_length=8, pre_process=ps.is_pipeline_first_stage(),
                     post_process=ps.is_pipeline_last_stage())
    stage = ps.get_pipeline_model_parallel_rank()
    try:
        bal = mbalancer.attach(model, torch.optim.AdamW(model.parameters()), writers=[])
    except ValueError as err:
        return stage, str(err)
    return stage, bal.layer_numbers, bal.placement_rows()


def test_each_pipeline_stage_takes_its_rows_of_one_placement_file(pool_for, tmp_path):
    """With pipeline parallelism every stage reads the same --hybrid-ep-balancer-placement: a file
    planned for the whole model gives each stage the rows of its own MoE layers (before, every
    stage refused it for its layer count); a file of stage 0's layers loads on stage 0 and is
    refused by stage 1, naming the layers (before, stage 1 installed rows planned for layers 1
    and 2); EP size and experts are still checked."""
    import numpy as np

    from hybrid_ep.balancer import plan_placement
    from hybrid_ep.balancer.placement_file import save_placement_yaml
    from hybrid_ep.balancer.planner import Placement

    plan = plan_placement(np.random.default_rng(7).random((4, 8)) * 100, 10, 1, 2)
    rows = plan.slot_to_expert
    whole = save_placement_yaml(plan, str(tmp_path / "whole.yaml"), extra={"layer_numbers": [1, 2, 3, 4]})
    first = save_placement_yaml(Placement(rows[:2], 2, 1, 8), str(tmp_path / "stage0.yaml"),
                                extra={"layer_numbers": [1, 2]})
    other_ep = save_placement_yaml(plan_placement(np.ones((4, 8)), 10, 1, 5), str(tmp_path / "ep5.yaml"),
                                   extra={"layer_numbers": [1, 2, 3, 4]})
    pool = pool_for(4)
    results = pool.run(_attach_on_pipeline_stages, [(whole,)] * 4, timeout_s=600)
    assert sorted(r[0] for r in results) == [0, 0, 1, 1]
    for stage, numbers, got in results:
        assert numbers == [1 + 2 * stage, 2 + 2 * stage] and torch.equal(got, rows[2 * stage:2 * stage + 2])
    results = pool.run(_attach_on_pipeline_stages, [(first,)] * 4, timeout_s=600)
    for result in results:
        if result[0] == 0:
            assert torch.equal(result[2], rows[:2])
        else:
            assert ("stage0.yaml' was planned for another model: layer_numbers [1, 2] (pipeline stage 1 has MoE "
                    "layers [3, 4]; none for [3, 4])") in result[1], result[1]
            assert "--stats takes every pipeline stage's statistics.npz" in result[1]
    for stage, message in pool.run(_attach_on_pipeline_stages, [(other_ep,)] * 4, timeout_s=600):
        assert "ep5.yaml' was planned for another model: ep_size 5 (the model has 2)" in message, message


def test_balancer_flags_through_megatron_argument_parser(monkeypatch):
    """Megatron-LM's parser takes the --hybrid-ep-balancer-* flags; they reach HybridEPOptions."""
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron.training import global_vars, training

    import megatron_patches
    from harness.megatron.moe_layer import TINY_GPT_ARGS
    from megatron_patches import options

    applied = megatron_patches.apply()
    assert applied["balancer_hook"] and getattr(training.setup_model_and_optimizer, "_hybrid_ep_balancer", False)
    argv = ["pretrain_gpt.py", *TINY_GPT_ARGS, "--moe-token-dispatcher-type", "hybrid_ep",
            "--hybrid-ep-balancer-interval", "50", "--hybrid-ep-balancer-slots-per-rank", "5",
            "--hybrid-ep-balancer-window", "4", "--hybrid-ep-balancer-min-gain", "0.02",
            "--hybrid-ep-balancer-tolerance", "0.03", "--hybrid-ep-balancer-move-budget", "0.1",
            "--hybrid-ep-balancer-rdma-weight", "0.5", "--hybrid-ep-balancer-report-dir", "/tmp/reports"]
    monkeypatch.setattr("sys.argv", argv)
    args = arguments.parse_args(megatron_patches.extra_args_provider)
    arguments.validate_args(args)
    config = arguments.core_transformer_config_from_args(args)
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    opts = options.options_for(config)
    assert opts.balancer_enabled and opts.balancer_interval == 50 and opts.balancer_slots_per_rank == 5
    assert opts.balancer_window == 4 and opts.balancer_min_gain == 0.02 and opts.balancer_tolerance == 0.03
    assert opts.balancer_move_budget == 0.1 and opts.balancer_rdma_weight == 0.5
    assert opts.balancer_report_dir == "/tmp/reports" and opts.balancer_decay is None


@pytest.mark.parametrize("field, value, needle", [
    ("balancer_interval", -1, "balancer_interval"),
    ("balancer_slots_per_rank", 0, "balancer_slots_per_rank"),
    ("balancer_window", 0, "balancer_window"),
    ("balancer_decay", 1.0, "balancer_decay"),
    ("balancer_min_gain", -0.1, "balancer_min_gain"),
    ("balancer_tolerance", -0.1, "balancer_tolerance"),
    ("balancer_tolerance", float("nan"), "balancer_tolerance"),
    ("balancer_tolerance", float("inf"), "balancer_tolerance"),
    ("balancer_tolerance", "0.03", "balancer_tolerance"),
    ("balancer_move_budget", -0.1, "balancer_move_budget"),
    ("balancer_move_budget", 1.5, "balancer_move_budget"),
    ("balancer_move_budget", float("nan"), "balancer_move_budget"),
    ("balancer_move_budget", "0.1", "balancer_move_budget"),
    ("balancer_rdma_weight", -0.5, "balancer_rdma_weight"),
    ("balancer_rdma_weight", float("inf"), "balancer_rdma_weight"),
    ("balancer_rdma_weight", "0.5", "balancer_rdma_weight"),
])
def test_balancer_options_name_the_field(field, value, needle):
    from megatron_patches.options import HybridEPOptions

    with pytest.raises(ValueError, match=needle):
        HybridEPOptions(**{field: value}).validate()


def _assert_knob_flag(knob: str, good: dict[str, float], bad: tuple[str, ...]) -> str:
    """--hybrid-ep-balancer-<knob> through the flags' own parser: each good value read as given,
    each bad one refused by name; without it None in the options, the recipe schema and
    ExpertBalancer. Returns the flag."""
    import argparse

    from hybrid_ep.balancer import ExpertBalancer
    from megatron_patches import options
    from megatron_patches.slurm.schema import KINDS

    parser = options.add_arguments(argparse.ArgumentParser())
    flag, field = "--hybrid-ep-balancer-" + knob.replace("_", "-"), "balancer_" + knob
    for text, value in good.items():
        assert getattr(options.from_args(parser.parse_args([flag, text])), field) == value
    assert getattr(options.from_args(parser.parse_args([])), field) is None
    for text in bad:
        with pytest.raises(ValueError, match=field):
            options.from_args(parser.parse_args([flag, text]))
    assert KINDS["pretrain"]["balancer"][knob] == ("float?", None)
    assert ExpertBalancer.__init__.__kwdefaults__[knob] is None
    return flag


def test_balancer_tolerance_flag_and_defaults():
    """--hybrid-ep-balancer-tolerance; without it None everywhere: the planner's
    DEFAULT_TOLERANCE, defined once."""
    _assert_knob_flag("tolerance", {"0.05": 0.05}, ("-0.1", "nan"))


def test_balancer_move_budget_flag_and_defaults():
    """--hybrid-ep-balancer-move-budget; without it None everywhere: no cap on the slots one
    rebalance moves."""
    _assert_knob_flag("move_budget", {"0.1": 0.1}, ("-0.1", "1.5", "nan"))


def test_balancer_rdma_weight_flag_and_defaults():
    """--hybrid-ep-balancer-rdma-weight through the flags' own parser, the recipe key and the
    Megatron arguments a recipe makes; without it None everywhere: the node-agnostic plan."""
    from hybrid_ep.balancer.knobs import DEFAULT_RDMA_WEIGHT
    from megatron_patches.slurm.megatron_args import dispatcher_args
    from megatron_patches.slurm.schema import KINDS

    flag = _assert_knob_flag("rdma_weight", {str(DEFAULT_RDMA_WEIGHT): 0.5, "0": 0.0}, ("-0.1", "nan", "inf"))
    dispatcher = {"type": "hybrid_ep", "pad_multiple": 1, "num_sms_dispatch": None, "num_sms_combine": None,
                  "static_size_factor": None, "max_tokens_per_rank": None, "backend": "auto", "dispatch_fp8": False}
    balancer = {key: default for key, (_, default) in KINDS["pretrain"]["balancer"].items()} | {"interval": 10}
    assert flag not in dispatcher_args(dispatcher, balancer)
    args = dispatcher_args(dispatcher, balancer | {"rdma_weight": 0.25})
    assert args[args.index(flag) + 1] == "0.25"


def test_too_few_slots_is_refused():
    from megatron_patches.balancer import slots_per_rank
    from megatron_patches.options import HybridEPOptions

    assert slots_per_rank(HybridEPOptions(balancer_interval=5), 8, 4) == 2
    with pytest.raises(ValueError, match="balancer_slots_per_rank"):
        slots_per_rank(HybridEPOptions(balancer_interval=5, balancer_slots_per_rank=1), 8, 4)


def _layer_with_placement(slots: int, ep: int, window: int = 1, experts: int = 8):
    layer = torch.nn.Module()
    layer.register_buffer("hybrid_ep_placement_shape", torch.tensor([slots, ep]))
    layer.register_buffer("hybrid_ep_load_stats", torch.zeros(window + 2, experts, dtype=torch.int64))  # float64 bits
    layer.register_buffer("hybrid_ep_load_meta", torch.zeros(4, dtype=torch.int64))
    layer._hybrid_ep_shape = (slots, ep)
    return layer


def test_checkpoint_shape_check_names_slots_and_replans_other_ep_sizes():
    from megatron_patches.balancer import _check_placement_shape

    saved = {"hybrid_ep_placement_shape": torch.tensor([12, 2])}
    with pytest.raises(ValueError, match="12 slots over EP size 2; this run has 16 slots over EP size 4"):
        _check_placement_shape(_layer_with_placement(16, 4), dict(saved), "")
    layer = _layer_with_placement(12, 4)
    state = dict(saved)  # saved before statistics were checkpointed: zeros, nothing restored
    _check_placement_shape(layer, state, "")
    assert layer._hybrid_ep_replan and state["hybrid_ep_placement_shape"].tolist() == [12, 4]
    assert state["hybrid_ep_load_meta"].tolist() == [0, 0, 0, 0]
    window3 = torch.arange(5 * 8, dtype=torch.float64).reshape(5, 8)  # 3 reductions, average, carry
    state = {"hybrid_ep_placement_shape": torch.tensor([12, 4]), "hybrid_ep_load_stats": window3,
             "hybrid_ep_load_meta": torch.tensor([3, 1, 40, 1])}
    layer = _layer_with_placement(12, 4, window=1)
    _check_placement_shape(layer, state, "")
    assert not getattr(layer, "_hybrid_ep_replan", False)
    assert state["hybrid_ep_load_stats"].dtype == torch.int64  # a float64 file (earlier versions) into the bits
    assert state["hybrid_ep_load_stats"].view(torch.float64).tolist() == [window3[2].tolist(), window3[3].tolist(),
                                                                         window3[4].tolist()]
    assert state["hybrid_ep_load_meta"].tolist() == [1, 1, 40, 1]


def test_save_hook_prepares_the_balancer_before_megatron_saves():
    import types

    from megatron_patches.balancer import _install_save_hook

    calls = []
    training = types.SimpleNamespace(save_checkpoint=lambda it, model, opt, *a, **k: calls.append(("save", it)))
    _install_save_hook(training)
    _install_save_hook(training)  # idempotent
    balancer = types.SimpleNamespace(prepare_checkpoint=lambda: calls.append(("prepare", None)))
    training.save_checkpoint(7, None, types.SimpleNamespace(hybrid_ep_balancer=balancer))
    training.save_checkpoint(8, None, None)
    assert calls == [("prepare", None), ("save", 7), ("save", 8)]


def test_torch_dist_checkpoint_keeps_slot_order_apart_from_expert_order(pool_for, new_checkpoint_dir):
    """A balancer with as many slots as experts (placement only) saves weights in slot order
    with the shapes of expert-ordered ones: a run without the balancer must fail to load them
    rather than take slot s for expert s, and the reverse too. A run with another statistics
    window loads the saved statistics (dist_checkpointing checks shapes before the layer's
    hook could resize them, so they are saved as objects)."""
    from harness.megatron.balancer_checkpoints import load_elsewhere, save_placement_only

    case = LayerCase(world_size=2, num_experts=8, topk=2, hidden=16, ffn=12, seq=8, batch=4)
    pool = pool_for(2)
    placed, plain = new_checkpoint_dir(), new_checkpoint_dir()
    saved = pool.run(save_placement_only, [(case, TrainRun(INTERVAL, INTERVAL, 4, "megatron"), placed)] * 2,
                     timeout_s=600)
    [event] = saved[0]["events"]
    assert event["applied"] and event["slots_changed"] > 0  # slot order is no longer expert order
    for r in pool.run(load_elsewhere, [(case, TrainRun(INTERVAL), placed)] * 2, timeout_s=600):
        assert r["error"] is not None and "hybrid_ep_slot_experts" in r["error"]
    pool.run(save_placement_only, [(case, TrainRun(INTERVAL, optimizer="megatron"), plain)] * 2, timeout_s=600)
    for r in pool.run(load_elsewhere, [(case, TrainRun(interval=INTERVAL, slots_per_rank=4), plain)] * 2,
                      timeout_s=600):
        assert r["error"] is not None and "hybrid_ep" in r["error"]
    window3 = TrainRun(interval=INTERVAL, slots_per_rank=4, window=3)
    for s, r in zip(saved, pool.run(load_elsewhere, [(case, window3, placed)] * 2, timeout_s=600)):
        assert r["error"] is None and r["held"] == 1 and r["steps"] == INTERVAL
        assert (r["load"] == s["load"]).all() and s["load"].sum() > 0
    five_slots = TrainRun(interval=INTERVAL, slots_per_rank=5)
    for r in pool.run(load_elsewhere, [(case, five_slots, placed)] * 2, timeout_s=600):
        assert r["error"] is not None and "hybrid_ep_slot_experts" in r["error"] and "[8," in r["error"]


def test_state_saved_before_a_placement_loads(pool_for):
    from harness.megatron.balancer_checkpoints import load_unplaced
    from hybrid_ep.balancer import Placement

    case = LayerCase(world_size=2, num_experts=8, topk=2, hidden=16, ffn=12, seq=8, batch=4)
    for r in pool_for(2).run(load_unplaced, [(case, TrainRun(interval=INTERVAL, slots_per_rank=5))] * 2,
                             timeout_s=600):
        assert r["unset_after_load"]
        assert torch.equal(r["placement"], Placement.identity(1, 8, 10, 2, 1).slot_to_expert)  # as unloaded
        assert "load it before the balancer is attached" in r["after_attach"]


def test_checkpoint_loaded_after_attach_restores_the_statistics(pool_for):
    from harness.megatron.balancer_checkpoints import reload_after_attach

    case = LayerCase(world_size=2, num_experts=8, topk=2, hidden=16, ffn=12, seq=8, batch=4)
    for r in pool_for(2).run(reload_after_attach, [(case, TrainRun(7, INTERVAL, 6))] * 2, timeout_s=600):
        saved, after = r["saved"], r["after"]
        assert saved["steps"] == after["steps"] == 7 and saved["load"].sum() > 0 and saved["carry"].sum() > 0
        assert (saved["load"] == after["load"]).all() and (saved["carry"] == after["carry"]).all()
        assert torch.equal(saved["placement"], after["placement"])
        assert r["meta_after_save"][2:] == [7, 1] and not r["replan_pending"]  # same EP size: no re-plan


@pytest.mark.parametrize("stages, stage, first, expect_dir", [
    (1, 0, True, "rep"), (1, 0, False, "rep"), (4, 2, True, "rep/pipeline_stage_2"),
    (4, 3, False, "rep/pipeline_stage_3")])
def test_each_pipeline_stage_reports_its_layers_in_its_own_folder(monkeypatch, stages, stage, first, expect_dir):
    """With pipeline parallelism each stage's balancer covers its own layers: the first rank of
    each stage's expert grid reports (global rank 0 alone left every later stage unreported),
    into a folder per stage."""
    from megatron.core import parallel_state as ps

    from megatron_patches.balancer import _stage_reporter

    rank = 0 if first else 1
    for name, value in (("model_parallel_is_initialized", True), ("get_pipeline_model_parallel_world_size", stages),
                        ("get_pipeline_model_parallel_rank", stage), ("get_expert_model_parallel_rank", 0),
                        ("get_expert_tensor_parallel_rank", 0), ("get_expert_data_parallel_rank", rank)):
        monkeypatch.setattr(ps, name, lambda value=value: value)
    assert _stage_reporter("rep") == (first, expect_dir)
    assert _stage_reporter(None) == (first, None)
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: False)
    assert _stage_reporter("rep") == (None, "rep")  # library use: the ExpertBalancer's default


@pytest.mark.parametrize("world,pipeline,per_stage", [(2, 1, 2), (4, 2, 1)], ids=["2 MoE layers", "PP 2"])
def test_torch_dist_checkpoint_of_a_block_of_moe_layers(pool_for, new_checkpoint_dir, world, pipeline, per_stage):
    """Every layer of a TransformerBlock has the same checkpoint key; before the balancer's
    objects took the block's offsets, dist_checkpointing refused the save (duplicate shard
    keys) on one rank while the others waited."""
    from harness.megatron.balancer_checkpoints import block_checkpoint

    directory = new_checkpoint_dir()
    results = pool_for(world).run(block_checkpoint, [(directory, pipeline, per_stage)] * world, timeout_s=600)
    placements = set()
    for r in results:
        assert r["loaded"] == r["saved"]
        assert len(r["saved"]) == per_stage
        for layer in r["saved"]:
            placements.add(tuple(layer["hybrid_ep_slot_to_expert"]))
            assert any(v != 0 for row in layer["hybrid_ep_load_stats"] for v in row)
    assert len(placements) == 2  # the layers (or stages) held different placements


@pytest.mark.parametrize("slots_per_rank", [4, 6])
def test_legacy_balancer_checkpoint_is_refused_by_layers_without_it(pool_for, slots_per_rank):
    """Megatron-LM retries a failed strict load with strict=False, which dropped the placement
    keys and loaded slot j as expert j (S = E) or dropped the spare slots (S > E), silently."""
    from harness.megatron.balancer_checkpoints import load_legacy_without_balancer

    run = TrainRun(7, INTERVAL, slots_per_rank, "torch")
    for r in pool_for(W).run(load_legacy_without_balancer, [(CASE, run)] * W, timeout_s=600):
        assert r["slots_changed"] > 0  # saved after a migration
        for dispatcher in ("hybrid_ep", "alltoall"):
            assert r[dispatcher] is not None, dispatcher
            assert f"{slots_per_rank * W} slots over EP size {W}" in r[dispatcher]
            assert "--hybrid-ep-balancer-interval" in r[dispatcher]


def test_torch_dist_balancer_objects_are_host_copies():
    """An object is pickled with its tensor's device and unpickled there on every loading rank:
    a GPU buffer would put each rank on the saver's GPU, and fail on a host without it."""
    import types

    from megatron_patches.balancer import _slot_sharded_state_dict

    buffers = {name: torch.arange(4) for name in ("hybrid_ep_slot_to_expert", "hybrid_ep_load_stats")}

    def original(prefix="", sharded_offsets=(), metadata=None):
        return {prefix + name: types.SimpleNamespace(key=prefix + name, data=t, replica_id=(0, 0, 0))
                for name, t in buffers.items()}

    out = _slot_sharded_state_dict(original)("decoder.layers.mlp.", ((0, 2, 4),))
    for name, t in buffers.items():
        obj = out["decoder.layers.mlp." + name]
        assert torch.equal(obj.data, t) and obj.data.device.type == "cpu"
        assert obj.data.data_ptr() != t.data_ptr()  # not the live buffer (async saves read it later)


def test_training_loops_iteration_sets_the_schedule_after_a_resume(pool_for):
    """Saved after 7 steps (rebalanced at 5): a library attach (None) and a resume at Megatron's
    iteration 7 go on at step 7 and rebalance at 10; --finetune starts Megatron at iteration 0,
    and the balancer with it (it kept the saved 7 and rebalanced at its step 10, Megatron's 3)."""
    from harness.megatron.balancer_checkpoints import resume_at_iteration

    run = TrainRun(7, INTERVAL, SLOTS_PER_RANK, "torch")
    for r in pool_for(W).run(resume_at_iteration, [(CASE, run, [None, 7, 0])] * W, timeout_s=600):
        assert r[None] == r[7] == {"steps": 7, "rebalanced_at": [10]}
        assert r[0] == {"steps": 0, "rebalanced_at": [5]}


def test_statistics_survive_megatrons_float16_module(pool_for):
    """Megatron-LM wraps every model chunk in Float16Module under --bf16 / --fp16, which casts
    floating-point buffers: float64 statistics came back rounded (1000003 -> 999424 in bf16,
    inf in fp16). Kept as int64 bits they go through the cast, a save and a load exactly."""
    from harness.megatron.balancer_checkpoints import stats_through_float16_module

    case = LayerCase(world_size=1, num_experts=4)
    for fp16 in (False, True):
        dtype, restored = pool_for(1).run(stats_through_float16_module, [(case, fp16)])[0]
        assert dtype == "torch.int64"
        assert restored == [1000003.0, 7.0, 513.0, 1.0]  # counts since the last reduction, exact
