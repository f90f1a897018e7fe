"""The GPU microbenchmarks on a machine without a GPU: the command line and the JSON writer
(csrc/microbench/cli.h, json.h, built with the host compiler), the program built with nvcc for
sm_90a (its --help, --list and bad arguments make no CUDA call; without a GPU it stops with one
line), and the post-processor (tools.microbench) that turns its lines into micro.json."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from hybrid_ep import metadata
from tools.microbench import __main__ as cli
from tools.microbench import constants, records, report

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
MEASUREMENTS = [("timer", "M9"), ("handoff", "M1"), ("tma", "M2"), ("latency", "M3"), ("flags", "M4"),
                ("fences", "M5"), ("reduce", "M6"), ("copy-engine", "M10"), ("tma-profile", "M8")]
ALL = [name for name, _ in MEASUREMENTS if name != "tma-profile"]


@pytest.fixture(scope="module")
def host_check(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path_factory.mktemp("host") / "host_check"
    subprocess.run([cxx, "-std=c++17", "-Wall", "-Werror", "-I", str(REPO / "csrc"),
                    str(REPO / "tests" / "tools" / "microbench" / "host_check.cpp"), "-o", str(exe)], check=True)
    return exe


def _parse(exe, *args):
    out = subprocess.run([str(exe), "parse", *args], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_arguments_select_measurements_in_order_and_expand_all(host_check):
    p = _parse(host_check, "--device", "3", "--timeout-s", "0.5", "--quick", "reduce", "timer")
    assert p == {"action": "run", "run": "reduce,timer", "device": 3, "timeout_s": 0.5, "quick": True, "error": ""}
    p = _parse(host_check, "all")
    assert p["action"] == "run" and p["run"].split(",") == ALL  # tma-profile is ncu's, not all's
    assert _parse(host_check, "tma-profile")["run"] == "tma-profile"
    assert _parse(host_check, "tma", "--list")["action"] == "list"
    assert _parse(host_check, "--help", "nonsense")["action"] == "help"


@pytest.mark.parametrize("args, message", [
    ((), "name a measurement, or `all`"),
    (("tmaa",), "unknown measurement 'tmaa' (--list names them)"),
    (("--speed", "tma"), "unknown option '--speed'"),
    (("tma", "--device"), "--device needs a value"),
    (("--device", "-1", "tma"), "--device must be a CUDA device index (an integer >= 0), got '-1'"),
    (("--device", "1.5", "tma"), "got '1.5'"),
    (("--device", "99999999999", "tma"), "got '99999999999'"),
    (("--timeout-s", "0", "tma"), "--timeout-s must be a number of seconds in (0, 600], got '0'"),
    (("--timeout-s", "nan", "tma"), "got 'nan'"),
    (("--timeout-s", "601", "tma"), "got '601'"),
    (("--timeout-s", "2s", "tma"), "got '2s'"),
    (("all", "tma"), "measurement 'tma' named twice"),
])
def test_bad_arguments_name_the_argument(host_check, args, message):
    p = _parse(host_check, *args)
    assert p["action"] == "error" and message in p["error"], p


def test_json_lines_escape_strings_and_write_non_finite_numbers_as_null(host_check):
    out = subprocess.run([str(host_check), "json"], capture_output=True, text=True, check=True).stdout.splitlines()
    assert json.loads(out[0]) == {"text": "quote \" backslash \\ newline \n tab \t bell \x07 end"}
    v = json.loads(out[1])
    assert v["nan"] is None and v["inf"] is None
    assert v["third"] == pytest.approx(1 / 3, rel=1e-9) and v["small"] == 1.5e-300
    assert v["big"] == 2**64 - 1 and v["negative"] == -(2**63)
    assert v["yes"] is True and v["list"] == [1, 2.5, None] and v["empty"] == []
    assert list(v) == ["nan", "inf", "third", "big", "negative", "small", "yes", "list", "empty"]


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("microbench")
    subprocess.run(["bash", str(REPO / "scripts" / "build_microbench.sh"), str(out)], check=True,
                   capture_output=True, text=True)
    return out / "hybrid_ep_microbench"


@pytest.mark.slow
def test_program_builds_for_sm90a_and_answers_without_a_gpu(program):
    listed = subprocess.run([str(program), "--list"], capture_output=True, text=True)
    assert listed.returncode == 0 and listed.stderr == ""
    assert [tuple(line.split()[:2]) for line in listed.stdout.splitlines()] == MEASUREMENTS
    helped = subprocess.run([str(program), "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: hybrid_ep_microbench")
    bad = subprocess.run([str(program), "--device", "x", "tma"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.startswith("hybrid_ep_microbench: --device must be a CUDA device index")
    if shutil.which("nvidia-smi") is None:  # no GPU here: one line, no JSON, status 3
        run = subprocess.run([str(program), "timer"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 3 and run.stdout == "" and "microbench: no CUDA device" in run.stderr


# ---- the post-processor ----------------------------------------------------------------------

DEVICE = {"m": "device", "name": "NVIDIA H100 80GB HBM3", "cc": "9.0", "sms": 132, "l2_bytes": 52428800,
          "smem_per_block_optin": 232448, "max_clock_mhz_reported": 1980.0, "driver": 13000, "runtime": 13000,
          "timeout_s": 2.0, "quick": False}


def _tma(**over):
    line = {"m": "M2", "test": "tma", "sweep": "sms", "mode": "load", "fanout": 1, "sms": 1, "copy_bytes": 16384,
            "stages": 8, "depth": -1, "pipelines": 1, "rows": "sequential", "source": "hbm",
            "copies_per_pipeline": 2048, "reps": 5, "ms": 1.0, "event_ms": 1.02, "gbps": 33.6, "gbps_per_sm": 33.6,
            "load_gbps_per_sm": 33.6, "store_gbps_per_sm": 0.0, "bytes_per_clk_per_sm": 19.1, "clock_mhz": 1755.0,
            "clock_span_us": 1000.0, "ok": True}
    return {**line, **over}


def _lines(*records_):
    return "\n".join(json.dumps(r) for r in (DEVICE, *records_)) + "\n"


RUN = _lines(
    _tma(),
    _tma(mode="mix", fanout=2, depth=4, gbps_per_sm=41.0, bytes_per_clk_per_sm=23.4),
    _tma(sweep="copy_bytes", copy_bytes=32768, gbps_per_sm=52.5),
    _tma(sweep="sms", sms=32, mode="mix", fanout=1, depth=4, gbps_per_sm=20.0, gbps=640.0),
    {"m": "M1", "test": "handoff", "wait": "project", "hint_ns": 0, "agree": "lane", "spinners": 8,
     "iterations": 1000, "one_way_cycles": 900.0, "one_way_min_cycles": 700.0, "one_way_ns": 512.8,
     "round_trip_cycles": 1900.0, "round_trip_ns": 1082.6, "clock_mhz": 1755.0, "clock_span_us": 1082.6, "ok": False},
    {"m": "M9", "test": "globaltimer", "reads": 1048576, "read_cycles": 30.0, "read_ns": 17.1, "changes": 30000,
     "gap_min_ns": 32.0, "gap_median_ns": 1024.0, "gap_values_ns": [1024.0, 992.0], "gap_counts": [3000.0, 20.0],
     "clock_mhz": 1755.0, "clock_span_us": 30000.0, "ok": True},
)


def test_constants_come_from_their_lines_and_missing_ones_are_none():
    lines = records.parse(RUN)
    rows = {r["name"]: r for r in constants.table(lines)}
    assert [c.name for c in constants.CONSTANTS] == list(rows)
    assert rows["C_load"]["value"] == 33.6 and rows["C_load"]["also"] == 19.1 and rows["C_load"]["clock_mhz"] == 1755.0
    assert rows["C_mix2"]["value"] == 41.0 and rows["C_mix1_32sm"]["value"] == 20.0
    assert rows["H_project_8"]["value"] == 512.8 and rows["H_project_8"]["ok"] is False
    assert rows["T_gap"]["value"] == 32.0 and rows["T_gap"]["also"] == 17.1
    assert rows["C_store"]["value"] is None and rows["E_alone"]["value"] is None
    assert constants.best_tma(lines)["gbps_per_sm"] == 52.5  # the copy-size sweep's 32 KiB point
    assert lines.missing() == ["M3", "M4", "M5", "M6", "M10"] and len(lines.failed()) == 1


def test_every_constant_reads_a_field_its_measurement_prints():
    # fields of each measurement's lines (csrc/microbench/sweep_*.cuh) that a constant may read
    fields = {
        "M1": {"one_way_ns", "ns"}, "M2": {"gbps_per_sm", "bytes_per_clk_per_sm"},
        "M3": {"complete_ns_median", "read_ns_median", "write_ns_median"}, "M4": {"one_way_ns", "cycles"},
        "M5": {"ns"}, "M6": {"input_gbps", "ns_per_row"}, "M9": {"gap_min_ns", "read_ns"}, "M10": {"copy_gbps"},
    }
    sources = "".join(p.read_text() for p in (REPO / "csrc" / "microbench").glob("sweep_*.cuh"))
    for c in constants.CONSTANTS:
        assert c.field in fields[c.m], c.name
        for key in c.where:
            assert f'"{key}"' in sources, (c.name, key)


def test_micro_json_has_the_metadata_block_every_line_and_the_table(tmp_path):
    src = tmp_path / "micro.jsonl"
    src.write_text(RUN)
    assert cli.main([str(src), "--out", str(tmp_path / "out"), "--commit", "abc1234",
                     "--command", "hybrid_ep_microbench all"]) == 0
    doc = json.loads((tmp_path / "out" / "micro.json").read_text())
    metadata.validate(doc["metadata"])
    assert doc["metadata"]["tool"] == "hybrid_ep_microbench" and doc["metadata"]["device"] == DEVICE["name"]
    assert doc["metadata"]["config"]["commit"] == "abc1234" and doc["metadata"]["config"]["sms"] == 132
    assert doc["device"] == DEVICE and len(doc["measurements"]["M2"]) == 4 and doc["failed"] == 1
    assert doc["missing"] == ["M3", "M4", "M5", "M6", "M10"]
    text = (tmp_path / "out" / "micro.txt").read_text().splitlines()
    assert text[0].startswith("NVIDIA H100 80GB HBM3 (132 SMs)") and text[0].endswith("hybrid_ep_microbench all")
    c_load = next(line for line in text if line.startswith("C_load "))
    assert c_load.split()[1:5] == ["33.6", "GB/s/SM", "19.1", "B/clk"] and "1755" in c_load
    assert "FAILED" in next(line for line in text if line.startswith("H_project_8 "))
    assert next(line for line in text if line.startswith("C_store ")).split()[1] == "-"
    assert any(line.startswith("most bytes per SM on 1 SM: 52.5 GB/s/SM") for line in text)
    assert text[-2:] == ["no lines for: M3, M4, M5, M6, M10", "lines with ok false: 1"]
    assert (tmp_path / "out" / "micro_tma.png").stat().st_size > 1000


@pytest.mark.parametrize("text, message", [
    ("", "no device line: the program did not start on a GPU"),
    ('{"m": "M2"}\n', ":1: a measurement line before the device line"),
    (_lines() + "not json\n", ":2: not a JSON line"),
    (_lines() + "[1, 2]\n", ':2: a line must be a JSON object with "m"'),
    (_lines({"m": "M7"}), ":2: unknown measurement 'M7'"),
    (_lines(DEVICE), ":2: a second device line"),
])
def test_lines_that_are_not_one_run_are_refused_with_the_line(tmp_path, capsys, text, message):
    src = tmp_path / "micro.jsonl"
    src.write_text(text)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        records.read(str(src))
    assert cli.main([str(src), "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out" / "micro.json").exists()


def test_report_counts_a_quick_run_with_every_measurement():
    lines = records.parse(_lines(*({"m": m, "ok": True} for m in records.ALL)))
    doc = report.build(lines, command="hybrid_ep_microbench --quick all", commit=None)
    assert doc["missing"] == [] and doc["failed"] == 0 and doc["best_tma_1sm"] is None
    assert all(row["value"] is None for row in doc["constants"])
