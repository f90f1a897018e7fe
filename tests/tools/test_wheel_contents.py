"""The wheel (`pip wheel .`): the library, its extensions and the user CLIs, and none of the
development tools beside it (tools/: the timing model with its tables and accessor patches, the
microbenchmarks' driver). pip builds in the source folder,
so the wheel is built from a copy of this tree with the venv's pip, without build isolation (the
installed setuptools and torch), the CUDA extension skipped as on a machine without a GPU, and
the CPU model too (hybrid_ep._model: the same setup.py path as the planner's, minutes more on 2
cores); the planner hybrid_ep._planner is always built, so the wheel holds one extension."""

from __future__ import annotations

import ast
import configparser
import glob
import os
import shutil
import subprocess
import sys
import zipfile

import pytest
import tomllib

from helpers import REPO

pytestmark = [pytest.mark.unit, pytest.mark.slow]

PACKAGES = ("hybrid_ep", "megatron_patches")
NO_CUDA = {"HYBRID_EP_SKIP_CUDA_BUILD": "1", "HYBRID_EP_SKIP_MODEL_BUILD": "1", "PYTHONWARNINGS": "ignore",
           "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
_IGNORED = shutil.ignore_patterns(".git", ".pytest_cache", ".mypy_cache", ".ruff_cache", "__pycache__", "*.so", "*.o",
                                  "*.egg-info", "build", "dist", "results", ".before")


def _library_modules(tree: str) -> list[str]:
    """The packages' modules in the tree, relative to it."""
    found = []
    for package in PACKAGES:
        for path in glob.glob(f"{tree}/{package}/**/*.py", recursive=True):
            found.append(os.path.relpath(path, tree).replace(os.sep, "/"))
    return sorted(found)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """(the wheel's file names, the wheel, the copied tree it was built from)."""
    tmp = tmp_path_factory.mktemp("wheel")
    tree = tmp / "tree"
    shutil.copytree(REPO, tree, ignore=_IGNORED)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", str(tree), "-w", str(tmp / "dist"), "--no-deps",
                           "--no-build-isolation", "-q"], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, **NO_CUDA))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (path,) = glob.glob(str(tmp / "dist" / "hybrid_ep-*.whl"))
    with zipfile.ZipFile(path) as whl:
        names = sorted(whl.namelist())
    return names, path, str(tree)


def test_wheel_holds_no_development_tool(wheel):
    names, _, tree = wheel
    assert os.path.isdir(os.path.join(tree, "tools", "timing"))  # the tree it came from has them
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == set(PACKAGES), tops
    unwanted = [n for n in names if n.endswith(".patch") or "/timing/" in n
                or "/microbench/" in n or n.endswith(("h100.json", "h200.json", "points.json"))]
    assert not unwanted, unwanted


def test_wheel_holds_every_library_module_and_the_planner(wheel):
    names, _, tree = wheel
    modules = _library_modules(tree)
    assert "hybrid_ep/buffer.py" in modules and "megatron_patches/__init__.py" in modules
    assert sorted(n for n in names if n.endswith(".py")) == modules
    assert [n for n in names if n.endswith(".so")] == [n for n in names if n.startswith("hybrid_ep/_planner.")]
    assert any(n.startswith("hybrid_ep/_planner.") for n in names)


def test_wheel_names_the_user_clis_of_pyproject(wheel):
    names, path, tree = wheel
    with open(os.path.join(tree, "pyproject.toml"), "rb") as f:
        scripts = tomllib.load(f)["project"]["scripts"]
    assert set(scripts) == {"hybrid-ep-bench", "hybrid-ep-traffic", "hybrid-ep-balance", "hybrid-ep-launch"}
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    parser = configparser.ConfigParser()
    with zipfile.ZipFile(path) as whl:
        parser.read_string(whl.read(entry_points).decode())
    assert dict(parser["console_scripts"]) == scripts
    for target in scripts.values():  # each CLI's module is in the wheel and defines the function
        module, function = target.split(":")
        rel = module.replace(".", "/") + ".py"
        assert rel in names, target
        with zipfile.ZipFile(path) as whl:
            tree_ = ast.parse(whl.read(rel))
        assert any(isinstance(n, ast.FunctionDef) and n.name == function for n in tree_.body), target


def test_wheel_modules_import_no_tool(wheel):
    """An installed hybrid_ep has no tools/ beside it: none of its modules may import one."""
    names, path, _ = wheel
    offenders = []
    with zipfile.ZipFile(path) as whl:
        for name in (n for n in names if n.endswith(".py")):
            for node in ast.walk(ast.parse(whl.read(name))):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
                offenders += [f"{name}: {m}" for m in mods if m == "tools" or m.startswith("tools.")]
    assert not offenders, offenders


def test_the_installed_wheel_renders_a_recipe_by_name_from_any_folder(wheel, tmp_path):
    """`pip install` of the wheel, then `hybrid-ep-launch deepseek_v3` from a folder outside the
    checkout: the recipe ships with the package (package data) and renders as in the clone."""
    names, path, tree = wheel
    shipped = sorted({n.split("/")[3] for n in names if n.startswith("megatron_patches/slurm/recipes/")
                      and n.endswith("/recipe.yaml")})
    assert shipped == sorted(d for d in os.listdir(os.path.join(tree, "recipes"))
                             if os.path.isfile(os.path.join(tree, "recipes", d, "recipe.yaml")))
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-compile", "-q", "--target",
                           str(target), path], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, **NO_CUDA))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def render(cwd, recipe, **env):
        out = subprocess.run([sys.executable, "-m", "megatron_patches.slurm.cli", recipe], cwd=cwd,
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, PYTHONWARNINGS="ignore", **env))
        assert out.returncode == 0, out.stderr[-3000:]
        return out.stdout

    assert render(elsewhere, "deepseek_v3", PYTHONPATH=str(target)) == render(REPO, "recipes/deepseek_v3")
