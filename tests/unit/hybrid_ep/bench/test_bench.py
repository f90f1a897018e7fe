"""`python -m hybrid_ep.bench` end to end on CPU (gloo): table, results.json, PNG, bad flags."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch

import hybrid_ep
from helpers import checkout_env, numbers_without_units
from hybrid_ep.bench import cli, main, plot
from hybrid_ep.bench.plot import plot_per_rank, plot_vs_sms
from hybrid_ep.bench.report import config_line, format_table
from hybrid_ep.metadata import validate
from hybrid_ep.spawn import pool_timeout_s
from hybrid_ep.synthetic import random_weights

pytestmark = pytest.mark.unit

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
    assert meta["tool"] == "hybrid-ep-bench" and meta["device"].startswith("CPU: ")
    assert meta["backends"] == ["reference"]
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
    import matplotlib.figure
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
    monkeypatch.setattr(matplotlib.figure, "Figure", OldFigure)  # the class hybrid_ep.figures makes
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
    env = checkout_env()
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


# --------------------------------------------------------------------------- review mends


def test_results_json_gives_every_number_a_unit(tmp_path, capsys):
    _, _, doc = _run(tmp_path, capsys, "units", "-w", "2", "--backends", "reference")
    assert numbers_without_units(doc) == set()
    assert "rows" in doc["metadata"]["units"]  # the rows each rank receives


def _torchrun_env(monkeypatch, rank: int, world_size: int = 2) -> None:
    for key, value in (("RANK", rank), ("LOCAL_RANK", rank), ("WORLD_SIZE", world_size),
                       ("LOCAL_WORLD_SIZE", world_size), ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", 29599)):
        monkeypatch.setenv(key, str(value))


@pytest.mark.parametrize("rank", [0, 1])
def test_every_launched_rank_refuses_a_bad_out_before_the_group_forms(tmp_path, capsys, monkeypatch, rank):
    """Under srun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT and no torchrun agent) a rank that
    did not check --out went on into init_process_group and waited for rank 0, which had exited."""
    _launcher_must_not_start(monkeypatch)
    _torchrun_env(monkeypatch, rank)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    assert main([*TINY, "--out", str(blocker)]) == 2
    err = capsys.readouterr().err
    assert ("error: argument --out:" in err) == (rank == 0)  # one message: rank 0's
    assert "Traceback" not in err and blocker.read_text() == "x"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # the full tier (scripts/test.sh --full): four launcher processes
def test_srun_style_ranks_all_exit_on_a_bad_out(tmp_path):
    """Two ranks started as srun starts them, with an --out that is a file: both exit 2 (no rank
    is left waiting in init_process_group for a rank that refused the flags)."""
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    base = checkout_env(WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([sys.executable, "-m", "hybrid_ep.bench", *TINY, "--out", str(blocker)],
                              env=base | {"RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in range(2)]
    try:
        # Two processes that import torch and exit: seconds, unless the machine is loaded (the
        # pool's start-up limit, HYBRID_EP_POOL_TIMEOUT_S, is what such a machine is given).
        results = [p.communicate(timeout=pool_timeout_s()) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [2, 2], results
    assert "error: argument --out:" in results[0][1]
    assert blocker.read_text() == "x"


@pytest.mark.parametrize("flags, flag", [
    (["--emulate-nodes", "2"], "--emulate-nodes"),  # without --emulate: a plain one-node bench ran
    (["--reference-iters", "5"], "--reference-iters"),
    (["--reference-iters", "0"], "--reference-iters"),
    (["--emulate", "4", "-w", "4"], "--world-size"),
    (["--emulate", "4", "--world-size", "4"], "--world-size"),
    (["--emulate", "4", "--ranks-per-node", "2"], "--ranks-per-node"),
    (["--emulate", "4", "--backends", "cuda"], "--backends"),
    (["--emulate", "4", "--device", "cuda"], "--device"),
    (["--emulate", "4", "--device", "auto"], "--device"),
])
def test_flags_the_run_would_ignore_are_refused(tmp_path, capsys, monkeypatch, flags, flag):
    from hybrid_ep.bench import emulated

    _launcher_must_not_start(monkeypatch)
    monkeypatch.setattr(emulated, "run", lambda args: pytest.fail("the emulation ran"))
    out = tmp_path / "never"
    assert main([*flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"error: argument {flag}:" in err and "--emulate" in err.splitlines()[-1] and "Traceback" not in err
    assert not out.exists()


@pytest.mark.parametrize("emulate", [[], ["--emulate", "2"]])
def test_an_empty_out_is_refused(tmp_path, capsys, monkeypatch, emulate):
    """--out '' named no folder and the results went to results/bench-<timestamp>."""
    from hybrid_ep.bench import emulated

    _launcher_must_not_start(monkeypatch)
    monkeypatch.setattr(emulated, "run", lambda args: pytest.fail("the emulation ran"))
    monkeypatch.chdir(tmp_path)
    flags = [*TINY, "-w", "2"] if not emulate else emulate
    assert main([*flags, "--out", ""]) == 2
    err = capsys.readouterr().err
    assert "error: argument --out: the path is empty" in err and "Traceback" not in err
    assert not (tmp_path / "results").exists()


def test_zero_experts_is_named_before_the_topk_it_implies(tmp_path, capsys, monkeypatch):
    _launcher_must_not_start(monkeypatch)
    assert main(["--device", "cpu", "--experts", "0", "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert "error: argument --experts: must be >= 1, got 0" in err and "--topk" not in err.splitlines()[-1]


@pytest.mark.parametrize("seed", [str(2**64), str(20000000000000 * 10**6), "-1"])
def test_seed_outside_the_generator_range_is_refused_before_the_run(tmp_path, capsys, monkeypatch, seed):
    _launcher_must_not_start(monkeypatch)
    assert main([*TINY, "-w", "2", "--seed", seed, "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert "error: argument --seed: must be in [0, 2^64 - 1]" in err and "Traceback" not in err


@pytest.mark.parametrize("seed", [20000000000000, 2**63, 2**64 - 1])
def test_every_seed_in_range_makes_the_inputs_of_every_rank(seed):
    """A rank's own generator is seeded with seed x 1000003 + rank + 1, folded into 64 bits: it
    overflowed for --seed 20000000000000 on every rank."""
    from hybrid_ep.bench.inputs import make_inputs
    from hybrid_ep.bench.spec import BenchSpec

    spec = BenchSpec(world_size=2, ranks_per_node=2, hidden=64, tokens=4, topk=2, experts=4, dtype="bf16",
                     routing="uniform", sms=(), backends=(), warmup=0, iters=1, seed=seed, device="cpu").validate()
    inputs = [make_inputs(spec, rank, torch.device("cpu")) for rank in range(2)]
    assert all(x.shape == (4, 64) and idx.shape == (4, 2) for x, _, idx, _ in inputs)
    assert not torch.equal(inputs[0][0], inputs[1][0])  # each rank its own input
    # Seeds that fitted before draw what they drew: rank 1 of seed 1 seeds its generator with 1000005.
    x, _, idx, weights = make_inputs(dataclasses.replace(spec, seed=1), 1, torch.device("cpu"))
    own = torch.Generator().manual_seed(1 * 1_000_003 + 1 + 1)
    assert torch.equal(weights, random_weights(idx, own))
    assert torch.equal(x, torch.randn(4, 64, generator=own).to(torch.bfloat16))


def _fake_doc(W: int, G: int, runs: list[tuple[str, int | None]], nvlink: float = 1.0, rdma: float = 0.5) -> dict:
    """A results document for the plots: every rank at algbw 2 + rank/W, NVLink / RDMA busbw
    `nvlink` / `rdma` (x 1 + k for the k-th run; RDMA 0 on one node)."""
    nodes = W // G
    rdma = rdma if nodes > 1 else 0.0
    config = {"world_size": W, "ranks_per_node": G, "nodes": nodes, "hidden": 256, "tokens_per_rank": 32,
              "topk": 2, "experts": 2 * W, "experts_per_rank": 2, "dtype": "bf16", "routing": "uniform",
              "zipf_exponent": None, "group_limit": None, "seed": 0, "iters": 3, "warmup": 1, "device": "cuda",
              "transport": "nccl"}
    doc = {"metadata": {"config": config, "device": "GPU", "date": "today", "versions": {"torch": "x"}},
           "machine": {"hosts": [f"h{n}" for n in range(nodes)], "logical_nodes": False}, "label": "GPU numbers"}
    doc["runs"] = []
    for k, (backend, sms) in enumerate(runs):
        scale = 1 + k
        ranks = [{"rank": r, "node": r // G, **{op: {"algbw_gbps": scale * (2 + r / W), "nvlink_gbps": scale * nvlink,
                                                     "rdma_gbps": scale * rdma} for op in ("dispatch", "combine")}}
                 for r in range(W)]
        summary = {op: {"max_ms": 1.0, "mean_algbw_gbps": scale * 2.5, "mean_nvlink_gbps": scale * nvlink,
                        "mean_rdma_gbps": scale * rdma} for op in ("dispatch", "combine")}
        doc["runs"].append({"backend": backend, "num_sms": sms, "sms_note": "no SM setting" if sms is None else "",
                            "ranks": ranks, "summary": summary})
    return doc


@pytest.fixture
def figures(monkeypatch):
    """The figures the plot functions draw, drawn but not written."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    drawn = []

    def keep(fig, path, dpi=None):
        FigureCanvasAgg(fig).draw()
        drawn.append(fig)
        return path

    monkeypatch.setattr(plot, "save_png", keep)
    return drawn


