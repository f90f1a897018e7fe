"""Placement YAML, statistics files, plots and the offline CLI (`hybrid-ep-balance plan`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from helpers import checkout_env
from hybrid_ep.balancer import cli
from hybrid_ep.balancer.cli import main
from hybrid_ep.balancer.metrics import summarize
from hybrid_ep.balancer.placement_file import load_placement_yaml, save_placement_yaml
from hybrid_ep.balancer.planner import Placement, plan_placement
from hybrid_ep.balancer.report import (
    DEFAULT_BYTES_PER_PARAM,
    load_statistics,
    save_statistics,
    slot_bytes,
    write_heatmap,
    write_imbalance_plot,
    write_report,
)
from hybrid_ep.wording import byte_unit

pytestmark = pytest.mark.unit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path: str, min_bytes: int = 5000) -> None:
    with open(path, "rb") as f:
        data = f.read()
    assert data[:8] == PNG_MAGIC, path
    assert len(data) > min_bytes, (path, len(data))


def _stats(tmp_path, layers=3, experts=32, intervals=6, seed=0) -> tuple[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    pop = 1.0 / np.arange(1, experts + 1) ** 1.0
    history = np.stack([np.stack([rng.poisson(rng.permutation(pop) * 2000) for _ in range(layers)])
                        for _ in range(intervals)]).astype(np.float64)
    load = history.sum(0)
    path = str(tmp_path / "stats.npz")
    save_statistics(path, load, history=history, steps=np.arange(intervals) * 10, ep_size=8,
                    layer_numbers=np.arange(layers) + 1)
    return path, load


# ----------------------------------------------------------------------------- YAML

def test_yaml_round_trip(tmp_path):
    load = np.random.default_rng(1).random((3, 16))
    p = plan_placement(load, 24, 2, 4)
    path = save_placement_yaml(p, str(tmp_path / "p.yaml"), extra={"step": 100})
    doc = yaml.safe_load(open(path))
    assert (doc["num_slots"], doc["num_experts"], doc["ep_size"], doc["num_nodes"], doc["step"]) == (24, 16, 4, 2, 100)
    assert doc["initial_global_assignments"][2] == p.slot_to_expert[2].tolist()
    q = load_placement_yaml(path)
    assert torch.equal(q.slot_to_expert, p.slot_to_expert)
    assert (q.num_ranks, q.num_nodes, q.num_experts) == (4, 2, 16)
    with pytest.raises(ValueError, match="clashes"):
        save_placement_yaml(p, str(tmp_path / "x.yaml"), extra={"num_slots": 1})


@pytest.mark.parametrize("edit, match", [
    (lambda d: d.pop("ep_size"), "ep_size must be a positive integer"),
    (lambda d: d["initial_global_assignments"].pop(0), "keys must be the layer indices"),
    (lambda d: d["initial_global_assignments"].pop(1), "num_layers is 2 but"),
    (lambda d: d["initial_global_assignments"][0].pop(), r"initial_global_assignments\[0\] has 7 slots"),
    (lambda d: d["initial_global_assignments"].__setitem__(0, [0] * 8), "no slot for expert 1"),
    (lambda d: d.__setitem__("num_nodes", 3), "num_nodes"),
    (lambda d: d["initial_global_assignments"][0].__setitem__(3, 10**30),
     r"p.yaml: initial_global_assignments\[0\] has expert id 10{30}, outside \[0, 7\] \(num_experts=8\)"),
    (lambda d: d["initial_global_assignments"][1].__setitem__(0, -1), r"p.yaml: .*\[1\] has expert id -1, outside"),
    (lambda d: d.__setitem__("layer_numbers", [1]), "p.yaml: layer_numbers has 1 entries for 2 layers"),
    (lambda d: d.__setitem__("layer_numbers", [3, 3]), r"p.yaml: layer_numbers names a layer twice: \[3, 3\]"),
    (lambda d: d.__setitem__("layer_numbers", [0, 1]), r"layer_numbers must be layer numbers >= 1 .*\[0, 1\]"),
    (lambda d: d.__setitem__("layer_numbers", ["1", 2]), "layer_numbers must be a list of integers"),
])
def test_yaml_load_names_the_problem(tmp_path, edit, match):
    p = plan_placement(np.ones((2, 8)), 8, 1, 2)
    path = save_placement_yaml(p, str(tmp_path / "p.yaml"))
    doc = yaml.safe_load(open(path))
    edit(doc)
    yaml.safe_dump(doc, open(path, "w"))
    with pytest.raises(ValueError, match=match):
        load_placement_yaml(path)


def test_yaml_load_names_a_file_that_is_not_text(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_bytes(b"num_slots: 8\n\xff\xfe: 1\n")
    with pytest.raises(ValueError, match=r"p.yaml: not UTF-8 text"):
        load_placement_yaml(str(path))


def test_yaml_keeps_layer_numbers_and_gives_rows_by_number(tmp_path):
    """A file's layer_numbers (the model layer of each row) load with it: a model takes its own
    layers' rows by number, in its order, and a layer the file lacks is named with the file's."""
    p = plan_placement(np.random.default_rng(4).random((3, 8)), 12, 1, 4)
    path = save_placement_yaml(p, str(tmp_path / "p.yaml"), extra={"layer_numbers": [2, 4, 6]})
    q = load_placement_yaml(path)
    assert q.layer_numbers == (2, 4, 6) and torch.equal(q.slot_to_expert, p.slot_to_expert)
    assert torch.equal(q.rows_for([6, 2]), p.slot_to_expert[[2, 0]])
    assert q.missing_layers([1, 2, 3]) == [1, 3]
    with pytest.raises(ValueError, match=r"no rows for layers \[3\] \(its layer_numbers: \[2, 4, 6\]\)"):
        q.rows_for([2, 3])
    again = load_placement_yaml(save_placement_yaml(q, str(tmp_path / "again.yaml")))  # saved, keeps them
    assert again.layer_numbers == (2, 4, 6) and torch.equal(again.slot_to_expert, p.slot_to_expert)
    kept = open(path).read()
    for bad, match in (([2, 2, 6], "names a layer twice"), ([1, 2], "has 2 entries for 3 layers")):
        with pytest.raises(ValueError, match=match):
            save_placement_yaml(p, path, extra={"layer_numbers": bad})
    assert open(path).read() == kept


def test_yaml_without_layer_numbers_matches_in_order(tmp_path):
    """A file written before layer_numbers were read (or by hand) gives its rows in order, to a
    model with as many layers."""
    p = plan_placement(np.random.default_rng(4).random((2, 8)), 12, 1, 4)
    q = load_placement_yaml(save_placement_yaml(p, str(tmp_path / "p.yaml")))
    assert q.layer_numbers is None and q.missing_layers([7, 9]) == []
    assert torch.equal(q.rows_for([7, 9]), p.slot_to_expert)
    with pytest.raises(ValueError, match=r"2 layers and no layer_numbers, 3 layers \(\[1, 2, 3\]\) want rows"):
        q.rows_for([1, 2, 3])


# ----------------------------------------------------------------------------- statistics, plots

def test_statistics_round_trip_and_errors(tmp_path):
    path, load = _stats(tmp_path)
    stats = load_statistics(path)
    assert np.array_equal(stats["load"], load) and stats["history"].shape == (6, 3, 32)
    assert stats["ep_size"] == 8 and stats["steps"].tolist() == [0, 10, 20, 30, 40, 50]
    assert stats["layer_numbers"].tolist() == [1, 2, 3]
    with pytest.raises(ValueError, match="history must be"):
        save_statistics(str(tmp_path / "bad.npz"), load, history=np.ones((2, 3, 5)))
    np.savez(str(tmp_path / "nolaod.npz"), other=np.ones(3))
    with pytest.raises(ValueError, match="no 'load'"):
        load_statistics(str(tmp_path / "nolaod.npz"))


def _write_npz(path, **arrays) -> str:
    with open(path, "wb") as f:  # np.savez would append .npz to a bare name
        np.savez(f, **arrays)
    return str(path)


_LOAD = np.arange(1.0, 17.0).reshape(2, 8)
BAD_FIELDS = [  # (arrays besides load, the ValueError's text after "<path>: ")
    ({"ep_size": np.array("4")}, "ep_size must be one integer >= 1, got '4'"),
    ({"ep_size": np.int64(0)}, "ep_size must be one integer >= 1, got 0"),
    ({"history": np.full((2, 2, 8), "a")}, "history must hold numbers, got dtype <U1"),
    ({"history": np.ones((2, 2, 8), dtype=bool)}, "history must hold numbers, got dtype bool"),
    ({"history": np.full((2, 2, 8), np.nan)}, "history must be finite, got nan"),
    ({"history": -np.ones((2, 2, 8))}, "history must be token counts >= 0, got -1.0"),
    ({"history": np.ones((2, 16))}, "history has shape (2, 16), expected [T, 2, 8] (reductions, layers, experts)"),
    ({"history": np.ones((3, 2, 8)), "steps": np.arange(2)}, "steps has 2 entries, history has 3 rows"),
    ({"history": np.ones((2, 2, 8)), "steps": np.array([0.0, 1.5])}, "steps must hold integers, got 1.5"),
    ({"history": np.ones((2, 2, 8)), "steps": np.zeros((2, 1), dtype=np.int64)},
     "steps must be one step per history row, got shape (2, 1)"),
    ({"layer_numbers": np.array([1.5, 2.5])}, "layer_numbers must hold integers, got 1.5"),
    ({"layer_numbers": np.array([0, 1])}, "layer_numbers must be >= 1 (Megatron counts layers from 1), got [0, 1]"),
    ({"layer_numbers": np.array(["1", "2"])}, "layer_numbers must hold numbers, got dtype <U1"),
]


@pytest.mark.parametrize("arrays, why", BAD_FIELDS)
def test_load_statistics_checks_every_field_by_name(tmp_path, arrays, why):
    """Each field is converted and checked on reading, a ValueError naming file and field:
    the CLI died on strings with a TypeError, took NaN or negative history, truncated layer
    numbers 1.5 into 1, and training's first report died on a steps/history mismatch with an
    IndexError (it catches ValueError only)."""
    path = _write_npz(tmp_path / "bad.npz", load=_LOAD, **arrays)
    with pytest.raises(ValueError) as info:
        load_statistics(path)
    assert str(info.value) == f"{path}: {why}"


def test_load_statistics_converts_whole_numbers(tmp_path):
    path = _write_npz(tmp_path / "ok.npz", load=_LOAD.astype(np.int32), history=np.ones((2, 2, 8), dtype=np.uint16),
                      steps=np.array([3.0, 4.0]), layer_numbers=np.array([2.0, 4.0]), ep_size=np.float64(4))
    stats = load_statistics(path)
    assert stats["load"].dtype == np.float64 and stats["history"].dtype == np.float64
    assert stats["steps"].dtype == np.int64 and stats["steps"].tolist() == [3, 4]
    assert stats["layer_numbers"].dtype == np.int64 and stats["layer_numbers"].tolist() == [2, 4]
    assert stats["ep_size"] == 4 and type(stats["ep_size"]) is int


def test_byte_unit_goes_past_gib():
    """9.34 TiB of moved slots printed as "9.56e+03 GiB" while GiB was the largest unit."""
    assert byte_unit(16646 * 616562688) == (2.0 ** 40, "TiB")
    assert byte_unit(3 * 2.0 ** 50) == (2.0 ** 50, "PiB")
    assert byte_unit(2.0 ** 40 - 1) == (2.0 ** 30, "GiB") and byte_unit(1023) == (1.0, "B")


def test_heatmap_many_layers(tmp_path):
    history = np.random.default_rng(2).random((20, 61, 64)) * 1000
    path = write_heatmap(history, str(tmp_path / "h.png"))
    _assert_png(path, 50_000)
    with pytest.raises(ValueError, match="layer_names"):
        write_heatmap(history, str(tmp_path / "x.png"), layer_names=["a"])


def test_imbalance_plot_and_report(tmp_path):
    load = np.random.default_rng(3).random((4, 16)) * 100
    after = plan_placement(load, 20, 2, 4)
    summary = summarize(load, None, after)
    _assert_png(write_imbalance_plot(summary, str(tmp_path / "imb.png")))
    paths = write_report(summary, str(tmp_path / "rep"), history=np.ones((3, 4, 4)), step=7)
    assert set(paths) == {"summary", "imbalance", "heatmap_after"}
    assert paths["summary"].endswith("balancer_summary_step7.json")
    doc = json.load(open(paths["summary"]))
    assert doc["step"] == 7 and doc["imbalance_rank_after"] == pytest.approx(summary["imbalance_rank_after"])


def test_report_moved_bytes(tmp_path):
    # bf16 weight 2 + fp32 main 4 + Adam moments 8 bytes per parameter
    assert DEFAULT_BYTES_PER_PARAM == 14 and slot_bytes(1000) == 14000 and slot_bytes(10, bytes_per_param=6) == 60
    with pytest.raises(ValueError, match="params_per_slot"):
        slot_bytes(0)
    load = np.random.default_rng(4).random((3, 16)) * 100
    summary = summarize(load, None, plan_placement(load, 24, 2, 4))
    paths = write_report(summary, str(tmp_path / "rep"), bytes_per_slot=slot_bytes(3 * 64 * 32))
    doc = json.load(open(paths["summary"]))
    assert doc["bytes_per_slot"] == 3 * 64 * 32 * 14
    assert doc["moved_bytes"] == [m * 3 * 64 * 32 * 14 for m in summary["moves"]]
    assert doc["moved_bytes_total"] == sum(summary["moves"]) * 3 * 64 * 32 * 14 > 0
    units = doc["metadata"]["units"]  # every number of the JSON says what it counts
    assert all(units[k].startswith("bytes") for k in ("bytes_per_slot", "moved_bytes", "moved_bytes_total"))
    assert "step" in units and "layer_numbers" in units
    _assert_png(paths["imbalance"])
    with pytest.raises(ValueError, match="bytes_per_slot"):
        write_report(summary, str(tmp_path / "bad"), bytes_per_slot=-1)


def test_imbalance_plot_labels_layers_by_their_numbers(tmp_path):
    load = np.random.default_rng(5).random((3, 16)) * 100
    summary = summarize(load, None, plan_placement(load, 20, 2, 4))
    _assert_png(write_imbalance_plot({**summary, "layer_numbers": [2, 4, 6]}, str(tmp_path / "imb.png")))
    with pytest.raises(ValueError, match="layer_numbers"):
        write_imbalance_plot({**summary, "layer_numbers": [2, 4]}, str(tmp_path / "bad.png"))


# ----------------------------------------------------------------------------- CLI

def test_cli_plan_end_to_end(tmp_path, capsys):
    stats, load = _stats(tmp_path)
    out, rep = str(tmp_path / "out" / "placement.yaml"), str(tmp_path / "report")
    rc = main(["plan", "--stats", stats, "--num-slots", "40", "--ranks-per-node", "4", "--out", out,
               "--report-dir", rep])
    assert rc == 0
    text = capsys.readouterr().out
    assert "rank imb before" in text and "mean" in text
    p = load_placement_yaml(out)
    assert p.slot_to_expert.shape == (3, 40) and (p.num_ranks, p.num_nodes, p.num_experts) == (8, 2, 32)
    assert yaml.safe_load(open(out))["layer_numbers"] == [1, 2, 3]
    summary = json.load(open(os.path.join(rep, "balancer_summary.json")))
    assert len(summary["imbalance_rank_after"]) == 3
    assert max(summary["imbalance_rank_after"]) < min(summary["imbalance_rank_before"])
    for name in ("imbalance.png", "heatmap_after.png", "heatmap_before.png"):
        _assert_png(os.path.join(rep, name))
    # again with the result as previous: nothing moves
    out2 = str(tmp_path / "again.yaml")
    assert main(["plan", "--stats", stats, "--slots-per-rank", "5", "--ranks-per-node", "4",
                 "--previous", out, "--out", out2]) == 0
    assert load_placement_yaml(out2).moves(p).tolist() == [0, 0, 0]


def _numbered_stats(path, load, numbers, intervals=4):
    """A statistics file of the layers `numbers` (rows of load), as one pipeline stage writes it."""
    history = np.stack([load / intervals] * intervals)
    return save_statistics(str(path), load, history=history, steps=np.arange(intervals) * 10, ep_size=8,
                           layer_numbers=numbers)


def test_cli_joins_pipeline_stages_and_takes_previous_rows_by_layer_number(tmp_path, capsys):
    """With pipeline parallelism each stage writes its own statistics: --stats takes every
    stage's file and plans one file for the whole model (the plan of the same load in one
    file); a stage's statistics with that file as --previous take its rows of the stage's
    layers, and a --previous without them is refused naming both."""
    _, load = _stats(tmp_path, layers=4)
    stage0 = _numbered_stats(tmp_path / "stage0.npz", load[:2], [1, 2])
    stage1 = _numbered_stats(tmp_path / "stage1.npz", load[2:], [3, 4])
    whole = _numbered_stats(tmp_path / "whole.npz", load, [1, 2, 3, 4])
    common = ["--slots-per-rank", "5", "--ranks-per-node", "4"]
    joined, single, rep = str(tmp_path / "joined.yaml"), str(tmp_path / "single.yaml"), str(tmp_path / "rep")
    assert main(["plan", "--stats", stage1, stage0, "--out", joined, "--report-dir", rep] + common) == 0
    assert main(["plan", "--stats", whole, "--out", single] + common) == 0
    j, w = load_placement_yaml(joined), load_placement_yaml(single)
    assert j.layer_numbers == (1, 2, 3, 4) and torch.equal(j.slot_to_expert, w.slot_to_expert)
    assert yaml.safe_load(open(joined))["source_stats"] == [stage1, stage0]
    _assert_png(os.path.join(rep, "heatmap_after.png"))
    # stage 1 re-planned from the whole model's file: its rows are kept, nothing moves
    out1 = str(tmp_path / "stage1.yaml")
    assert main(["plan", "--stats", stage1, "--previous", joined, "--out", out1] + common) == 0
    s1 = load_placement_yaml(out1)
    assert s1.layer_numbers == (3, 4) and torch.equal(s1.slot_to_expert, j.rows_for([3, 4]))
    capsys.readouterr()
    assert main(["plan", "--stats", stage0, "--previous", out1, "--out", str(tmp_path / "x.yaml")] + common) == 2
    assert "--previous " + out1 + " has layer_numbers [3, 4], no row for layers [1, 2]" in capsys.readouterr().err
    assert main(["plan", "--stats", stage0, stage0, "--out", str(tmp_path / "x.yaml")] + common) == 2
    assert "layers [1, 2] are in more than one file" in capsys.readouterr().err
    bare = str(tmp_path / "bare.npz")
    save_statistics(bare, load[2:])
    assert main(["plan", "--stats", stage0, bare, "--out", str(tmp_path / "x.yaml"), "--ep-size", "8"] + common) == 2
    assert f"--stats: {bare} has no layer_numbers" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "x.yaml")


def test_cli_statistics_without_layer_numbers_write_a_file_matched_in_order(tmp_path):
    """Statistics of an older version have no layer_numbers: the plan has none either (its
    rows match a model's MoE layers in order), rather than numbers 1..L a model may not have."""
    _, load = _stats(tmp_path)
    bare = save_statistics(str(tmp_path / "bare.npz"), load)
    out = str(tmp_path / "p.yaml")
    assert main(["plan", "--stats", bare, "--ep-size", "8", "--out", out]) == 0
    assert "layer_numbers" not in yaml.safe_load(open(out)) and load_placement_yaml(out).layer_numbers is None


def test_cli_reports_moved_bytes(tmp_path, capsys):
    stats, _ = _stats(tmp_path)
    rep = str(tmp_path / "rep")
    params = 3 * 64 * 32  # an expert's three weight matrices
    assert main(["plan", "--stats", stats, "--num-slots", "40", "--out", str(tmp_path / "p.yaml"),
                 "--report-dir", rep, "--params-per-slot", str(params)]) == 0
    text = capsys.readouterr().out
    doc = json.load(open(os.path.join(rep, "balancer_summary.json")))
    moves = sum(doc["moves"])
    assert moves > 0 and doc["bytes_per_slot"] == params * DEFAULT_BYTES_PER_PARAM
    assert doc["moved_bytes_total"] == moves * params * DEFAULT_BYTES_PER_PARAM
    assert f"moved: {moves} of 3 x 40 slots ({100 * moves / 120:.1f}%)" in text
    assert f"at {params * DEFAULT_BYTES_PER_PARAM} B per slot" in text
    # fp32 weights with Adam, no separate main weights: 4 + 8 bytes per parameter
    assert main(["plan", "--stats", stats, "--num-slots", "40", "--out", str(tmp_path / "p.yaml"),
                 "--report-dir", rep, "--params-per-slot", str(params), "--bytes-per-param", "12"]) == 0
    assert json.load(open(os.path.join(rep, "balancer_summary.json")))["moved_bytes_total"] == moves * params * 12


def test_cli_prints_tib(tmp_path, capsys):
    stats, _ = _stats(tmp_path, intervals=2)
    params = 2 ** 36  # x 14 bytes: over a TiB for two moved slots
    assert main(["plan", "--stats", stats, "--num-slots", "40", "--out", str(tmp_path / "p.yaml"),
                 "--params-per-slot", str(params)]) == 0
    line = next(row for row in capsys.readouterr().out.splitlines() if row.startswith("moved: "))
    moves = int(line.split()[1])
    assert moves >= 2 and f"; {moves * params * 14 / 2 ** 40:.3g} TiB at {params * 14} B per slot" in line


@pytest.mark.parametrize("argv, match", [
    (["--stats", "missing.npz"], "--stats: no such file"),
    (["--bytes-per-param", "6"], "--bytes-per-param needs --params-per-slot"),
    (["--params-per-slot", "0"], "argument --params-per-slot: must be an integer >= 1, got 0"),
    (["--params-per-slot", "1.5"], "argument --params-per-slot: must be an integer >= 1, got '1.5'"),
    (["--num-slots", "30"], "--num-slots gives 30 slots, fewer than the 32 experts"),
    (["--num-slots", "36"], "--num-slots: 36 slots do not split evenly over the statistics' ep_size 8 ranks"),
    (["--ep-size", "8", "--num-slots", "36"], "--num-slots: 36 slots do not split evenly over --ep-size 8 ranks"),
    (["--ranks-per-node", "3"], "--ranks-per-node"),
    (["--ep-size", "0"], "--ep-size must be >= 1"),
    (["--previous", "missing.yaml"], "--previous"),
    (["--move-budget", "1.5"], "argument --move-budget: must be a fraction of the slots in [0, 1], got 1.5"),
    (["--move-budget", "nan"], "argument --move-budget: must be a fraction of the slots in [0, 1], got nan"),
    (["--tolerance", "-1"], "argument --tolerance: must be a finite number >= 0, got -1"),
    (["--tolerance", "inf"], "argument --tolerance: must be a finite number >= 0, got inf"),
    (["--tolerance", "0.02"], "--tolerance needs --previous"),
    (["--move-budget", "0.1"], "--move-budget needs --previous"),
    (["--ep-size", "7", "--num-slots", "70"], "--ep-size 7 must divide the 32 experts"),
    (["--ep-size", "4", "--slots-per-rank", "1000000000000000000000"],
     "--slots-per-rank gives 4000000000000000000000 slots, more than 64 x the 32 experts in "),
    (["--num-slots", "400000000"], "--num-slots gives 400000000 slots, more than 64 x the 32 experts in "),
])
def test_cli_errors_name_the_flag(tmp_path, capsys, argv, match):
    stats, _ = _stats(tmp_path, intervals=2)
    args = {"--stats": stats, "--out": str(tmp_path / "p.yaml")}
    for flag, value in zip(argv[::2], argv[1::2]):
        args[flag] = str(tmp_path / value) if value.endswith((".npz", ".yaml")) else value
    rc = main(["plan"] + [x for kv in args.items() for x in kv])
    assert rc == 2
    assert match in capsys.readouterr().err


def test_cli_slot_bound_names_the_limit(tmp_path, capsys):
    """At most 64 slots per expert: 2048 for 32 experts is planned, 2056 refused (before, a slot
    count past the native call's range printed a pybind TypeError with the whole load, and
    --num-slots 400000000 ran for minutes)."""
    stats, _ = _stats(tmp_path, intervals=2)
    out = str(tmp_path / "p.yaml")
    assert main(["plan", "--stats", stats, "--num-slots", "2048", "--out", out]) == 0
    capsys.readouterr()
    assert main(["plan", "--stats", stats, "--num-slots", "2056", "--out", out]) == 2
    assert capsys.readouterr().err == (f"hybrid-ep-balance: error: --num-slots gives 2056 slots, more than 64 x the "
                                       f"32 experts in {stats} (2048), the most this tool plans\n")


def test_cli_planner_type_errors_are_one_line(tmp_path, capsys, monkeypatch):
    """A TypeError or OverflowError from the planner's native call: exit 2 and its first line,
    not a traceback whose message prints the whole load array."""
    stats, _ = _stats(tmp_path, intervals=2)
    for exc in (TypeError("plan_fresh(): incompatible function arguments.\n    1. (load: tensor)\n[1.0, 2.0]"),
                OverflowError("Python int too large to convert to C long")):
        def refuse(*args, exc=exc, **kwargs):
            raise exc
        monkeypatch.setattr(cli, "plan_placement", refuse)
        assert main(["plan", "--stats", stats, "--num-slots", "40", "--out", str(tmp_path / "p.yaml")]) == 2
        first = str(exc).splitlines()[0]
        assert capsys.readouterr().err == (f"hybrid-ep-balance: error: the planner cannot take 40 slots on 8 ranks "
                                           f"in 1 nodes ({first})\n")


@pytest.mark.parametrize("arrays, why", BAD_FIELDS)
def test_cli_names_the_bad_statistics_field(tmp_path, capsys, arrays, why):
    """No traceback, exit 2, the file's field named: an ep_size of 0 in the file was reported
    as "--ep-size must be >= 1, got 0" though no --ep-size was given."""
    path = _write_npz(tmp_path / "bad.npz", load=_LOAD, **arrays)
    out = str(tmp_path / "p.yaml")
    assert main(["plan", "--stats", path, "--out", out, "--report-dir", str(tmp_path / "rep")]) == 2
    assert capsys.readouterr().err == f"hybrid-ep-balance: error: --stats: cannot read {path}: {why}\n"
    assert not os.path.exists(out)


def test_cli_names_the_statistics_ep_size_when_no_flag_gave_it(tmp_path, capsys):
    path = _write_npz(tmp_path / "ep7.npz", load=np.ones((2, 32)), ep_size=np.int64(7))
    assert main(["plan", "--stats", path, "--num-slots", "42", "--out", str(tmp_path / "p.yaml")]) == 2
    assert capsys.readouterr().err == (f"hybrid-ep-balance: error: the statistics' ep_size 7 must divide the 32 "
                                       f"experts in {path} (as Megatron's EP size must)\n")


def test_cli_bad_outputs_and_statistics_exit_2_before_writing(tmp_path, capsys):
    """Output paths are checked before the plan, and a statistics file of the wrong make is
    named: exit 2, no traceback, no placement YAML left behind."""
    stats, load = _stats(tmp_path, intervals=2)
    afile = tmp_path / "afile"
    afile.write_text("x")
    out = str(tmp_path / "p.yaml")
    bad_stats = {"array.npy": None, "ep.npz": {"load": load, "ep_size": np.array([8, 8])},
                 "ep_frac.npz": {"load": load, "ep_size": np.float64(8.7)},
                 "empty.npz": {"load": np.zeros((0, 32))},
                 "numbers.npz": {"load": load, "layer_numbers": np.array([1, 2])},
                 "twice.npz": {"load": load, "layer_numbers": np.array([1, 2, 1])}}
    for name, arrays in bad_stats.items():
        path = str(tmp_path / name)
        if arrays is None:
            np.save(path, load)
        else:
            with open(path, "wb") as f:
                np.savez(f, **arrays)
    cases = [(["--out", str(tmp_path)], "--out", "is a folder; give a file name"),
             (["--out", str(afile / "p.yaml")], "--out", "is a file, not a folder"),
             (["--out", ""], "--out: the path is empty"),
             (["--report-dir", str(afile)], "--report-dir", "is a file, not a folder"),
             (["--report-dir", str(afile / "sub")], "--report-dir", "is a file, not a folder")]
    cases += [(["--stats", str(tmp_path / name)], "--stats: cannot read", why)
              for name, why in (("array.npy", "not a statistics file"), ("ep.npz", "ep_size must be one integer"),
                                ("ep_frac.npz", "ep_size must be one integer"),
                                ("empty.npz", "at least one layer and one expert"),
                                ("numbers.npz", "layer_numbers has shape (2,), load has 3 layers"))]
    cases.append((["--stats", str(tmp_path / "twice.npz")], "--stats: layer_numbers of",
                  "names a layer twice: [1, 2, 1]"))
    for case in cases:
        argv, needles = case[0], case[1:]
        args = {"--stats": stats, "--out": out, "--ep-size": "8", **dict(zip(argv[::2], argv[1::2]))}
        assert main(["plan"] + [x for kv in args.items() for x in kv]) == 2, argv
        err = capsys.readouterr().err
        assert all(n in err for n in needles) and "Traceback" not in err, (argv, err)
        assert not os.path.exists(out)


def test_cli_move_budget_caps_the_slots_changed_per_layer(tmp_path):
    stats, _ = _stats(tmp_path)
    prev = save_placement_yaml(Placement.identity(3, 32, 40, 8, 2), str(tmp_path / "prev.yaml"))
    plans = {}
    for budget in (None, "0.1", "0"):
        out = str(tmp_path / f"plan_{budget}.yaml")
        extra = [] if budget is None else ["--move-budget", budget]
        assert main(["plan", "--stats", stats, "--num-slots", "40", "--ranks-per-node", "4", "--previous", prev,
                     "--out", out] + extra) == 0
        plans[budget] = load_placement_yaml(out).moves(load_placement_yaml(prev))
    assert (plans[None] > 4).all()  # from the identity, a Zipf load moves more than a tenth of 40 slots
    assert (plans["0.1"] <= 4).all() and (plans["0.1"] > 0).all()
    assert plans["0"].tolist() == [0, 0, 0]


def test_cli_previous_shape_mismatch(tmp_path, capsys):
    stats, _ = _stats(tmp_path, intervals=2)
    prev = save_placement_yaml(Placement.identity(3, 32, 32, 8, 2), str(tmp_path / "prev.yaml"))
    rc = main(["plan", "--stats", stats, "--num-slots", "40", "--previous", prev, "--out", str(tmp_path / "p.yaml")])
    assert rc == 2 and "--previous" in capsys.readouterr().err


@pytest.mark.slow  # the full tier (scripts/test.sh --full): the report's CLI in a child process
def test_module_entry_point(tmp_path):
    stats, _ = _stats(tmp_path, intervals=2)
    out = str(tmp_path / "p.yaml")
    env = checkout_env()
    done = subprocess.run([sys.executable, "-m", "hybrid_ep.balancer", "plan", "--stats", stats, "--out", out],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert load_placement_yaml(out).slot_to_expert.shape == (3, 32)
    bad = subprocess.run([sys.executable, "-m", "hybrid_ep.balancer", "plan", "--out", out],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "--stats" in bad.stderr
    # the CLI module itself runs too, instead of exiting 0 having done nothing
    bad = subprocess.run([sys.executable, "-m", "hybrid_ep.balancer.cli", "plan", "--out", out],
                         capture_output=True, text=True, env=env, timeout=120)
    assert bad.returncode == 2 and "--stats" in bad.stderr
