"""The MoE layer benchmark (hybrid_ep against Megatron's alltoall): its summary arithmetic, and
one short run on 4 gloo ranks where both dispatchers give the same layer output, the meter sees
each step's activations and gradients, and hybrid_ep's peak of memory is compared with
alltoall's plus the bytes its buffer holds."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from hybrid_ep.metadata import validate  # noqa: E402
from megatron_patches import layer_bench  # noqa: E402

pytestmark = pytest.mark.megatron


def _rank_memory(steps: dict, firsts: dict, held: int) -> dict:
    """One rank's memory as time_rank returns it."""
    return {**{f"tiny/{n}": {"step_peaks_bytes": steps[n], "first_step_peak_bytes": firsts[n], "output_bytes": 1024}
               for n in layer_bench.DISPATCHERS},
            "tiny": {"held_bytes": held, "held_by_region": {"rows": held} if held else {}}}


def test_summary_takes_medians_and_their_ratio():
    samples = {"tiny/hybrid_ep": [0.010, 0.030, 0.011], "tiny/alltoall": [0.010, 0.020, 0.040]}
    cpu = {"tiny/hybrid_ep": [0.004, 0.006, 0.005], "tiny/alltoall": [0.004, 0.004, 0.009]}
    memory = [_rank_memory({"hybrid_ep": [5000, 4900], "alltoall": [3000, 4000]},
                           {"hybrid_ep": 9000, "alltoall": 4000}, 2048),
              _rank_memory({"hybrid_ep": [7000, 7000], "alltoall": [5500, 5400]},
                           {"hybrid_ep": 7000, "alltoall": 5500}, 1024)]
    [row] = layer_bench.summarize(samples, ["tiny"], {"tiny": 0.0}, cpu, memory)
    assert row["median_ms"] == pytest.approx({"hybrid_ep": 11.0, "alltoall": 20.0})
    assert row["ratio"] == pytest.approx(0.55)
    assert row["paired_ratio"] == pytest.approx(1.0)  # per repeat: 1.0, 1.5, 0.275
    assert row["median_cpu_ms"] == pytest.approx({"hybrid_ep": 5.0, "alltoall": 4.0})
    assert row["cpu_ratio"] == pytest.approx(1.25)
    assert (row["hidden"], row["experts"], row["topk"], row["tokens_per_rank"]) == (128, 8, 2, 128)
    assert ("| tiny | 128 | 256 | 8 | 2 | 128 | 11.00 | 20.00 | 0.550 | 1.000 | 5.00 | 4.00 | 1.250 | 0.0e+00 |"
            in layer_bench.table([row]))
    assert row["peak_bytes"] == {"hybrid_ep": [5000, 7000], "alltoall": [4000, 5500]}  # the largest step per rank
    assert row["step_peaks_bytes"]["alltoall"] == [[3000, 4000], [5500, 5400]]
    assert row["held_bytes"] == [2048, 1024] and row["held_by_region"] == [{"rows": 2048}, {"rows": 1024}]
    # Per rank: 5000 - 4000 - 2048 = -1048 and 7000 - 5500 - 1024 = 476 (the worst rank is over).
    assert row["excess_bytes"] == 476
    assert row["first_step_excess_bytes"] == 9000 - 4000 - 2048
    assert "| tiny | 6.8 | 5.4 | 2.0 | 0.5 | 8.8 | 5.4 | 2.9 | 1.0 |" in layer_bench.memory_table([row])


def test_memory_steps_below_one_is_refused_with_the_flag_named(capsys):
    with pytest.raises(SystemExit) as exit_info:
        layer_bench.main(["--memory-steps", "0"])
    assert exit_info.value.code == 2
    assert "--memory-steps must be >= 1, got 0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def short_run(pool_for):
    """Two repeats of the tiny shape on 4 gloo ranks as 2 nodes of 2, no warm-up beyond the meter's first step,
    then two metered steps."""
    return layer_bench.run(["tiny"], repeats=2, warmup=0, world_size=4, ranks_per_node=2, pool=pool_for(4),
                           memory_steps=2)


def test_short_run_times_both_dispatchers_on_the_same_routing(short_run, tmp_path):
    doc = short_run
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


def _step_bytes_at_least(shape: str, world_size: int) -> int:
    """Bytes a forward + backward leaves alive on a rank at its end, all created in it: the layer
    output, the input's gradient, and the gradients of the router and the rank's experts (fp32)."""
    H, F, E, _, seq, batch = layer_bench.SHAPES[shape]
    activation = seq * batch * H * 4
    return 2 * activation + (E * H + E // world_size * 2 * F * H) * 4


def test_the_meter_sees_each_steps_activations_and_gradients(short_run):
    [row] = short_run["rows"]
    floor = _step_bytes_at_least("tiny", 4)
    for name in layer_bench.DISPATCHERS:
        steps = row["step_peaks_bytes"][name]
        assert len(steps) == 4 and all(len(s) == 2 for s in steps)
        for peaks in (row["first_step_peak_bytes"][name], *zip(*steps)):
            assert len(peaks) == 4 and all(p >= floor for p in peaks), (name, peaks, floor)
        # The output is the tokens' hidden rows (hybrid_ep's combine keeps one more row: 128 + 1).
        assert all(128 * 128 * 4 <= b <= 129 * 128 * 4 for b in row["output_bytes"][name])
    # On the CPU the reference backend holds its two gloo message buffers, kept across calls,
    # and nothing else: memory_plan()'s bound on them, the same on every rank.
    held = row["held_bytes"][0]
    assert held > 0 and row["held_bytes"] == [held] * 4 and row["held_by_region"] == [{"gloo_messages": held}] * 4


@pytest.mark.parametrize("field", ["peak_bytes", "first_step_peak_bytes"])
def test_hybrid_ep_peaks_at_most_alltoalls_plus_the_held_bytes(short_run, field):
    [row] = short_run["rows"]
    peaks, held = row[field], row["held_bytes"]  # peaks are real: test_the_meter_sees_each_steps_...
    over = [h - (a + b) for h, a, b in zip(peaks["hybrid_ep"], peaks["alltoall"], held)]
    assert max(over) <= 0, f"{field}: hybrid_ep's peak exceeds alltoall's + held bytes by {over} bytes per rank"
    # not loose by the whole plan: the gloo buffers are what the first step adds (measured
    # 2026-11-26: 370 KiB of them in a 413 KiB excess over alltoall's peak at this shape)
    first = [h - a for h, a in zip(short_run["rows"][0]["first_step_peak_bytes"]["hybrid_ep"],
                                   short_run["rows"][0]["first_step_peak_bytes"]["alltoall"])]
    assert max(first) > 0
