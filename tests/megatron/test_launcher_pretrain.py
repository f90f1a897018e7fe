"""The launcher end to end through megatron.training's own `pretrain()` (the installed wheel's):
tests/megatron/megatron_lm/pretrain_gpt.py, shaped like Megatron-LM's (its entry wrapped by
`maybe_wrap_for_inprocess_restart`, which parses the command line with no provider; its own
extra_args_provider), trains a 2-layer MoE GPT (8 experts, EP 2) on mock data on two gloo
ranks with the CPU stand-ins asked for (HYBRID_EP_CPU_COMPAT=1), once with hybrid_ep and once
with alltoall: the losses of every iteration are equal."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from harness.megatron.moe_layer import TINY_GPT_ARGS

pytestmark = [pytest.mark.megatron, pytest.mark.slow]

REPO = pathlib.Path(__file__).resolve().parents[2]
SHAPED = REPO / "tests" / "megatron" / "megatron_lm"
RANKS = 2
ITERATIONS = 3
# The GPU-only fusions off (as on any machine without a GPU), no evaluation, one log line per step.
HOST_ARGS = [
    "--expert-model-parallel-size", str(RANKS), "--train-iters", str(ITERATIONS), "--distributed-backend", "gloo",
    "--global-batch-size", "8", "--micro-batch-size", "2", "--split", "100,0,0",
    "--eval-iters", "0", "--eval-interval", "1000", "--log-interval", "1",
    "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion", "--no-bias-dropout-fusion",
    "--no-masked-softmax-fusion", "--no-persist-layer-norm", "--no-rope-fusion", "--shaped-script-flag", "7",
]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*\| lm loss: (\S+) \|")


def pretrain(dispatcher: str) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM_DIR", "RANK", "WORLD_SIZE")}
    env.update(HYBRID_EP_CPU_COMPAT="1", PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1")
    args = [*TINY_GPT_ARGS, *HOST_ARGS, "--moe-token-dispatcher-type", dispatcher]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(RANKS),
         "-m", "megatron_patches.pretrain_gpt", "--megatron-lm-dir", str(SHAPED), *args],
        capture_output=True, text=True, timeout=480, env=env, cwd=str(REPO),
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def losses(output: str) -> list[tuple[int, str]]:
    return [(int(step), loss) for step, loss in LOSS.findall(output)]


def test_megatrons_own_pretrain_through_the_launcher_hybrid_ep_equals_alltoall():
    pytest.importorskip("megatron.training.training")
    from megatron.core import package_info

    hybrid = pretrain("hybrid_ep")
    alltoall = pretrain("alltoall")
    assert f"running {SHAPED / 'pretrain_gpt.py'} with Megatron-Core {package_info.__version__}" in hybrid
    assert "> shaped script flag 7" in hybrid  # the script's own provider ran too
    assert f"backend reference (asked: auto) for EP 1 node x {RANKS} ranks" in hybrid  # hybrid_ep's dispatcher ran
    assert "hybrid_ep dispatcher:" in hybrid and "hybrid_ep dispatcher:" not in alltoall
    assert [step for step, _ in losses(hybrid)] == list(range(1, ITERATIONS + 1))
    assert losses(hybrid) == losses(alltoall)
