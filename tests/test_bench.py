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
from hybrid_ep.bench import cli, main, plot
from hybrid_ep.bench.plot import plot_per_rank, plot_vs_sms
from hybrid_ep.bench.report import config_line, format_table
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


def test_two_nodes_bf16(tmp_path, capsys, monkeypatch):
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

    # The plots on the matplotlib API before 3.5 (setup.py pins no version): set_xticks without
    # labels, no Figure(layout=...).
    import matplotlib.axes
    from matplotlib.figure import Figure

    set_xticks = matplotlib.axes.Axes.set_xticks

    def old_set_xticks(self, ticks, *args, **kwargs):
        if args or "labels" in kwargs:
            raise TypeError("set_xticks() takes 2 positional arguments (matplotlib < 3.5)")
        return set_xticks(self, ticks, **kwargs)

    class OldFigure(Figure):
        def __init__(self, *args, layout=None, **kwargs):
            if layout is not None:
                raise TypeError("unexpected keyword argument 'layout' (matplotlib < 3.5)")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks", old_set_xticks)
    monkeypatch.setattr(plot, "Figure", OldFigure)
    assert _is_png(plot_per_rank(doc, str(tmp_path / "old_per_rank.png")))
    assert _is_png(plot_vs_sms(swept, str(tmp_path / "old_sweep.png")))


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


def _launcher_must_not_start(monkeypatch):
    def never(spec):
        raise AssertionError("the benchmark started its ranks")

    monkeypatch.setattr(cli, "open_launcher", never)


@pytest.mark.parametrize("make", ["file", "under a file", "under a file, deeper"])
def test_bad_out_is_refused_before_the_run(tmp_path, capsys, monkeypatch, make):
    _launcher_must_not_start(monkeypatch)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = {"file": blocker, "under a file": blocker / "sub", "under a file, deeper": blocker / "a" / "b"}[make]
    assert main([*TINY, "-w", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "error: argument --out:" in err and "not a folder" in err and "Traceback" not in err
    assert blocker.read_text() == "x"


def test_out_folders_that_do_not_exist_yet_are_accepted(tmp_path):
    args = cli.build_parser().parse_args([*TINY, "-w", "2", "--out", str(tmp_path / "new" / "deeper")])
    spec, out = cli.resolve(args)
    assert out == str(tmp_path / "new" / "deeper") and not (tmp_path / "new").exists()  # made after the run
    cli.check_out_dir(str(tmp_path))  # an existing folder


@pytest.mark.parametrize("world_size", ["100000", str(cli.MAX_SPAWNED_RANKS + 1)])
def test_absurd_cpu_world_size_is_refused_before_spawning(tmp_path, capsys, monkeypatch, world_size):
    """Without torchrun every rank is a local process: -w 100000 would try to start 100000."""
    _launcher_must_not_start(monkeypatch)
    assert main([*TINY, "-w", world_size, "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert "error: argument --world-size:" in err and f"at most {cli.MAX_SPAWNED_RANKS}" in err
    assert "torchrun" in err and "Traceback" not in err
    assert not (tmp_path / "never").exists()
    # The bound is that of spawned ranks: up to it, the flags resolve as before.
    args = cli.build_parser().parse_args([*TINY, "-w", str(cli.MAX_SPAWNED_RANKS), "--out", str(tmp_path)])
    assert cli.resolve(args)[0].world_size == cli.MAX_SPAWNED_RANKS


def _doc(nodes=2, group_limit=1, iters=1):
    config = {"world_size": 2 * nodes, "ranks_per_node": 2, "nodes": nodes, "hidden": 256, "tokens_per_rank": 32,
              "topk": 2, "experts": 4 * nodes, "experts_per_rank": 2, "dtype": "bf16", "routing": "group-limited",
              "group_limit": group_limit, "seed": 0, "iters": iters, "warmup": 0}
    meta = {"config": config, "device": "CPU: test", "versions": {"torch": torch.__version__}, "date": "today"}
    return {"metadata": meta, "machine": {"hosts": ["h"], "logical_nodes": nodes > 1}, "label": "CPU numbers"}


def test_printouts_count_in_the_singular_for_one():
    assert "(<= 1 node per token)" in config_line(_doc(group_limit=1))
    assert "(<= 2 nodes per token)" in config_line(_doc(group_limit=2))
    line = config_line(_doc(nodes=1))
    assert "(1 node x 2 ranks)" in line and "logical" not in line
    assert "logical nodes on 1 host)" in config_line(_doc(nodes=2))
    run = {"backend": "reference", "num_sms": None, "sms_note": "no SM setting", "timing": "t", "ranks": [],
           "summary": {op: {"max_ms": 1.0, "mean_algbw_gbps": 1.0, "mean_nvlink_gbps": 0.0, "mean_rdma_gbps": 0.0}
                       for op in ("dispatch", "combine")}}
    assert "median of 1 timed call per rank after 0 warm-up" in format_table(_doc(iters=1), run)
    assert "median of 3 timed calls per rank" in format_table(_doc(iters=3), run)
