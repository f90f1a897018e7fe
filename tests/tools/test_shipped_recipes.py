"""The recipes ship with the package and are named, not pathed: `hybrid-ep-launch deepseek_v3`
from a folder outside the checkout, with the package as setuptools lays it out for a wheel,
renders what `recipes/deepseek_v3` renders in the clone. The layout comes from setuptools' own
build_py (the packages' modules and pyproject.toml's package data, the recipes read through the
link megatron_patches/slurm/recipes -> recipes/), about 1 s, with the checkout's compiled
modules beside it; tests/tools/test_wheel_contents.py builds and installs the wheel itself (slow)."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys

import pytest

from helpers import REPO
from megatron_patches.slurm import recipe as recipe_mod

pytestmark = pytest.mark.unit

NO_COMPILE = {"HYBRID_EP_SKIP_CUDA_BUILD": "1", "HYBRID_EP_SKIP_MODEL_BUILD": "1", "PYTHONWARNINGS": "ignore"}


def test_the_package_ships_the_checkouts_recipes_through_one_link():
    link = os.path.join(REPO, "megatron_patches", "slurm", "recipes")
    assert os.path.islink(link) and os.path.realpath(link) == os.path.realpath(os.path.join(REPO, "recipes"))
    assert os.path.realpath(recipe_mod.RECIPES_DIR) == os.path.realpath(os.path.join(REPO, "recipes"))


def _render(cwd: str, recipe: str, env: dict) -> str:
    proc = subprocess.run([sys.executable, "-m", "megatron_patches.slurm.cli", recipe, "--dry-run"], cwd=cwd,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_a_recipe_by_name_from_outside_the_checkout_renders_as_in_the_clone(tmp_path):
    lib = tmp_path / "lib"
    proc = subprocess.run([sys.executable, "setup.py", "-q", "build_py", "--build-lib", str(lib)], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, **NO_COMPILE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    shipped = recipe_mod.recipe_names(str(lib / "megatron_patches" / "slurm" / "recipes"))
    assert shipped == recipe_mod.recipe_names(os.path.join(REPO, "recipes")) and "deepseek_v3" in shipped
    assert not os.path.islink(lib / "megatron_patches" / "slurm" / "recipes")  # the files themselves
    for built in glob.glob(os.path.join(REPO, "hybrid_ep", "_*.so")):  # what the wheel's build compiles
        shutil.copy(built, lib / "hybrid_ep")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = dict(os.environ, PYTHONPATH=str(lib), PYTHONWARNINGS="ignore")
    where = subprocess.run([sys.executable, "-c", "import megatron_patches; print(megatron_patches.__file__)"],
                           cwd=elsewhere, capture_output=True, text=True, env=env, check=True).stdout
    assert where.startswith(str(lib)), where
    installed = _render(str(elsewhere), "deepseek_v3", env)
    clone = _render(REPO, "recipes/deepseek_v3", dict(os.environ, PYTHONWARNINGS="ignore"))
    assert installed == clone
    assert "# Rendered by hybrid-ep-launch from the recipe deepseek_v3 shipped with hybrid-ep\n" in installed
