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


def _mutations():
    path = os.path.join(REPO, "scripts", "model_mutations.py")
    spec = importlib.util.spec_from_file_location("model_mutations", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.MUTATIONS


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
