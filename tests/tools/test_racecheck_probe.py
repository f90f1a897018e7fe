"""The racecheck probe (csrc/tools/racecheck_probe.cu) built with nvcc for sm_90a on a machine
without a GPU: its case list in the form `scripts/gpu_check.sh racecheck-probe` reads (one clean
control, one racy control, every kernel class of docs/benchmarks/racecheck.md with a case), and
its answers to a bad case, no argument and no device. What racecheck reports needs a GPU."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    if shutil.which("nvcc") is None:
        pytest.skip("nvcc not found")
    out = tmp_path_factory.mktemp("racecheck_probe")
    subprocess.run(["bash", str(Path(REPO, "scripts", "build_racecheck_probe.sh")), str(out)], check=True,
                   capture_output=True, text=True, timeout=300)
    return str(out / "racecheck_probe")


@pytest.mark.slow
def test_the_case_list_has_both_controls_and_a_case_per_class(program):
    listed = subprocess.run([program, "--list"], capture_output=True, text=True)
    assert listed.returncode == 0 and listed.stderr == ""
    rows = [line.split("\t") for line in listed.stdout.splitlines()]
    assert all(len(row) == 5 for row in rows)
    cases = {name: (ordered, role, kernels) for name, ordered, role, _, kernels in rows}
    assert [name for name, (_, role, _) in cases.items() if role == "control"] == ["syncthreads", "racy"]
    assert cases["syncthreads"][0] == "ordered" and cases["racy"][0] == "racy"
    assert all(ordered == "ordered" for name, (ordered, _, _) in cases.items() if name != "racy")
    # the site pairs racecheck flagged on 2026-11-26, each behind one probe case
    for site in ("dispatch_direct.cuh:124", "dispatch.cuh:497", "segments.cuh:163", "primitives.cuh:68"):
        assert sum(site in kernels for _, _, kernels in cases.values()) == 1, site


@pytest.mark.slow
def test_a_bad_case_no_argument_and_no_device(program):
    bad = subprocess.run([program, "syncthreads", "bogus"], capture_output=True, text=True)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr == "racecheck_probe: unknown case 'bogus' (--list names them)\n"
    bare = subprocess.run([program], capture_output=True, text=True)
    assert bare.returncode == 2 and bare.stderr.startswith("usage: racecheck_probe --list | all | CASE...")
    helped = subprocess.run([program, "--help"], capture_output=True, text=True)
    assert helped.returncode == 0 and helped.stdout == bare.stderr
    if shutil.which("nvidia-smi") is None:  # no GPU here: nothing on stdout, status 3
        run = subprocess.run([program, "all"], capture_output=True, text=True, timeout=60)
        assert run.returncode == 3 and run.stdout == "" and run.stderr == "racecheck_probe: no CUDA device\n"
