"""The timing model of the kernels on the CPU model (hybrid_ep.timing, csrc/device/model/timing.*).

The measured points it is calibrated on are data (docs/benchmarks/timing/points.json); they
must be exactly the GPU runs' numbers, each tied to the commit that was measured.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from hybrid_ep.timing import points

pytestmark = pytest.mark.model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_RUNS = os.path.join(REPO, "docs", "benchmarks", "gpu")


def test_points_are_the_gpu_runs_numbers():
    runs, pts = points.load_points()
    assert len(pts) == 30  # 2026-11-22: 12; 2026-11-24: 12 on one node, 6 on two
    for name, run in runs.items():
        with open(os.path.join(GPU_RUNS, name, "emulated.json")) as f:
            want_run, want = points.points_from_run(json.load(f), name, run.commit, run.commit_note)
        assert run == want_run
        assert [p for p in pts if p.run == name] == want
    keys = [(p.run, *p.key) for p in pts]
    assert len(set(keys)) == len(keys)
    combine_w2 = {p.run: p.ms for p in pts if p.key == (2, 1, 1, "combine")}
    assert combine_w2 == {"2026-11-22-h100/bench": pytest.approx(233.636, abs=1e-3),
                          "2026-11-24-h100/bench": pytest.approx(203.405, abs=1e-3)}


def test_every_run_names_a_commit_of_the_repository():
    runs, _ = points.load_points()
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                             text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("needs the repository's whole history")
    for run in runs.values():
        done = subprocess.run(["git", "cat-file", "-e", f"{run.commit}^{{commit}}"], cwd=REPO)
        assert done.returncode == 0, f"{run.name}: {run.commit} is not a commit"
