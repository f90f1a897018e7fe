"""The tiny MoE GPT demo, a few steps on 4 CPU ranks (2 nodes x 2): hybrid_ep and alltoall
train from the same weights on the same data, in alternation, and give the same loss curve;
each step's line comes as the step ends; the run writes its JSON and a plot of both curves;
a bad argument is refused within seconds, before torch is loaded."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import time

import pytest

pytest.importorskip("megatron.core")

from helpers import REPO, checkout_env  # noqa: E402
from megatron_patches.local import demo, demo_ranks  # noqa: E402

pytestmark = pytest.mark.megatron

STEPS = 4


@pytest.fixture(scope="module")
def trained(pool_for):
    """(results, [(time echoed, line)]) of one run of both dispatchers."""
    lines = []
    results = demo.run(["hybrid_ep", "alltoall"], steps=STEPS, world_size=4, ranks_per_node=2,
                       pool=pool_for(4), echo=lambda line: lines.append((time.time(), line)))
    return results, lines


def test_demo_hybrid_ep_matches_alltoall(trained):
    results, timed = trained
    lines = [line for _, line in timed]
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
    assert text[7].startswith("    hybrid_ep / alltoall: ratio of medians ")
    assert max(len(line) for line in text + lines) < 200
    # Where it ran and what the columns mean come first, then one line per step.
    assert lines[0] == demo.where_line("gloo", 4, results["metadata"]["device"], "reference")
    assert lines[0].startswith("running on CPU: ") and "4 processes over torch.distributed gloo, no GPU" in lines[0]
    assert lines[0].endswith("; hybrid_ep backend: reference")
    assert tuple(lines[1:3]) == demo.LEGEND and "(max - mean) / mean of tokens per expert" in lines[1]
    steps = lines[3:]
    assert len(steps) == 2 * STEPS and all("loss" in line and "modelled dispatch bytes" in line for line in steps)
    # in the order they ran: step 1 of each, then step 2 of each, the order rotating
    assert steps == [demo.format_record(name, results["curves"][name][step])
                     for step in range(STEPS) for name in (["hybrid_ep", "alltoall"] if step % 2 == 0
                                                            else ["alltoall", "hybrid_ep"])]
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
    counts = torch.stack([demo_ranks.routing_counts(m, config) for m in maps])[:, None]  # one layer
    got = demo_ranks.modelled_dispatch_bytes(counts, config, row_bytes=512)
    want = routing_row_counts(topk, config)
    assert got == {"nvlink_bytes": int(want.dispatch_nvlink.sum()) * 512,
                   "rdma_bytes": int(want.dispatch_rdma.sum()) * 512,
                   "flat_nvlink_bytes": int(want.flat_dispatch_nvlink.sum()) * 512,
                   "flat_rdma_bytes": int(want.flat_dispatch_rdma.sum()) * 512}
    assert got["rdma_bytes"] < got["flat_rdma_bytes"]


def test_step_lines_come_as_the_steps_end(trained):
    """Each step's line is echoed once its step has ended, and the first ones before the last
    step has ended (not all at the end of the run)."""
    results, timed = trained
    steps = [(t, line) for t, line in timed if " step " in line]
    records = {demo.format_record(name, rec): rec for name, recs in results["curves"].items() for rec in recs}
    assert len(steps) == len(records) == 2 * STEPS
    assert all(t >= records[line]["ended_at"] for t, line in steps)
    last_end = max(rec["ended_at"] for rec in records.values())
    assert steps[0][0] < last_end and steps[1][0] < last_end


def test_the_plot_shows_both_curves(trained, tmp_path):
    from matplotlib.image import imread

    results, _ = trained
    path = demo.plot(results, str(tmp_path / "moe_train.png"))
    image = imread(path)
    assert image.shape[0] > 400 and image.shape[1] > 1000  # two panels side by side


def test_main_writes_the_json_and_the_plot_beside_it(trained, tmp_path, monkeypatch, capsys):
    results, _ = trained
    monkeypatch.setattr(demo, "run", lambda *args, **kwargs: results)
    out = tmp_path / "demo"
    assert demo.main(["--steps", str(STEPS), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"wrote {out / 'moe_train.json'}\nwrote {out / 'moe_train.png'}\n" in printed
    assert json.loads((out / "moe_train.json").read_text())["curves"].keys() == {"hybrid_ep", "alltoall"}
    assert (out / "moe_train.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("steps, shown", [("0", "0"), ("-3", "-3"), ("abc", "'abc'"), ("2.5", "'2.5'")])
def test_bad_steps_exit_2_within_seconds_naming_the_flag(steps, shown):
    """As scripts/demo.sh runs it: a fresh interpreter, refused before torch is imported."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_patches.local.demo", "--world-size", "4",
                           "--ranks-per-node", "2", "--steps", steps, "--out", "results/demo"],
                          capture_output=True, text=True, timeout=60, cwd=REPO, env=checkout_env())
    elapsed = time.monotonic() - started
    assert proc.returncode == 2 and elapsed < 5, (elapsed, proc.stderr)
    assert proc.stderr.splitlines()[-1] == (f"python -m megatron_patches.local.demo: error: argument --steps: must "
                                            f"be an integer >= 1, got {shown}")
    assert "Traceback" not in proc.stderr


def test_a_near_miss_flag_is_named(capsys):
    with pytest.raises(SystemExit) as exit_:
        demo.build_parser().parse_args(["--step", "3", "--wrld-size=2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "error: unrecognized arguments: --step 3 --wrld-size=2 (did you mean --steps for --step, --world-size for "
        "--wrld-size?)")
