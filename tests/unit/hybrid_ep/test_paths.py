"""Every tool checks its output paths before the work (hybrid_ep/paths.py), by creating an entry
there, not by permission bits (root passes those even where /proc refuses); a statistics file of
the wrong kind is named as such."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hybrid_ep.balancer.report import load_statistics, save_statistics
from hybrid_ep.paths import output_problem

pytestmark = pytest.mark.unit

needs_proc = pytest.mark.skipif(not os.path.isfile("/proc/version"), reason="needs Linux's /proc")


@needs_proc
def test_a_folder_that_refuses_new_entries_is_refused_whoever_runs():
    refused = output_problem("/proc/nope", folder=True)
    assert refused.startswith("cannot write /proc/nope: cannot create anything in /proc")
    assert output_problem("/proc/nope/out.json", folder=False).startswith("cannot write /proc/nope/out.json: ")
    assert output_problem("/proc/version", folder=False).startswith("cannot write /proc/version: ")


def test_a_writable_path_passes_and_nothing_is_left_behind(tmp_path):
    (tmp_path / "old.json").write_text("kept")
    assert output_problem(str(tmp_path / "a" / "b"), folder=True) is None
    assert output_problem(str(tmp_path), folder=True) is None
    assert output_problem(str(tmp_path / "old.json"), folder=False) is None
    assert sorted(os.listdir(tmp_path)) == ["old.json"] and (tmp_path / "old.json").read_text() == "kept"


@needs_proc
def test_bench_refuses_the_folder_before_starting_ranks(capsys):
    from hybrid_ep.bench.cli import main

    assert main(["--world-size", "2", "--out", "/proc/nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("hybrid-ep-bench: error: argument --out: cannot write /proc/nope")
    assert not any("starting" in line for line in err)


@needs_proc
@pytest.mark.parametrize("tool, argv", [
    ("hybrid_ep.traffic.cli", ["--json", "/proc/nope/traffic.json"]),
    ("tools.balancer_study.quality", ["--out", "/proc/nope"]),
    ("megatron_patches.local.demo", ["--out", "/proc/nope"]),
])
def test_other_tools_refuse_the_path_as_a_usage_error(tool, argv, capsys):
    module = __import__(tool, fromlist=["main"])
    with pytest.raises(SystemExit) as exit_:
        module.main(argv)
    assert exit_.value.code == 2
    assert "cannot write /proc/nope" in capsys.readouterr().err


@needs_proc
def test_balance_plan_refuses_its_output_before_planning(tmp_path, capsys):
    from hybrid_ep.balancer.cli import main

    stats = save_statistics(str(tmp_path / "stats.npz"), np.ones((2, 8)), ep_size=2)
    assert main(["plan", "--stats", stats, "--num-slots", "10", "--out", "/proc/nope.yaml"]) == 2
    assert "--out: cannot write /proc/nope.yaml" in capsys.readouterr().err


@pytest.mark.parametrize("content, kind", [
    (b'{"load": [[1, 2]]}', "a JSON file"),
    (b"layer,expert,tokens\n0,1,5\n", "a text file"),
    (b"", "an empty file"),
    (b"\x00\x01\x02\xff", "a file of another kind"),
])
def test_a_statistics_file_of_the_wrong_kind_is_named_as_such(tmp_path, content, kind):
    path = tmp_path / "some.json"
    path.write_bytes(content)
    with pytest.raises(ValueError) as err:
        load_statistics(str(path))
    assert str(err.value) == (f"{path}: not a statistics file (an .npz with a 'load' array, as training's "
                              f"statistics.npz), got {kind}")
    assert "pickle" not in str(err.value)


def test_a_damaged_npz_is_named_as_such(tmp_path):
    path = tmp_path / "statistics.npz"
    path.write_bytes(b"PK\x03\x04 not an archive")
    with pytest.raises(ValueError, match=r"not a statistics file: a damaged \.npz"):
        load_statistics(str(path))


def test_balance_plan_names_a_json_statistics_file(tmp_path, capsys):
    from hybrid_ep.balancer.cli import main

    path = tmp_path / "some.json"
    path.write_text('{"load": [[1, 2]]}')
    assert main(["plan", "--stats", str(path), "--num-slots", "4", "--ep-size", "2",
                 "--out", str(tmp_path / "p.yaml")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"hybrid-ep-balance: error: --stats: cannot read {path}: not a statistics file (an .npz with a 'load' "
        "array, as training's statistics.npz), got a JSON file")
