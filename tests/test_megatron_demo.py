"""The tiny MoE GPT demo, a few steps on 4 CPU ranks (2 nodes x 2): hybrid_ep and alltoall
train from the same weights on the same data and give the same loss curve."""

from __future__ import annotations

import math

import pytest

pytest.importorskip("megatron.core")

from megatron_patches import demo  # noqa: E402

pytestmark = pytest.mark.megatron

STEPS = 4


def test_demo_hybrid_ep_matches_alltoall(pool_for):
    lines = []
    results = demo.run(["hybrid_ep", "alltoall"], steps=STEPS, world_size=4, ranks_per_node=2,
                       pool=pool_for(4), echo=lines.append)
    ours, stock = results["curves"]["hybrid_ep"], results["curves"]["alltoall"]
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))
    losses = [r["loss"] for r in ours]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(demo.VOCAB)) < 0.5  # starts near uniform over the vocabulary
    assert losses[-1] < losses[0]  # and learns
    assert results["max_rel_loss_diff"] <= 1e-4
    for rec in ours:
        assert len(rec["imbalance"]) == demo.LAYERS and all(v >= 0 for v in rec["imbalance"])
        assert rec["tokens_per_s"] > 0
        # 2 nodes: some rows cross RDMA, some stay on NVLink.
        assert rec["nvlink_bytes"] > 0 and rec["rdma_bytes"] > 0
    assert all(r["nvlink_bytes"] is None for r in stock)
    # Same routing for both dispatchers, hence the same load statistics.
    assert [r["imbalance"] for r in ours] == [r["imbalance"] for r in stock]
    # Where it ran and what the columns mean come first, then one line per step.
    assert lines[0] == demo.where_line("gloo", 4, results["metadata"]["device"], "reference")
    assert lines[0].startswith("running on CPU: ") and "4 processes over torch.distributed gloo, no GPU" in lines[0]
    assert lines[0].endswith("; hybrid_ep backend: reference")
    assert lines[1] == demo.LEGEND and "(max - mean) / mean of tokens per expert" in lines[1]
    assert len(lines) == 2 + 2 * STEPS and "loss" in lines[2] and "modelled dispatch bytes" in lines[2]
    meta = results["metadata"]
    assert meta["backends"] == ["reference"] and meta["device"].startswith("CPU: ")
    assert meta["config"]["transport"] == "gloo" and meta["config"]["nodes"] == 2
    assert set(meta["units"]) >= {"loss", "tokens_per_s", "imbalance", "nvlink_bytes", "rdma_bytes"}
