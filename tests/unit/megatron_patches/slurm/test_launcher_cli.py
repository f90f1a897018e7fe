"""hybrid-ep-launch: errors that name the field and the rule, what a dry run says about
Megatron-LM, local mode on the CPU, exact flag names in every command-line tool, text fields
kept as written, and bad input (flags, files, values) refused with exit status 2."""

from __future__ import annotations

import os
import subprocess

import pytest

from helpers import REPO
from hybrid_ep.bench.spec import BENCH_BACKENDS
from megatron_patches.slurm import cli, local
from megatron_patches.slurm import recipe as recipe_mod

pytestmark = pytest.mark.unit

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
    assert "error: balancer.slots_per_rank: 1 slot x EP 2 = 2 cannot hold model.num_experts 8" in err


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
    assert not path.on_gpus and path.module == ["-m", "megatron_patches.local.cpu_train"]
    assert "cpu_train on the CPU, gloo (0 GPUs for 2 ranks;" in path.description
    cli.report(recipe, on_cpu=not path.on_gpus)
    err = capsys.readouterr().err
    assert "tiny_moe: 2 CPU processes = TP 1 x PP 1 x CP 1 x DP 2" in err
    assert "memory per rank (CPU process)" in err and "GPU" not in err and "GiB of" not in err
    cli.report(recipe)  # a cluster job: GPUs and their memory
    err = capsys.readouterr().err
    assert "2 GPUs = TP 1" in err and "MiB of 80 GiB" in err  # tiny_moe: under 1 GiB per GPU


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
    from megatron_patches.local.demo import main as demo

    mains = {"launch": cli.main, "bench": bench, "traffic": traffic, "balance": balance, "demo": demo}
    assert _exit_code(mains[tool], argv) == 2
    assert f"error: unrecognized arguments: {bad}" in capsys.readouterr().err


def _no_sbatch(monkeypatch):
    def run(*args, **kwargs):
        raise AssertionError(f"sbatch called: {args}")
    monkeypatch.setattr(cli.subprocess, "run", run)


def test_script_must_name_a_file_that_can_be_written(capsys, monkeypatch, tmp_path):
    _no_sbatch(monkeypatch)
    regular = tmp_path / "regular"
    regular.write_text("keep")
    for script, words in [(str(tmp_path), f"{tmp_path} is a folder; give a file name"),
                          (str(regular / "job.sbatch"), f"{regular} is a file, not a folder"),
                          (str(regular / "a" / "b" / "job.sbatch"), f"{regular} is a file, not a folder"),
                          ("", "the path is empty; give a file name")]:
        code, out, err = _launch(capsys, "--submit", "--script", script)
        assert code == 2 and out == "" and "error: --script: " in err and words in err, err
        assert "Traceback" not in err and "memory per GPU" not in err  # refused before the recipe is loaded
    assert sorted(os.listdir(tmp_path)) == ["regular"] and regular.read_text() == "keep"


def test_dry_run_says_where_the_log_goes(capsys):
    code, out, err = _launch(capsys)
    assert code == 0 and "#SBATCH --output=results/tiny_moe/slurm-%j.out\n" in out
    assert ("note: the Slurm log goes to results/tiny_moe/slurm-%j.out (%j: the job id); Slurm creates no folders: "
            "--submit creates results/tiny_moe before sbatch\nhybrid-ep-launch:   (to run sbatch by hand: mkdir -p "
            "results/tiny_moe first)") in err
    assert "# Slurm log: results/tiny_moe/slurm-<job id>.out, from the folder sbatch is run in." in out
    code, out, err = _launch(capsys, "--set", "output.dir=$HOME/results/${SLURM_JOB_ID}")
    assert code == 0 and "#SBATCH --output=slurm-%j.out\n" in out
    assert "note: the Slurm log goes to slurm-%j.out (%j: the job id), in the folder sbatch runs in" in err


def test_log_folder_that_cannot_be_created_is_an_error(capsys, monkeypatch, tmp_path):
    _no_sbatch(monkeypatch)
    regular = tmp_path / "regular"
    regular.write_text("keep")
    code, out, err = _launch(capsys, "--submit", "--script", str(tmp_path / "job.sbatch"),
                             "--set", f"output.dir={regular}/tiny/${{SLURM_JOB_ID}}")
    assert code == 2 and out == "" and "Traceback" not in err
    assert f"error: output.dir: cannot create {regular}/tiny, the folder of the Slurm log" in err, err
    assert regular.read_text() == "keep"


def test_script_that_cannot_be_written_is_an_error(capsys, monkeypatch, tmp_path):
    _no_sbatch(monkeypatch)
    monkeypatch.setattr(cli.os, "makedirs", lambda *a, **k: (_ for _ in ()).throw(PermissionError(13, "Permission "
                                                                                                      "denied")))
    code, _, err = _launch(capsys, "--submit", "--script", str(tmp_path / "new" / "job.sbatch"))
    assert code == 2 and "error: --script: cannot write" in err and "Permission denied" in err


