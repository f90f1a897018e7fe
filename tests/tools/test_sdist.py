"""The source distribution (MANIFEST.in): it carries what setup.py reads at build time (csrc/
sources and headers, scripts/find_nvshmem.py, README.md) and what a user of the source needs
(scripts, recipes, docs, the measurement records of benchmarks/results/, the development tools of
tools/, tests with conftest.py),
and no build outputs. Nothing is compiled: `setup.py sdist` with the CUDA and model builds
skipped, on a copy of this tree with a few build outputs planted in it, then setup.py's own
loader of find_nvshmem.py run from the unpacked sdist (the step that failed a wheel build from
the sdist on a CUDA machine)."""

from __future__ import annotations

import ast
import glob
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

NO_COMPILE = {"HYBRID_EP_SKIP_CUDA_BUILD": "1", "PYTHONWARNINGS": "ignore"}  # the CPU model: only on request
# Build outputs planted in the copy: none may reach the sdist.
PLANTED = ["hybrid_ep/_C.cpython-312-x86_64-linux-gnu.so", "csrc/kernels/dispatch.o",
           "tests/__pycache__/conftest.cpython-312.pyc", "build/lib/hybrid_ep/_model.so", "results/demo/run.json",
           "recipes/tiny_moe/__pycache__/x.pyc", "tools/timing/__pycache__/cli.cpython-312.pyc"]
_IGNORED_NAMES = shutil.ignore_patterns(".git", ".pytest_cache", "__pycache__", "*.so", "*.o", "*.egg-info", "build",
                                        "dist", ".before")


def _IGNORED(folder, names):
    """What the copy of the tree leaves out: build outputs, caches and the tools' results/ at the
    top (benchmarks/results/ holds the committed measurement records the docs cite)."""
    top = os.path.abspath(folder) == os.path.abspath(REPO)
    return set(_IGNORED_NAMES(folder, names)) | ({"results"} & set(names) if top else set())


def _is_build_output(name: str) -> bool:
    return name.endswith((".so", ".o", ".pyc")) or "__pycache__" in name \
        or name.split("/")[0] in ("build", "dist", "results")


def _relative(paths, root):
    """Files among `paths`, relative to root, build outputs left out."""
    names = (os.path.relpath(p, root) for p in paths if os.path.isfile(p))
    return sorted(n for n in names if not _is_build_output(n))


def _build_time_files(root: str) -> list[str]:
    """What setup.py reads while it builds: every csrc source and header (_csrc_files, the
    extensions' sources and depends), scripts/find_nvshmem.py (_load_finder), README.md."""
    csrc = [p for ext in ("cu", "cuh", "h", "cpp") for p in glob.glob(f"{root}/csrc/**/*.{ext}", recursive=True)]
    return _relative(csrc, root) + ["README.md", "pyproject.toml", "scripts/find_nvshmem.py", "setup.py"]


def _user_files(root: str) -> list[str]:
    """What a user of the source needs besides the packages."""
    found = glob.glob(f"{root}/scripts/*")
    for folder in ("recipes", "docs", "benchmarks", "tools", "tests", "hybrid_ep", "megatron_patches"):
        found += glob.glob(f"{root}/{folder}/**/*", recursive=True)
    return _relative(found, root)


@pytest.fixture(scope="module")
def sdist(tmp_path_factory):
    """(files in the sdist relative to its top folder, the unpacked sdist, the copied tree it
    was built from)."""
    tmp = tmp_path_factory.mktemp("sdist")
    tree = tmp / "tree"
    shutil.copytree(REPO, tree, ignore=_IGNORED)
    for path in PLANTED:
        os.makedirs(os.path.dirname(tree / path), exist_ok=True)
        (tree / path).write_bytes(b"\0build output")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "--dist-dir", str(tmp / "dist")], cwd=tree,
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, **NO_COMPILE))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (archive,) = glob.glob(str(tmp / "dist" / "*.tar.gz"))
    with tarfile.open(archive) as tar:
        top = os.path.commonpath(tar.getnames())
        names = sorted(os.path.relpath(m.name, top) for m in tar.getmembers() if m.isfile())
        tar.extractall(tmp / "unpacked", filter="data")
    return names, str(tmp / "unpacked" / top), str(tree)


def test_sdist_carries_what_setup_py_reads_at_build_time(sdist):
    names, _, tree = sdist
    missing = sorted(set(_build_time_files(tree)) - set(names))
    assert not missing, f"setup.py reads these at build time, the sdist lacks them: {missing}"
    assert any(n.startswith("csrc/kernels/") and n.endswith(".cu") for n in names)


def test_sdist_carries_scripts_recipes_docs_and_tests(sdist):
    names, _, tree = sdist
    missing = sorted(set(_user_files(tree)) - set(names))
    assert not missing, f"the sdist lacks: {missing}"
    for needed in ("LICENSE", "tests/conftest.py", "tests/helpers.py", "recipes/tiny_moe/recipe.yaml",
                   "recipes/bench_dispatch/recipe.yaml", "docs/slurm.md", "scripts/launch_slurm.py", "MANIFEST.in",
                   "tools/timing/h100.json", "tools/timing/README.md", "tools/microbench/__main__.py"):
        assert needed in names, needed


def test_sdist_has_no_build_outputs(sdist):
    names, _, _ = sdist
    assert not [n for n in names if _is_build_output(n)]


# setup.py's _load_finder, taken from the unpacked sdist's setup.py and run there (running the
# file itself would call setup()): on a machine with CUDA torch and nvcc, _nvshmem_for calls it.
LOAD_FINDER = textwrap.dedent('''
    import ast, os, sys
    source = open("setup.py").read()
    (fn,) = [n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "_load_finder"]
    scope = {"os": os, "sys": sys, "__file__": os.path.abspath("setup.py")}
    exec(compile(ast.Module([fn], []), "setup.py", "exec"), scope)
    finder = scope["_load_finder"]()
    found, reason = finder.find()
    print("FINDER", finder.__file__, found is not None or bool(finder.not_found_line(reason)))
''')


def test_unpacked_sdist_loads_find_nvshmem_as_setup_py_does(sdist):
    _, unpacked, _ = sdist
    assert ast.parse(open(os.path.join(unpacked, "setup.py")).read())  # the sdist's own setup.py
    proc = subprocess.run([sys.executable, "-c", LOAD_FINDER], cwd=unpacked, capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"FINDER {os.path.join(unpacked, 'scripts', 'find_nvshmem.py')} True" in proc.stdout, proc.stdout
