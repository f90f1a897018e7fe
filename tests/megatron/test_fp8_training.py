"""The tiny MoE GPT (4 CPU ranks, 2 nodes x 2) with fp8 on the wire: hybrid_ep's dispatcher
with the forward dispatch and the combine's backward in fp8 trains bit for bit as Megatron's
alltoall dispatcher whose experts quantize their input rows and their output's gradient with
the same quantizer; the run's JSON records its loss against fp32 rows per step."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("megatron.core")

from megatron_patches.local import demo  # noqa: E402

pytestmark = pytest.mark.megatron

CURVES = ["hybrid_ep_fp8", "alltoall_fp8", "hybrid_ep"]


def _train_and_check(pool, steps: int) -> dict:
    results = json.loads(json.dumps(demo.run(CURVES, steps=steps, world_size=4, ranks_per_node=2, pool=pool,
                                             echo=lambda line: None)))  # as the run's JSON holds it
    fp8, stock, plain = (results["curves"][name] for name in CURVES)
    losses = [r["loss"] for r in fp8]
    assert len(losses) == steps and losses == [r["loss"] for r in stock]  # bit for bit
    assert results["max_rel_loss_diff"] == 0.0
    # fp8 rows are not fp32 rows: the losses differ from the first step on, by little.
    diffs = results["fp8_rel_loss_diff"]
    assert diffs == [(a - b) / abs(b) for a, b in zip(losses, (r["loss"] for r in plain))]
    assert all(d != 0.0 and abs(d) < 1e-2 for d in diffs), diffs
    # Modelled bytes of the same routing's dispatch rows: fp8 with scales against fp32.
    for a, b in zip(fp8, stock):
        assert [a[f] for f in demo.BYTE_FIELDS] == [b[f] for f in demo.BYTE_FIELDS]
    assert fp8[0]["rdma_bytes"] > 0
    # Against fp32 rows: (128 + 4) / (128 * 4) of the bytes for the same routing; the routing
    # differs a little (the second layer's router sees the first's output of fp8 rows).
    ratio = sum(r["rdma_bytes"] for r in fp8) / sum(r["rdma_bytes"] for r in plain)
    assert abs(ratio - 132 / 512) < 0.02, ratio
    return results


def test_fp8_wire_trains_as_alltoall_with_quantizing_experts(pool_for):
    _train_and_check(pool_for(4), steps=2)


@pytest.mark.slow
def test_fp8_wire_trains_as_alltoall_with_quantizing_experts_for_longer(pool_for):
    results = _train_and_check(pool_for(4), steps=12)
    losses = [r["loss"] for r in results["curves"]["hybrid_ep_fp8"]]
    assert losses[-1] < losses[0] - 0.5  # and learns
