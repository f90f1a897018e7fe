"""The MoE layer benchmark (hybrid_ep against Megatron's alltoall): its summary arithmetic, and
one short run on 4 gloo ranks where both dispatchers give the same layer output."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from hybrid_ep.metadata import validate  # noqa: E402
from megatron_patches import layer_bench  # noqa: E402

pytestmark = pytest.mark.megatron


def test_summary_takes_medians_and_their_ratio():
    samples = {"tiny/hybrid_ep": [0.010, 0.030, 0.011], "tiny/alltoall": [0.010, 0.020, 0.040]}
    cpu = {"tiny/hybrid_ep": [0.004, 0.006, 0.005], "tiny/alltoall": [0.004, 0.004, 0.009]}
    [row] = layer_bench.summarize(samples, ["tiny"], {"tiny": 0.0}, cpu)
    assert row["median_ms"] == pytest.approx({"hybrid_ep": 11.0, "alltoall": 20.0})
    assert row["ratio"] == pytest.approx(0.55)
    assert row["paired_ratio"] == pytest.approx(1.0)  # per repeat: 1.0, 1.5, 0.275
    assert row["median_cpu_ms"] == pytest.approx({"hybrid_ep": 5.0, "alltoall": 4.0})
    assert row["cpu_ratio"] == pytest.approx(1.25)
    assert (row["hidden"], row["experts"], row["topk"], row["tokens_per_rank"]) == (128, 8, 2, 128)
    assert ("| tiny | 128 | 256 | 8 | 2 | 128 | 11.00 | 20.00 | 0.550 | 1.000 | 5.00 | 4.00 | 1.250 | 0.0e+00 |"
            in layer_bench.table([row]))


def test_short_run_times_both_dispatchers_on_the_same_routing(pool_for, tmp_path):
    doc = layer_bench.run(["tiny"], repeats=2, warmup=0, world_size=4, ranks_per_node=2, pool=pool_for(4))
    validate(doc["metadata"])
    assert doc["metadata"]["backends"] == ["reference"] and doc["metadata"]["device"].startswith("CPU: ")
    assert doc["metadata"]["config"]["nodes"] == 2
    [row] = doc["rows"]
    assert row["max_abs_diff"] < 1e-5  # same weights, inputs and routing
    for name in layer_bench.DISPATCHERS:
        assert len(row["samples_ms"][name]) == 2 and all(t > 0 for t in row["samples_ms"][name])
        assert len(row["cpu_samples_ms"][name]) == 2 and all(t > 0 for t in row["cpu_samples_ms"][name])
    layer_bench.plot(doc, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 0
