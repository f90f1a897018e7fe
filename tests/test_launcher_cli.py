"""hybrid-ep-launch: errors that name the field and the rule, what a dry run says about
Megatron-LM, local mode on the CPU, and exact flag names in every command-line tool."""

from __future__ import annotations

import os

import pytest

from megatron_patches.slurm import cli, local
from megatron_patches.slurm import recipe as recipe_mod

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(REPO, "recipes", "tiny_moe")
BENCH = os.path.join(REPO, "recipes", "bench_dispatch")


def _launch(capsys, *args, recipe=TINY):
    code = cli.main([recipe, *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("value", ["4h", "4:00h", "1:75:00", "tomorrow", "1-2-3"])
def test_bad_slurm_time_is_refused(capsys, value):
    code, out, err = _launch(capsys, "--set", f"cluster.time={value}")
    assert code == 2 and out == ""
    assert (f"error: cluster.time: must be a Slurm time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS "
            f"(e.g. 04:00:00 for four hours), got '{value}'") in err


@pytest.mark.parametrize("value", ["90", "30:00", "04:00:00", "1-12", "2-00:30", "1-00:00:00", "UNLIMITED"])
def test_slurm_time_formats_render(capsys, value):
    code, out, _ = _launch(capsys, "--set", f"cluster.time={value}")
    assert code == 0 and f"#SBATCH --time={value}\n" in out


@pytest.mark.parametrize("override, words", [
    ("parallelism=8", "error: parallelism: is a section, not a field: set one of its fields (parallelism.tp, "
                      "parallelism.pp,"),
    ("parallelism.tpp=2", "error: parallelism.tpp: unknown field (fields in parallelism: tp, pp,"),
    ("parallelism.tpp=2", "did you mean parallelism.tp?"),
    ("paralelism.ep=2", "error: paralelism.ep: unknown field (fields at the top level: name,"),
    ("paralelism.ep=2", "did you mean parallelism.ep?"),
    ("cluster.time.max=2", "error: cluster.time.max: cluster.time is a str field and has no sub-fields"),
])
def test_override_of_no_field_says_what_exists(capsys, override, words):
    code, _, err = _launch(capsys, "--set", override)
    assert code == 2 and words in err, err


def test_balancer_slots_are_checked_only_when_the_balancer_is_on(capsys):
    code, out, err = _launch(capsys, "--set", "balancer.slots_per_rank=1")  # tiny_moe: balancer off
    assert code == 0 and "balancer" not in err and "--hybrid-ep-balancer" not in out
    code, _, err = _launch(capsys, "--set", "balancer.slots_per_rank=1", "--set", "balancer.interval=5")
    assert code == 2
    assert "error: balancer.slots_per_rank: 1 slots x EP 2 = 2 cannot hold model.num_experts 8" in err


def test_hidden_size_rows_of_16_bytes(capsys):
    code, _, err = _launch(capsys, "--set", "precision=bf16", "--set", "model.hidden_size=100")
    assert code == 2
    assert ("error: model.hidden_size: with precision bf16 and the hybrid_ep dispatcher: a row of 100 bfloat16 "
            "values is 200 bytes; every backend needs rows of a multiple of 16 bytes, so the hidden size must be a "
            "multiple of 8 for bfloat16") in err
    assert _launch(capsys, "--set", "model.hidden_size=100")[0] == 0  # fp32 rows of 400 bytes
    code, _, err = _launch(capsys, "--set", "bench.hidden=7164", recipe=BENCH)
    assert code == 2 and "error: bench.hidden: with bench.dtype bf16: a row of 7164 bfloat16 values" in err


def test_dry_run_without_megatron_lm_dir_warns_and_keeps_no_placeholder(capsys, monkeypatch):
    monkeypatch.delenv("MEGATRON_LM_DIR", raising=False)
    code, out, err = _launch(capsys)
    assert code == 0 and "/path/to/Megatron-LM" not in out and "export MEGATRON_LM_DIR" not in out
    assert "# megatron_lm_dir is not set: pretrain_gpt.py comes from MEGATRON_LM_DIR exported" in out
    assert "warning: megatron_lm_dir is not set and MEGATRON_LM_DIR is not exported" in err
    # The docs' placeholder copied into an override is treated the same way.
    code, out, err = _launch(capsys, "--set", "megatron_lm_dir=/path/to/Megatron-LM")
    assert "export MEGATRON_LM_DIR" not in out and "(the docs' placeholder)" in err
    monkeypatch.setenv("MEGATRON_LM_DIR", "/opt/Megatron-LM")
    code, out, err = _launch(capsys)
    assert "note: megatron_lm_dir is not set; the job uses MEGATRON_LM_DIR=/opt/Megatron-LM" in err
    code, out, err = _launch(capsys, "--set", "megatron_lm_dir=/shared/Megatron-LM")
    assert "export MEGATRON_LM_DIR=/shared/Megatron-LM\n" in out and "megatron_lm_dir" not in err


def test_local_mode_on_cpu_counts_processes_not_gpus(capsys, monkeypatch):
    monkeypatch.setattr(local, "_gpus", lambda: 0)
    monkeypatch.setattr(local, "_pretrain_script", lambda recipe: "/opt/Megatron-LM/pretrain_gpt.py")
    recipe = cli.load_checked(TINY, [])
    path = local.choose(recipe)
    assert not path.on_gpus and path.module == ["-m", "megatron_patches.slurm.cpu_train"]
    assert "cpu_train on the CPU, gloo (0 GPU(s) for 2 ranks;" in path.description
    cli.report(recipe, on_cpu=not path.on_gpus)
    err = capsys.readouterr().err
    assert "tiny_moe: 2 CPU processes = TP 1 x PP 1 x CP 1 x DP 2" in err
    assert "memory per rank (CPU process)" in err and "GPU" not in err and "GiB of" not in err
    cli.report(recipe)  # a cluster job: GPUs and their memory
    err = capsys.readouterr().err
    assert "2 GPUs = TP 1" in err and "GiB of 80 GiB" in err


def test_local_mode_errors_name_the_field():
    with pytest.raises(recipe_mod.RecipeError, match="cluster.nodes: local mode runs on this one machine"):
        local.choose(cli.load_checked(TINY, ["train.global_batch_size=16"], nodes=2))
    with pytest.raises(recipe_mod.RecipeError, match="kind: local mode runs pretraining recipes; run the "
                                                     "benchmark with hybrid-ep-bench"):
        local.choose(cli.load_checked(BENCH, []))


def _exit_code(fn, argv):
    try:
        return fn(argv)
    except SystemExit as exc:
        return exc.code


@pytest.mark.parametrize("tool, argv, bad", [
    ("launch", [TINY, "--node", "2"], "--node 2"),
    ("bench", ["--device", "cpu", "--hid", "128"], "--hid 128"),
    ("traffic", ["--hid", "128"], "--hid 128"),
    ("balance", ["plan", "--stats", "x.npz", "--out", "p.yaml", "--ep-siz", "4"], "--ep-siz 4"),
    ("demo", ["--step", "3"], "--step 3"),
])
def test_prefixes_of_flags_are_not_accepted(capsys, tool, argv, bad):
    from hybrid_ep.balancer.cli import main as balance
    from hybrid_ep.bench import main as bench
    from hybrid_ep.traffic.cli import main as traffic
    from megatron_patches.demo import main as demo

    mains = {"launch": cli.main, "bench": bench, "traffic": traffic, "balance": balance, "demo": demo}
    assert _exit_code(mains[tool], argv) == 2
    assert f"error: unrecognized arguments: {bad}" in capsys.readouterr().err
