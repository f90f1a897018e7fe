"""Run pytest on AddressSanitizer + UndefinedBehaviorSanitizer builds of the native modules.

Two modules run on the CPU on every machine and touch memory through computed indices:
- hybrid_ep._planner, the balancer's placement planner. It runs in training on loads and
  previous placements that users and checkpoints hand in; a read past one of its tables would
  not crash but quietly plan a wrong slot, and the balancer would migrate experts to it;
- hybrid_ep._model, the kernels' own sources on the CPU model of the device layer. An index
  past a buffer there is the same index on the GPU, where nothing reports it.
Each is built from the sources setup.py compiles, at -O1 with -fsanitize=address,undefined,
and pytest runs in a child process with the sanitizer runtimes preloaded (Python itself is not
instrumented) and the sanitized modules standing in for the installed ones. The first report
ends the run with a non-zero exit; pytest captures the tests' stderr, so the sanitizers write
their reports to files that are printed at the end. The model's fibers tell AddressSanitizer
of every stack switch (csrc/device/model/fiber.cpp) and get 4x larger stacks under it.

    python scripts/sanitize.py                           # both modules, their default tests
    python scripts/sanitize.py --module planner          # tests/test_balancer_planner.py
    python scripts/sanitize.py --module model -q tests/test_kernels_model.py -k combine

Needs a C++ compiler with the sanitizer runtimes (g++ or clang++; CXX picks one) and pybind11.
Exit 3 when they are missing, so callers can tell "cannot check here" from "found a bug".
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CANNOT_CHECK = 3  # exit status: no compiler, sanitizer runtime or pybind11 here
SANITIZERS = ("asan", "ubsan")
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=1"  # CPython's own allocations read as leaks
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"
PYTEST_DEFAULTS = ["-q", "-p", "no:cacheprovider"]


def _sources(module: str) -> list[str]:
    folder, binding = {"planner": ("balancer", "planner_module.cpp"),
                       "model": (os.path.join("device", "model"), "model_module.cpp")}[module]
    return sorted(glob.glob(os.path.join(REPO, "csrc", folder, "*.cpp"))) + [
        os.path.join(REPO, "csrc", "bindings", binding)]


DEFAULT_TESTS = {
    "planner": ["tests/test_balancer_planner.py"],
    "model": ["tests/test_device_model.py", "tests/test_kernels_model.py", "tests/test_hierarchy_model.py"],
}


def _runtime(cxx: str, name: str) -> str | None:
    """Absolute path of the compiler's shared sanitizer runtime (lib<name>.so), or None."""
    try:
        path = subprocess.run([cxx, f"-print-file-name=lib{name}.so"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return os.path.realpath(path) if os.path.isabs(path) and os.path.exists(path) else None


def _pybind11_includes() -> list[str] | None:
    """pybind11's headers (a build requirement in pyproject.toml), or None without it."""
    try:
        import pybind11
    except ImportError:
        return None
    return [pybind11.get_include()]


def build(module: str, cxx: str, build_dir: str, includes: list[str]) -> subprocess.Popen:
    """Start compiling the sanitized module into build_dir (hybrid_ep.<_module><EXT_SUFFIX>)."""
    out = os.path.join(build_dir, f"_{module}" + sysconfig.get_config_var("EXT_SUFFIX"))
    cmd = [cxx, "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
           "-fno-sanitize-recover=undefined", "-std=c++17", "-fno-strict-aliasing", "-Wno-unknown-pragmas",
           "-shared", "-fPIC", "-I" + os.path.join(REPO, "csrc"), *("-I" + d for d in includes),
           "-I" + sysconfig.get_paths()["include"], *_sources(module), "-o", out]
    print(f"sanitize: building {out}", flush=True)
    return subprocess.Popen(cmd)


def _child(modules: list[str], pytest_args: list[str]) -> int:
    """In the preloaded process: put the sanitized modules in place, then run pytest here."""
    import hybrid_ep
    loaded = {}
    for path in modules:
        name = "hybrid_ep." + os.path.basename(path).split(".")[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
        setattr(hybrid_ep, name.split(".")[1], module)  # `from .. import _planner` finds this one
        loaded[name] = module
    import pytest
    rc = int(pytest.main(pytest_args))
    for name, module in loaded.items():  # the run must have used the sanitized builds
        if sys.modules.get(name) is not module:
            print(f"sanitize: the tests imported another {name}", file=sys.stderr)
            return rc or 1
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--module", action="append", choices=sorted(DEFAULT_TESTS),
                        help="module to sanitize (repeat for both; default both)")
    parser.add_argument("--build-dir", help="where the sanitized modules go (default: a temporary folder)")
    parser.add_argument("--child", action="append", help=argparse.SUPPRESS)  # module paths, in the child
    args, pytest_args = parser.parse_known_args(argv)
    if args.child:
        return _child(args.child, pytest_args)
    modules = args.module or sorted(DEFAULT_TESTS)
    if not pytest_args:
        pytest_args = PYTEST_DEFAULTS + [os.path.join(REPO, t) for m in modules for t in DEFAULT_TESTS[m]]

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        print("sanitize: no C++ compiler (set CXX)", file=sys.stderr)
        return CANNOT_CHECK
    runtimes = [_runtime(cxx, name) for name in SANITIZERS]
    if None in runtimes:
        print(f"sanitize: {cxx} has no shared {' / '.join(SANITIZERS)} runtime", file=sys.stderr)
        return CANNOT_CHECK
    includes = _pybind11_includes()
    if includes is None:
        print("sanitize: pybind11 is not importable (pip install pybind11)", file=sys.stderr)
        return CANNOT_CHECK
    with tempfile.TemporaryDirectory(prefix="sanitize_") as tmp:
        build_dir = args.build_dir or tmp
        os.makedirs(build_dir, exist_ok=True)
        builds = {m: build(m, cxx, build_dir, includes) for m in modules}  # both compile at once
        if [proc.wait() for proc in builds.values()] != [0] * len(builds):  # every build waited for
            return 1
        paths = [os.path.join(build_dir, f"_{m}" + sysconfig.get_config_var("EXT_SUFFIX")) for m in modules]
        reports = os.path.join(tmp, "report")
        env = dict(os.environ, LD_PRELOAD=":".join(runtimes), ASAN_OPTIONS=f"{ASAN_OPTIONS}:log_path={reports}",
                   UBSAN_OPTIONS=f"{UBSAN_OPTIONS}:log_path={reports}")
        env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        cmd = [sys.executable, os.path.abspath(__file__), *(f"--child={p}" for p in paths), *pytest_args]
        rc = subprocess.run(cmd, env=env, cwd=REPO).returncode
        for path in sorted(glob.glob(reports + ".*")):
            with open(path) as f:
                print(f"sanitize: sanitizer report {os.path.basename(path)}\n{f.read()}", file=sys.stderr)
            rc = rc or 1
        return rc


if __name__ == "__main__":
    sys.exit(main())
