"""The mutation script's defects still apply to today's kernels: each one's text occurs exactly
once in its file and changes it (the script itself rebuilds the model per defect and is run by
hand, docs/dev/cpu_model.md)."""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit


def _script():
    path = os.path.join(REPO, "scripts", "model_mutations.py")
    spec = importlib.util.spec_from_file_location("model_mutations", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _mutations():
    return _script().MUTATIONS


@pytest.mark.parametrize("mutation", _mutations(), ids=lambda m: m.name)
def test_each_defect_plants_into_todays_kernels(mutation):
    with open(os.path.join(REPO, mutation.path)) as f:
        text = f.read()
    assert text.count(mutation.old) == 1, f"{mutation.name}: update its text to {mutation.path} as it is today"
    assert mutation.new != mutation.old


def test_every_kernel_file_has_a_defect():
    paths = {m.path for m in _mutations()}
    assert {"csrc/kernels/dispatch_receive.cuh", "csrc/kernels/combine_receive.cuh", "csrc/kernels/count.cuh",
            "csrc/kernels/dispatch_direct.cuh", "csrc/kernels/combine_direct.cuh", "csrc/kernels/segments.cuh",
            "csrc/kernels/direct.cuh", "csrc/kernels/pipeline.cuh", "csrc/kernels/skeleton.cuh"} <= paths


def test_a_completion_count_of_the_wrong_call_is_planted_on_both_data_paths():
    """Issue 60's list of defects of the new kind: a completion count of the wrong call, on the
    receive path's chunk signals and on the direct path's per-call counts."""
    wrong_call = {m.path for m in _mutations() if m.kind.startswith("a completion count of the wrong call")}
    assert {"csrc/kernels/dispatch_receive.cuh", "csrc/kernels/dispatch_direct.cuh",
            "csrc/kernels/direct.cuh"} <= wrong_call


def test_a_test_run_past_the_timeout_is_a_timeout_not_a_verdict(monkeypatch, tmp_path, capsys):
    """On a loaded machine a defect's tests can outlast --timeout: the script records that defect
    as timed out (neither caught nor missed), runs the next one and exits 1."""
    import json
    import subprocess

    script = _script()
    first, second = script.MUTATIONS[0].name, script.MUTATIONS[1].name
    runs = []

    def run_tests(root, tests, timeout_s):
        runs.append(root)
        if len(runs) == 1:
            raise subprocess.TimeoutExpired(["pytest"], timeout_s)
        if len(runs) == 2:  # the second defect is caught
            return 1, "FAILED tests/x.py::test_y\nE   AssertionError: rows differ\n"
        return 0, "1 passed"  # the control passes: the timeout alone makes the exit 1

    monkeypatch.setattr(script, "_copy_checkout", lambda dst: None)
    monkeypatch.setattr(script, "_plant", lambda root, m: None)
    monkeypatch.setattr(script, "_build", lambda root, log: None)
    monkeypatch.setattr(script, "_run_tests", run_tests)
    out = tmp_path / "results.json"
    assert script.main(["--only", first, second, "--json", str(out), "--timeout", "7"]) == 1
    doc = json.loads(out.read_text())
    assert next(iter(doc)) == "metadata" and doc["metadata"]["config"]["timeout_s"] == 7
    rows = doc["results"]
    assert [(r["defect"], r["caught"], r["timed_out"]) for r in rows] == [
        (first, False, True), (second, True, False), ("control (no defect)", False, False)]
    printed = capsys.readouterr().out
    assert f"{first:<26} TIMED OUT" in printed and "ran past --timeout 7 s" in printed