def _legend_texts(ax) -> list[str]:
    legend = ax.get_legend()
    return [t.get_text() for t in legend.get_texts()] if legend is not None else []


@pytest.mark.parametrize("G, drawn, note", [
    (4, ["cuda: algbw", "cuda: NVLink busbw"], "RDMA busbw: 0 (one node), not drawn"),
    (2, ["cuda: algbw", "cuda: NVLink busbw", "cuda: RDMA busbw"], None),
    (1, ["cuda: algbw", "cuda: RDMA busbw"], "NVLink busbw: 0 (one rank per node), not drawn"),
])
def test_sm_sweep_plot_draws_nvlink_and_leaves_out_an_unused_link(figures, G, drawn, note):
    """On one node the only link in use is NVLink: the sweep drew algbw and a flat 0 of RDMA."""
    doc = _fake_doc(4, G, [("cuda", 16), ("cuda", 32), ("reference", None)], nvlink=1.0 if G > 1 else 0.0)
    plot_vs_sms(doc, "unused.png")
    for ax in figures[0].axes:
        lines = [line.get_label() for line in ax.get_lines() if len(line.get_xdata())]
        assert [name for name in lines if name.startswith("cuda")] == drawn
        texts = _legend_texts(ax)
        assert all(name in texts for name in drawn) and "reference (no SM setting): algbw" in texts
        assert (note in texts) if note else not any("not drawn" in t for t in texts)
        nvlink = [line for line in ax.get_lines() if line.get_label() == "cuda: NVLink busbw"]
        if nvlink:
            assert list(nvlink[0].get_ydata()) == [1.0, 2.0]  # the runs' mean NVLink busbw


