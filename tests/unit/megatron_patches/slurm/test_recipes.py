"""Slurm recipes: every recipe renders to a script bash accepts, every pretraining recipe's
argument list parses with Megatron-LM's own parser into a TransformerConfig, submission goes
through `sbatch` (a fake one on PATH here) into a log folder that exists when the job starts
(a stand-in for Slurm that opens --output as slurmstepd does), bad overrides fail naming the
field, and the memory estimate (docs/slurm.md) gives the numbers quoted in the docs."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import REPO, checkout_env
from megatron_patches.slurm import cli, memory, render, shape
from megatron_patches.slurm import recipe as recipe_mod

pytestmark = pytest.mark.unit

RECIPES_DIR = os.path.join(REPO, "recipes")
ALL = sorted(d for d in os.listdir(RECIPES_DIR) if os.path.isfile(os.path.join(RECIPES_DIR, d, "recipe.yaml")))
PRETRAIN = ["deepseek_v3", "deepseek_v3_gb200", "deepseek_v3_proxy", "qwen3_30b_a3b", "qwen3_235b_a22b", "mixtral_8x7b",
            "mixtral_8x22b", "tiny_moe"]


def path_of(name: str) -> str:
    return os.path.join(RECIPES_DIR, name)


def site_sets(name: str) -> list[str]:
    """--set flags that fill every site placeholder of a recipe, as a user at a site would."""
    sets = ["cluster.partition=batch", "cluster.account=moe", "container.image=nvcr.io#nvidia/pytorch:25.04-py3",
            "container.mounts=[/lustre:/lustre]"]
    if name != "bench_dispatch":
        sets.append("data.path=/lustre/data/web_text_document")
    return [word for item in sets for word in ("--set", item)]


def test_the_recipe_set():
    assert set(PRETRAIN) | {"bench_dispatch"} == set(ALL)
    for name in ALL:
        assert os.path.isfile(os.path.join(RECIPES_DIR, name, "README.md")), f"{name} has no README.md"


@pytest.mark.parametrize("name", ALL)
def test_recipe_renders_and_bash_accepts_it(name, tmp_path, capsys):
    assert cli.main([path_of(name), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("#!/bin/bash\n") and "srun " in text
    module = "hybrid_ep.bench" if name == "bench_dispatch" else "megatron_patches.pretrain_gpt"
    assert f"-m {module}" in text
    script = tmp_path / f"{name}.sbatch"
    script.write_text(text)
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_rendered_pretrain_script_sets_the_environment():
    text = render.render(cli.load_checked(path_of("deepseek_v3"), []))
    for needed in ("export CUDA_DEVICE_MAX_CONNECTIONS=1", "export NVSHMEM_IB_ENABLE_IBGDA=1",
                   "export HYBRID_EP_TIMEOUT_S=100", "#SBATCH --nodes=128", "#SBATCH --ntasks-per-node=8",
                   "--moe-token-dispatcher-type hybrid_ep", "--expert-model-parallel-size 64",
                   "--use-distributed-optimizer"):
        assert needed in text, needed
    proxy = render.render(cli.load_checked(path_of("deepseek_v3_proxy"), []))
    for needed in ("--hybrid-ep-balancer-interval 100", "--hybrid-ep-balancer-slots-per-rank 17",
                   "--expert-model-parallel-size 16", "--pipeline-model-parallel-size 2"):
        assert needed in proxy, needed
    assert "--use-distributed-optimizer" in proxy  # the balancer moves the optimizer's shards
    bench = render.render(cli.load_checked(path_of("bench_dispatch"), []))
    for n in (1, 2, 4):
        assert f"srun --nodes={n} " in bench and f'--out "$OUT_DIR/nodes{n}"' in bench
    assert "--hidden 7168" in bench and "--experts 256" in bench and "--topk 8" in bench


EVIDENCE = 'export HYBRID_EP_AUTO_EVIDENCE="results/{name}/auto-evidence.json"'


@pytest.mark.parametrize("name", PRETRAIN)
def test_every_gpu_recipe_as_shipped_calibrates_first_and_keeps_its_evidence(name):
    """As shipped, every pretraining recipe first runs hybrid-ep-bench --calibrate --reuse on one EP
    group's ranks, bounded (--time-limit, and Slurm's --time on the step), its evidence beside the
    recipe's results where the next job finds it, and cannot end the job (`|| echo`); training follows
    and reads the same file. dispatcher.calibrate=false drops the step, not the file."""
    text = render.render(cli.load_checked(path_of(name), []))
    export = EVIDENCE.format(name=name)
    calibrate = text.index(" --calibrate --reuse ")
    step = text[text.rindex("srun ", 0, calibrate):text.index("\n\n", calibrate)]
    assert text.index(export) < calibrate < text.index("-m megatron_patches.pretrain_gpt")
    assert " --relative=0 --kill-on-bad-exit=1 --time=8 " in step  # 300 s, rounded up, + 3 min
    assert "-m hybrid_ep.bench" in step and "--device cuda --time-limit 300 \\\n" in step
    assert step.endswith('  || echo "hybrid-ep: the calibration step ended with status $?; training starts, auto '
                         'following $HYBRID_EP_AUTO_EVIDENCE where it holds an entry (a failure keeps reference), else '
                         'its rule"')
    assert text.count("srun ") == 2 and text.count("--kill-on-bad-exit=1 --time=") == 1
    off = render.render(cli.load_checked(path_of(name), ["dispatcher.calibrate=false"]))
    assert "--calibrate" not in off and export in off


def test_calibration_runs_the_dispatchers_shape_on_one_ep_group():
    """At the buffer's shape, on the group's hosts: deepseek_v3's EP 64 as 8 nodes x 8, 320 experts
    (5 balancer slots per rank x EP 64); tiny_moe's EP 2 on one node."""
    text = render.render(cli.load_checked(path_of("deepseek_v3"), []))
    calibrate = text.index(" --calibrate --reuse ")
    step = text[text.rindex("srun ", 0, calibrate):text.index("\n\n", calibrate)]
    assert step.startswith("srun --nodes=8 --ntasks-per-node=8 ")
    assert ("--calibrate --reuse --hidden 7168 --tokens 4096 --experts 320 --topk 8 --dtype bf16 --ranks-per-node 8 "
            "--device cuda --time-limit 300") in step
    tiny = render.render(cli.load_checked(path_of("tiny_moe"), ["dispatcher.calibrate_time_limit_s=90"]))
    assert "srun --nodes=1 --ntasks-per-node=2 --relative=0 --kill-on-bad-exit=1 --time=5 " in tiny  # 2 + 3 min
    assert "--time-limit 90" in tiny
    for sets in (["dispatcher.backend=cuda"], ["dispatcher.type=alltoall", "balancer.interval=0"]):
        assert "--calibrate" not in render.render(cli.load_checked(path_of("tiny_moe"), sets))


