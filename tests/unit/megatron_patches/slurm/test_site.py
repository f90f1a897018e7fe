"""The site fields of a recipe (partition, account, QoS, container, interpreter, NICs), its
checkpoints and its data: with them set, every rendered script carries their lines and bash
accepts it; left unset or as `<...>` placeholders, a dry run names them and --submit refuses
the placeholders before anything is written; list arguments stay on one line."""

from __future__ import annotations

import os
import subprocess

import pytest

from helpers import REPO
from megatron_patches.slurm import cli, megatron_args, render, site_fields
from megatron_patches.slurm import recipe as recipe_mod

pytestmark = pytest.mark.unit

RECIPES_DIR = os.path.join(REPO, "recipes")
ALL = recipe_mod.recipe_names(RECIPES_DIR)
PRETRAIN = [n for n in ALL if n != "bench_dispatch"]
# The recipes a cluster user submits as they are: their site fields are placeholders or nulls.
CLUSTER = ["deepseek_v3", "deepseek_v3_gb200", "qwen3_235b_a22b", "qwen3_30b_a3b", "mixtral_8x7b", "mixtral_8x22b"]

SITE = ["cluster.partition=batch", "cluster.account=moe-team", "cluster.qos=high",
        "cluster.python=/opt/venv/bin/python",
        "container.image=nvcr.io#nvidia/pytorch:25.04-py3", "container.mounts=[/lustre:/lustre,/data:/data:ro]",
        "network.nccl_ib_hca=mlx5_0,mlx5_3", "network.nvshmem_hca_list=mlx5_0:1,mlx5_3:1",
        "network.socket_ifname=eth0"]
DATA = ["data.mock=false", "data.path=null", "data.blend=[0.7 /lustre/data/web_text_document, "
        "0.3 /lustre/data/code_text_document]", "data.split=98,2,0", "checkpoint.save=/lustre/ckpt/${SLURM_JOB_NAME}",
        "checkpoint.load=/lustre/ckpt/base", "checkpoint.interval=50"]


