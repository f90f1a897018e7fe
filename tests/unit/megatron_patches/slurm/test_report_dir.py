"""A recipe's relative balancer.report_dir lands under the job's own output folder ($OUT_DIR,
beside tensorboard/), not in the submit folder every job shares; an absolute one stays as given."""

from __future__ import annotations

import os
import pathlib
import subprocess

import pytest

from megatron_patches.slurm import cli, render

pytestmark = pytest.mark.unit

RECIPES = pathlib.Path(__file__).resolve().parents[4] / "recipes"
BALANCED = ["deepseek_v3", "deepseek_v3_proxy", "qwen3_235b_a22b", "qwen3_30b_a3b"]


def _expanded_args(script: str, out_dir: str) -> list[str]:
    """The pretrain_gpt.py arguments the job passes, as bash expands the script's ARGS lines."""
    lines = script.splitlines()
    start = lines.index("ARGS=(")
    end = max(i for i, line in enumerate(lines) if line.startswith("ARGS+=("))
    snippet = "\n".join([f"OUT_DIR={out_dir}"] + lines[start:end + 1] + ['printf "%s\\n" "${ARGS[@]}"'])
    return subprocess.run(["bash", "-c", snippet], capture_output=True, text=True, check=True).stdout.splitlines()


@pytest.mark.parametrize("name", BALANCED)
def test_relative_report_dir_goes_under_the_jobs_output(name):
    recipe = cli.load_checked(str(RECIPES / name), [])
    assert recipe["balancer.report_dir"] == "balancer"
    args = _expanded_args(render.render(recipe), f"results/{name}/4242")
    flag = args.index("--hybrid-ep-balancer-report-dir")
    assert args[flag + 1] == f"results/{name}/4242/balancer"
    assert args[args.index("--tensorboard-dir") + 1] == f"results/{name}/4242/tensorboard"
    assert args.count("--hybrid-ep-balancer-report-dir") == 1


def test_absolute_report_dir_stays_as_given():
    recipe = cli.load_checked(str(RECIPES / "deepseek_v3"), ["balancer.report_dir=/lustre/reports/run 1"])
    args = _expanded_args(render.render(recipe), "results/deepseek_v3/4242")
    assert args[args.index("--hybrid-ep-balancer-report-dir") + 1] == "/lustre/reports/run 1"
    assert os.path.isabs(args[args.index("--hybrid-ep-balancer-report-dir") + 1])


def test_no_report_dir_without_the_balancer():
    recipe = cli.load_checked(str(RECIPES / "deepseek_v3"), ["balancer.interval=0"])
    assert "--hybrid-ep-balancer-report-dir" not in _expanded_args(render.render(recipe), "out")