def test_the_dry_run_says_what_will_be_measured(capsys):
    assert cli.main([path_of("deepseek_v3"), "--dry-run"]) == 0
    err = capsys.readouterr().err
    assert ("hybrid-ep-launch: deepseek_v3: calibration before training: one EP group of 64 ranks (8 hosts x 8) times "
            "reference against cuda at H 7168, 4096 tokens/rank, top-8, bf16, 320 experts, within 300 s; evidence "
            "results/deepseek_v3/auto-evidence.json, reused while device, versions, topology and shape match "
            "(dispatcher.calibrate=false skips it)") in err
    assert cli.main([path_of("tiny_moe"), "--set", "dispatcher.calibrate=false"]) == 0
    assert ("tiny_moe: no calibration (dispatcher.calibrate is false): auto follows "
            "results/tiny_moe/auto-evidence.json where it holds an entry, else its rule") in capsys.readouterr().err


def test_container_fields_are_optional_and_rendered(capsys):
    assert cli.main([path_of("tiny_moe"), "--set", "container.image=nvcr.io/nvidia/pytorch:25.04-py3",
                     "--set", "container.mounts=[/data:/data,/ckpt:/ckpt]"]) == 0
    assert "--container-image=nvcr.io/nvidia/pytorch:25.04-py3 --container-mounts=/data:/data,/ckpt:/ckpt" \
        in capsys.readouterr().out


# Runs in a fresh interpreter: megatron_patches.apply() patches Megatron globally.
PARSE_ALL = textwrap.dedent('''
    import contextlib, io, json, sys
    from megatron_patches.slurm import cli, megatron_args, megatron_parse, shape
    out = {}
    for path in sys.argv[1:]:
        r = cli.load_checked(path, [])
        notes = []
        with contextlib.redirect_stdout(io.StringIO()):   # validate_args prints every argument
            args, config = megatron_parse.parse(megatron_args.megatron_args(r), shape.shape_of(r).world,
                                                gpu_type=r["cluster.gpu_type"], env=r["env"], notes=notes)
        out[r.name] = {
            "config": type(config).__name__, "layers": config.num_layers, "experts": config.num_moe_experts,
            "topk": config.moe_router_topk, "dispatcher": config.moe_token_dispatcher_type,
            "tp": config.tensor_model_parallel_size, "pp": config.pipeline_model_parallel_size,
            "ep": config.expert_model_parallel_size, "dp": args.data_parallel_size,
            "balancer_interval": args.hybrid_ep_balancer_interval, "pad_multiple": args.hybrid_ep_pad_multiple,
            "mla": bool(config.multi_latent_attention), "notes": notes,
        }
    print("RESULT " + json.dumps(out))
''')


