"""The Megatron patches in one checked place: the registry (megatron_patches/patches.py) against
what apply() really replaces, against docs/megatron.md's table, and against the installed
Megatron-Core (signatures and source hashes recorded per release, each difference named); the
CPU stand-ins only when asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

import megatron_patches  # noqa: E402
from helpers import REPO, checkout_env  # noqa: E402
from megatron_patches import patches  # noqa: E402
from megatron_patches.local import cpu_compat  # noqa: E402

pytestmark = pytest.mark.megatron

DOC = os.path.join(REPO, "docs", "megatron.md")


def doc_text() -> str:
    with open(DOC, encoding="utf-8") as f:
        return f.read()


# -- the record against the installed Megatron-Core ---------------------------------------------


def test_installed_megatron_core_matches_the_record():
    """Every patched function's signature (and source, where the patch relies on its body) is
    the one recorded for the installed release; a failure names each function that changed."""
    problems = patches.check()
    assert problems == [], "\n".join(problems)
    assert patches.installed_version() in patches.recorded()


def test_a_changed_signature_is_named(monkeypatch):
    from megatron.core.models.common import utils

    def should_free_input(name, is_moe, config):  # one parameter fewer than the patch was written for
        return False

    monkeypatch.setattr(utils, "should_free_input", should_free_input)
    problems = patches.check()
    target = "megatron.core.models.common.utils:should_free_input"
    assert [line for line in problems if line.startswith(target + ": signature is now (name, is_moe, config)")]
    assert [line for line in problems if line.startswith(target + ": source changed")]
    assert all(line.startswith(target) for line in problems), problems


def test_a_changed_body_is_named():
    """Same signatures, another source hash recorded for MoELayer.__init__: only it is named."""
    version = patches.installed_version()
    record = {version: dict(patches.recorded()[version])}
    target = "megatron.core.transformer.moe.moe_layer:MoELayer.__init__"
    signature, _ = record[version][target]
    record[version][target] = (signature, "0" * 16)
    problems = patches.check(record=record)
    assert len(problems) == 1 and problems[0].startswith(f"{target}: source changed"), problems
    assert "selection.py" in problems[0]


def test_a_release_without_a_record_is_named():
    problems = patches.check(version="0.99.0")
    assert len(problems) == 1
    assert problems[0].startswith("Megatron-Core 0.99.0: no fingerprints recorded (checked: 0.19.2")


def test_a_missing_function_and_a_stale_record_are_named(monkeypatch):
    from megatron.training import training

    version = patches.installed_version()
    record = {version: dict(patches.recorded()[version], **{"megatron.gone:f": ("()", None)})}
    monkeypatch.delattr(training, "calc_params_l2_norm")
    problems = patches.check(record=record)
    assert any(line.startswith("megatron.training.training:calc_params_l2_norm: not found") for line in problems)
    assert any(line.startswith("megatron.gone:f: recorded") for line in problems)
    assert len(problems) == 2, problems


def _module(tmp_path, name: str, source: str):
    import importlib.util

    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.f


def test_source_hash_ignores_comments_and_layout_only(tmp_path):
    base = _module(tmp_path, "a", """
        def f(x):
            if x:
                return 1
            return 2
    """)
    reformatted = _module(tmp_path, "b", """
        def f(x):  # the same code
            # a comment
            if x:

                return 1
            return 2
    """)
    moved = _module(tmp_path, "c", """
        def f(x):
            if x:
                return 1
                return 2
    """)
    edited = _module(tmp_path, "d", """
        def f(x):
            if x:
                return 1
            return 3
    """)
    norm = patches.normalized_source
    assert norm(base) == norm(reformatted)
    assert norm(base) != norm(moved)  # a statement moved into a block
    assert norm(base) != norm(edited)


def test_signature_drift_is_empty_on_the_recorded_release():
    assert patches.signature_drift() == []


def test_every_patch_has_a_record_and_a_known_installer():
    record = patches.recorded()[patches.installed_version()]
    assert set(record) == {p.target for p in patches.PATCHES}
    modules = patches._installers()
    for patch in patches.PATCHES:
        assert patch.target.count(":") == 1 and patch.reason and patch.does
        if patch.installed_by == patches.APPLY:
            module, name = patch.installer.split(":")
            assert callable(getattr(modules[module], name)), patch.target
            assert patch.key
        else:
            assert patch.installer is None and patch.key is None, patch.target


# -- the registry against what really happens ---------------------------------------------------

# In a fresh interpreter: every attribute of every imported megatron module (and of the classes
# they define) before and after apply(); what changed is what apply() replaced.
SNAPSHOT = textwrap.dedent('''
    import importlib, inspect, json, sys
    import megatron_patches
    from megatron_patches import patches

    for patch in patches.PATCHES:
        importlib.import_module(patch.module)

    def snapshot():
        seen = {}
        for name, module in list(sys.modules.items()):
            if module is None or not (name == "megatron" or name.startswith("megatron.")):
                continue
            for attr, value in list(vars(module).items()):
                seen[f"{name}:{attr}"] = id(value)
                if inspect.isclass(value) and value.__module__ == name:
                    for member, inner in list(vars(value).items()):
                        seen[f"{name}:{attr}.{member}"] = id(inner)
        return seen

    before = snapshot()
    applied = megatron_patches.apply()
    after = snapshot()
    changed = sorted(k for k in before if k in after and after[k] != before[k])
    print("RESULT " + json.dumps({"changed": changed, "applied": {k: bool(v) for k, v in applied.items()}}))
''')


def run_snapshot(**env) -> dict:
    child_env = checkout_env(PYTHONWARNINGS="ignore", **env)
    if "HYBRID_EP_CPU_COMPAT" not in env:
        child_env.pop("HYBRID_EP_CPU_COMPAT", None)
    proc = subprocess.run([sys.executable, "-c", SNAPSHOT], capture_output=True, text=True, timeout=300,
                          env=child_env, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_apply_replaces_exactly_the_listed_functions():
    """On a machine without a GPU and without asking for the CPU stand-ins: apply() replaces the
    functions PATCHES marks `apply()`, and nothing else (no parser function among them)."""
    got = run_snapshot()
    listed = {p.target for p in patches.PATCHES if p.installed_by == patches.APPLY}
    assert set(got["changed"]) == listed
    keys = {p.key for p in patches.PATCHES if p.installed_by == patches.APPLY}
    assert got["applied"] == dict.fromkeys(keys, True) | {"cpu_compat": False}


def test_cpu_stand_ins_when_asked_through_the_environment():
    got = run_snapshot(HYBRID_EP_CPU_COMPAT="1")
    assert got["applied"]["cpu_compat"] is True
    listed = {p.target for p in patches.PATCHES if p.installed_by in (patches.APPLY, patches.CPU_COMPAT)}
    assert listed <= set(got["changed"]), listed - set(got["changed"])
    # the other names it replaces are module-level names (docs/megatron.md#running-without-a-gpu)
    extra = {k for k in set(got["changed"]) - listed if not k.split(":")[1][:1].isupper()}
    assert extra <= {f"{m}:torch" for m in (
        "megatron.core.optimizer.optimizer", "megatron.core.optimizer.clip_grads",
        "megatron.core.optimizer.grad_scaler", "megatron.core.utils", "megatron.core.optimizer.distrib_optimizer",
        "megatron.core.distributed.param_and_grad_buffer", "megatron.core.tensor_parallel.mappings",
        "megatron.core.pipeline_parallel.schedules", "megatron.training.utils.common_utils")} | {
        "megatron.core.tensor_parallel.random:_CUDA_RNG_STATE_TRACKER",
        "megatron.core.tensor_parallel.random:_CUDA_RNG_STATE_TRACKER_INITIALIZED",
        "megatron.core.tensor_parallel.layers:fused_weight_gradient_mlp_cuda",
        "megatron.core.tensor_parallel.layers:_grad_accum_fusion_available",
    }, extra


@pytest.mark.parametrize("value, error", [("yes", ValueError), ("2", ValueError)])
def test_a_bad_cpu_compat_request_is_refused_by_name(monkeypatch, value, error):
    monkeypatch.setenv("HYBRID_EP_CPU_COMPAT", value)
    with pytest.raises(error, match="HYBRID_EP_CPU_COMPAT must be 1"):
        megatron_patches.apply()
    monkeypatch.setenv("HYBRID_EP_CPU_COMPAT", "0")
    assert cpu_compat.requested() is False
    assert cpu_compat.requested(True) is True
    with pytest.raises(TypeError, match="cpu_compat must be True, False or None"):
        megatron_patches.apply(cpu_compat="yes")


def test_apply_leaves_megatron_parser_alone(monkeypatch, capsys):
    """The flags come through extra_args_provider; Megatron-LM's parser itself is not patched."""
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron_patches.testing.moe_layer import TINY_GPT_ARGS

    megatron_patches.apply()
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *TINY_GPT_ARGS, "--moe-token-dispatcher-type", "hybrid_ep"])
    with pytest.raises(SystemExit):
        arguments.parse_args()
    assert "invalid choice: 'hybrid_ep'" in capsys.readouterr().err
    args = arguments.parse_args(megatron_patches.extra_args_provider)
    assert args.moe_token_dispatcher_type == "hybrid_ep" and args.hybrid_ep_pad_multiple == 1
    provider = megatron_patches.extra_args_provider
    twice = arguments.parse_args(lambda parser: provider(provider(parser)))
    assert vars(twice) == vars(args)


