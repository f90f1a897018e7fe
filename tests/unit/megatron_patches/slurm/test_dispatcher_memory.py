"""The launcher's memory estimate counts the hybrid_ep dispatcher's buffer: the library's own
memory_plan() for the recipe's shape, backend and EP layout, by region, in the total."""

from __future__ import annotations

import os

import pytest
import torch

from helpers import REPO
from hybrid_ep.backends.choice import AUTO_RULES
from hybrid_ep.backends.cuda.backend import memory_plan
from hybrid_ep.config import BufferConfig
from megatron_patches.slurm import cli, dispatcher_memory, memory
from megatron_patches.slurm import recipe as recipe_mod

pytestmark = pytest.mark.unit

GIB = 1024**3


def load(name, *sets):
    return cli.load_checked(os.path.join(REPO, "recipes", name), list(sets))


def test_deepseek_v3_with_the_cuda_backend_counts_memory_plans_held_bytes():
    """DeepSeek-V3's buffer: hidden 7168, 4096 tokens per rank (seq 4096 x micro-batch 1), 64
    EP ranks as 8 nodes of 8, 5 balancer slots per rank (320 slots), pad 16, rings of the bf16
    rows it trains with."""
    est = memory.estimate(load("deepseek_v3", "dispatcher.backend=cuda"))
    want = memory_plan(BufferConfig(hidden_dim=7168, max_tokens_per_rank=4096, num_experts=320, world_size=64,
                                    ranks_per_node=8, pad_multiple=16, ring_dtype=torch.bfloat16).validate())
    held = want.held_bytes
    assert 0 < held <= 4e9  # bounded by design: rings of a fixed size, whatever the tokens
    assert est.dispatcher.held_bytes == held and est.dispatcher_gb == held / GIB
    assert est.total_gb == pytest.approx(est.weights_gb + est.grads_gb + est.optimizer_gb + est.activations_gb
                                         + held / GIB, rel=1e-12)
    without = memory.estimate(load("deepseek_v3", "dispatcher.backend=reference"))
    assert est.total_gb - without.total_gb == pytest.approx(held / GIB, rel=1e-9)
    rows = est.table().splitlines()
    row = next(r for r in rows if r.startswith("  dispatcher buffer (hybrid_ep cuda)"))
    assert row.endswith(f" {held / GIB:.1f} GiB  (dispatcher.backend)")
    total = next(r for r in rows if r.startswith("  total "))
    assert f"{est.total_gb:.1f} GiB of 80 GiB" in total and est.total_gb > without.total_gb
    # by region: every held region of the plan, in its order, under the buffer's row
    regions = [(b.name, b.nbytes) for b in want.buffers if b.registered and b.nbytes]
    assert [name for name, _ in regions] == ["flags+counts", "recv_meta", "recv_rows", "recv_scales", "partial_rows",
                                             "forward_rows", "nvshmem_heap"]
    start = rows.index(row) + 1
    assert [r.split()[0] for r in rows[start:start + len(regions)]] == [name for name, _ in regions]
    assert sum(n for _, n in regions) == held


def test_auto_runs_its_rules_pick_and_says_what_cuda_would_hold():
    est = memory.estimate(load("deepseek_v3"))
    picked = AUTO_RULES["several nodes"].picks
    assert est.dispatcher.backend == picked and est.dispatcher.why == "auto's pick for several nodes"
    cuda = memory.estimate(load("deepseek_v3", "dispatcher.backend=cuda"))
    if picked == "reference":
        assert est.dispatcher_gb == 0 and est.dispatcher.plan.registered_bytes == 0
        assert est.cuda_dispatcher.held_bytes == cuda.dispatcher.held_bytes
        assert est.table().splitlines()[-1] == ("  with dispatcher.backend cuda the buffer would hold (not in the "
                                                f"total)     {cuda.dispatcher.held_bytes / GIB:4.1f} GiB")
    one = memory.estimate(load("qwen3_30b_a3b"))
    assert one.dispatcher.why == "auto's pick for one node"
    assert one.dispatcher.backend == AUTO_RULES["one node"].picks


