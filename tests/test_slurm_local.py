"""Local mode: tiny_moe trains end to end on this machine through the launcher, no Slurm.

On a CPU-only machine without Megatron-LM's pretrain_gpt.py the launcher runs the
Megatron-Core trainer (megatron_patches.slurm.cpu_train) on 2 gloo processes with the
recipe's argument list, parsed by Megatron's parser; the test checks that it says so, that
it trained the asked number of steps and that every loss is finite. About 25 s on 2 cores.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from megatron_patches.slurm import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_tiny_moe_trains_locally():
    pytest.importorskip("megatron.training.arguments")
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_DIR"}
    env["PYTHONWARNINGS"] = "ignore"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "launch_slurm.py"), os.path.join(REPO, "recipes", "tiny_moe"),
         "--local", "--set", "train.steps=3", "--set", "balancer.interval=0"],
        capture_output=True, text=True, timeout=180, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    gpu_path = "path: Megatron-LM pretrain_gpt.py" in out
    if not gpu_path:
        assert "path: Megatron-Core trainer megatron_patches.slurm.cpu_train" in out
        losses = [float(m) for m in re.findall(r"cpu_train: step +\d+/3 +loss ([0-9.eE+-]+|nan|inf)", out)]
        assert len(losses) == 3 and all(math.isfinite(v) for v in losses), out
        assert "dispatcher hybrid_ep" in out and "done, 3 steps" in out


def test_local_mode_refuses_more_than_one_node(capsys):
    assert cli.main([os.path.join(REPO, "recipes", "tiny_moe"), "--local", "--nodes", "2",
                     "--set", "train.global_batch_size=16"]) == 2
    assert "error: cluster.nodes: local mode runs on this one machine" in capsys.readouterr().err
