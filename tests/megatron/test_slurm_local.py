"""Local mode: tiny_moe trains end to end on this machine through the launcher, no Slurm.

On a CPU-only machine without Megatron-LM's pretrain_gpt.py the launcher runs the
Megatron-Core trainer (megatron_patches.local.cpu_train) on 2 gloo processes with the
recipe's argument list, parsed by Megatron's parser; the test checks that it says so, that
it trained the asked number of steps and that every loss is finite. About 25 s on 2 cores.
The CPU trainer also runs the recipe's expert tensor parallelism (EP 1 x ETP 2 on 2 ranks,
EP 2 x ETP 2 on 4), with the losses of ETP 1 on the same ranks: about 100 s more.
It builds dense and MoE layers as the recipe's model.dense_layers (--moe-layer-freq) says,
and runs the expert balancer when the recipe turns it on (log lines, report folder), with the
same losses as without it: about 30 s more.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest

from helpers import REPO
from megatron_patches.slurm import cli

pytestmark = pytest.mark.megatron



@pytest.mark.slow
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
        assert "path: Megatron-Core trainer megatron_patches.local.cpu_train" in out
        losses = [float(m) for m in re.findall(r"cpu_train: step +\d+/3 +loss ([0-9.eE+-]+|nan|inf)", out)]
        assert len(losses) == 3 and all(math.isfinite(v) for v in losses), out
        assert "dispatcher hybrid_ep" in out and "done, 3 steps" in out


def _train_locally(*overrides: str, steps: int):
    """Run tiny_moe --local with the overrides; (stdout, losses), or None on the GPU path."""
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_DIR"}
    env["PYTHONWARNINGS"] = "ignore"
    sets = [a for o in (f"train.steps={steps}", *overrides) for a in ("--set", o)]
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "launch_slurm.py"), os.path.join(REPO, "recipes", "tiny_moe"),
         "--local", *sets], capture_output=True, text=True, timeout=300, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    if "path: Megatron-LM pretrain_gpt.py" in proc.stdout:
        return None
    assert "path: Megatron-Core trainer megatron_patches.local.cpu_train" in proc.stdout
    losses = [float(m) for m in re.findall(rf"cpu_train: step +\d+/{steps} +loss ([0-9.eE+-]+|nan|inf)", proc.stdout)]
    assert len(losses) == steps and all(math.isfinite(v) for v in losses), proc.stdout
    return proc.stdout, losses


@pytest.mark.slow
@pytest.mark.parametrize("ep,ranks", [(1, 2), (2, 4)], ids=["EP1xETP2-2ranks", "EP2xETP2-4ranks"])
def test_cpu_trainer_runs_the_recipes_expert_tensor_parallelism(ep, ranks):
    """The CPU trainer builds Megatron's parallel state with the recipe's ETP (it used to pass EP
    only: ETP 2 ran as ETP 1 with expert DP 2). Each rank then holds half of every expert's FFN;
    with the same data and weights the losses equal those of ETP 1 (expert DP 2) on the same
    ranks, so the expert gradients are reduced as Megatron's DDP reduces them."""
    pytest.importorskip("megatron.training.arguments")
    layout = (f"parallelism.ep={ep}", f"cluster.gpus_per_node={ranks}", f"train.global_batch_size={4 * ranks}",
              "balancer.interval=0")
    sharded = _train_locally(*layout, "parallelism.etp=2", steps=2)
    if sharded is None:
        pytest.skip("local mode ran Megatron-LM's pretrain_gpt.py on GPUs, not the CPU trainer")
    out, losses = sharded
    assert f"dispatcher hybrid_ep, world {ranks} (DP {ranks}; experts: EP {ep} x ETP 2 x EDP 1)" in out, out
    whole = _train_locally(*layout, "parallelism.etp=1", steps=2)
    assert f"experts: EP {ep} x ETP 1 x EDP 2)" in whole[0]
    assert losses == pytest.approx(whole[1], rel=1e-3), (losses, whole[1])


@pytest.mark.slow
def test_cpu_trainer_builds_the_recipes_dense_layers():
    """model.dense_layers = 2 of 4 (--moe-layer-freq ([0]*2+[1]*2)): the first two layers have a
    dense MLP, the last two a MoE layer, as Megatron's decoder block spec builds them for
    pretrain_gpt.py (the trainer used one MoE layer spec for every layer: four MoE layers)."""
    pytest.importorskip("megatron.training.arguments")
    ran = _train_locally("model.num_layers=4", "model.dense_layers=2", "balancer.interval=0", steps=1)
    if ran is None:
        pytest.skip("local mode ran Megatron-LM's pretrain_gpt.py on GPUs, not the CPU trainer")
    assert "cpu_train: layers 1-2 dense, 3-4 MoE\n" in ran[0], ran[0]


@pytest.mark.slow
def test_cpu_trainer_runs_the_balancer_and_keeps_the_losses(tmp_path):
    """balancer.interval > 0 in local mode runs the expert balancer, as pretrain_gpt.py does (it
    was switched off without a word): 5 slots per rank for 8 experts on EP 2 (2 replicas),
    rebalancing every 2 steps. Its log lines reach the output, its report folder is written,
    and the losses equal those of the same run without the balancer (rebalancing never changes
    what the model computes; the expert weights do not depend on the slots per rank)."""
    pytest.importorskip("megatron.training.arguments")
    report = tmp_path / "balancer"
    steps = 4
    on = _train_locally("balancer.interval=2", "balancer.slots_per_rank=5", "balancer.tolerance=0.02",
                        "balancer.move_budget=0.5", f"balancer.report_dir={report}", steps=steps)
    if on is None:
        pytest.skip("local mode ran Megatron-LM's pretrain_gpt.py on GPUs, not the CPU trainer")
    out, losses = on
    assert "cpu_train: expert balancer every 2 steps, 5 slots per rank (10 slots for 8 experts)" in out, out
    rebalances = re.findall(r"hybrid_ep balancer at iteration (\d+): rank imbalance [0-9.]+ -> [0-9.]+, "
                            r"(applied|kept), (\d+) slots changed", out)
    assert [int(r[0]) for r in rebalances] == [2, 4], out
    assert any(r[1] == "applied" and int(r[2]) > 0 for r in rebalances), out  # slots moved at least once
    assert (report / "statistics.npz").is_file()
    for it in (2, 4):
        folder = report / f"iter_{it:07d}"
        names = sorted(p.name for p in folder.iterdir())
        assert f"balancer_summary_step{it}.json" in names and "statistics.npz" in names, names
        assert any(n.endswith(".png") for n in names), names
    off = _train_locally("balancer.interval=0", steps=steps)
    assert "expert balancer" not in off[0]
    assert losses == pytest.approx(off[1], rel=1e-5), (losses, off[1])


def test_local_mode_refuses_more_than_one_node(capsys):
    assert cli.main([os.path.join(REPO, "recipes", "tiny_moe"), "--local", "--nodes", "2",
                     "--set", "train.global_batch_size=16"]) == 2
    assert "error: cluster.nodes: local mode runs on this one machine" in capsys.readouterr().err
