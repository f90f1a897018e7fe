"""scripts/compile_csrc.sh, the nvcc compile check of csrc/ that CI runs (scripts/test.sh): a
compile error in any file fails the run and the run names the file, with the files compiled one
at a time or several at once; and every source under csrc/ is compiled there or by setup.py."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

SCRIPT = Path(REPO, "scripts", "compile_csrc.sh")
GOOD_CU = ("template <int N> __global__ void fill(int* out) { out[threadIdx.x] = N; }\n"
           "template __global__ void fill<3>(int*);\n")
GOOD_CPP = "#include <vector>\nint count() { std::vector<int> v{1, 2}; return static_cast<int>(v.size()); }\n"
BAD_CU = "__global__ void fill(int* out) { out[threadIdx.x] = missing_name; }\n"  # an undeclared name
BAD_CPP = "#include <vector>\nint count() { std::vector<int> v; return v.size() }\n"  # a missing ';'


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A checkout of the script and the files (paths under csrc/) and nothing else."""
    (root / "scripts").mkdir(parents=True)
    for name in ("compile_csrc.sh", "find_nvshmem.py"):
        shutil.copy(Path(REPO, "scripts", name), root / "scripts" / name)
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    return root


def _compile(root: Path, jobs: int, **extra: str) -> subprocess.CompletedProcess:
    # sm_90a alone, and no NVSHMEM: the files here need neither the second arch nor the transport
    env = {**os.environ, "PYTHON": sys.executable, "HYBRID_EP_CUDA_ARCHS": "90a", "HYBRID_EP_COMPILE_JOBS": str(jobs),
           "NVSHMEM_HOME": str(root / "no-nvshmem"), "HYBRID_EP_COMPILE_CACHE": str(root / "stamps"), **extra}
    return subprocess.run(["bash", str(root / "scripts" / "compile_csrc.sh")], env=env, capture_output=True, text=True,
                          timeout=600)


needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not found")


@needs_nvcc
@pytest.mark.parametrize("jobs", [pytest.param(1, marks=pytest.mark.slow), 2])  # slow: the full tier
def test_a_compile_error_in_any_file_fails_the_run_and_names_it(tmp_path, jobs):
    """A kernel (.cu) with an undeclared name and a host file (.cpp) with a syntax error, beside
    a file that compiles: the run fails and names both, and the good file still compiles."""
    root = _tree(tmp_path, {"csrc/kernels/a_good.cu": GOOD_CU, "csrc/kernels/b_bad.cu": BAD_CU,
                            "csrc/transport/c_bad.cpp": BAD_CPP})
    run = _compile(root, jobs)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "compile_csrc: 2 file(s) failed to compile: csrc/kernels/b_bad.cu csrc/transport/c_bad.cpp" in run.stderr
    assert "missing_name" in run.stdout and "c_bad.cpp:2" in run.stdout  # the compilers' own messages
    assert "compile_csrc: csrc/kernels/a_good.cu (sm 90a)\n" in run.stdout
    assert "file(s) compiled with" not in run.stdout


@needs_nvcc
def test_clean_files_compile_several_at_once_and_are_counted(tmp_path):
    files = {f"csrc/kernels/k{i}.cu": GOOD_CU for i in range(3)} | {"csrc/transport/host.cpp": GOOD_CPP}
    run = _compile(_tree(tmp_path, files), jobs=2)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = [line for line in run.stdout.splitlines() if line.startswith("compile_csrc: csrc/")]
    assert lines == ["compile_csrc: csrc/kernels/k0.cu (sm 90a)", "compile_csrc: csrc/kernels/k1.cu (sm 90a)",
                     "compile_csrc: csrc/kernels/k2.cu (sm 90a)", "compile_csrc: csrc/transport/host.cpp"]
    assert "compile_csrc: 4 file(s) compiled with " in run.stdout and ", 2 at a time;" in run.stdout


# A compiler that fails on a source naming `missing_name`, else writes the object: the stamp's
# rules need no real compile.
STUB_NVCC = """#!/usr/bin/env bash
[ "$1" = --version ] && { echo "stub nvcc 1.0"; exit 0; }
src="" obj=""
while [ $# -gt 0 ]; do case "$1" in -c) src=$2; shift;; -o) obj=$2; shift;; esac; shift; done
if grep -q missing_name "$src"; then echo "$src: missing_name undeclared"; exit 1; fi
touch "$obj"
"""


