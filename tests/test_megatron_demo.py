"""The tiny MoE GPT demo, a few steps on 4 CPU ranks (2 nodes x 2): hybrid_ep and alltoall
train from the same weights on the same data, in alternation, and give the same loss curve."""

from __future__ import annotations

import math
import statistics

import pytest

pytest.importorskip("megatron.core")

from megatron_patches.local import demo  # noqa: E402

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
        # the hierarchy crosses RDMA once per (token, remote node), a flat all-to-all once per
        # (token, remote rank)
        assert 0 < rec["rdma_bytes"] < rec["flat_rdma_bytes"]
    # Same routing for both dispatchers, hence the same load statistics and modelled bytes
    # (the alltoall rows said "bytes n/a" before).
    assert [r["imbalance"] for r in ours] == [r["imbalance"] for r in stock]
    fields = demo.BYTE_FIELDS
    assert [[r[f] for f in fields] for r in ours] == [[r[f] for f in fields] for r in stock]
    # One summary: the losses' agreement and the modelled bytes of the hierarchy against flat.
    summary = results["summary"]
    assert summary["compared"] == ["hybrid_ep", "alltoall"] and summary["steps"] == STEPS
    assert summary["max_rel_loss_diff"] == results["max_rel_loss_diff"]
    assert {f: summary[f] for f in fields} == {f: sum(r[f] for r in ours) for f in fields}
    text = demo.summary_lines(summary)
    assert text[0] == "summary:"
    assert text[1].startswith("  losses: hybrid_ep and alltoall agree within a max relative difference of ")
    assert "traffic model, not measured" in text[2]
    assert text[3].startswith("    hierarchical scheme   NVLink ") and text[4].startswith("    flat all-to-all ")
    saved = 1 - summary["rdma_bytes"] / summary["flat_rdma_bytes"]
    assert text[5].startswith(f"    the hierarchy sends {saved:.0%} fewer RDMA bytes")
    # Speed, from the steps both models trained in alternation (steps 3 on).
    assert summary["speed_steps"] == [demo.SPEED_FROM_STEP, STEPS]
    ours_tps = [r["tokens_per_s"] for r in ours[demo.SPEED_FROM_STEP - 1:]]
    stock_tps = [r["tokens_per_s"] for r in stock[demo.SPEED_FROM_STEP - 1:]]
    assert summary["median_tokens_per_s"] == [statistics.median(ours_tps), statistics.median(stock_tps)]
    assert summary["tokens_per_s_ratio"] == pytest.approx(statistics.median(ours_tps) / statistics.median(stock_tps))
    assert summary["tokens_per_s_step_ratio"] == pytest.approx(
        statistics.median(a / b for a, b in zip(ours_tps, stock_tps)))
    assert text[6].startswith(f"  tokens/s, median over steps {demo.SPEED_FROM_STEP}-{STEPS} (trained in alternation")
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


def test_speed_pairs_the_steps_of_two_curves():
    """Ratio of medians and median of per-step ratios over steps 3 on (all steps when fewer)."""
    def curve(tps):
        return [{"step": i + 1, "tokens_per_s": t} for i, t in enumerate(tps)]

    got = demo.speed(curve([1, 1, 90, 100, 120]), curve([10, 10, 100, 80, 100]))
    assert got["speed_steps"] == [3, 5] and got["median_tokens_per_s"] == [100, 100]
    assert got["tokens_per_s_ratio"] == 1.0
    assert got["tokens_per_s_step_ratio"] == pytest.approx(1.2)  # median of 0.9, 1.25, 1.2
    assert demo.speed(curve([2, 4]), curve([4, 4]))["speed_steps"] == [1, 2]


def test_dispatchers_must_differ():
    with pytest.raises(ValueError, match="dispatchers must differ"):
        demo.run(["alltoall", "alltoall"], steps=1)


def test_modelled_bytes_follow_the_traffic_model():
    """The demo's per-step bytes, from each rank's routing_map, equal hybrid_ep.traffic's for
    the same routing given as top-k ids."""
    import torch

    from hybrid_ep.config import BufferConfig
    from hybrid_ep.traffic import routing_row_counts

    config = BufferConfig(demo.HIDDEN, 64, demo.EXPERTS, 4, 2).validate()
    g = torch.Generator().manual_seed(3)
    topk = [torch.stack([torch.randperm(demo.EXPERTS, generator=g)[:demo.TOPK] for _ in range(64)])
            for _ in range(4)]
    maps = [torch.zeros(64, demo.EXPERTS, dtype=torch.bool).scatter_(1, idx, True) for idx in topk]
    counts = torch.stack([demo.routing_counts(m, config) for m in maps])[:, None]  # one layer
    got = demo.modelled_dispatch_bytes(counts, config, row_bytes=512)
    want = routing_row_counts(topk, config)
    assert got == {"nvlink_bytes": int(want.dispatch_nvlink.sum()) * 512,
                   "rdma_bytes": int(want.dispatch_rdma.sum()) * 512,
                   "flat_nvlink_bytes": int(want.flat_dispatch_nvlink.sum()) * 512,
                   "flat_rdma_bytes": int(want.flat_dispatch_rdma.sum()) * 512}
    assert got["rdma_bytes"] < got["flat_rdma_bytes"]
