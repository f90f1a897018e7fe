"""Run pytest on sanitized builds of the native modules: AddressSanitizer + UBSan, or
ThreadSanitizer for the kernels' data races.

Two modules run on the CPU on every machine and touch memory through computed indices:
- hybrid_ep._planner, the balancer's placement planner. It runs in training on loads and
  previous placements that users and checkpoints hand in; a read past one of its tables would
  not crash but quietly plan a wrong slot, and the balancer would migrate experts to it;
- hybrid_ep._model, the kernels' own sources on the CPU model of the device layer. An index
  past a buffer there is the same index on the GPU, where nothing reports it.
Each is built from the sources setup.py compiles, at -O1 (the pybind11 glue at -O0) with
-fsanitize=address,undefined, and pytest runs in a child process with the sanitizer runtimes
preloaded (Python itself is not instrumented) and the sanitized modules standing in for the
installed ones. The first report
ends the run with a non-zero exit; pytest captures the tests' stderr, so the sanitizers write
their reports to files that are printed at the end. The model's fibers tell AddressSanitizer
of every stack switch (csrc/device/model/fiber.cpp) and get 4x larger stacks under it.

With --sanitizer thread the model is built for ThreadSanitizer instead: each CUDA thread and
each warp's bulk copies run as a fiber of their own, the device layer's synchronisation tells
it what orders what (csrc/device/model/happens_before.h), and a plain access that nothing
orders against another thread's, or against a bulk copy's, is reported as a data race. Only
the kernels are instrumented; the model's scheduler and the timing model's clocks are not
(their bookkeeping is shared by every fiber on purpose), and accesses inside intercepted calls
such as memcpy are ignored.
ThreadSanitizer's runtime stops at 8128 threads and fibers, so a launch that needs more is
refused and its test counted as skipped, with the reason printed.

    python scripts/sanitize.py                           # both modules, their default tests
    python scripts/sanitize.py --module planner          # tests/unit/hybrid_ep/balancer/test_planner.py
    python scripts/sanitize.py --module model -q tests/model/test_kernels_model.py -k combine
    python scripts/sanitize.py --module model --sanitizer thread   # data races in the kernels
    python scripts/sanitize.py --all                     # the two full runs above, for csrc changes

With --build-dir the sanitized modules stay there, in a folder per csrc/ state and compile
command, and are built again only when a file under csrc/ or the command changed: runs of any
checkout (tests/sanitizer/test_sanitized.py's, CI's with ~/.cache/hybrid-ep/sanitized) build each once.

Needs a C++ compiler with the sanitizer runtimes (g++ or clang++; CXX picks one) and pybind11.
Exit 3 when they are missing, so callers can tell "cannot check here" from "found a bug".
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CANNOT_CHECK = 3  # exit status: no compiler, sanitizer runtime or pybind11 here
RUNTIMES = {"address": ("asan", "ubsan"), "thread": ("tsan",)}
ASAN_OPTIONS = "detect_leaks=0:abort_on_error=1"  # CPython's own allocations read as leaks
UBSAN_OPTIONS = "print_stacktrace=1:halt_on_error=1"
# Every race reported (once per pair of stacks: launches reuse the addresses of shared memory),
# exit status 66 at the end; accesses inside memcpy and friends are the scheduler's.
TSAN_OPTIONS = "halt_on_error=0:suppress_equal_addresses=0:ignore_interceptors_accesses=1"
FLAGS = {"address": ["-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"],
         "thread": ["-DHYBRID_EP_MODEL_TSAN=1", "-fsanitize=thread"]}
# The model's scheduler, one file per job (csrc/device/model/state.h lists them).
MODEL_RUNTIME = ("state.cpp", "scheduler.cpp", "sync.cpp", "bulk_copies.cpp", "remote_ops.cpp", "injection.cpp",
                 "faults.cpp", "timing_notes.cpp")
# Sources compiled without the sanitizer: the model's pybind11 glue, which only passes pointers
# and values on (instrumented, it took longer to compile than the model itself), and, under
# ThreadSanitizer, the model's scheduler (happens_before.h) and the timing model's clocks
# (timing.cpp: every fiber's time, its warp's and its scheduler's, shared on purpose as the
# scheduler's bookkeeping is). Instrumented, a test with timing on ran 50 minutes in the race
# reports' handling of the Timer's own accesses (gdb: HandleRace in Timer::place and
# Timer::advance), none of them the kernels'.
UNINSTRUMENTED = {"address": ("model_module.cpp",),
                  "thread": ("model_module.cpp", "fiber.cpp", "timing.cpp", *MODEL_RUNTIME)}
# The pybind11 glue at -O0: a third of the time to compile at -O1, and nothing in it runs long.
GLUE = ("model_module.cpp", "planner_module.cpp")
STAMP = "stamp"  # in a build's folder once it is complete
KEEP = 3  # builds kept per module and sanitizer in a build folder (one per csrc/ state)
RACE_LIMIT = "ThreadSanitizer's limit"  # in the model's message for a launch too large for it
PYTEST_DEFAULTS = ["-q", "-p", "no:cacheprovider"]


def _sources(module: str) -> list[str]:
    folder, binding = {"planner": ("balancer", "planner_module.cpp"),
                       "model": (os.path.join("device", "model"), "model_module.cpp")}[module]
    return sorted(glob.glob(os.path.join(REPO, "csrc", folder, "*.cpp"))) + [
        os.path.join(REPO, "csrc", "bindings", binding)]


DEFAULT_TESTS = {
    "planner": ["tests/unit/hybrid_ep/balancer/test_planner.py"],
    "model": ["tests/model/test_device_model.py", "tests/model/test_kernels_model.py",
              "tests/model/test_hierarchy_model.py"],
}
# The model's own tests run broken kernels on purpose (races among them), so the race check
# runs the real kernels' tests.
RACE_TESTS = ["tests/model/test_kernels_model.py", "tests/model/test_hierarchy_model.py"]


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


def _csrc_digest() -> str:
    """Hash of every file under csrc/ (sources and the headers they include)."""
    digest = hashlib.sha256()
    for path in sorted(glob.glob(os.path.join(REPO, "csrc", "**", "*"), recursive=True)):
        if os.path.isfile(path):
            digest.update(os.path.relpath(path, REPO).encode() + b"\0")
            with open(path, "rb") as f:
                digest.update(f.read())
    return digest.hexdigest()


class Build:
    """The compilers of one sanitized module, started at once; wait() links and returns 0 on success.

    The module goes to a folder of the build folder named for its stamp (the compile and link
    commands and the contents of csrc/), so a module built from the same csrc/ with the same
    commands is reused, by any checkout: the commands run in the checkout with paths relative
    to it. A build is made in a folder of its own and renamed into place once linked, so a
    run never loads a half-written module and two runs building at once both finish; the
    oldest builds of a module beyond KEEP are removed."""

    def __init__(self, module: str, sanitizer: str, cxx: str, build_dir: str, includes: list[str]):
        top = os.path.join(os.path.abspath(build_dir), sanitizer)  # the two sanitizers' builds apart
        os.makedirs(top, exist_ok=True)
        name = f"_{module}" + sysconfig.get_config_var("EXT_SUFFIX")
        common = [cxx, "-g", "-fno-omit-frame-pointer", "-std=c++17", "-fno-strict-aliasing", "-Wno-unknown-pragmas",
                  "-fPIC", "-Icsrc", *("-I" + d for d in includes), "-I" + sysconfig.get_paths()["include"]]
        commands = []  # one compiler per source, all at once; objects named relative to the build's folder
        for source in _sources(module):
            base = os.path.basename(source)
            flags = FLAGS[sanitizer]
            if base in UNINSTRUMENTED[sanitizer]:  # defines kept, sanitizer left out
                flags = [f for f in flags if not f.startswith(("-fsanitize", "-fno-sanitize"))]
            level = "-O0" if base in GLUE else "-O1"
            commands.append(common + [level, *flags, "-c", os.path.relpath(source, REPO), "-o", base + ".o"])
        objects = [c[-1] for c in commands]
        link = [cxx, "-shared", *FLAGS[sanitizer], *objects, "-o", name]
        self.stamp = hashlib.sha256(repr([commands, link, _csrc_digest()]).encode()).hexdigest()
        self.folder = os.path.join(top, f"{module}-{self.stamp[:16]}")
        self.out = os.path.join(self.folder, name)
        self.procs = []
        if os.path.exists(os.path.join(self.folder, STAMP)):
            print(f"sanitize: {self.out} is up to date", flush=True)
            os.utime(self.folder)  # the most recently used are kept
            return
        self.work = tempfile.mkdtemp(prefix=f"{module}-building-", dir=top)
        print(f"sanitize: building {self.out}", flush=True)

        def absolute(cmd):  # objects into the work folder, sources read from the checkout
            return [os.path.join(self.work, a) if a.endswith(".o") or a == name else a for a in cmd]

        self.link = absolute(link)
        self.procs = [subprocess.Popen(absolute(c), cwd=REPO) for c in commands]
        self.module, self.top = module, top

    def wait(self) -> int:
        if not self.procs:  # up to date
            return 0
        rc = max(p.wait() for p in self.procs)  # every compiler waited for
        if rc == 0:
            rc = subprocess.run(self.link, cwd=REPO).returncode
        if rc != 0:
            shutil.rmtree(self.work, ignore_errors=True)
            return rc
        with open(os.path.join(self.work, STAMP), "w") as f:
            f.write(self.stamp)
        for _ in range(2):
            try:
                os.rename(self.work, self.folder)
                break
            except OSError:  # another run put the same build in place first: use that one
                if os.path.exists(os.path.join(self.folder, STAMP)):
                    shutil.rmtree(self.work, ignore_errors=True)
                    break
                shutil.rmtree(self.folder, ignore_errors=True)  # a partly removed one: replaced
        builds = sorted(glob.glob(os.path.join(self.top, f"{self.module}-*", STAMP)),
                        key=lambda p: os.path.getmtime(os.path.dirname(p)), reverse=True)
        stale = [p for p in glob.glob(os.path.join(self.top, "*-building-*"))  # left by runs that were killed
                 if time.time() - os.path.getmtime(p) > 3600]
        for old in [os.path.dirname(p) for p in builds[KEEP:]] + stale:
            shutil.rmtree(old, ignore_errors=True)
        return 0


def _race_limit_plugin(pytest, skipped: list[str]):
    """A pytest plugin: a test whose launch ThreadSanitizer's thread limit refused is a skip."""

    class RaceLimitSkips:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_makereport(self, item, call):
            report = (yield).get_result()
            if call.when == "call" and call.excinfo is not None and RACE_LIMIT in str(call.excinfo.value):
                skipped.append(item.nodeid)
                report.outcome = "skipped"
                report.longrepr = (str(item.path), item.location[1] or 0,
                                   "Skipped: " + str(call.excinfo.value).splitlines()[0])

    return RaceLimitSkips()


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
    skipped: list[str] = []
    rc = int(pytest.main(pytest_args, plugins=[_race_limit_plugin(pytest, skipped)]))
    if skipped:
        print(f"sanitize: {len(skipped)} test(s) skipped, their launches too large for ThreadSanitizer: "
              + ", ".join(skipped), file=sys.stderr)
    for name, module in loaded.items():  # the run must have used the sanitized builds
        if sys.modules.get(name) is not module:
            print(f"sanitize: the tests imported another {name}", file=sys.stderr)
            return rc or 1
    return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--module", action="append", choices=sorted(DEFAULT_TESTS),
                        help="module to sanitize (repeat for both; default both)")
    parser.add_argument("--sanitizer", choices=sorted(RUNTIMES), default="address",
                        help="address: AddressSanitizer + UBSan (default); thread: data races, model only")
    parser.add_argument("--build-dir", help="where the sanitized modules go and are kept for the next run "
                                             "(default: a temporary folder)")
    parser.add_argument("--all", action="store_true",
                        help="both full runs: address on both modules' default tests, then thread on the kernels'")
    parser.add_argument("--child", action="append", help=argparse.SUPPRESS)  # module paths, in the child
    args, pytest_args = parser.parse_known_args(argv)
    if args.child:
        return _child(args.child, pytest_args)
    if args.all:
        if args.module or pytest_args or args.sanitizer != "address":
            parser.error("--all runs the default modules and tests of both sanitizers; it takes no other choice")
        build = ["--build-dir", args.build_dir] if args.build_dir else []
        codes = [main(build), main(build + ["--sanitizer", "thread"])]  # the race check runs even after a failure
        return next((c for c in codes if c), 0)
    modules = args.module or (["model"] if args.sanitizer == "thread" else sorted(DEFAULT_TESTS))
    if args.sanitizer == "thread" and modules != ["model"]:
        parser.error("--sanitizer thread is for --module model (the planner runs on one thread)")
    if not pytest_args:
        tests = RACE_TESTS if args.sanitizer == "thread" else [t for m in modules for t in DEFAULT_TESTS[m]]
        pytest_args = PYTEST_DEFAULTS + [os.path.join(REPO, t) for t in tests]

    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        print("sanitize: no C++ compiler (set CXX)", file=sys.stderr)
        return CANNOT_CHECK
    runtimes = [_runtime(cxx, name) for name in RUNTIMES[args.sanitizer]]
    if None in runtimes:
        print(f"sanitize: {cxx} has no shared {' / '.join(RUNTIMES[args.sanitizer])} runtime", file=sys.stderr)
        return CANNOT_CHECK
    includes = _pybind11_includes()
    if includes is None:
        print("sanitize: pybind11 is not importable (pip install pybind11)", file=sys.stderr)
        return CANNOT_CHECK
    with tempfile.TemporaryDirectory(prefix="sanitize_") as tmp:
        build_dir = args.build_dir or tmp
        os.makedirs(build_dir, exist_ok=True)
        builds = [Build(m, args.sanitizer, cxx, build_dir, includes) for m in modules]  # compile at once
        if [b.wait() for b in builds] != [0] * len(builds):  # every build waited for
            return 1
        paths = [b.out for b in builds]
        reports = os.path.join(tmp, "report")
        env = dict(os.environ, LD_PRELOAD=":".join(runtimes), ASAN_OPTIONS=f"{ASAN_OPTIONS}:log_path={reports}",
                   UBSAN_OPTIONS=f"{UBSAN_OPTIONS}:log_path={reports}",
                   TSAN_OPTIONS=f"{TSAN_OPTIONS}:log_path={reports}")
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