@pytest.mark.parametrize("args, words", [
    (["--script", "job.sbatch"], "error: --script: only applies with --submit"),
    (["--dry-run", "--script", "job.sbatch"], "error: --script: only applies with --submit"),
    (["--trainer", "core"], "error: --trainer: only applies with --local"),
    (["--submit", "--trainer", "auto"], "error: --trainer: only applies with --local"),
])
def test_flags_without_their_mode_are_refused(capsys, monkeypatch, tmp_path, args, words):
    _no_sbatch(monkeypatch)
    monkeypatch.chdir(tmp_path)
    code, out, err = _launch(capsys, *args)
    assert code == 2 and out == "" and words in err, err
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("override, words", [
    ("model.num_attention_heads=0", "error: model.num_attention_heads: must be >= 1, got 0"),
    ("model.num_attention_heads=-4", "error: model.num_attention_heads: must be >= 1, got -4"),
    ("train.lr=.nan", "error: train.lr: must be a finite number, got nan"),
    ("train.min_lr=.inf", "error: train.min_lr: must be a finite number, got inf"),
    ("train.lr=-.inf", "error: train.lr: must be a finite number, got -inf"),
    ("dispatcher.static_size_factor=.inf", "error: dispatcher.static_size_factor: must be a finite number or null, "
                                           "got inf"),
    ("balancer.tolerance=.nan", "error: balancer.tolerance: must be a finite number or null, got nan"),
    ("env.1A=x", "error: env.1A: '1A' is not an environment variable name"),
    ("env.A;touch x=1", "error: env.A;touch x: 'A;touch x' is not an environment variable name"),
    ("env.A=null", "error: env.A: must be a string or number, got None"),
    ("cluster.workdir=$HOME/run", "error: cluster.workdir: must be a path without shell variables: it is written "
                                  "as #SBATCH --chdir, which expands none"),
    ("cluster.workdir=/lustre/${USER}/run", "error: cluster.workdir: must be a path without shell variables"),
    ("cluster.workdir=~/run", "error: cluster.workdir: must not start with ~"),
    ("output.dir=~/results/${SLURM_JOB_ID}", "error: output.dir: must not start with ~"),
    ("output.dir=results/%j", "error: output.dir: must not contain %"),
    ('output.dir=results/"x"', "error: output.dir: must not contain a double quote"),
    ("output.dir=' '", "error: output.dir: must name a folder, got an empty path"),
])
def test_bad_values_are_validation_errors(capsys, override, words):
    code, out, err = _launch(capsys, "--set", override)
    assert code == 2 and out == "" and words in err and "Traceback" not in err, err


@pytest.mark.parametrize("text, words", [
    ("name: x\nkind: [1]\n", "error: kind: must be one of pretrain, benchmark, got [1] (in {path})"),
    ("name: x\nkind: {a: 1}\n", "error: kind: must be one of pretrain, benchmark, got {'a': 1} (in {path})"),
    (b"name: x\ndescription: \xff\xfe\n", "error: recipe: {path} is not UTF-8 text"),
    ("- 1\n", "error: recipe: must be a mapping, got [1] (in {path})"),
    ("{[1]: 2}\n", "error: recipe: {path} is not valid YAML"),
    ("a: 1\n---\nb: 2\n", "error: recipe: {path} is not valid YAML"),
    ("name: x\nenv: [1]\n", "error: env: must be a mapping of names to strings or numbers, got ['1'] (in {path})"),
    ("name: x\nenv: {9X: 1}\n", "error: env.9X: '9X' is not an environment variable name"),
])
def test_malformed_recipe_files_name_the_file_and_field(capsys, tmp_path, text, words):
    path = tmp_path / "recipe.yaml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    code, out, err = _launch(capsys, recipe=str(tmp_path))
    assert code == 2 and out == "" and words.replace("{path}", str(path)) in err and "Traceback" not in err, err


def test_env_and_extra_args_keep_the_text_as_written(capsys, tmp_path):
    """YAML would read 010 as 8, 1:30 as 90, 1.10 as 1.1, yes as True and a date as a date."""
    code, out, _ = _launch(capsys, "--set", "env.B=010", "--set", "env.C=yes", "--set", "env.A=1:30",
                           "--set", "env.D=1.10", "--set", "env.E=2024-01-01", "--set", "env.F=0x1F",
                           "--set", "env.G='quoted 1'", "--set", "env.H=",
                           "--set", "train.extra_args=[--foo,010,--bar,1:30,--flag,--baz,1.10]",
                           "--set", "model.extra_args=[--on,yes]")
    assert code == 0
    for line in ["export B=010\n", "export C=yes\n", "export A=1:30\n", "export D=1.10\n",
                 "export E=2024-01-01\n", "export F=0x1F\n", "export G='quoted 1'\n", "export H=''\n",
                 "  --foo 010\n", "  --bar 1:30\n", "  --flag\n", "  --baz 1.10\n", "  --on yes\n"]:
        assert line in out, line
    # The same in a recipe file (and an unquoted Slurm time is a time, not 14400 seconds).
    text = open(os.path.join(TINY, "recipe.yaml")).read()
    text = text.replace('env:\n', 'env:\n  NCCL_IB_TIMEOUT: 022\n  NCCL_DEBUG_SUBSYS: yes\n  T: 1:30\n  V: 1.10\n', 1)
    assert "  warmup_steps: 2\n" in text and 'time: "00:15:00"' in text
    text = text.replace("  warmup_steps: 2\n", "  warmup_steps: 2\n  extra_args: [--foo, 010, --bar, 1:30]\n")
    text = text.replace('time: "00:15:00"', "time: 04:00:00")
    (tmp_path / "recipe.yaml").write_text(text)
    code, out, _ = _launch(capsys, recipe=str(tmp_path))
    assert code == 0
    for line in ["export NCCL_IB_TIMEOUT=022\n", "export NCCL_DEBUG_SUBSYS=yes\n", "export T=1:30\n",
                 "export V=1.10\n", "  --foo 010\n", "  --bar 1:30\n", "#SBATCH --time=04:00:00\n"]:
        assert line in out, line
    subprocess.run(["bash", "-n"], input=out, text=True, check=True)


