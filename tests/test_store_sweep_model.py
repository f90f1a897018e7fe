"""The store plans' sweep (python -m hybrid_ep.bench.store_sweep) on the CPU model at a small shape.

On a GPU it times every store plan of the direct dispatch at each store-queue depth and SM
count in one call; here the same command runs the kernels on the CPU model, with the timing
model's table for the times, and must write one JSON and one plot with every point, each
plan's rows equal to the first plan's.
"""

from __future__ import annotations

import json
import os

import pytest

from helpers import REPO
from hybrid_ep.backends.cuda import launch
from hybrid_ep.bench import store_sweep

pytestmark = pytest.mark.model

H100 = os.path.join(REPO, "tools", "timing", "h100.json")
SMALL = ["--world-size", "2", "--hidden", "512", "--tokens", "33", "--experts", "4", "--topk", "2",
         "--store-groups", "0", "1", "--sms", "1"]


def test_the_sweep_times_every_plan_on_the_model_and_writes_json_and_plot(tmp_path, capsys):
    assert store_sweep.main(["--out", str(tmp_path), "--costs", H100, *SMALL]) == 0
    doc = json.loads((tmp_path / "store_sweep.json").read_text())
    assert doc["outputs_match"] is True
    assert doc["metadata"]["config"]["timed_by"] == "the timing model's prediction"
    points = doc["points"]
    assert sorted((p["plan"], p["store_groups_requested"]) for p in points) == sorted(
        (plan, g) for plan in launch.STORE_PLANS for g in (0, 1))
    for p in points:
        assert p["kernel_ms"] > 0 and p["count_ms"] > 0 and p["dest_gbps_per_sm"] > 0
        assert p["dispatch_ms"] == pytest.approx(p["kernel_ms"] + p["count_ms"])
        assert p["store_groups"] <= p["store_groups_requested"] and p["stages"] % launch.DIRECT_STORE_THREADS == 0
    assert (tmp_path / "store_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr()
    assert "GB/s/SM" in out.out and "[store_sweep] single, 1 store groups" in out.err  # progress per point


def test_a_plan_that_moves_other_rows_stops_the_sweep(tmp_path, monkeypatch):
    """The check between plans can fail: the second plan's outputs, changed by one byte."""
    calls = []
    real = store_sweep._outputs

    def outputs(results):
        got = real(results)
        calls.append(1)
        if len(calls) == 2:
            got[0] = got[0].clone()
            got[0].view(-1)[0] ^= 1
        return got

    monkeypatch.setattr(store_sweep, "_outputs", outputs)
    with pytest.raises(RuntimeError, match=r"store plan alternate with 1 store groups dispatched other rows than "
                                           r"alternate with 0"):
        store_sweep.main(["--out", str(tmp_path), *SMALL])


@pytest.mark.parametrize("flags,words", [
    (["--store-groups", "9"], "--store-groups: each must be in [0, 7]"),
    (["--sms", "0"], "--sms: each must be >= 1"),
    (["--experts", "6", "--world-size", "4"], "--experts (6) must be a multiple of --world-size (4)"),
    (["--plans", "widest"], "argument --plans: invalid choice: 'widest'"),
])
def test_bad_flags_are_refused_naming_the_flag(tmp_path, capsys, flags, words):
    with pytest.raises(SystemExit) as exc:
        store_sweep.parse_args(["--out", str(tmp_path), *flags])
    assert exc.value.code == 2
    assert words in capsys.readouterr().err
