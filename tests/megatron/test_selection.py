"""Selecting the dispatcher: megatron_patches.apply(), the config type, Megatron-LM's
command line (--moe-token-dispatcher-type hybrid_ep and the --hybrid-ep-* knobs), and
clear errors for combinations the dispatcher does not support."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

import megatron_patches  # noqa: E402
from harness.megatron.moe_layer import TINY_GPT_ARGS as MEGATRON_ARGS  # noqa: E402
from harness.megatron.moe_layer import try_build_moe_layer  # noqa: E402
from megatron_patches import options, selection  # noqa: E402
from megatron_patches.local.layer import LayerCase  # noqa: E402

pytestmark = pytest.mark.megatron


def test_apply_is_idempotent_and_wraps_once():
    from megatron.core.transformer.moe.moe_layer import MoELayer

    first = megatron_patches.apply()
    init = MoELayer.__init__
    second = megatron_patches.apply()
    assert MoELayer.__init__ is init
    assert first == second
    assert first["moe_layer"] is True
    # One wrapper around Megatron's own constructor, not two.
    assert getattr(init, "_hybrid_ep_patched", False)
    assert not getattr(init.__wrapped__, "_hybrid_ep_patched", False)
    assert selection.patch_moe_layer() is False


def test_manager_is_exported_lazily():
    from megatron_patches.manager import HybridEPManager

    assert megatron_patches.HybridEPManager is HybridEPManager
    assert HybridEPManager.__mro__[1].__name__ == "_DispatchManager"


def test_config_type_selects_dispatcher_and_leaves_others_alone(pool_for):
    pool = pool_for(2)
    for dispatcher, expected in [
        ("hybrid_ep", "HybridEPManager"),
        ("alltoall", "MoEAlltoAllTokenDispatcher"),
        ("allgather", "MoEAllGatherTokenDispatcher"),
    ]:
        got = pool.run(try_build_moe_layer, [(LayerCase(world_size=2, dispatcher=dispatcher), {})] * 2)
        assert got == [expected, expected]


def _built_config(single_rank_group, **fields):
    """A hybrid_ep config after one MoELayer was built from it (EP 1 on this process)."""
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_patches.local.common import PLAIN_FP32_CONFIG

    megatron_patches.apply()
    config = _config(expert_model_parallel_size=1, bf16=False, **PLAIN_FP32_CONFIG, **fields)
    group = single_rank_group
    pgs = ProcessGroupCollection(tp=group, cp=group, ep=group, expt_tp=group, expt_dp=group, tp_ep=group,
                                 tp_cp=group, tp_dp_cp=group, dp=group, dp_cp=group, pp=group)
    spec = get_moe_module_spec(use_te=False, num_experts=4, moe_grouped_gemm=False)
    layer = spec(config=config, layer_number=1, pg_collection=pgs)
    return config, layer


def test_a_hybrid_ep_layer_is_megatrons_flex_dispatcher_with_hybrid_eps_backend(single_rank_group):
    """Validation keeps the type the user gave; building the layer makes it Megatron's flex
    dispatcher over HybridEPManager, with a backend name Megatron reads as "hybridep" and the
    patch tells apart from DeepEP's; DeepEP's manager is bound again right after."""
    import dataclasses

    from megatron.core.transformer.moe import token_dispatcher

    deepep_manager = token_dispatcher._HybridEPManager
    config, layer = _built_config(single_rank_group)
    assert type(layer.token_dispatcher).__name__ == "MoEFlexTokenDispatcher"
    assert type(layer.token_dispatcher._comm_manager) is megatron_patches.HybridEPManager
    assert token_dispatcher._HybridEPManager is deepep_manager
    assert config.moe_token_dispatcher_type == "flex" and config.moe_flex_dispatcher_backend == "hybridep"
    assert selection.selected(config) and selection.selected(dataclasses.replace(config))
    deepep = dataclasses.replace(config, moe_flex_dispatcher_backend="hybridep")  # a user's own choice
    assert not selection.selected(deepep) and deepep.moe_flex_dispatcher_backend == "hybridep"


def test_megatrons_own_answers_for_hybridep_are_what_hybrid_ep_needs(single_rank_group):
    """The EP-overlap schedule frees moe_combine's input, mlp's only with fp8/fp4, never
    moe_dispatch's (the router and the experts keep those for backward), and the experts skip
    their padding copy (the dispatcher aligned the rows): Megatron's own answers for the flex
    dispatcher's hybridep backend, which hybrid_ep's patches of should_free_input and
    skip_routed_expert_padding gave before."""
    from megatron.core.models.common.utils import should_free_input
    from megatron.core.transformer.moe.moe_utils import skip_routed_expert_padding

    config, _ = _built_config(single_rank_group)
    frees = {name: should_free_input(name, True, config, 4) for name in ("moe_dispatch", "mlp", "moe_combine")}
    assert frees == {"moe_dispatch": False, "mlp": False, "moe_combine": True}
    config.fp8 = "e4m3"
    assert should_free_input("mlp", True, config, 4) is True
    assert skip_routed_expert_padding(config) is True


@pytest.mark.parametrize("overrides, needle, alternative", [
    (dict(moe_pad_expert_input_to_capacity=True), "moe_pad_expert_input_to_capacity", "set moe_expert_capacity_factor"),
    (dict(moe_expert_rank_capacity_factor=1.5, hybrid_ep_options=options.HybridEPOptions(static_size_factor=2.0)),
     "disagree", "set only moe_expert_rank_capacity_factor"),
    (dict(hybrid_ep_options=options.HybridEPOptions(balancer_interval=4), moe_pad_expert_input_to_capacity=True,
          moe_expert_capacity_factor=1.0), "expert balancer", "use moe_expert_rank_capacity_factor"),
    # set after validation: refused again when MoELayer is built
    (dict(moe_paged_stash=True, moe_expert_rank_capacity_factor=1.5), "moe_paged_stash", "turn moe_paged_stash off"),
])
def test_unsupported_combinations_raise_clearly(pool_for, overrides, needle, alternative):
    """Every refusal names the field and says what to use instead."""
    got = pool_for(2).run(try_build_moe_layer, [(LayerCase(world_size=2), overrides)] * 2)
    for message in got:
        assert message.startswith("ValueError: "), message
        assert needle in message and alternative in message, message


def _config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=16, num_attention_heads=2, num_moe_experts=4, moe_router_topk=2,
                expert_model_parallel_size=2, moe_token_dispatcher_type="hybrid_ep", bf16=True)
    return TransformerConfig(**dict(base, **fields))


@pytest.mark.parametrize("fields", [
    dict(overlap_moe_expert_parallel_comm=True),
    dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_overlap=True),
    dict(moe_expert_rank_capacity_factor=1.25),
    dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
])
def test_config_validation_accepts_hybrid_ep(fields):
    """Megatron refuses these for any type but alltoall/flex; after apply() hybrid_ep passes
    the same validation, and the fields keep their values."""
    megatron_patches.apply()
    config = _config(**fields)
    assert config.moe_token_dispatcher_type == "hybrid_ep"
    for name, value in fields.items():
        assert getattr(config, name) == value


def test_config_validation_still_checks_the_rest_for_hybrid_ep():
    """The alltoall checks still run: the EP overlap refuses an fp32 model and shared-expert overlap."""
    megatron_patches.apply()
    with pytest.raises(AssertionError, match="bf16 or fp16"):
        _config(overlap_moe_expert_parallel_comm=True, bf16=False)
    with pytest.raises(AssertionError, match="moe_shared_expert_overlap"):
        _config(overlap_moe_expert_parallel_comm=True, moe_shared_expert_intermediate_size=16,
                moe_shared_expert_overlap=True)
    with pytest.raises(ValueError, match="moe_expert_rank_capacity_factor"):
        _config(moe_token_dispatcher_type="alltoall", moe_expert_rank_capacity_factor=1.25)


def test_paged_stash_is_refused_by_name_at_config_validation():
    """Megatron's paged-stash runner reruns overflowing steps with the flex manager's rank
    capacity factor off, which has not run with hybrid_ep: refused naming the flag and why, not
    with Megatron's misleading "requires moe_expert_rank_capacity_factor" (that factor is set
    here, only hidden from validation)."""
    megatron_patches.apply()
    with pytest.raises(ValueError) as err:
        _config(moe_paged_stash=True, moe_expert_rank_capacity_factor=1.5)
    message = str(err.value)
    assert message.startswith("moe_token_dispatcher_type='hybrid_ep' does not support: moe_paged_stash=True")
    assert "rank capacity factor turned off" in message and "turn moe_paged_stash off" in message
    assert "requires moe_expert_rank_capacity_factor" not in message
    # Other dispatcher types still get Megatron's own paged-stash check.
    with pytest.raises(ValueError, match="moe_paged_stash requires moe_expert_rank_capacity_factor"):
        _config(moe_token_dispatcher_type="alltoall", moe_paged_stash=True)


_BAD_OPTION_VALUES = [
    (field, value)
    for field in ("num_sms_dispatch", "num_sms_combine", "max_tokens_per_rank", "ranks_per_node",
                  "balancer_slots_per_rank", "pad_multiple", "balancer_window", "balancer_interval")
    for value in (True, 2.0, "2", float("inf"), -1)
] + [
    (field, value)
    for field in ("static_size_factor", "balancer_decay", "balancer_min_gain")
    for value in (True, "0.5", float("inf"), float("nan"), -0.5)
] + [
    ("pad_multiple", None), ("balancer_window", None), ("balancer_interval", None), ("balancer_min_gain", None),
    ("balancer_decay", 1.0), ("balancer_tolerance", True), ("balancer_move_budget", False),
]


@pytest.mark.parametrize("field, value", _BAD_OPTION_VALUES, ids=lambda v: repr(v) if not isinstance(v, str) else v)
def test_options_validate_every_numeric_field_by_name(field, value):
    """Wrong types (bools too: True is an int), inf and nan are refused by validate() with a
    ValueError naming the field, not a bare TypeError or an OverflowError at the first dispatch."""
    with pytest.raises(ValueError, match=f"hybrid_ep option {field} must be"):
        options.HybridEPOptions(**{field: value}).validate()


def test_options_validate_keeps_good_values():
    opts = options.HybridEPOptions(num_sms_dispatch=4, pad_multiple=8, static_size_factor=2, balancer_interval=0,
                                   balancer_window=3, balancer_decay=0.5, balancer_min_gain=0).validate()
    assert (opts.num_sms_dispatch, opts.pad_multiple, opts.static_size_factor) == (4, 8, 2)


@pytest.mark.parametrize("factor", [float("inf"), float("nan"), "1.5", True, 0.0])
def test_rank_capacity_factor_is_checked_by_name(factor):
    """moe_expert_rank_capacity_factor is hidden from Megatron's validation for hybrid_ep, so
    the dispatcher checks it (inf used to pass and overflow in the first dispatch)."""
    import types

    config = types.SimpleNamespace(moe_expert_rank_capacity_factor=factor)
    with pytest.raises(ValueError, match="moe_expert_rank_capacity_factor must be a finite number > 0"):
        options.static_size_factor(config, options.HybridEPOptions())
    assert options.static_size_factor(types.SimpleNamespace(moe_expert_rank_capacity_factor=1.5),
                                      options.HybridEPOptions()) == 1.5


def test_options_validate_names_the_field():
    with pytest.raises(ValueError, match="pad_multiple"):
        options.HybridEPOptions(pad_multiple=0).validate()
    with pytest.raises(ValueError, match="static_size_factor"):
        options.HybridEPOptions(static_size_factor=-1.0).validate()
    with pytest.raises(ValueError, match="backend"):
        options.HybridEPOptions(backend="nope").validate()


def test_expert_out_in_place_is_on_by_default_and_turned_off_by_its_no_flag():
    """--hybrid-ep-expert-out-in-place defaults to on; --no-hybrid-ep-expert-out-in-place turns it
    off; validate() refuses anything but a bool by name."""
    import argparse

    parser = options.add_arguments(argparse.ArgumentParser())
    assert options.HybridEPOptions().expert_out_in_place is True
    assert options.from_args(parser.parse_args([])).expert_out_in_place is True
    assert options.from_args(parser.parse_args(["--hybrid-ep-expert-out-in-place"])).expert_out_in_place is True
    off = options.from_args(parser.parse_args(["--no-hybrid-ep-expert-out-in-place"]))
    assert off == options.HybridEPOptions(expert_out_in_place=False)
    for value in (1, "false", None):
        with pytest.raises(ValueError, match="hybrid_ep option expert_out_in_place must be a bool"):
            options.HybridEPOptions(expert_out_in_place=value).validate()


def test_flag_through_megatron_argument_parser(monkeypatch):
    """Megatron-LM's own parser accepts the type and knobs and builds the TransformerConfig."""
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.training import global_vars

    megatron_patches.apply()
    argv = ["pretrain_gpt.py", *MEGATRON_ARGS, "--moe-token-dispatcher-type", "hybrid_ep",
            "--hybrid-ep-pad-multiple", "4", "--hybrid-ep-num-sms-dispatch", "24",
            "--hybrid-ep-num-sms-combine", "20", "--hybrid-ep-static-size-factor", "1.5",
            "--no-hybrid-ep-expert-out-in-place"]
    monkeypatch.setattr("sys.argv", argv)
    args = arguments.parse_args(megatron_patches.extra_args_provider)
    assert args.moe_token_dispatcher_type == "hybrid_ep"
    arguments.validate_args(args)
    config = arguments.core_transformer_config_from_args(args)
    assert isinstance(config, TransformerConfig)
    assert config.moe_token_dispatcher_type == "hybrid_ep"
    assert config.num_moe_experts == 8 and config.moe_router_topk == 2
    monkeypatch.setattr(global_vars, "_GLOBAL_ARGS", args)
    assert options.options_for(config) == options.HybridEPOptions(
        num_sms_dispatch=24, num_sms_combine=20, pad_multiple=4, static_size_factor=1.5, expert_out_in_place=False
    )


def test_megatron_parser_still_rejects_unknown_types(monkeypatch, capsys):
    arguments = pytest.importorskip("megatron.training.arguments")
    megatron_patches.apply()
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *MEGATRON_ARGS, "--moe-token-dispatcher-type", "bogus"])
    with pytest.raises(SystemExit):
        arguments.parse_args(megatron_patches.extra_args_provider)
    assert "hybrid_ep" in capsys.readouterr().err  # the choices listed include ours