def _launch(capsys, name, *argv):
    code = cli.main([os.path.join(RECIPES_DIR, name), *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _sets(items):
    return [word for item in items for word in ("--set", item)]


def _bash_accepts(text, tmp_path):
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("name", ALL)
def test_every_field_set_renders_its_lines(name, capsys, tmp_path):
    sets = SITE + (DATA if name in PRETRAIN else [])
    code, out, err = _launch(capsys, name, *_sets(sets))
    assert code == 0, err
    _bash_accepts(out, tmp_path)
    for line in ("#SBATCH --partition=batch\n", "#SBATCH --account=moe-team\n", "#SBATCH --qos=high\n",
                 "export NCCL_IB_HCA=mlx5_0,mlx5_3\n", "export NVSHMEM_HCA_LIST=mlx5_0:1,mlx5_3:1\n",
                 "export NCCL_SOCKET_IFNAME=eth0\n", "export GLOO_SOCKET_IFNAME=eth0\n",
                 "  --container-image='nvcr.io#nvidia/pytorch:25.04-py3' "
                 "--container-mounts=/lustre:/lustre,/data:/data:ro "
                 '--container-workdir="$PWD" bash -c \\\n', "  /opt/venv/bin/python \"${"):
        assert line in out, (line, out)
    assert "unset:" not in err and "placeholder:" not in err and "# Unset" not in out
    if name in PRETRAIN:
        assert ("  --data-path 0.7 /lustre/data/web_text_document 0.3 /lustre/data/code_text_document\n"
                "  --split 98,2,0\n") in out
        assert "--mock-data" not in out and "# Data: a blend of 2 datasets (data.blend)" in out
        assert ('ARGS+=(--save "/lustre/ckpt/${SLURM_JOB_NAME}" --load "/lustre/ckpt/base")  # checkpoint (recipe '
                "section checkpoint)\n") in out
        assert "  --save-interval 50\n" in out


@pytest.mark.parametrize("name", CLUSTER)
def test_dry_run_names_what_is_unset_and_submit_refuses_placeholders(name, capsys, monkeypatch, tmp_path):
    code, out, err = _launch(capsys, name)
    assert code == 0
    for field in ("cluster.partition", "cluster.account", "container.image", "container.mounts", "data.path"):
        assert f"hybrid-ep-launch: placeholder: {field} = <" in err, field
    for field in ("cluster.qos", "network.nccl_ib_hca", "network.nvshmem_hca_list", "network.socket_ifname"):
        assert f"hybrid-ep-launch: unset: {field}: {site_fields.UNSET_MEANS[field]}\n" in err, field
    assert "# PLACEHOLDERS to replace before sbatch (values written <...>): cluster.partition," in out
    assert "#SBATCH --partition=<partition>\n" in out  # rendered as given: bash still accepts the script
    _bash_accepts(out, tmp_path)

    def no_sbatch(*args, **kwargs):
        raise AssertionError(f"sbatch called: {args}")

    monkeypatch.setattr(cli.subprocess, "run", no_sbatch)
    submit_dir = tmp_path / "submit"
    submit_dir.mkdir()
    monkeypatch.chdir(submit_dir)
    code, out, err = _launch(capsys, name, "--submit", "--script", str(submit_dir / "job.sbatch"))
    assert code == 2 and out == ""
    assert "hybrid-ep-launch: error: data.path: is a placeholder (<Megatron .bin/.idx prefix" in err
    assert "error: cluster.account: is a placeholder (<account>): give your site's value" in err
    assert os.listdir(submit_dir) == []  # neither the script nor the log folder


def test_a_recipe_without_site_fields_says_what_runs_instead(capsys):
    code, out, err = _launch(capsys, "tiny_moe")
    assert code == 0 and "placeholder" not in err
    assert "hybrid-ep-launch: unset: cluster.python: `python` from the job's PATH" in err
    assert "hybrid-ep-launch: unset: container.image: no container: the nodes' own software environment" in err
    assert "#SBATCH --partition" not in out and "--container-image" not in out and "NCCL_IB_HCA" not in out
    assert '  python "${ARGS[@]}"' in out


def test_mock_data_only_when_asked_and_said_in_the_header(capsys):
    code, out, _ = _launch(capsys, "tiny_moe")
    assert code == 0 and "  --mock-data\n" in out
    assert "# Data: MOCK (data.mock true): synthetic tokens, no dataset is read.\n" in out
    code, out, _ = _launch(capsys, "deepseek_v3", "--set", "data.path=/lustre/data/web_text_document")
    assert code == 0 and "--mock-data" not in out and "MOCK" not in out
    assert "  --data-path /lustre/data/web_text_document\n" in out
    assert "# Data: /lustre/data/web_text_document (data.path), tokenizer HuggingFaceTokenizer.\n" in out
    assert "  --tokenizer-model deepseek-ai/DeepSeek-V3\n" in out
    code, out, err = _launch(capsys, "deepseek_v3", "--set", "data.mock=true")
    assert code == 0 and "  --mock-data\n" in out and "--data-path" not in out
    assert "placeholder: data.path" not in err  # mock data reads no path


def test_list_arguments_stay_on_one_line(capsys):
    code, out, _ = _launch(capsys, "deepseek_v3")
    assert code == 0 and "  --recompute-modules mla_up_proj mlp moe\n" in out
    args = megatron_args.megatron_args(cli.load_checked(os.path.join(RECIPES_DIR, "deepseek_v3"), []))
    moved = ("--save", "--load", "--hybrid-ep-balancer-report-dir")  # added after the array, under OUT_DIR
    flags = [a for a in args if a.startswith("--") and a not in moved]
    body = out[out.index("ARGS=(\n") + 7:out.index("\n)\n")].splitlines()
    assert [line.split()[0] for line in body] == flags  # one line per flag, each with all its values


@pytest.mark.parametrize("out_dir, ckpt", [
    ("results/x/${SLURM_JOB_ID}", "results/x/checkpoints"),
    ("$SCRATCH/run/${SLURM_JOB_ID}", "$SCRATCH/run/checkpoints"),
    ("results/fixed", "results/fixed/checkpoints"),
    ("${SLURM_JOB_ID}", "./checkpoints"),
])
def test_checkpoints_go_beside_the_job_folders_by_default(out_dir, ckpt, capsys):
    recipe = cli.load_checked(os.path.join(RECIPES_DIR, "deepseek_v3"), [f"output.dir={out_dir}"])
    assert megatron_args.checkpoint_dir(recipe) == ckpt
    text = render.render(recipe)
    assert f'ARGS+=(--save "{ckpt}" --load "{ckpt}")' in text and "  --save-interval 200\n" in text


def test_checkpoint_interval_null_saves_at_the_end_and_zero_saves_none():
    path = os.path.join(RECIPES_DIR, "deepseek_v3")
    end = megatron_args.megatron_args(cli.load_checked(path, ["checkpoint.interval=null", "train.steps=300"]))
    assert end[end.index("--save-interval") + 1] == "300"
    none = megatron_args.megatron_args(cli.load_checked(path, ["checkpoint.interval=0"]))
    assert not {"--save", "--load", "--save-interval"} & set(none)


def test_unknown_recipe_lists_the_recipes(capsys, monkeypatch, tmp_path):
    code, out, err = _launch(capsys, "deepseek_v4")
    assert code == 2 and out == ""
    first, second = err.splitlines()
    assert first.endswith("recipe: no recipe at " + os.path.join(RECIPES_DIR, "deepseek_v4") + "; did you mean "
                          + os.path.join(RECIPES_DIR, "deepseek_v3") + "?")
    assert second == f"  recipes in {RECIPES_DIR}: {', '.join(ALL)}"
    monkeypatch.chdir(tmp_path)  # a bare name: the checkout's recipes/, whatever the folder
    assert cli.main(["deepseek_v3", "--set", "data.mock=true"]) == 0
    assert cli.main(["deepseekv3"]) == 2
    err = capsys.readouterr().err
    assert "no recipe at deepseekv3; did you mean deepseek_v3?\n  recipes by name: bench_dispatch," in err


def test_launcher_log_lines_are_short(capsys):
    """Every line the launcher writes to the terminal stays under 200 characters."""
    for name in ALL:
        _launch(capsys, name)
        _launch(capsys, name, "--set", "train.recompute=none") if name in PRETRAIN else None
    _launch(capsys, "deepseek_v4")
    cli.main(["deepseek_v3", "--submit", "--script", "/proc/x/y"])
    err = capsys.readouterr().err
    assert max(len(line) for line in err.splitlines()) < 200, max(err.splitlines(), key=len)
