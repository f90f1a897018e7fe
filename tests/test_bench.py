"""`python -m hybrid_ep.bench` end to end on CPU (gloo): table, results.json, PNG, bad flags."""

from __future__ import annotations

import copy
import json
import os
import re
import subprocess
import sys

import pytest
import torch

import hybrid_ep
from hybrid_ep.bench import main
from hybrid_ep.bench.plot import plot_vs_sms
from hybrid_ep.metadata import validate

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
TINY = ["--hidden", "256", "--tokens", "32", "--topk", "4", "--warmup", "1", "--iters", "3", "--device", "cpu"]


def _is_png(path) -> bool:
    with open(path, "rb") as f:
        return f.read(8) == PNG_SIGNATURE


def _run(tmp_path, capsys, name, *flags):
    out = tmp_path / name
    assert main([*TINY, *flags, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    doc = json.loads((out / "results.json").read_text())
    return out, printed, doc


def _check_ranks(doc, printed, world_size, ranks_per_node):
    for run in doc["runs"]:
        assert [r["rank"] for r in run["ranks"]] == list(range(world_size))
        for r in run["ranks"]:
            assert r["node"] == r["rank"] // ranks_per_node
            for op in ("dispatch", "combine"):
                m = r[op]
                assert m["median_ms"] > 0 and len(m["samples_ms"]) == doc["metadata"]["config"]["iters"]
                assert m["algorithm_bytes"] > 0 and m["algbw_gbps"] > 0
                assert m["algbw_gbps"] == pytest.approx(m["algorithm_bytes"] / (m["median_ms"] * 1e-3) / 1e9)
                assert m["nvlink_gbps"] == pytest.approx(m["nvlink_bytes"] / (m["median_ms"] * 1e-3) / 1e9)
                assert m["rdma_gbps"] == pytest.approx(m["rdma_bytes"] / (m["median_ms"] * 1e-3) / 1e9)
                if doc["metadata"]["config"]["nodes"] > 1:
                    assert m["rdma_bytes"] > 0 and m["rdma_gbps"] > 0
                else:
                    assert m["rdma_bytes"] == 0 and m["rdma_gbps"] == 0
                if ranks_per_node > 1:
                    assert m["nvlink_bytes"] > 0 and m["nvlink_gbps"] > 0
        summary = run["summary"]["dispatch"]
        assert summary["max_ms"] == max(r["dispatch"]["median_ms"] for r in run["ranks"])
    for rank in range(world_size):
        assert re.search(rf"^\s*{rank}\s+{rank // ranks_per_node}\s+\d+\.\d+", printed, re.M), printed
    assert "max/mean" in printed
    assert "CPU numbers" in printed and "CPU numbers" in doc["label"]


def test_two_nodes_bf16(tmp_path, capsys):
    out, printed, doc = _run(tmp_path, capsys, "two-nodes", "-w", "4", "--ranks-per-node", "2",
                             "--backends", "reference")
    c = doc["metadata"]["config"]
    shape = (c["world_size"], c["nodes"], c["hidden"], c["tokens_per_rank"], c["topk"], c["experts"])
    assert shape == (4, 2, 256, 32, 4, 8)
    assert (c["dtype"], c["routing"], c["transport"]) == ("bf16", "uniform", "gloo")
    meta = validate(doc["metadata"])
    assert meta["tool"] == "hybrid-ep-bench" and meta["device"].startswith("CPU: ") and meta["backends"] == ["reference"]
    assert meta["versions"]["torch"] == torch.__version__ and meta["versions"]["hybrid_ep"] == hybrid_ep.__version__
    assert meta["units"]["algbw_gbps"] == "GB/s (1e9 bytes/s)" and meta["units"]["median_ms"].startswith("ms")
    assert [r["backend"] for r in doc["runs"]] == ["reference"]
    _check_ranks(doc, printed, 4, 2)
    assert _is_png(out / "bandwidth_per_rank.png")
    assert str(out / "results.json") in printed and str(out / "bandwidth_per_rank.png") in printed

    # The SM-sweep plot, drawn from this run's numbers relabelled as a swept backend.
    swept = copy.deepcopy(doc)
    for sms in (8, 16):
        run = copy.deepcopy(doc["runs"][0]) | {"backend": "cuda", "num_sms": sms}
        swept["runs"].append(run)
    assert _is_png(plot_vs_sms(swept, str(tmp_path / "sweep.png")))


def test_one_node_fp8_sms_ignored_by_reference(tmp_path, capsys):
    out, printed, doc = _run(tmp_path, capsys, "one-node", "-w", "2", "--dtype", "fp8", "--sms", "8,16")
    assert doc["metadata"]["config"]["nodes"] == 1 and doc["metadata"]["config"]["sms"] == [8, 16]
    run = doc["runs"][0]
    assert run["backend"] == "reference" and run["num_sms"] is None and "ignored" in run["sms_note"]
    d, c = run["ranks"][0]["dispatch"], run["ranks"][0]["combine"]
    assert d["row_bytes"] == 256 + 2 * 4  # fp8 values plus one fp32 scale per 128
    assert c["row_bytes"] == 256 * 2  # combine in bf16
    _check_ranks(doc, printed, 2, 2)
    assert _is_png(out / "bandwidth_per_rank.png")
    assert not (out / "bandwidth_vs_sms.png").exists()  # no backend with an SM setting ran


@pytest.mark.parametrize("flags, flag", [
    (["-w", "4", "--experts", "6"], "--experts"),
    (["-w", "4", "--ranks-per-node", "3"], "--ranks-per-node"),
    (["--dtype", "fp8", "--hidden", "100"], "--hidden"),
    (["--topk", "0"], "--topk"),
    (["--routing", "bogus"], "--routing"),
    (["--backends", "nccl"], "--backends"),
])
def test_bad_arguments(tmp_path, capsys, flags, flag):
    code = main([*flags, "--device", "cpu", "--out", str(tmp_path / "never")])
    err = capsys.readouterr().err
    assert code != 0
    assert flag in err and "error" in err
    assert not (tmp_path / "never").exists()


def test_cli_module_runs_as_a_script(tmp_path):
    """`python -m hybrid_ep.bench.cli` is the CLI too, not a module that exits 0 having done nothing."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "hybrid_ep.bench.cli", "--topk", "0", "--device", "cpu",
                           "--out", str(tmp_path / "never")], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode != 0 and "--topk" in done.stderr
    assert not (tmp_path / "never").exists()