def test_launcher_chains_the_scripts_own_provider(monkeypatch):
    arguments = pytest.importorskip("megatron.training.arguments")
    from megatron_patches.pretrain_gpt import hybrid_ep_arguments

    seen = []

    def fake_parse_and_validate_args(extra_args_provider=None, ignore_unknown_args=False, args_defaults={}):
        import argparse

        parser = argparse.ArgumentParser()
        parser.add_argument("--moe-token-dispatcher-type", choices=["alltoall"])
        seen.append(args_defaults)
        return extra_args_provider(parser)

    def own(parser):
        parser.add_argument("--own-flag")
        return parser

    monkeypatch.setattr(arguments, "parse_and_validate_args", fake_parse_and_validate_args)
    with hybrid_ep_arguments():
        parser = arguments.parse_and_validate_args(extra_args_provider=own, args_defaults={"a": 1})
    assert arguments.parse_and_validate_args is fake_parse_and_validate_args  # restored
    ns = parser.parse_args(["--own-flag", "x", "--moe-token-dispatcher-type", "hybrid_ep",
                            "--hybrid-ep-backend", "cuda"])
    assert (ns.own_flag, ns.moe_token_dispatcher_type, ns.hybrid_ep_backend) == ("x", "hybrid_ep", "cuda")
    assert seen == [{"a": 1}]