@pytest.mark.parametrize("name, sets, tokens, experts, world, per_node", [
    ("deepseek_v3", [], 4096, 320, 64, 8),  # balancer slots: 5 x 64
    ("deepseek_v3", ["balancer.interval=0"], 4096, 256, 64, 8),
    ("qwen3_235b_a22b", [], 2048, 160, 32, 8),  # TP 2 with sequence parallelism: half the sequence
    ("qwen3_30b_a3b", ["train.micro_batch_size=2", "train.global_batch_size=512"], 8192, 136, 8, 8),
    ("mixtral_8x22b", ["parallelism.etp=2"], 2048, 16, 16, 8),  # the ETP x EP group, ETP copies of each expert
    ("tiny_moe", [], 128, 8, 2, 2),  # seq 32 x micro-batch 4
    ("deepseek_v3", ["dispatcher.max_tokens_per_rank=5000"], 5000, 320, 64, 8),
    ("deepseek_v3", ["train.extra_args=[--hybrid-ep-ranks-per-node, '4']"], 4096, 320, 64, 4),
])
def test_the_buffer_config_follows_the_recipe(name, sets, tokens, experts, world, per_node):
    config = dispatcher_memory.buffer_config(load(name, *sets))
    assert (config.max_tokens_per_rank, config.num_experts, config.world_size, config.ranks_per_node) == \
        (tokens, experts, world, per_node)


def test_stages_without_moe_layers_hold_no_buffer_and_other_dispatchers_none():
    stages = memory.stage_estimates(load("deepseek_v3", "dispatcher.backend=cuda", "model.dense_layers=4"))
    held = stages[0].dispatcher.held_bytes
    assert stages[0].dispatcher_gb == 0  # stage 0: 4 dense layers
    assert "(no MoE layer on this stage)" in stages[0].table()
    assert all(s.dispatcher_gb == held / GIB for s in stages[1:])
    alltoall = memory.estimate(load("qwen3_30b_a3b", "dispatcher.type=alltoall", "balancer.interval=0"))
    assert alltoall.dispatcher is None and alltoall.dispatcher_gb == 0 and "dispatcher buffer" not in alltoall.table()


def test_a_group_that_does_not_fill_nodes_is_refused(capsys):
    code = cli.main([os.path.join(REPO, "recipes", "qwen3_30b_a3b"), "--set", "cluster.gpus_per_node=6",
                     "--set", "train.global_batch_size=480"])
    assert code == 2
    assert ("error: parallelism.ep: EP x ETP = 8 ranks per hybrid_ep group must be a multiple or a divisor of "
            "cluster.gpus_per_node 6") in capsys.readouterr().err


def test_hybrid_ep_flags_the_library_refuses_are_refused(capsys):
    code = cli.main([os.path.join(REPO, "recipes", "deepseek_v3"), "--set",
                     "train.extra_args=[--hybrid-ep-ranks-per-node, '3']"])
    assert code == 2
    assert ("error: extra_args: the hybrid_ep buffer of these --hybrid-ep-* flags: ranks_per_node (3) must divide "
            "the EP world size (64)") in capsys.readouterr().err


def test_the_reference_plan_is_the_backends_own():
    """library_plan asks ReferenceBackend.memory_plan for its per-call buffers (nothing held)."""
    config = dispatcher_memory.buffer_config(load("tiny_moe"))
    plan = dispatcher_memory.library_plan("reference", config)
    assert plan.backend == "reference" and plan.registered_bytes == 0 and plan.workspace_bytes > 0
    assert recipe_mod.load(os.path.join(REPO, "recipes", "tiny_moe"))["dispatcher.backend"] == "auto"


def test_docs_quote_the_dispatcher_rows_as_printed():
    """docs/slurm.md's deepseek_v3 block (cuda backend) and the line after its default total."""
    with open(os.path.join(REPO, "docs", "slurm.md")) as f:
        text = f.read()
    block = text[text.index("    dispatcher buffer (hybrid_ep cuda)"):]
    quoted = [line[2:] for line in block[:block.index("\n\n")].splitlines()]
    assert len(quoted) == 9 and all(line in memory.estimate(load("deepseek_v3", "dispatcher.backend=cuda"))
                                    .table().splitlines() for line in quoted), quoted
    cuda_line = next(line[2:] for line in text.splitlines() if "the buffer would hold (not in the total)" in line)
    assert cuda_line == memory.estimate(load("deepseek_v3")).table().splitlines()[-1]