def test_every_pretrain_recipe_parses_with_megatrons_parser():
    """parse_args + validate_args + core_transformer_config_from_args on every recipe's list.

    On this CPU machine megatron_parse answers validate_args' compute-capability question with
    the recipe's GPU type and appends --no-rope-fusion when Transformer Engine is missing (both
    documented there); nothing is allocated, so the 671B config builds in milliseconds.
    """
    pytest.importorskip("megatron.training.arguments")
    env = checkout_env(PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-c", PARSE_ALL, *[path_of(n) for n in PRETRAIN]],
                          capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert sorted(got) == sorted(PRETRAIN)
    for name in PRETRAIN:
        r = recipe_mod.load(path_of(name))
        parallel = shape.shape_of(r)
        g = got[name]
        assert g["layers"] == r["model.num_layers"] and g["experts"] == r["model.num_experts"]
        assert g["topk"] == r["model.moe_router_topk"] and g["dispatcher"] == "hybrid_ep"
        assert (g["tp"], g["pp"], g["ep"], g["dp"]) == (parallel.tp, parallel.pp, parallel.ep, parallel.dp), name
        assert g["balancer_interval"] == r["balancer.interval"] and g["pad_multiple"] == r["dispatcher.pad_multiple"]
        assert g["mla"] == r["model.mla.enabled"]
    assert got["deepseek_v3"]["config"] == got["deepseek_v3_gb200"]["config"] == "MLATransformerConfig"


def test_alltoall_comparison_parses_too(capsys):
    sets = ["--set", "dispatcher.type=alltoall", "--set", "balancer.interval=0"]
    assert cli.main([path_of("qwen3_30b_a3b"), *sets]) == 0
    text = capsys.readouterr().out
    assert "--moe-token-dispatcher-type alltoall" in text and "--hybrid-ep" not in text


def test_submit_goes_through_sbatch(tmp_path, monkeypatch, capsys):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    captured = tmp_path / "captured.sbatch"
    fake = bin_dir / "sbatch"
    fake.write_text(f'#!/bin/bash\ncp "$1" {captured}\ntest -d results/qwen3_235b_a22b || exit 3\n'
                    'echo "Submitted batch job 4242"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "out" / "job.sbatch"
    sets = site_sets("qwen3_235b_a22b") + ["--set", "train.steps=50"]
    rc = cli.main([path_of("qwen3_235b_a22b"), "--submit", "--script", str(script), *sets])
    captured_io = capsys.readouterr()
    assert rc == 0 and "Submitted batch job 4242" in captured_io.out
    assert "Slurm log results/qwen3_235b_a22b/slurm-%j.out" in captured_io.err
    expected = render.render(cli.load_checked(path_of("qwen3_235b_a22b"), sets[1::2]))
    assert captured.read_text() == expected == script.read_text()
    assert "--train-iters 50" in expected
    assert "#SBATCH --output=results/qwen3_235b_a22b/slurm-%j.out\n" in expected


# Stands in for Slurm running a batch job, in the order slurmstepd does: go to the job's
# working directory (--chdir, relative to the submission folder; else the submission folder),
# open --output there (Slurm creates no folders: a missing one fails the job before the script
# starts, "Could not open stdout file"), then run the script with SLURM_JOB_ID set and srun /
# scontrol stubbed. Synchronous, so sbatch's exit status is the job's.
SLURM_STAND_IN = textwrap.dedent('''
    import os, re, shlex, subprocess, sys
    script = os.path.abspath(sys.argv[1])
    text = open(script).read()
    opts = {k: shlex.split(v)[0] for k, v in re.findall(r"^#SBATCH --(chdir|output)=(.*)$", text, re.M)}
    os.chdir(opts.get("chdir", "."))
    log = opts["output"].replace("%j", "77")
    if not os.path.isdir(os.path.dirname(log) or "."):
        sys.exit(f"slurmstepd: error: Could not open stdout file {os.path.abspath(log)}: No such file or directory")
    stubs = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stubs")
    env = dict(os.environ, SLURM_JOB_ID="77", SLURM_JOB_NODELIST="node1",
               PATH=stubs + os.pathsep + os.environ["PATH"])
    with open(log, "w") as f:
        rc = subprocess.call(["bash", script], stdout=f, stderr=subprocess.STDOUT, env=env)
    print("Submitted batch job 77")
    sys.exit(rc)
''')


def _slurm_stand_in(tmp_path, monkeypatch, srun: str = 'echo "srun $*"'):
    """sbatch on PATH (SLURM_STAND_IN), its srun stub the bash of `srun`."""
    bin_dir = tmp_path / "bin"
    (bin_dir / "stubs").mkdir(parents=True)
    sbatch = bin_dir / "sbatch"
    sbatch.write_text(f"#!{sys.executable}\n{SLURM_STAND_IN}")
    for name, body in [("srun", srun), ("scontrol", "echo node1")]:
        (bin_dir / "stubs" / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / "stubs" / name).chmod(0o755)
    sbatch.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")


@pytest.mark.parametrize("workdir", [None, "relative", "absolute with space"])
@pytest.mark.parametrize("name", ALL)
def test_submitted_job_finds_its_log_folder(name, workdir, tmp_path, monkeypatch, capsys):
    """Every recipe, submitted: the log's folder exists when the job starts (the launcher made
    it), and the log and the per-job OUT_DIR resolve from the same folder, with cluster.workdir
    (the job's --chdir) or without."""
    _slurm_stand_in(tmp_path, monkeypatch)
    submit_dir = tmp_path / "submit"
    submit_dir.mkdir()
    monkeypatch.chdir(submit_dir)
    sets, base = site_sets(name), submit_dir
    if workdir == "relative":
        sets, base = sets + ["--set", "cluster.workdir=run/here"], submit_dir / "run" / "here"
    elif workdir:
        sets, base = sets + ["--set", f"cluster.workdir={tmp_path / 'work dir'}"], tmp_path / "work dir"
    rc = cli.main([path_of(name), "--submit", "--script", str(tmp_path / "scripts" / "job.sbatch"), *sets])
    out, err = capsys.readouterr()
    assert rc == 0 and "Submitted batch job 77" in out, err
    recipe = cli.load_checked(path_of(name), sets[1::2])
    out_dir = base / recipe["output.dir"].replace("${SLURM_JOB_ID}", "77")
    log = base / render.log_dir(recipe) / "slurm-77.out"
    assert out_dir.is_dir() and log.is_file()
    assert log.parent == out_dir.parent == base / "results" / name
    assert "srun --nodes=" in log.read_text()  # the script ran to its srun line
    if workdir:
        assert not (submit_dir / "results").exists()  # nothing resolved from the submission folder


@pytest.mark.parametrize("name", PRETRAIN)
def test_a_failing_calibration_never_ends_the_job(name, tmp_path, monkeypatch, capsys):
    """Every GPU recipe, submitted as shipped, under `set -euo pipefail`: the calibration step fails
    (its srun exits 7, as a step whose tasks crashed or ran out of time does) and the job goes on to
    its training step, saying so in its log."""
    _slurm_stand_in(tmp_path, monkeypatch, srun='echo "srun $*"; case "$*" in *--calibrate*) exit 7;; esac')
    monkeypatch.chdir(tmp_path)
    rc = cli.main([path_of(name), "--submit", "--script", str(tmp_path / "job.sbatch"), *site_sets(name)])
    assert rc == 0 and "Submitted batch job 77" in capsys.readouterr().out
    log = (tmp_path / "results" / name / "slurm-77.out").read_text().splitlines()
    calibration = next(i for i, line in enumerate(log) if "--calibrate --reuse" in line)
    assert log[calibration + 1] == ("hybrid-ep: the calibration step ended with status 7; training starts, auto "
                                    f"following results/{name}/auto-evidence.json where it holds an entry (a failure "
                                    "keeps reference), else its rule")
    assert "-m megatron_patches.pretrain_gpt" in log[calibration + 2]  # the training step ran, and was the last


def test_a_missing_log_folder_fails_the_stand_in_as_it_fails_slurm(tmp_path, monkeypatch):
    """The stand-in is a real check: the script rendered before the fix (log in the per-job
    folder that only the script creates) does not start."""
    _slurm_stand_in(tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    text = render.render(cli.load_checked(path_of("tiny_moe"), []))
    old = text.replace("#SBATCH --output=results/tiny_moe/slurm-%j.out",
                       "#SBATCH --output=results/tiny_moe/%j/slurm-%j.out")
    assert old != text
    (tmp_path / "old.sbatch").write_text(old)
    os.makedirs("results/tiny_moe")
    proc = subprocess.run(["sbatch", "old.sbatch"], capture_output=True, text=True)
    assert proc.returncode != 0 and "Could not open stdout file" in proc.stderr


@pytest.mark.parametrize("out, folder", [
    ("results/x/${SLURM_JOB_ID}", "results/x"),
    ("results/x/$SLURM_JOB_ID/run", "results/x"),
    ("/lustre/r/run-${SLURM_JOB_ID}", "/lustre/r"),
    ("./results//fixed/", "results/fixed"),
    ("results/fixed", "results/fixed"),
    ("$HOME/results/${SLURM_JOB_ID}", "."),
    ("/${SCRATCH}/r", "."),
])
def test_log_dir_is_the_leading_part_without_variables(out, folder):
    recipe = cli.load_checked(path_of("tiny_moe"), [f"output.dir={out}"])
    assert render.log_dir(recipe) == folder
    assert render.log_file(recipe) == ("slurm-%j.out" if folder == "." else f"{folder}/slurm-%j.out")
    text = render.render(recipe)
    assert f"#SBATCH --output={render.log_file(recipe)}\n" in text and f'OUT_DIR="{out}"' in text


def test_workdir_is_the_jobs_chdir():
    """#SBATCH --chdir, not a `cd` in the script: Slurm resolves --output from it, so the log and
    OUT_DIR resolve from the same folder."""
    plain = render.render(cli.load_checked(path_of("tiny_moe"), []))
    assert "--chdir" not in plain and "\ncd " not in plain
    text = render.render(cli.load_checked(path_of("tiny_moe"), ["cluster.workdir=/lustre/you/run"]))
    lines = text.splitlines()
    chdir, output = "#SBATCH --chdir=/lustre/you/run", "#SBATCH --output=results/tiny_moe/slurm-%j.out"
    assert lines.index(chdir) < lines.index(output)
    assert "\ncd " not in text and 'OUT_DIR="results/tiny_moe/${SLURM_JOB_ID}"' in text
    assert "# Slurm log: results/tiny_moe/slurm-<job id>.out, from cluster.workdir /lustre/you/run" in text
    assert render.log_dir_to_create(cli.load_checked(path_of("tiny_moe"), ["cluster.workdir=/lustre/you/run"])) \
        == "/lustre/you/run/results/tiny_moe"


def test_nodes_rescales_data_parallelism(capsys):
    assert cli.main([path_of("deepseek_v3_proxy"), "--nodes", "8"]) == 0
    captured = capsys.readouterr()
    assert "#SBATCH --nodes=8" in captured.out
    assert "64 GPUs = TP 1 x PP 2 x CP 1 x DP 32" in captured.err
    assert shape.shape_of(cli.load_checked(path_of("deepseek_v3_proxy"), [], nodes=8)).edp == 2


# EP x ETP with the balancer off: (recipe, overrides, layout line). The hybrid_ep dispatcher runs
# expert tensor parallelism (docs/megatron.md); only the balancer refuses it.
ETP_LAYOUTS = [
    ("tiny_moe", ["parallelism.ep=1", "parallelism.etp=2"], "2 GPUs = TP 1 x PP 1 x CP 1 x DP 2; "
                                                             "experts: EP 1 x ETP 2 x EDP 1"),
    ("tiny_moe", ["parallelism.ep=2", "parallelism.etp=2", "cluster.gpus_per_node=4", "train.global_batch_size=16"],
     "4 GPUs = TP 1 x PP 1 x CP 1 x DP 4; experts: EP 2 x ETP 2 x EDP 1"),
    ("deepseek_v3", ["parallelism.ep=32", "parallelism.etp=2", "balancer.interval=0"],
     "1024 GPUs = TP 1 x PP 16 x CP 1 x DP 64; experts: EP 32 x ETP 2 x EDP 1"),
]


@pytest.mark.parametrize("name,overrides,line", ETP_LAYOUTS,
                         ids=[f"{c[0]}:{c[1][0].split('=')[1]}x{c[1][1].split('=')[1]}" for c in ETP_LAYOUTS])
def test_expert_tensor_parallelism_with_hybrid_ep_and_the_balancer_off(name, overrides, line, capsys):
    sets = [a for o in overrides for a in ("--set", o)]
    assert cli.main([path_of(name), *sets]) == 0
    captured = capsys.readouterr()
    assert "error" not in captured.err and line in captured.err, captured.err
    assert "--moe-token-dispatcher-type hybrid_ep" in captured.out
    assert "--expert-tensor-parallel-size 2" in captured.out and "--hybrid-ep-balancer-interval" not in captured.out
    # the same layout with the balancer on is refused, naming the balancer's setting
    assert cli.main([path_of(name), *sets, "--set", "balancer.interval=5", "--set", "balancer.slots_per_rank=9"]) == 2
    err = capsys.readouterr().err
    assert "error: balancer.interval: the expert balancer with parallelism.etp 2" in err
    assert "parallelism.etp:" not in err


INVALID = [
    ("deepseek_v3", ["--set", "parallelism.ep=7"], "parallelism.ep", "not divisible by EP 7"),
    ("deepseek_v3", ["--set", "parallelism.ep=128"], "parallelism.ep", "must divide world / PP"),
    ("deepseek_v3", ["--set", "parallelism.tp=3"], "cluster.nodes", "TP x PP x CP"),
    ("deepseek_v3", ["--nodes", "3"], "cluster.nodes", "not divisible by TP x PP x CP"),
    ("deepseek_v3", ["--set", "parallelism.pp=8"], "parallelism.pp", "do not split"),
    ("deepseek_v3", ["--set", "train.global_batch_size=1000"], "train.global_batch_size", "micro batch x DP"),
    ("deepseek_v3", ["--set", "parallelism.ep=32", "--set", "parallelism.etp=2", "--set", "balancer.slots_per_rank=9"],
     "balancer.interval", "the expert balancer with parallelism.etp 2 (expert tensor parallelism): use "
     "parallelism.etp 1 with the balancer, or turn the balancer off (balancer.interval 0"),
    ("deepseek_v3", ["--set", "model.moe_router_topk=300"], "model.moe_router_topk", "exceeds"),
    ("deepseek_v3", ["--set", "parallelism.tpp=2"], "parallelism.tpp", "unknown field"),
    ("deepseek_v3", ["--set", "parallelism.ep=abc"], "parallelism.ep", "must be a int"),
    ("deepseek_v3", ["--set", "cluster.gpu_type=K80"], "cluster.gpu_type", "must be one of"),
    ("tiny_moe", ["--set", "balancer.interval=5", "--set", "balancer.slots_per_rank=3"], "balancer.slots_per_rank",
     "cannot hold"),
    ("deepseek_v3", ["--set", "balancer.decay=1.5"], "balancer.decay", "(0, 1)"),
    ("deepseek_v3", ["--set", "balancer.tolerance=-0.1"], "balancer.tolerance", "must be a finite number >= 0"),
    ("deepseek_v3", ["--set", "balancer.tolerance=.nan"], "balancer.tolerance", "got nan"),
    ("deepseek_v3", ["--set", "balancer.move_budget=-0.1"], "balancer.move_budget",
     "must be a fraction of the slots in [0, 1]"),
    ("deepseek_v3", ["--set", "balancer.move_budget=1.5"], "balancer.move_budget", "got 1.5"),
    ("deepseek_v3", ["--set", "balancer.move_budget=.nan"], "balancer.move_budget", "got nan"),
    ("deepseek_v3", ["--set", "dispatcher.type=alltoall"], "balancer.interval", "runs inside the hybrid_ep dispatcher"),
    ("deepseek_v3", ["--set", "dispatcher.type=magic"], "dispatcher.type", "must be one of"),
    ("deepseek_v3", ["--set", "data.path=null"], "data.path", "is required"),
    ("tiny_moe", ["--set", "data.mock=false"], "data.path", "is required when data.mock is false"),
    ("deepseek_v3", ["--set", "data.blend=[0.5 /d/a_text_document]"], "data.blend", "alternatives"),
    ("tiny_moe", ["--set", "data.mock=false", "--set", "data.blend=[/d/a_text_document]"], "data.blend",
     "entries are \"WEIGHT PREFIX\" with a weight > 0"),
    ("tiny_moe", ["--set", "data.mock=false", "--set", "data.blend=[-1 /d/a]"], "data.blend", "got '-1 /d/a'"),
    ("tiny_moe", ["--set", "checkpoint.interval=-5"], "checkpoint.interval", "must be >= 0"),
    ("tiny_moe", ["--set", "checkpoint.save=~/ckpt"], "checkpoint.save", "must not start with ~"),
    ("tiny_moe", ["--set", "cluster.partition=a b"], "cluster.partition", "must be one word"),
    ("tiny_moe", ["--set", "cluster.qos=x'y"], "cluster.qos", "must be one word"),
    ("tiny_moe", ["--set", "container.image=img", "--set", "container.mounts=['/a:/a,/b:/b']"], "container.mounts",
     "without whitespace, quotes or commas"),
    ("tiny_moe", ["--set", "container.mounts=[/a:/a]"], "container.mounts", "applies only with container.image"),
    ("tiny_moe", ["--set", "container.image=img", "--set", "container.workdir=run"], "container.workdir",
     "must be an absolute path"),
    ("tiny_moe", ["--set", "network.nccl_ib_hca=mlx5_0, mlx5_1"], "network.nccl_ib_hca", "without whitespace"),
    ("tiny_moe", ["--set", "network.nccl_ib_hca=mlx5_0", "--set", "env.NCCL_IB_HCA=mlx5_1"], "env.NCCL_IB_HCA",
     "is set by network.nccl_ib_hca"),
    ("bench_dispatch", ["--set", "network.socket_ifname=eth0", "--set", "env.GLOO_SOCKET_IFNAME=eth1"],
     "env.GLOO_SOCKET_IFNAME", "is set by network.socket_ifname"),
    ("deepseek_v3", ["--set", "precision=fp4"], "precision", "must be one of"),
    ("qwen3_235b_a22b", ["--set", "parallelism.sequence_parallel=false"], "parallelism.sequence_parallel", "needs"),
    ("qwen3_235b_a22b", ["--set", "parallelism.vpp=5"], "parallelism.pp", "do not split"),
    ("mixtral_8x7b", ["--set", "model.num_query_groups=5"], "model.num_query_groups", "must divide"),
    ("bench_dispatch", ["--set", "bench.experts=100"], "bench.experts", "not divisible"),
    ("bench_dispatch", ["--set", "bench.node_counts=[1,8]"], "bench.node_counts", "must be in"),
    ("tiny_moe", ["--set", "train.recompute=sometimes"], "train.recompute", "must be one of"),
    ("tiny_moe", ["--set", "dispatcher.calibrate=true", "--set", "dispatcher.backend=cuda"], "dispatcher.calibrate",
     "with backend auto"),
    ("tiny_moe", ["--set", "dispatcher.calibrate=true", "--set", "dispatcher.type=alltoall"], "dispatcher.calibrate",
     "only applies to the hybrid_ep dispatcher"),
    ("tiny_moe", ["--set", "dispatcher.dispatch_fp8=true"], "dispatcher.dispatch_fp8", "precision fp8"),
]


def test_fp8_dispatch_is_a_recipe_field_off_by_default():
    """dispatcher.dispatch_fp8 with precision fp8 renders --hybrid-ep-dispatch-fp8 beside the
    recipe's TE flags; no recipe turns it on (not measured faster yet)."""
    for name in ("deepseek_v3", "deepseek_v3_proxy", "mixtral_8x7b", "qwen3_30b_a3b", "tiny_moe"):
        assert "--hybrid-ep-dispatch-fp8" not in render.render(cli.load_checked(path_of(name), [])), name
    text = render.render(cli.load_checked(path_of("deepseek_v3"), ["precision=fp8", "dispatcher.dispatch_fp8=true"]))
    assert "--hybrid-ep-dispatch-fp8" in text and "--fp8-recipe blockwise" in text


@pytest.mark.parametrize("name,args,field,rule", INVALID, ids=[f"{c[0]}:{c[2]}" for c in INVALID])
def test_invalid_override_names_field_and_rule(name, args, field, rule, capsys):
    assert cli.main([path_of(name), *args]) == 2
    err = capsys.readouterr().err
    assert f"error: {field}: " in err and rule in err, err


@pytest.mark.parametrize("key, value", [("tolerance", 0.03), ("move_budget", 0.1), ("move_budget", 0.0)])
def test_balancer_planner_flag_only_when_set(key, value):
    """Unset (null: the planner's default tolerance, no move cap), the flag is left out, so the
    rendered recipes stay as they were; set, even to 0, it reaches HybridEPOptions."""
    from megatron_patches import options
    from megatron_patches.slurm.megatron_args import megatron_args

    flag = "--hybrid-ep-balancer-" + key.replace("_", "-")
    default = megatron_args(recipe_mod.load(path_of("deepseek_v3")))
    assert "--hybrid-ep-balancer-interval" in default and flag not in default
    assert recipe_mod.load(path_of("deepseek_v3"))["balancer." + key] is None
    args = megatron_args(recipe_mod.load(path_of("deepseek_v3"), [f"balancer.{key}={value}"]))
    assert args[args.index(flag) + 1] == str(value)
    parser = options.add_arguments(argparse.ArgumentParser())
    flags = args[args.index("--hybrid-ep-balancer-interval"):args.index("--hybrid-ep-balancer-report-dir") + 2]
    assert getattr(options.from_args(parser.parse_args(flags)), "balancer_" + key) == value
    off = megatron_args(recipe_mod.load(path_of("deepseek_v3"), ["balancer.interval=0", f"balancer.{key}={value}"]))
    assert flag not in off  # no balancer, no balancer flags


def test_override_types():
    r = recipe_mod.load(path_of("tiny_moe"), ["train.lr=1", "cluster.time=01:30:00", "env.NCCL_DEBUG=INFO",
                                              "model.extra_args=[--foo, 3]", "parallelism.vpp=null"])
    assert r["train.lr"] == 1.0 and isinstance(r["train.lr"], float)
    assert r["cluster.time"] == "01:30:00" and r["env.NCCL_DEBUG"] == "INFO"
    assert r["model.extra_args"] == ["--foo", "3"] and r["parallelism.vpp"] is None
    with pytest.raises(recipe_mod.RecipeError, match="an override is key=value"):
        recipe_mod.load(path_of("tiny_moe"), ["parallelism.ep"])


def test_memory_estimates_of_the_large_recipes():
    """The numbers quoted in docs/slurm.md (GiB per GPU, fullest stage)."""
    ds = memory.estimate(recipe_mod.load(path_of("deepseek_v3")))
    assert abs(ds.total_params_model / 1e9 - 671.0) < 1.0  # DeepSeek-V3 without the MTP module
    assert ds.stage == 0 and round(ds.weights_gb, 1) == 5.8 and round(ds.states_gb, 1) == 20.5
    assert round(ds.total_gb, 1) == 59.0 and round(ds.spare_slots_gb, 1) == 0.7 and not ds.over
    qw = memory.estimate(recipe_mod.load(path_of("qwen3_235b_a22b")))
    assert abs(qw.total_params_model / 1e9 - 235.1) < 0.5
    assert round(qw.states_gb, 1) == 21.8 and round(qw.total_gb, 1) == 71.3 and not qw.over


def test_spare_slots_row_follows_the_total_and_names_its_parts():
    """The spare slots are a part of weights + grads + optimizer: their row comes after the
    total, not under the optimizer row (Mixtral 8x22B: optimizer 51.8, 'of which spare' 35.4,
    while the spare slots' optimizer share is 23.6)."""
    est = memory.estimate(recipe_mod.load(path_of("mixtral_8x22b"), [
        "balancer.interval=100", "balancer.slots_per_rank=2", "parallelism.distributed_optimizer=false"]))
    rows = est.table().splitlines()
    labels = [row.split("  ")[1].strip() if row.startswith("  ") else row for row in rows]
    spare = labels.index("balancer spare slots (weights + grads + optimizer, in the rows above)")
    assert spare == labels.index("total") + 1 and "of which balancer spare slots" not in est.table()
    assert rows[spare].split()[-2:] == [f"{est.spare_slots_gb:.1f}", "GiB"] and est.spare_slots_gb > 35


def test_fp16_gradients_are_two_bytes():
    """Megatron-LM accumulates and all-reduces grads in fp32 for bf16 (and fp8, which runs
    --bf16) only: an fp16 run's main grads are fp16 unless asked otherwise."""
    bf16 = memory.estimate(recipe_mod.load(path_of("mixtral_8x7b")))
    fp16 = memory.estimate(recipe_mod.load(path_of("mixtral_8x7b"), ["precision=fp16"]))
    assert fp16.grads_gb == pytest.approx(bf16.grads_gb / 2, rel=1e-12) and fp16.weights_gb == bf16.weights_gb
    assert "gradients (fp16)" in fp16.table() and "gradients (fp32)" in bf16.table()


def test_spare_slots_of_the_stage_paying_the_most():
    """deepseek_v3: the fullest stage 0 holds 1 MoE layer (0.74 GiB of spare slots), stages 1-14
    hold 4 each (2.95 GiB): the table names stage 1 and its cost too."""
    est = memory.estimate(recipe_mod.load(path_of("deepseek_v3")))
    assert est.stage == 0 and round(est.spare_slots_gb, 2) == 0.74
    assert est.max_spare_stage == 1 and est.max_spare_slots_gb == pytest.approx(4 * est.spare_slots_gb, rel=1e-12)
    assert ("  balancer spare slots on stage 1 (the most of any stage)                    3.0 GiB"
            in est.table().splitlines())
    single = memory.estimate(recipe_mod.load(path_of("qwen3_30b_a3b")))  # one stage: no second line
    assert single.max_spare_stage == single.stage == 0 and "the most of any stage" not in single.table()
    off = memory.estimate(recipe_mod.load(path_of("deepseek_v3"), ["balancer.interval=0"]))
    assert "spare" not in off.table() and off.max_spare_slots_gb == 0


@pytest.mark.parametrize("doc, name", [("docs/slurm.md", "deepseek_v3"),
                                       ("recipes/deepseek_v3/README.md", "deepseek_v3"),
                                       ("recipes/qwen3_235b_a22b/README.md", "qwen3_235b_a22b")])
def test_docs_quote_the_spare_slot_lines_as_printed(doc, name):
    table = memory.estimate(recipe_mod.load(path_of(name))).table().splitlines()
    with open(os.path.join(REPO, doc)) as f:
        quoted = [line[2:] for line in f.read().splitlines() if line.strip().startswith("balancer spare slots")]
    assert len(quoted) == 2 and all(line in table for line in quoted), (quoted, table)


def test_memory_warning(capsys):
    sets = ["--set", "train.recompute=none", "--set", "train.recompute_modules=[]"]
    assert cli.main([path_of("deepseek_v3"), *sets]) == 0
    err = capsys.readouterr().err
    assert "warning: estimated" in err and "exceeds the 80 GiB of cluster.gpu_type H100" in err
