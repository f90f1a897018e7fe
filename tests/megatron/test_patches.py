"""The Megatron patches in one checked place: the registry (megatron_patches/patches.py) against
what apply() really replaces, against docs/megatron.md's table, and against the installed
Megatron-Core (signatures and source hashes recorded per release, each difference named); the
CPU stand-ins only when asked for; the dispatcher's startup line and the memory figure of
docs/megatron.md's first screen."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("megatron.core")

import megatron_patches  # noqa: E402
from helpers import REPO, checkout_env  # noqa: E402
from megatron_patches import patches  # noqa: E402
from megatron_patches.local import cpu_compat, cpu_training  # noqa: E402

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
    from megatron.training import training

    def calc_params_l2_norm(model):  # parameters fewer than the patch was written for
        return 0.0

    monkeypatch.setattr(training, "calc_params_l2_norm", calc_params_l2_norm)
    problems = patches.check()
    target = "megatron.training.training:calc_params_l2_norm"
    assert [line for line in problems if line.startswith(target + ": signature is now (model)")]
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


def test_a_changed_flex_dispatcher_is_named_for_the_manager_it_builds():
    """The replaced `_HybridEPManager` name is fingerprinted by its constructor's signature and
    by the source of what drives the manager, MoEFlexTokenDispatcher: a change there names it."""
    version = patches.installed_version()
    record = {version: dict(patches.recorded()[version])}
    target = "megatron.core.transformer.moe.token_dispatcher:_HybridEPManager"
    signature, _ = record[version][target]
    assert signature == "(group, num_local_experts, num_experts, config)"
    record[version][target] = (signature, "0" * 16)
    problems = patches.check(record=record)
    assert len(problems) == 1 and problems[0].startswith(f"{target}: source changed"), problems
    assert "relies on what megatron.core.transformer.moe.token_dispatcher:MoEFlexTokenDispatcher does" \
        in problems[0]


def test_a_release_without_a_record_is_named():
    problems = patches.check(version="0.99.0")
    assert len(problems) == 1
    assert problems[0].startswith("Megatron-Core 0.99.0: no fingerprints recorded (checked: 0.19.1, 0.19.2, 0.20.0")


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


def test_apply_warns_naming_a_patched_function_whose_signature_changed(monkeypatch, caplog):
    from megatron.training import training

    def save_checkpoint(iteration, model, optimizer):
        return None

    monkeypatch.setattr(training, "save_checkpoint", save_checkpoint)
    with caplog.at_level(logging.WARNING, logger="megatron_patches.patches"):
        patches.warn_on_drift()
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_patches.patches"]
    assert len(lines) == 1, lines
    changed = "megatron.training.training:save_checkpoint(iteration, model, optimizer) (written for (iteration, "
    assert changed in lines[0]


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


@pytest.mark.slow  # the full tier (scripts/test.sh --full): a Megatron snapshot in a child process
def test_apply_replaces_exactly_the_listed_functions():
    """On a machine without a GPU and without asking for the CPU stand-ins: apply() replaces the
    functions PATCHES marks `apply()`, and nothing else (no parser function among them)."""
    got = run_snapshot()
    listed = {p.target for p in patches.PATCHES if p.installed_by == patches.APPLY}
    assert set(got["changed"]) == listed
    keys = {p.key for p in patches.PATCHES if p.installed_by == patches.APPLY}
    assert got["applied"] == dict.fromkeys(keys, True) | {"cpu_compat": False}


@pytest.mark.slow  # the full tier (scripts/test.sh --full): every Megatron CPU test runs the stand-ins
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
        "megatron.core.pipeline_parallel.schedules", "megatron.training.utils.common_utils",
        *cpu_training.MODULES)} | {
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
    from harness.megatron.moe_layer import TINY_GPT_ARGS

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


# -- docs/megatron.md ---------------------------------------------------------------------------


def test_doc_table_is_the_registry():
    assert patches.markdown_table() in doc_text(), "docs/megatron.md's patch table: python -m megatron_patches.patches"


def test_doc_first_screen():
    """The switch, the backend auto runs (AUTO_RULES), the memory held and the newest figures,
    in the first 40 lines; at most 5 dated lines in the page."""
    from hybrid_ep.backends.choice import AUTO_RULES

    text = doc_text()
    head = "\n".join(text.splitlines()[:40])
    assert re.search(r"^torchrun .*-m megatron_patches\.pretrain_gpt .*--moe-token-dispatcher-type hybrid_ep$",
                     head, re.M)
    for topology, rule in AUTO_RULES.items():
        assert f"{topology}:\n  `{rule.picks}`" in head or f"{topology}: `{rule.picks}`" in head, topology
    assert "(benchmarks/README.md)" in head and "GB/s" in head
    assert "(#memory-per-gpu)" in head
    dated = [line for line in text.splitlines() if re.search(r"20\d\d-\d\d-\d\d|\b[0-9a-f]{7,40}\b", line)]
    assert len(dated) <= 5, dated


def _recipe_buffer_config():
    from hybrid_ep.config import BufferConfig
    from megatron_patches.slurm.dispatcher_memory import ring_dtype
    from megatron_patches.slurm.recipe import load

    r = load(os.path.join(REPO, "recipes", "deepseek_v3"))
    ep = r["parallelism.ep"] * r["parallelism.etp"]
    experts = r["balancer.slots_per_rank"] * ep if r["balancer.interval"] > 0 else r["model.num_experts"]
    return BufferConfig(hidden_dim=r["model.hidden_size"],
                        max_tokens_per_rank=r["train.micro_batch_size"] * r["model.seq_length"],
                        num_experts=experts, world_size=ep, ranks_per_node=min(ep, r["cluster.gpus_per_node"]),
                        pad_multiple=r["dispatcher.pad_multiple"], ring_dtype=ring_dtype(r)).validate()


def test_doc_memory_figure_is_the_recipes_memory_plan():
    """The first screen's figure is memory_plan() at the DeepSeek-V3 recipe's shape, and so is
    what the page's own snippet prints."""
    import contextlib
    import io

    from hybrid_ep.backends.cuda.backend import memory_plan
    from megatron_patches.buffers import size

    plan = memory_plan(_recipe_buffer_config())
    text = doc_text()
    memory = [line for line in text.splitlines()[:40] if line.startswith("- **Memory.**")]
    assert len(memory) == 1 and f"holds {size(plan.registered_bytes)} per GPU" in memory[0], memory
    section = text[text.index("## Memory per GPU"):]
    snippet = section[section.index("```python") + len("```python"):]
    snippet = snippet[:snippet.index("```")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(snippet, {})
    assert str(plan) == out.getvalue().strip()


# -- the dispatcher's startup line ----------------------------------------------------------------


def test_startup_line_reports_held_bytes_by_region():
    from hybrid_ep.backends.cuda.backend import memory_plan
    from megatron_patches.buffers import LINE_LIMIT, memory_line, size

    config = _recipe_buffer_config()
    plan = memory_plan(config)
    line = memory_line(plan, config)
    assert len(line) <= LINE_LIMIT < 200, line
    assert line.startswith("hybrid_ep dispatcher: cuda buffer for EP 64 (8 nodes x 8), 4096 tokens/rank, "
                           f"holds {size(plan.registered_bytes)} per GPU (")
    held = sorted((b for b in plan.buffers if b.registered and b.nbytes), key=lambda b: -b.nbytes)
    shown = re.findall(r"(\w[\w+]*) (\d+\.\d\d [KMGT]iB)", line.split(" per GPU (")[1].split(")")[0])
    assert [name for name, _ in shown] == [b.name for b in held[:len(shown)]] and len(shown) >= 2
    assert [value for _, value in shown] == [size(b.nbytes) for b in held[:len(shown)]]
    assert f"+{len(held) - len(shown)} more" in line
    assert line.endswith(f"; per call <= {size(plan.workspace_bytes)}")
    # a buffer's plan names its data path, and what peer memory holds, after the shape
    import dataclasses

    live = dataclasses.replace(memory_plan(config, peer_held=6 << 20), data_path="direct path, peer memory 6.0 MiB now")
    line = memory_line(live, config)
    assert len(line) <= LINE_LIMIT and line.startswith(
        "hybrid_ep dispatcher: cuda buffer for EP 64 (8 nodes x 8), 4096 tokens/rank, direct path, peer memory "
        f"6.0 MiB now, expert output copied, holds {size(plan.registered_bytes + (6 << 20))} per "
        "GPU ("), line
    # where the dispatcher's experts write their output into the expert-out block (expert_out.py)
    line = memory_line(live, config, expert_out_in_place=True)
    assert len(line) <= LINE_LIMIT and line.startswith(
        "hybrid_ep dispatcher: cuda buffer for EP 64 (8 nodes x 8), 4096 tokens/rank, direct path, peer memory "
        f"6.0 MiB now, expert output in place, holds {size(plan.registered_bytes + (6 << 20))} per GPU ("), line
    # the receive path copies nothing into an expert-out block: the line says neither
    assert "expert output" not in memory_line(plan, config, expert_out_in_place=True)


def test_buffer_creation_logs_the_line(single_rank_group, caplog):
    import torch

    from megatron_patches import buffers

    cache = buffers.BufferCache()
    key = buffers.BufferKey(group_id=id(single_rank_group), hidden_dim=64, num_experts=4, pad_multiple=1,
                            ranks_per_node=None, backend="reference", num_sms_dispatch=None, num_sms_combine=None)
    with caplog.at_level(logging.INFO, logger="megatron_patches.buffers"):
        buf = cache.get(single_rank_group, key, 16, None, torch.device("cpu"))
    lines = [r.getMessage() for r in caplog.records if r.name == "megatron_patches.buffers"]
    assert lines == [buffers.memory_line(buf.memory_plan(), buf.config)]
    assert lines[0].startswith("hybrid_ep dispatcher: reference buffer for EP 1 (1 node x 1), 16 tokens/rank, "
                               "holds 0 B per GPU; per call <= ")
    assert len(lines[0]) < 200


def test_the_dispatchers_rings_take_the_width_of_its_hidden_states(single_rank_group):
    """bf16 (or fp16) training sizes the buffer's rings for 2-byte rows, half of fp32's: every row
    and partial sum the layer moves is no wider (fp8 dispatch, the experts' bf16 output, both
    backward passes); fp32 hidden states keep fp32 rings. One buffer per width."""
    import torch

    from megatron_patches import buffers

    assert [buffers.ring_dtype_for(d) for d in (torch.bfloat16, torch.float16, torch.float32)] == [
        torch.bfloat16, torch.float16, torch.float32]
    cache = buffers.BufferCache()
    made = {}
    for dtype in (torch.bfloat16, torch.float32):
        key = buffers.BufferKey(group_id=id(single_rank_group), hidden_dim=64, num_experts=4, pad_multiple=1,
                                ranks_per_node=None, backend="reference", num_sms_dispatch=None, num_sms_combine=None,
                                ring_dtype=buffers.ring_dtype_for(dtype))
        made[dtype] = cache.get(single_rank_group, key, 16, None, torch.device("cpu"))
    assert [made[d].config.ring_dtype for d in made] == [torch.bfloat16, torch.float32] and len(cache) == 2
