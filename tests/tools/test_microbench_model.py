"""The GPU microbenchmarks' kernels (csrc/microbench/) run on the CPU model of the device layer
at tiny sizes (tests/tools/microbench/model_check.cpp, built with the host compiler and the model's
runtime): every mbarrier phase, bulk copy, barrier and flag of theirs passes the model's
checks, the copies land where they should, and a pipeline that cannot progress ends with its
abort flag instead of hanging. What a GPU run of them would cost is lost on the rare GPU;
this is where their logic is tested. It also runs the device layer's cheaper waits (hinted
try_wait, relaxed poll + fence, elect_one, named barriers, back-off) in the model."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.model

REPO = Path(__file__).resolve().parents[2]
KPHASE_PIPELINE = 7  # common/params.h: a shared-memory FIFO stage never completed


@pytest.fixture(scope="module")
def model_check(tmp_path_factory):
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    model = REPO / "csrc" / "device" / "model"
    runtime = sorted(str(p) for p in model.glob("*.cpp") if not p.name.startswith(("kernel_", "selftest")))
    exe = tmp_path_factory.mktemp("model") / "model_check"
    subprocess.run([cxx, "-std=c++17", "-O1", "-fno-strict-aliasing", "-Wno-unknown-pragmas", "-I", str(REPO / "csrc"),
                    str(REPO / "tests" / "tools" / "microbench" / "model_check.cpp"), *runtime, "-o", str(exe)],
                   check=True)

    def run(*cases):
        out = subprocess.run([str(exe), *cases], capture_output=True, text=True, timeout=120, check=True).stdout
        return {r["case"]: r for r in map(json.loads, out.splitlines())}

    return run


def _clean(r):
    assert r["error"] == "" and r["abort"] == 0, r


def test_handoffs_complete_every_round_trip(model_check):
    rs = model_check("handoff")
    assert len(rs) == 9  # with every lane's converged wait, and a group's waiter and named barrier
    for r in rs.values():
        _clean(r)
        assert r["out"][4] == 20, r  # round trips done


def test_named_barrier_kernel_passes_its_rounds(model_check):
    rs = model_check("barrier")
    assert sorted(rs) == ["bar.sync 2 warps", "bar.sync 3 warps", "bar.sync 4 warps"]
    for r in rs.values():
        _clean(r)


# Destination rows written: 12 copies per pipeline, sequential rows, per block and destination.
WRITTEN = {"tma load": 0, "tma load 4 pipelines random": 0, "tma store depth 0": 12,
           "tma store depth 7, 2 pipelines": 2 * 2 * 12, "tma mix k=1 depth 3": 12, "tma mix k=2 depth 0": 2 * 2 * 12,
           "tma mix k=2 depth 7, 4 pipelines": 4 * 12 * 2, "tma mix k=8 depth 1, 2 store threads": 12 * 8,
           "tma mix k=8 depth 1, route table": 2 * 12 * 8}


def test_tma_pipelines_move_every_row_to_its_place(model_check):
    rs = model_check("tma")
    for name, r in rs.items():
        _clean(r)
        assert r["wrong"] == 0, r
        if name in WRITTEN:
            assert r["written"] == WRITTEN[name], r
    random = rs["tma mix k=4 depth 1 random, 2 pipelines"]  # 24 copies to 4 destinations, rows may repeat
    assert 4 * 12 <= random["written"] <= 4 * 24
    # random rows through the route table: each copy's 8 routes still land in their regions' rows
    both = rs["tma mix k=8 depth 1, 2 store threads, route table"]
    assert 8 * 6 <= both["written"] <= 8 * 12


def test_a_pipeline_that_cannot_progress_ends_with_its_abort_flag(model_check):
    # depth = stages: the store thread never hands back the stage the next load needs
    r = model_check("tma_deadlock")["tma mix depth = stages"]
    assert r["error"] == "" and r["abort"] == KPHASE_PIPELINE and r["wrong"] == 0, r


def test_latency_flag_fence_timer_kernels_finish(model_check):
    rs = model_check("latency", "flags", "poll", "fences", "timer")
    assert len(rs) == 5 + 8 + 2 + 4 + 1
    for name, r in rs.items():
        _clean(r)
        if name.startswith("flags"):
            assert r["flags"] == [10, 10] and r["out"][2:] == [0, 1], r  # both raised to 10; blocks 0 and 1
        if name.startswith("latency store"):
            out = r["out"]
            assert all(out[2 * s + 1] >= out[2 * s] for s in range(4)), r  # written after read
        if name.startswith("poll"):
            assert r["out"][1] == 0, r  # the flag stayed 0


def test_reductions_are_exact(model_check):
    rs = model_check("reduce")
    assert len(rs) == 7
    for r in rs.values():
        _clean(r)
        assert r["wrong"] == 0, r