@pytest.mark.parametrize("override, words", [
    ("bench.routing=foo", "error: bench.routing: must be one of uniform, zipf, group-limited, got 'foo'"),
    ("bench.backends=[cuda,foo]", f"error: bench.backends: must be among {', '.join(BENCH_BACKENDS)}, got 'foo'"),
    ("bench.sms=[16,0]", "error: bench.sms: SM counts must be >= 1, got 0"),
    ("bench.warmup=-1", "error: bench.warmup: must be >= 0, got -1"),
    ("bench.node_counts=[1,2,1]", "error: bench.node_counts: 1 listed more than once"),
])
def test_benchmark_fields_follow_hybrid_ep_bench(capsys, override, words):
    code, out, err = _launch(capsys, "--set", override, recipe=BENCH)
    assert code == 2 and out == "" and words in err, err


def test_benchmark_recipe_runs_hybrid_ep_bench_checks(capsys):
    """What the recipe rules do not spell out, hybrid-ep-bench's own check refuses per node count."""
    code, _, err = _launch(capsys, "--set", "bench.routing=group-limited", "--set", "bench.topk=40", "--set",
                           "bench.experts=64", "--set", "cluster.nodes=8", "--set", "bench.node_counts=[1,8]",
                           recipe=BENCH)
    assert code == 2
    assert ("error: bench.topk: with 8 nodes: 40 exceeds the experts in 4 nodes (4 x 8) that --routing "
            "group-limited allows (hybrid-ep-bench --topk)") in err
    code, out, _ = _launch(capsys, "--set", "bench.routing=zipf", "--set", "bench.backends=[cuda,reference]",
                           "--set", "bench.sms=[16,24]", "--set", "bench.warmup=0", recipe=BENCH)
    assert code == 0 and "  --routing zipf\n" in out and "  --backends cuda,reference\n" in out
    assert "  --sms 16,24\n" in out and "  --warmup 0\n" in out


def test_counts_are_worded_with_plural(capsys):
    code, _, err = _launch(capsys, "--set", "cluster.gpus_per_node=3", "--set", "parallelism.tp=2")
    assert code == 2 and "error: cluster.nodes: 1 node x 3 GPUs = 3 is not divisible by TP x PP x CP = 2" in err
    code, _, err = _launch(capsys, "--set", "cluster.gpus_per_node=1", "--set", "bench.node_counts=[1,3]",
                           "--set", "bench.experts=8", "--set", "bench.topk=2", recipe=BENCH)
    assert code == 2 and "error: bench.experts: 8 is not divisible by 3 nodes x 1 GPU = 3 ranks" in err
    code, _, err = _launch(capsys, "--set", "balancer.slots_per_rank=1", "--set", "balancer.interval=5",
                           "--set", "parallelism.ep=1")
    assert "error: balancer.slots_per_rank: 1 slot x EP 1 = 1 cannot hold" in err, err


@pytest.mark.timeout(60)
def test_memory_estimate_counts_layers_without_visiting_each():
    """The estimate sums dense and MoE layers by count (it looped once per layer: a typo'd
    num_layers of 10**12 hung the launcher); the counts equal the per-layer sum."""
    from megatron_patches.slurm import memory

    recipe = recipe_mod.load("recipes/deepseek_v3")
    m = recipe["model"]
    for dense in (0, 3, m["num_layers"], m["num_layers"] + 5):
        m2 = dict(m, dense_layers=dense)
        by_layer = m["vocab_size"] * m["hidden_size"] * (2 if m["untie_embeddings"] else 1) + m["hidden_size"]
        by_layer += sum(sum(memory.layer_params(m2, moe=i >= dense)) for i in range(m["num_layers"]))
        assert memory.model_params({"model": m2}) == pytest.approx(by_layer, rel=1e-12)
    huge = recipe_mod.load("recipes/deepseek_v3", ["model.num_layers=1400000000005"])
    assert memory.estimate(huge).total_gb > 1e9  # far over any GPU, and computed at once