def test_a_passed_check_is_not_repeated_until_a_source_changes(tmp_path):
    """The stamp of a check that passed: the same tree again compiles nothing and says so; a
    changed source compiles everything again; a failed check leaves no stamp."""
    root = _tree(tmp_path / "tree", {"csrc/kernels/k0.cu": GOOD_CU})
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(STUB_NVCC)
    nvcc.chmod(0o755)
    stub = {"NVCC": str(nvcc), "PYTHON": "false"}  # no Python: no host includes, no NVSHMEM lookup
    first, again = _compile(root, 1, **stub), _compile(root, 1, **stub)
    assert first.returncode == again.returncode == 0, first.stdout + first.stderr + again.stderr
    assert "compile_csrc: 1 file(s) compiled with stub nvcc 1.0" in first.stdout
    assert "compile_csrc: nothing changed since the check that passed" in again.stdout
    assert "file(s) compiled with" not in again.stdout
    (root / "csrc/kernels/k0.cu").write_text(GOOD_CU + "// changed\n")
    changed = _compile(root, 1, **stub)
    assert "compile_csrc: 1 file(s) compiled with " in changed.stdout, changed.stdout + changed.stderr
    (root / "csrc/kernels/k1.cu").write_text(BAD_CU)
    failed, still = _compile(root, 1, **stub), _compile(root, 1, **stub)
    assert failed.returncode == still.returncode == 1
    assert "nothing changed" not in still.stdout and "failed to compile: csrc/kernels/k1.cu" in still.stderr


def test_a_cache_that_cannot_be_written_does_not_fail_a_passed_check(tmp_path):
    """A read-only cache (CI's restored home, a full disk): the check passes, says the stamp is
    missing, and the next run compiles again."""
    root = _tree(tmp_path / "tree", {"csrc/kernels/k0.cu": GOOD_CU})
    nvcc = tmp_path / "nvcc"
    nvcc.write_text(STUB_NVCC)
    nvcc.chmod(0o755)
    cache = tmp_path / "not-a-folder"
    cache.write_text("a file where the cache's folder would be\n")  # mkdir -p fails, as for root
    stub = {"NVCC": str(nvcc), "PYTHON": "false", "HYBRID_EP_COMPILE_CACHE": str(cache)}
    first, again = _compile(root, 1, **stub), _compile(root, 1, **stub)
    assert first.returncode == again.returncode == 0, first.stdout + first.stderr
    assert f"compile_csrc: passed, but no stamp could be written in {cache}" in first.stdout
    assert "compile_csrc: 1 file(s) compiled with stub nvcc 1.0" in again.stdout


def test_a_bad_job_count_is_refused(tmp_path):
    env = {**os.environ, "NVCC": "/bin/true", "HYBRID_EP_COMPILE_JOBS": "0"}
    run = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 2 and "HYBRID_EP_COMPILE_JOBS must be a whole number >= 1, got '0'" in run.stderr


def _sanitize_sources(module: str) -> list[str]:
    spec = importlib.util.spec_from_file_location("sanitize_under_test", Path(REPO, "scripts", "sanitize.py"))
    sanitize = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sanitize)
    return [os.path.relpath(p, REPO) for p in sanitize._sources(module)]


def test_every_source_is_compiled_here_or_by_setup_py():
    """What the script leaves out is exactly what setup.py builds in every install with the host
    compiler (the planner and the CPU model, the sources scripts/sanitize.py builds too); every
    other source under csrc/, a new one included, is compiled with nvcc."""
    listed = subprocess.run(["bash", str(SCRIPT), "--list"], capture_output=True, text=True, check=True).stdout
    rows = [line.split(" ", 1) for line in listed.splitlines()]
    compiled = [path for how, path in rows if how == "compile"]
    left = [path for how, path in rows if how == "setup.py"]
    assert len(compiled) + len(left) == len(rows)
    assert sorted(left) == sorted(_sanitize_sources("planner") + _sanitize_sources("model"))
    every = sorted(str(p.relative_to(REPO)) for ext in ("cu", "cpp") for p in Path(REPO, "csrc").rglob(f"*.{ext}"))
    assert sorted(compiled + left) == every
    assert {"csrc/kernels/dispatch_receive.cu", "csrc/kernels/combine_receive.cu", "csrc/bindings/cuda_module.cpp",
            "csrc/microbench/main.cu"} <= set(compiled)
