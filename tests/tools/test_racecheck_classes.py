"""scripts/racecheck_classes.py: racecheck reports grouped by (write site, read site), on the
committed logs of 2026-11-26 (docs/benchmarks/racecheck.md's table) and on a small log of each
shape the tool prints."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

LOGS = Path(REPO, "benchmarks", "results", "2026-11-26-h200")


def _module():
    spec = importlib.util.spec_from_file_location("racecheck_classes", Path(REPO, "scripts", "racecheck_classes.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _classify(path: Path):
    with open(path, encoding="utf-8") as f:
        return _module().classify(f)


def test_the_direct_path_log_of_2026_11_26():
    rows, reports, summary = _classify(LOGS / "sanitizer_racecheck_direct.log")
    assert reports == summary == 24
    all_cases = ["W4 bf16", "W2 fp8", "W3 fp32"]
    assert rows == {
        ("dispatch_direct.cuh:124", "dispatch_direct.cuh:156"): [6, 1936, all_cases],
        ("dispatch_direct.cuh:125", "dispatch_direct.cuh:158"): [6, 352, all_cases],
        ("primitives.cuh:68", "cuda_bf16.hpp:266"): [2, 39680, ["W4 bf16", "W2 fp8"]],
        ("primitives.cuh:68", "primitives.cuh:195"): [1, 9424, ["W3 fp32"]],
        ("segments.cuh:163", "segments.cuh:204"): [9, 1980, all_cases],
        ("segments.cuh:188", "segments.cuh:204"): [3, 20, all_cases],
    }


def test_the_receive_path_log_of_2026_11_26():
    rows, reports, summary = _classify(LOGS / "sanitizer_racecheck_receive.log")
    assert reports == summary == 26
    assert {pair: row[:2] for pair, row in rows.items()} == {
        ("dispatch.cuh:497", "dispatch.cuh:568"): [6, 3192],
        ("primitives.cuh:68", "cuda_bf16.hpp:266"): [3, 36208],
        ("primitives.cuh:68", "primitives.cuh:195"): [1, 19840],
        ("segments.cuh:163", "segments.cuh:204"): [15, 2304],
        ("segments.cuh:188", "segments.cuh:204"): [6, 48],
    }


def test_a_read_first_report_is_keyed_by_its_write_and_a_pair_counts_once_per_report(tmp_path, capsys):
    log = tmp_path / "r.log"
    log.write_text(
        "========= Error: Race reported between Read access at f+0x10 in a.cuh:7\n"
        "=========     and Write access at g+0x20 in b.cuh:3 [5 hazards]\n"
        "=========     and Write access at g+0x30 in b.cuh:3 [2 hazards]\n"
        "emulated_check [cuda] W2xG2 E4 H256 T[9, 17] K2 float32 uniform drop0.0 pad1 call 0: matches the oracle\n"
        "========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)\n")
    rows, reports, summary = _classify(log)
    assert rows == {("b.cuh:3", "a.cuh:7"): [1, 7, ["W2 fp32"]]} and (reports, summary) == (1, 2)
    assert _module().main([str(log)]) == 1  # one report where the summary says two
    out = capsys.readouterr().out
    assert "the reports do not add up to the summary's 2" in out
    assert out.splitlines()[-1].split() == ["b.cuh:3", "a.cuh:7", "1", "7", "W2", "fp32"]
