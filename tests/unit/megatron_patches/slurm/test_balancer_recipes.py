"""The flagship recipes run the expert balancer with Megatron's distributed optimizer, and the
launcher's memory estimate counts the spare slots the balancer keeps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import REPO
from megatron_patches.slurm import memory
from megatron_patches.slurm import recipe as recipe_mod

pytestmark = pytest.mark.unit

BALANCED = ["deepseek_v3", "deepseek_v3_proxy", "qwen3_235b_a22b", "qwen3_30b_a3b"]


def test_deepseek_v3_dry_run_renders_balancer_and_distributed_optimizer():
    proc = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "launch_slurm.py"),
                           os.path.join(REPO, "recipes", "deepseek_v3"), "--dry-run"],
                          capture_output=True, text=True, cwd=REPO, timeout=300)
    assert proc.returncode == 0, proc.stderr
    args = proc.stdout.split()
    assert "--use-distributed-optimizer" in args
    assert args[args.index("--hybrid-ep-balancer-interval") + 1] == "100"
    assert args[args.index("--hybrid-ep-balancer-slots-per-rank") + 1] == "5"
    line = next(row for row in proc.stderr.splitlines() if "balancer spare slots" in row)
    assert line.split()[-2] == "0.7"  # GiB per GPU: 58 MoE layers over 16 stages, 1 spare slot each


@pytest.mark.parametrize("name", BALANCED)
def test_spare_slots_are_what_the_balancer_adds_to_the_estimate(name):
    on = recipe_mod.load(os.path.join(REPO, "recipes", name))
    assert on["balancer.interval"] > 0 and on["parallelism.distributed_optimizer"]
    off = recipe_mod.load(os.path.join(REPO, "recipes", name), ["balancer.interval=0"])
    with_balancer, without = memory.estimate(on), memory.estimate(off)
    assert with_balancer.spare_slots_gb > 0 and without.spare_slots_gb == 0
    assert with_balancer.total_gb - without.total_gb == pytest.approx(with_balancer.spare_slots_gb, rel=1e-9)


def test_spare_slot_bytes_follow_the_formula():
    """deepseek_v3 stage 0: 1 MoE layer (layers 3 of 0-3), one spare slot per rank holding a
    3 x 7168 x 2048 expert: bf16 weights 2 + fp32 main grad 4 + master and Adam 12 / EDP (1)."""
    est = memory.estimate(recipe_mod.load(os.path.join(REPO, "recipes", "deepseek_v3")))
    assert est.stage == 0
    expert = 3 * 7168 * 2048
    assert est.spare_slots_gb == pytest.approx(expert * (2 + 4 + 12) / memory.GIB, rel=1e-12)
