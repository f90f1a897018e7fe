"""Run pytest on an AddressSanitizer + UndefinedBehaviorSanitizer build of hybrid_ep._planner.

The planner is the balancer's one native piece. It runs in training on loads and previous
placements that users and checkpoints hand in, and a read past a table there would not crash
but would quietly corrupt a placement. So its tests also run on a sanitized build: the sources
setup.py compiles (csrc/balancer/, csrc/bindings/planner_module.cpp) are built at -O1 with
-fsanitize=address,undefined, and pytest runs in a child process with the sanitizer runtimes
preloaded (Python itself is not instrumented) and the sanitized module standing in for the
installed one. The first report ends the run with a non-zero exit; pytest captures the test's
stderr, so the sanitizers write their reports to files that are printed at the end.

    python scripts/planner_sanitize.py                       # tests/test_balancer_planner.py
    python scripts/planner_sanitize.py -q tests/test_balancer_quality.py
    python scripts/planner_sanitize.py --build-dir /tmp/asan -k refit

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
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SANITIZERS = ("asan", "ubsan")
CANNOT_CHECK = 3  # exit status: no compiler or sanitizer runtime here
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=1"  # CPython's own allocations read as leaks
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"


def _runtime(cxx: str, name: str) -> str | None:
    """Absolute path of the compiler's shared sanitizer runtime (lib<name>.so), or None."""
    try:
        path = subprocess.run([cxx, f"-print-file-name=lib{name}.so"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return os.path.realpath(path) if os.path.isabs(path) and os.path.exists(path) else None


def _module_name() -> str:
    import sysconfig
    return "_planner" + sysconfig.get_config_var("EXT_SUFFIX")


def _pybind11_includes() -> list[str] | None:
    """pybind11's headers (a build requirement in pyproject.toml), or None without it."""
    try:
        import pybind11
    except ImportError:
        return None
    return [pybind11.get_include()]


def build(cxx: str, build_dir: str, includes: list[str]) -> str:
    """Compile the sanitized planner module into build_dir; return its path."""
    import sysconfig
    sources = sorted(glob.glob(os.path.join(REPO, "csrc", "balancer", "*.cpp")))
    sources.append(os.path.join(REPO, "csrc", "bindings", "planner_module.cpp"))
    out = os.path.join(build_dir, _module_name())
    cmd = [cxx, "-O1", "-g", "-fno-omit-frame-pointer", "-fsanitize=address,undefined",
           "-fno-sanitize-recover=undefined", "-std=c++17", "-fno-strict-aliasing", "-shared", "-fPIC",
           "-I" + os.path.join(REPO, "csrc"), *("-I" + d for d in includes),
           "-I" + sysconfig.get_paths()["include"], *sources, "-o", out]
    print("planner_sanitize: building", out, flush=True)
    subprocess.run(cmd, check=True)
    return out


def _child(module_path: str, pytest_args: list[str]) -> int:
    """In the preloaded process: put the sanitized module in place, then run pytest here."""
    spec = importlib.util.spec_from_file_location("hybrid_ep._planner", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["hybrid_ep._planner"] = module
    import hybrid_ep
    hybrid_ep._planner = module  # `from .. import _planner` in the balancer finds this one
    import pytest
    rc = pytest.main(pytest_args)
    from hybrid_ep.balancer import planner
    if planner._planner is not module:  # the run must have exercised the sanitized build
        print("planner_sanitize: the balancer imported another _planner", file=sys.stderr)
        return 1
    return int(rc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--build-dir", help="where the sanitized module goes (default: a temporary folder)")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the module path, in the preloaded child
    args, pytest_args = parser.parse_known_args(argv)
    pytest_args = pytest_args or ["-q", "-p", "no:cacheprovider", os.path.join(REPO, "tests", "test_balancer_planner.py")]
    if args.child:
        return _child(args.child, pytest_args)

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        print("planner_sanitize: no C++ compiler (set CXX)", file=sys.stderr)
        return CANNOT_CHECK
    runtimes = [_runtime(cxx, name) for name in SANITIZERS]
    if None in runtimes:
        print(f"planner_sanitize: {cxx} has no shared {' / '.join(SANITIZERS)} runtime", file=sys.stderr)
        return CANNOT_CHECK
    includes = _pybind11_includes()
    if includes is None:
        print("planner_sanitize: pybind11 is not importable (pip install pybind11)", file=sys.stderr)
        return CANNOT_CHECK
    with tempfile.TemporaryDirectory(prefix="planner_sanitize_") as tmp:
        build_dir = args.build_dir or tmp
        os.makedirs(build_dir, exist_ok=True)
        module_path = build(cxx, build_dir, includes)
        reports = os.path.join(tmp, "report")
        env = dict(os.environ, LD_PRELOAD=":".join(runtimes), ASAN_OPTIONS=f"{ASAN_OPTIONS}:log_path={reports}",
                   UBSAN_OPTIONS=f"{UBSAN_OPTIONS}:log_path={reports}")
        env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        cmd = [sys.executable, os.path.abspath(__file__), "--child", module_path, *pytest_args]
        rc = subprocess.run(cmd, env=env, cwd=REPO).returncode
        for path in sorted(glob.glob(reports + ".*")):
            with open(path) as f:
                print(f"planner_sanitize: sanitizer report {os.path.basename(path)}\n{f.read()}", file=sys.stderr)
            rc = rc or 1
        return rc


if __name__ == "__main__":
    sys.exit(main())
