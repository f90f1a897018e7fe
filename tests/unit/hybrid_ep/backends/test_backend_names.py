"""One list of backend names (hybrid_ep.backends): every place that takes a backend name accepts
exactly that list, and the benchmark exactly its implementations and its baselines (other libraries)."""

from __future__ import annotations

import argparse
import os

import pytest

from helpers import REPO
from hybrid_ep.backends import BACKEND_NAMES, BACKENDS
from hybrid_ep.bench.spec import BASELINES, BENCH_BACKENDS
from megatron_patches import options
from megatron_patches.slurm import recipe as recipe_mod
from megatron_patches.slurm import validate

pytestmark = pytest.mark.unit

NOT_BACKENDS = ["deepep", "nccl", "AUTO", ""]


def test_the_names_are_auto_and_the_implementations():
    assert BACKEND_NAMES == ("auto", *BACKENDS)
    assert BENCH_BACKENDS == (*BACKENDS, *BASELINES) and not set(BASELINES) & set(BACKEND_NAMES)


def test_the_megatron_flag_offers_exactly_the_backend_names():
    parser = options.add_arguments(argparse.ArgumentParser())
    action = next(a for a in parser._actions if "--hybrid-ep-backend" in a.option_strings)
    assert tuple(action.choices) == BACKEND_NAMES
    for name in BACKEND_NAMES:
        assert options.HybridEPOptions(backend=name).validate().backend == name
    for name in NOT_BACKENDS:
        with pytest.raises(ValueError, match="hybrid_ep option backend must be one of"):
            options.HybridEPOptions(backend=name).validate()


def _dispatcher_problems(backend: str) -> list[tuple[str, str]]:
    recipe = recipe_mod.load(os.path.join(REPO, "recipes", "tiny_moe"), [f"dispatcher.backend={backend}"])
    try:
        validate.validate(recipe)
    except recipe_mod.RecipeError as err:
        return [p for p in err.problems if p[0] == "dispatcher.backend"]
    return []


@pytest.mark.parametrize("name", BACKEND_NAMES + tuple(NOT_BACKENDS[:2]))
def test_the_recipe_validator_accepts_exactly_the_backend_names(name):
    problems = _dispatcher_problems(name)
    if name in BACKEND_NAMES:
        assert problems == []
    else:
        assert problems == [("dispatcher.backend", f"must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")]