def _overlapping(extents) -> list:
    extents = sorted(extents, key=lambda e: e.x0)
    return [(a, b) for a, b in zip(extents, extents[1:]) if a.x1 > b.x0 + 0.5]


@pytest.mark.parametrize("W", [4, 16, 64, pytest.param(256, marks=pytest.mark.slow)])  # slow: the full tier
def test_per_rank_plot_stays_readable_for_many_ranks_and_runs(figures, W):
    """At W >= 16 the rank labels overlapped, and with several runs the legend covered rank 0's bars."""
    runs = [("reference", None), ("cuda", 8), ("cuda", 16), ("cuda", 32)]
    plot_per_rank(_fake_doc(W, min(W, 8), runs), "per_rank.png")
    fig = figures[0]
    renderer = fig.canvas.get_renderer()
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert len(panels) == 6
    legends = [ax.get_legend() for ax in fig.axes if ax.get_legend() is not None] + list(fig.legends)
    assert len(legends) == 1 and [t.get_text() for t in legends[0].get_texts()] == [
        "reference (no SM setting)", "cuda (8 SMs)", "cuda (16 SMs)", "cuda (32 SMs)"]
    box = legends[0].get_window_extent(renderer)
    for ax in panels:
        assert not box.overlaps(ax.get_window_extent(renderer)), "the legend covers a panel"
        labels = [t for t in ax.get_xticklabels() if t.get_visible() and t.get_text()]
        assert labels[0].get_text() == "0 (0)" and len(labels) >= min(W, 64)
        assert _overlapping([t.get_window_extent(renderer) for t in labels]) == []
        assert ax.get_window_extent(renderer).width / fig.dpi >= 5.0  # a panel never narrower than at W <= 16
    width = fig.get_figwidth()
    assert width <= plot._MAX_WIDTH * (1 if W > plot._GRID_MAX_RANKS else 3)
    if W > plot._GRID_MAX_RANKS:  # one panel per row, wider with W
        assert panels[0].get_window_extent(renderer).width / fig.dpi >= min(plot._MAX_WIDTH, 0.1 * W) - 2
