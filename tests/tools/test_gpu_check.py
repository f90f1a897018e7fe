"""scripts/gpu_check.sh on CPU: argument handling, and what each stage runs, with every tool
of the GPU machine replaced by a stub that records its command line. Network tools (pip,
curl, wget, git, conda, uv) are stubs that fail loudly: no stage may call them, nor
scripts/env.sh (it builds a virtualenv from a package registry)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

SCRIPT = Path(REPO, "scripts", "gpu_check.sh")
NETWORK_TOOLS = ("pip", "pip3", "curl", "wget", "git", "conda", "uv", "apt-get")


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def machine(tmp_path):
    """A fake checkout (the script, csrc/, setup.py) and a PATH of stubs; calls go to calls.log."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "csrc" / "kernels").mkdir(parents=True)
    (repo / "hybrid_ep").mkdir()
    shutil.copy(SCRIPT, repo / "scripts" / "gpu_check.sh")
    shutil.copy(Path(REPO, "scripts", "gpu_short_lease.sh"), repo / "scripts" / "gpu_short_lease.sh")
    for script in ("build_microbench.sh", "build_racecheck_probe.sh", "gpu_prebuilt.py"):
        shutil.copy(Path(REPO, "scripts", script), repo / "scripts" / script)
    (repo / "csrc" / "kernels" / "dispatch_receive.cu").write_text("// kernel\n")
    (repo / "csrc" / "microbench").mkdir()
    (repo / "csrc" / "microbench" / "main.cu").write_text("// microbenchmarks\n")
    (repo / "csrc" / "tools").mkdir()
    (repo / "csrc" / "tools" / "racecheck_probe.cu").write_text("// racecheck probe\n")
    (repo / "setup.py").write_text("# setup\n")
    _stub(repo / "scripts" / "env.sh", 'echo "NETWORK env.sh" >> "$CALLS"; exit 1\n')
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    # python3: a build creates the extension; pytest / the bench exit with $PYTEST_RC; any
    # `-m pip` is a network call.
    _stub(bin_dir / "python3", r'''
echo "python3 $* | ARCHS=$HYBRID_EP_CUDA_ARCHS PYTHONPATH=$PYTHONPATH" \
     "DIRECT_COMBINE_STAGES=${HYBRID_EP_DIRECT_COMBINE_STAGES:-}" \
     "REDUCER_WAIT=${HYBRID_EP_REDUCER_WAIT:-} REDUCER_WARPS=${HYBRID_EP_REDUCER_WARPS:-}" \
     "COMBINE_STAGE=${HYBRID_EP_COMBINE_STAGE:-} STORE_RUNS=${HYBRID_EP_STORE_RUNS:-}" \
     "TEST_K=${GPU_CHECK_TEST_K:-}" \
     "DATA_PATH=${HYBRID_EP_DATA_PATH:-} STORE_GROUPS=${HYBRID_EP_STORE_GROUPS:-}" >> "$CALLS"
case "$*" in
  *"-m pip"*) echo "NETWORK pip via python" >> "$CALLS"; exit 1 ;;
  "setup.py build_ext --inplace") touch hybrid_ep/_C.cpython-312-x86_64-linux-gnu.so; echo built ;;
  *"-m pytest"*) echo "pytest HYBRID_EP_TIMEOUT_S=$HYBRID_EP_TIMEOUT_S" >> "$CALLS"
    if [ -n "${PYTEST_HANGS:-}" ]; then  # as a process blocked in a CUDA call
      echo "tests/gpu/test_cuda_emulation.py::test_hangs[w4] "; trap '' INT; sleep 60; fi
    echo "=== 40 passed in 100.00s ==="; exit "${PYTEST_RC:-0}" ;;
  *"-m hybrid_ep.bench"*) echo "table"; exit 0 ;;
  *"-m tools.microbench"*) PYTHONPATH="$REAL_REPO" exec "$REAL_PYTHON" "$@" ;;  # the real post-processor
  "scripts/gpu_prebuilt.py "*) exec "$REAL_PYTHON" "$@" ;;  # the real stamp check
  "-c import torch, hybrid_ep._C, hybrid_ep._model, hybrid_ep._planner")  # carried extensions that do not load here
    if [ -n "${CARRIED_DOES_NOT_LOAD:-}" ] && grep -qs carried hybrid_ep/_C*.so; then
      echo "Traceback (most recent call last):"; echo "ImportError: undefined symbol: _ZN3c104cuda"; exit 1; fi ;;
  *"-m harness.emulated_check"*) echo "matches the oracle"; exit 0 ;;
  *"-m harness.soak"*)
    if [ -n "${SOAK_FAILS:-}" ] && [[ "$*" == *receive* ]]; then
      echo "soak: 700 calls ({'receive': 700}), 14 oracle checks: FAILED: call 700: rank 3: row 5"; exit 1; fi
    echo "soak: 2000 calls, 40 oracle checks: passed"; exit 0 ;;
  *has_nvshmem*) exit "${HAS_NVSHMEM_RC:-0}" ;;
  *"-m harness.nvshmem_cases"*)
    if [ -n "${CASES_RC:-}" ]; then echo "nvshmem_cases: 11 of 12 cases match the oracle"; exit "$CASES_RC"; fi
    echo "nvshmem_cases: 12 of 12 cases match the oracle"; exit 0 ;;
  *"-m harness.nvshmem_selftest"*)
    mps=off; [ -e "$HOME/mps_running" ] && mps=on
    echo "selftest mps=$mps vmm_disabled=${NVSHMEM_DISABLE_CUDA_VMM:-} pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "$CALLS"
    case "${NVSHMEM_PASS_WHEN:-always}:$mps" in
      always:*|mps:on) echo "nvshmem self-test, 2 PEs on one GPU: PASSED"; exit 0 ;;
      *) echo "rank 1/2: failed at nvshmem init: NvshmemInitError: boom"
         echo "nvshmem self-test, 2 PEs on one GPU: FAILED"; exit 1 ;;
    esac ;;
esac
exit 0
''')
    # MPS control daemon: -d starts it (a marker file), "quit" on stdin stops it.
    _stub(bin_dir / "nvidia-cuda-mps-control", r'''
if [ "$1" = "-d" ]; then
  echo "mps-control -d pipe=$CUDA_MPS_PIPE_DIRECTORY" >> "$CALLS"
  [ -n "${MPS_START_FAILS:-}" ] && { echo "cannot start MPS"; exit 1; }
  touch "$HOME/mps_running"; exit 0
fi
echo "mps-control $(cat)" >> "$CALLS"; rm -f "$HOME/mps_running"
''')
    _stub(bin_dir / "nvidia-smi", 'echo "NVIDIA H100 80GB HBM3, 580.00, 81559 MiB"\n')
    # nvcc: --version answers; a build writes a stand-in microbenchmark at -o, which prints a
    # device line and one M2 line and exits with $MICRO_RC (or, MICRO_NO_GPU set, nothing and 3);
    # or a stand-in racecheck probe: three cases (two controls), each run printing its line,
    # with a wrong value in the case $PROBE_WRONG names
    _stub(bin_dir / "nvcc", r'''
[ "$1" = "--version" ] && { echo "Cuda compilation tools, release 13.0"; exit 0; }
echo "nvcc $*" >> "$CALLS"
[ -n "${NVCC_FAILS:-}" ] && { echo "main.cu(1): error: boom" >&2; exit 1; }
for a in "$@"; do [ "$prev" = "-o" ] && out=$a; prev=$a; done
if [[ "$out" == */racecheck_probe ]]; then
cat > "$out" <<'PROGRAM'
#!/usr/bin/env bash
echo "probe $*" >> "$CALLS"
if [ "$1" = --list ]; then
  printf 'syncthreads\tordered\tcontrol\t__syncthreads\tcontrol\n'
  printf 'racy\tracy\tcontrol\tnothing\tcontrol\n'
  printf 'mbar_syncwarp_writers\tordered\tprobe\tlanes, __syncwarp, arrive\tdispatch_direct.cuh:124/156\n'
  exit 0
fi
if [ "$1" = "${PROBE_WRONG:-}" ]; then
  echo "racecheck_probe: $1: ordered, 8 rounds: 1 values wrong (first: round 3 word 4 read 0, expected 4004)"; exit 1
fi
echo "racecheck_probe: $1: ordered, 8 rounds: every value read was right"
PROGRAM
chmod +x "$out"; exit 0
fi
cat > "$out" <<'PROGRAM'
#!/usr/bin/env bash
echo "microbench $*" >> "$CALLS"
[ -n "${MICRO_NO_GPU:-}" ] && { echo "microbench: no CUDA device (stub)" >&2; exit 3; }
echo '{"m":"device","name":"NVIDIA H100 80GB HBM3","cc":"9.0","sms":132,"timeout_s":2,"quick":false}'
echo -n '{"m":"M2","test":"tma","sweep":"sms","mode":"load","fanout":1,"sms":1,"copy_bytes":16384,"stages":8,'
echo '"depth":-1,"pipelines":1,"rows":"sequential","source":"hbm","gbps_per_sm":33.6,"clock_mhz":1755,"ok":true}'
echo "microbench: done" >&2
exit "${MICRO_RC:-0}"
PROGRAM
chmod +x "$out"
''')
    # compute-sanitizer: a summary line per tool; on the racecheck probe it runs the case and
    # reports $HAZARDS_<case> hazards (exit 99 when there are some, as --error-exitcode asks)
    _stub(bin_dir / "compute-sanitizer", r'''
echo "compute-sanitizer $* | PATH_ENV=${HYBRID_EP_DATA_PATH:-}" >> "$CALLS"
echo "HYBRID_EP_TIMEOUT_S=$HYBRID_EP_TIMEOUT_S" >> "$CALLS"
if [[ "$*" == *racecheck_probe* ]]; then
  name=${*: -1}; "${@: -2:1}" "$name"; rc=$?; var=HAZARDS_$name; n=${!var:-0}
  echo "========= RACECHECK SUMMARY: $n hazards displayed ($n errors, 0 warnings)"
  [ "$n" -gt 0 ] && exit 99; exit "$rc"
fi
if [ "$2" = racecheck ]; then echo "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"
else echo "========= ERROR SUMMARY: 0 errors"; fi
''')
    _stub(bin_dir / "ncu", r'''
echo "ncu $* | PATH_ENV=${HYBRID_EP_DATA_PATH:-}" >> "$CALLS"
for a in "$@"; do if [ "$prev" = "--export" ]; then touch "$a.ncu-rep"; fi; prev=$a; done
echo "==PROF== Disconnected"
''')
    for tool in NETWORK_TOOLS:
        _stub(bin_dir / tool, f'echo "NETWORK {tool} $*" >> "$CALLS"; exit 1\n')
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(log), "HOME": str(tmp_path),
           "REAL_PYTHON": sys.executable, "REAL_REPO": str(REPO)}

    def run(*args, script="gpu_check.sh", **extra_env):
        proc = subprocess.run(["bash", str(repo / "scripts" / script), *args], cwd=tmp_path,
                              env={**env, **extra_env}, capture_output=True, text=True, timeout=60)
        calls = log.read_text() if log.exists() else ""
        assert "NETWORK" not in calls, f"a stage reached for the network: {calls}"
        return proc, calls

    return repo, tmp_path / "results", run


def test_usage_and_bad_arguments(machine):
    _, results, run = machine
    for args in ((), ("test",), ("deploy", str(results)), ("bench", str(results), "extra")):
        proc, calls = run(*args)
        assert proc.returncode == 2, args
        assert "gpu_check.sh test     RESULTS" in proc.stderr
        assert calls == ""
    proc, _ = run("sanitize", str(results), "leakcheck")
    assert proc.returncode == 2 and "unknown compute-sanitizer tool 'leakcheck'" in proc.stderr


def test_test_stage_builds_in_place_for_sm90a_then_runs_the_gpu_tests(machine):
    repo, results, run = machine
    proc, calls = run("test", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = [line for line in calls.splitlines() if not line.startswith("python3 -c")]
    assert lines[0].startswith("python3 setup.py build_ext --inplace | ARCHS=90a PYTHONPATH=" + str(repo))
    pytest_line = next(line for line in lines if "-m pytest" in line)
    for expected in ("-m gpu or multigpu", "tests/gpu/test_cuda_emulation.py", "tests/gpu/test_reference_nccl.py",
                     "tests/unit/hybrid_ep/backends/cuda/test_nvshmem_transport.py",
                     "tests/unit/hybrid_ep/verify/test_oracle.py",
                     "tests/unit/hybrid_ep/backends/cuda/test_cuda_plan.py",
                     "-v", "--maxfail=10", "--timeout=120", f"--junitxml={results}/gpu_tests.xml"):
        assert expected in pytest_line
    assert (results / "gpu_tests.log").read_text().strip().endswith("40 passed in 100.00s ===")
    assert "H100" in (results / "machine.txt").read_text()
    assert "pytest exit 0" in proc.stdout


def test_every_file_with_gpu_tests_is_in_the_test_stage():
    """A test marked gpu or multigpu runs only where the lease's test stage names its file (or
    its folder): a new GPU test left out of the list would never run."""
    repo = Path(REPO)
    text = (repo / "scripts" / "gpu_check.sh").read_text()
    named = re.search(r'run_tests\(\) \{.*?"\$py" -m pytest (.*?)> "\$results/gpu_tests.log"', text, re.S).group(1)
    listed = set(re.findall(r"tests/[\w/]+(?:\.py)?", named))
    marked = sorted(str(f.relative_to(repo)) for f in (repo / "tests").rglob("test_*.py")
                    if f.parent.name != "tools" and re.search(r"mark\.(gpu|multigpu)\b", f.read_text()))
    assert len(marked) >= 10, marked
    missing = [f for f in marked if f not in listed and not any(f.startswith(d.rstrip("/") + "/") for d in listed)]
    assert not missing, f"GPU tests the lease's test stage does not run: {missing}"


def test_fresh_extension_is_not_rebuilt_and_a_changed_source_is(machine):
    repo, results, run = machine
    run("build", str(results))
    proc, calls = run("build", str(results))
    assert proc.returncode == 0
    assert calls.count("setup.py build_ext") == 1 and "not rebuilt" in proc.stdout
    time.sleep(0.01)
    src = repo / "csrc" / "kernels" / "dispatch_receive.cu"
    later = time.time() + 5
    os.utime(src, (later, later))
    _, calls = run("build", str(results))
    assert calls.count("setup.py build_ext") == 2


def _carry(repo: Path, archs: str = "90a") -> Path:
    """A build made ahead, as scripts/prebuild_gpu.sh leaves it in build/gpu-prebuilt: the three
    extensions, its log and its stamp (the real helper's, for this checkout and this torch)."""
    folder = repo / "build" / "gpu-prebuilt"
    (folder / "hybrid_ep").mkdir(parents=True)
    for name in ("_C", "_model", "_planner"):
        (folder / "hybrid_ep" / f"{name}.cpython-312-x86_64-linux-gnu.so").write_text("carried\n")
    (folder / "build.log").write_text("hybrid-ep: building the CUDA extension hybrid_ep._C for 90a\n")
    subprocess.run([sys.executable, str(repo / "scripts" / "gpu_prebuilt.py"), "write", str(folder), "--archs", archs,
                    "--build-s", "310"], check=True, capture_output=True)
    return folder


def test_a_carried_build_that_fits_is_used_and_not_built(machine):
    repo, results, run = machine
    _carry(repo)
    proc, calls = run("build", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "setup.py build_ext" not in calls
    assert "using the carried build (build/gpu-prebuilt), not building: matches: built " in proc.stdout
    assert ", sm_90a, sources " in proc.stdout
    assert all((repo / "hybrid_ep" / f"{n}.cpython-312-x86_64-linux-gnu.so").read_text() == "carried\n"
               for n in ("_C", "_model", "_planner"))
    log = (results / "build.log").read_text()
    assert log.startswith("carried build from build/gpu-prebuilt:") and "build_s=310" in log and "for 90a" in log
    proc, calls = run("build", str(results))  # now in place and newer than its sources
    assert "not rebuilt" in proc.stdout and "setup.py build_ext" not in calls


@pytest.mark.slow  # the full tier (scripts/test.sh --full): builds twice
def test_a_carried_build_of_other_sources_or_archs_is_not_used(machine):
    repo, results, run = machine
    _carry(repo)
    (repo / "csrc" / "kernels" / "dispatch_receive.cu").write_text("// kernel, changed since the build\n")
    proc, calls = run("build", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the carried build at build/gpu-prebuilt does not fit: built for inputs " in proc.stdout
    assert "; building here" in proc.stdout and calls.count("setup.py build_ext") == 1
    assert (repo / "hybrid_ep" / "_C.cpython-312-x86_64-linux-gnu.so").read_text() == ""  # built here
    proc, calls = run("build", str(results / "b"), HYBRID_EP_CUDA_ARCHS="100a")
    assert "does not fit: built for inputs" in proc.stdout and "archs 90a (here 100a)" in proc.stdout


def test_a_carried_build_that_does_not_load_is_taken_away_and_built_here(machine):
    repo, results, run = machine
    _carry(repo)
    proc, calls = run("build", str(results), CARRIED_DOES_NOT_LOAD="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("the carried extensions do not load: ImportError: undefined symbol: _ZN3c104cuda; building here"
            in proc.stdout)
    assert calls.count("setup.py build_ext") == 1
    assert not (repo / "hybrid_ep" / "_model.cpython-312-x86_64-linux-gnu.so").exists()  # its files taken away
    assert (repo / "hybrid_ep" / "_C.cpython-312-x86_64-linux-gnu.so").read_text() == ""


def test_the_stamp_names_every_difference_and_reads_sources_by_content(tmp_path):
    helper = _script("gpu_prebuilt")
    for path in ("csrc/kernels/a.cu", "csrc/microbench/main.cu", "csrc/tools/probe.cu", "setup.py", "README.md"):
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(path)
    assert [p.relative_to(tmp_path).as_posix() for p in helper.input_files(tmp_path)] == ["csrc/kernels/a.cu",
                                                                                          "setup.py"]
    before = helper.inputs_digest(tmp_path)
    for ignored in ("csrc/microbench/main.cu", "README.md"):
        (tmp_path / ignored).write_text("changed")
    later = time.time() + 5
    os.utime(tmp_path / "setup.py", (later, later))  # a copy's dates say nothing
    assert helper.inputs_digest(tmp_path) == before
    (tmp_path / "csrc" / "kernels" / "b.cuh").write_text("")
    assert helper.inputs_digest(tmp_path) != before
    here = {"inputs": "a1", "archs": "90a", "python": "3.12", "torch": "2.11.0", "cuda": "13.0", "nvshmem": "3.4.5"}
    assert helper.mismatch(dict(here, built="2026-12-01"), here) is None
    assert helper.mismatch({}, here) == "it has no stamp"
    assert helper.mismatch(dict(here, torch="2.14.1", nvshmem="3.3.9"), here) == (
        "built for torch 2.14.1 (here 2.11.0), nvshmem 3.3.9 (here 3.4.5)")


def test_build_again_for_other_archs(machine):
    _, results, run = machine
    run("build", str(results))
    _, calls = run("build", str(results), HYBRID_EP_CUDA_ARCHS="100a")
    assert calls.count("setup.py build_ext") == 2 and "ARCHS=100a" in calls.splitlines()[-2]
    proc, calls = run("build", str(results), HYBRID_EP_CUDA_ARCHS="100a")
    assert calls.count("setup.py build_ext") == 2 and "built for sm_100a: not rebuilt" in proc.stdout


def test_several_stages_in_one_command_build_once_and_record_the_commit(machine):
    _, results, run = machine
    proc, calls = run("test,sanitize", str(results), "racecheck", GPU_CHECK_COMMIT="0123abc")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls.count("setup.py build_ext") == 1 and calls.count("-m pytest") == 1
    # the one tool named, once per data path, each run naming its path
    sanitizer_runs = [line for line in calls.splitlines() if line.startswith("compute-sanitizer")]
    assert [line.split()[2] for line in sanitizer_runs] == ["racecheck", "racecheck"]
    assert all((results / f"sanitizer_racecheck_{path}.log").exists() for path in ("direct", "receive"))
    assert "pytest HYBRID_EP_TIMEOUT_S=20" in calls and "HYBRID_EP_TIMEOUT_S=60" in calls  # the sanitizer's own
    machine_txt = (results / "machine.txt").read_text()
    assert "commit: 0123abc" in machine_txt and "stages: test sanitize" in machine_txt
    summary = (results / "gpu_check_summary.txt").read_text()
    assert "commit: 0123abc" in summary and "pytest exit 0" in summary
    assert "racecheck (direct): exit 0;" in summary and "racecheck (receive): exit 0;" in summary
    proc, _ = run("build", str(results / "again"))
    assert "commit: unknown (no .git here; pass GPU_CHECK_COMMIT)" in (results / "again" / "machine.txt").read_text()
    proc, _ = run("test,bench", str(results), "memcheck")
    assert proc.returncode == 2 and "only the sanitize stage takes further arguments" in proc.stderr


@pytest.mark.slow  # the full tier (scripts/test.sh --full): waits out a budget
def test_a_hung_stage_is_killed_inside_the_budget_and_later_stages_are_skipped(machine):
    _, results, run = machine
    start = time.monotonic()
    proc, calls = run("test,bench", str(results), PYTEST_HANGS="1", GPU_CHECK_BUDGET_S="27")
    took = time.monotonic() - start
    assert took < 27, took  # 7 s for pytest (27 - the 20 s kept back), then SIGKILL 10 s later
    assert proc.returncode == 137, proc.stdout  # the worst stage: killed
    assert "pytest exit 137" in proc.stdout
    assert "the last test it started: tests/gpu/test_cuda_emulation.py::test_hangs[w4]" in proc.stdout
    assert "-m hybrid_ep.bench" not in calls and "[bench]: not run:" in proc.stdout


def test_pack_leaves_the_summary_and_one_archive(machine):
    import tarfile

    _, results, run = machine
    proc, _ = run("nvshmem", str(results), GPU_CHECK_PACK="1", NVSHMEM_PASS_WHEN="mps")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in results.iterdir()) == ["gpu_check_summary.txt", "logs_nvshmem.tgz"]
    with tarfile.open(results / "logs_nvshmem.tgz") as tar:
        names = set(tar.getnames())
    assert {"./machine.txt", "./build.log", "./nvshmem_summary.txt", "./nvshmem_mps-on_vmm-off_p4.log"} <= names
    assert len(names) == 4 + 8  # machine, build, summaries of the stage and of MPS' start, 8 combinations' logs
    assert "./mps/start.log" in names
    summary = (results / "gpu_check_summary.txt").read_text()
    assert "mps=on vmm=default procs=2: exit 0" in summary and "packed 12 files" in summary
    proc, _ = run("build", str(results), GPU_CHECK_PACK="1")  # a later command packs only its own files
    assert sorted(p.name for p in results.iterdir()) == ["gpu_check_summary.txt", "logs_build.tgz",
                                                         "logs_nvshmem.tgz"]
    with tarfile.open(results / "logs_build.tgz") as tar:
        assert tar.getnames() == ["./machine.txt"]


def test_failing_tests_fail_the_stage(machine):
    _, results, run = machine
    proc, _ = run("test", str(results), PYTEST_RC="1")
    assert proc.returncode == 1 and "pytest exit 1" in proc.stdout


def test_sanitize_runs_each_tool_on_the_small_cases_of_both_paths(machine):
    _, results, run = machine
    proc, calls = run("sanitize", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [line for line in calls.splitlines() if line.startswith("compute-sanitizer")]
    assert [(r.split()[2], r.split("PATH_ENV=")[1]) for r in runs] == [
        (tool, path) for tool in ("memcheck", "racecheck", "synccheck") for path in ("direct", "receive")]
    assert all("-m harness.emulated_check --preset small" in r for r in runs)
    summary = (results / "sanitizer_summary.txt").read_text().splitlines()
    errors, hazards = "========= ERROR SUMMARY: 0 errors", "========= RACECHECK SUMMARY: 0 hazards displayed"
    assert summary == [f"memcheck (direct): exit 0; {errors}", f"memcheck (receive): exit 0; {errors}",
                       f"racecheck (direct): exit 0; {hazards} (0 errors, 0 warnings)",
                       f"racecheck (receive): exit 0; {hazards} (0 errors, 0 warnings)",
                       f"synccheck (direct): exit 0; {errors}", f"synccheck (receive): exit 0; {errors}"]
    assert (results / "sanitizer_racecheck_receive.log").exists()
    proc, calls = run("sanitize", str(results), "memcheck")
    assert calls.count("--tool memcheck") == 4 and calls.count("--tool racecheck") == 2


def test_bench_and_ncu_stages(machine):
    _, results, run = machine
    proc, calls = run("bench", str(results))
    assert proc.returncode == 0
    bench = next(line for line in calls.splitlines() if "-m hybrid_ep.bench" in line)
    assert "--emulate 2 8 --hidden 8192 --tokens 4096 --topk 8 --experts 16 --dtype bf16 --sms 1 2 4" in bench
    assert f"--out {results}/bench" in bench
    nodes = [line for line in calls.splitlines() if "-m hybrid_ep.bench" in line][1]
    assert "--emulate 8 --emulate-nodes 2 --hidden 8192 --tokens 4096 --topk 8 --experts 16" in nodes
    assert f"--out {results}/bench_nodes" in nodes
    nodes4 = [line for line in calls.splitlines() if "-m hybrid_ep.bench" in line][2]
    assert "--emulate 8 --emulate-nodes 4 --hidden 8192 --tokens 4096 --topk 8 --experts 16 --dtype bf16 --sms 1 2" \
        in nodes4
    assert f"--out {results}/bench_nodes4" in nodes4
    assert len([line for line in calls.splitlines() if "-m hybrid_ep.bench" in line]) == 3
    proc, calls = run("bench-dsv3", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    dsv3 = [line for line in calls.splitlines() if "-m hybrid_ep.bench" in line][3:]  # after the bench stage's
    assert len(dsv3) == 4  # bf16 and fp8, 4096 and 1024 tokens per rank, on the direct path
    for line, (dtype, tokens) in zip(dsv3, [("bf16", 4096), ("bf16", 1024), ("fp8", 4096), ("fp8", 1024)]):
        assert f"--emulate 8 --hidden 7168 --tokens {tokens} --topk 8 --experts 256 --dtype {dtype} --sms 1 2" in line
        assert f"--out {results}/bench_dsv3_{dtype}_{tokens}" in line and "DATA_PATH=direct" in line
    proc, calls = run("ncu", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ncu = [line for line in calls.splitlines() if line.startswith("ncu ")]
    assert "regex:dispatch_direct_kernel|combine_direct_kernel" in ncu[0]
    assert "--launch-skip 3 --launch-count 2" in ncu[0]
    assert ncu[0].endswith("PATH_ENV=direct")  # the emulation's own path, said out loud
    assert "-w 8 --hidden 8192 --tokens 4096 --topk 8 --experts 16 --dtype bf16" in ncu[0]  # the default rows
    # the bench's own point: 1 SM per rank, at the GPU's clocks (not ncu's locked base clock)
    assert "--clock-control none" in ncu[0] and "--sms 1 --calls 2" in ncu[0]
    assert ncu[1].startswith(f"ncu --import {results}/ncu.ncu-rep --page details")
    assert "--section SourceCounters" in ncu[0]
    for kernel in ("dispatch_direct_kernel", "combine_direct_kernel"):
        assert any(f"--print-source cuda,sass --kernel-name regex:{kernel}" in line for line in ncu)
        assert any("scripts/ncu_lines.py" in line for line in calls.splitlines() if line.startswith("python3"))


def _script(name: str):
    """scripts/<name>.py, imported by path (scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, Path(REPO, "scripts", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ncu_lines_sums_stall_samples_per_source_line(tmp_path):
    # ncu's layout: a block per source file, one row per SASS instruction under its line.
    cols = '"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_long_sb"'
    table = tmp_path / "t.csv"
    table.write_text("\n".join([
        '"Function Name","combine_receive_kernel"',
        '"File Path","/src/csrc/kernels/state.cuh"', cols,
        '"100","if (try_wait) return true;","0x10","LDS R1","30","0","27"',
        '"100","","0x20","BRA","10","0","1"',
        '"101","spin","0x30","NOP","20","0","0"',
        '"File Path","/src/csrc/kernels/combine_receive.cuh"', cols,
        '"564","__syncthreads();","0x40","EXIT","140","140","0"',
    ]) + "\n")
    lines = _script("ncu_lines").summarize(str(table), top=2).splitlines()
    assert lines[0] == "combine_receive_kernel: 200 warp samples"
    assert lines[1].split()[:2] == ["70.0%", "combine_receive.cuh:564"] and "[barrier 100%]" in lines[1]
    assert lines[2].split()[:2] == ["20.0%", "state.cuh:100"] and "[long_sb 70%]" in lines[2]
    assert len(lines) == 3


def test_ncu_lines_reads_the_kernel_name_row_of_ncu_2025(tmp_path):
    # ncu 2025.3 heads the table with "Kernel Name" (benchmarks/results/2026-11-24-h100's sass export)
    cols = '"Line No","Source","Address","Source","Warp Stall Sampling (All Samples)"'
    table = tmp_path / "t.csv"
    table.write_text("\n".join(['"Kernel Name","void dispatch_receive_kernel<Loopback>(LaunchArgs)",',
                                '"File Path","/src/csrc/kernels/dispatch_receive.cuh"', cols,
                                '"686","if (sh.abort) return;","0x10","EXIT","5"']) + "\n")
    lines = _script("ncu_lines").summarize(str(table)).splitlines()
    assert lines[0] == "void dispatch_receive_kernel<Loopback>(LaunchArgs): 5 warp samples"


def test_ncu_lines_names_a_table_without_stall_samples(tmp_path):
    table = tmp_path / "sass_only.csv"
    table.write_text('"Line No","Source","Instructions Executed"\n"1","x","5"\n')
    with pytest.raises(ValueError, match="SourceCounters"):
        _script("ncu_lines").summarize(str(table))
    assert _script("ncu_lines").main([str(tmp_path / "missing.csv")]) == 1


def test_ncu_lines_rejects_a_top_below_one(tmp_path, capsys):
    with pytest.raises(ValueError, match="top must be a positive integer"):
        _script("ncu_lines").summarize(str(tmp_path / "t.csv"), top=0)
    with pytest.raises(SystemExit):
        _script("ncu_lines").main([str(tmp_path / "t.csv"), "--top", "-3"])
    assert "--top: must be a positive integer, got '-3'" in capsys.readouterr().err


def test_the_script_names_no_installer():
    text = SCRIPT.read_text()
    for word in ("pip ", "env.sh", "curl", "wget", "venv", "conda", "apt-get"):
        assert word not in text.split("set -uo pipefail")[1], word


def _selftests(calls: str) -> list[str]:
    return [line for line in calls.splitlines() if line.startswith(("selftest", "mps-control"))]


def test_nvshmem_stage_tries_each_combination_without_and_with_mps(machine):
    _, results, run = machine
    proc, calls = run("nvshmem", str(results), NVSHMEM_PASS_WHEN="mps")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    pipe = calls.split("mps-control -d ")[1].split()[0]
    assert pipe.startswith("pipe=/tmp/hybrid-ep-mps.")  # a short socket path, the same for clients
    runs = [f"selftest mps={m} vmm_disabled={v} {pipe}" for m in ("off", "on") for v in ("", "1") for _ in (2, 4)]
    assert _selftests(calls) == runs[:4] + [f"mps-control -d {pipe}"] + runs[4:] + ["mps-control quit"]
    runner = [line for line in calls.splitlines() if "-m harness.nvshmem_selftest" in line]
    assert [line.split("--procs ")[1].split()[0] for line in runner] == ["2", "4"] * 4
    assert f"--out {results}/nvshmem/mps-on_vmm-off_p4" in runner[-1]
    summary = (results / "nvshmem_summary.txt").read_text().splitlines()
    assert summary[0] == "mps=off vmm=default procs=2: exit 1; rank 1/2: failed at nvshmem init: NvshmemInitError: boom"
    assert summary[4] == "mps=on vmm=default procs=2: exit 0; nvshmem self-test, 2 PEs on one GPU: PASSED"
    assert [line.split(": ")[1].split(";")[0] for line in summary] == ["exit 1"] * 4 + ["exit 0"] * 4
    assert "worked with 2 PEs (mps/vmm): on/default on/off; with 4 PEs: on/default on/off" in proc.stdout


def test_nvshmem_stage_gives_each_run_a_floor_and_skips_what_does_not_fit(machine):
    """A short budget does not cut every self-test run to a few seconds (the 2026-11-27 run's
    60 s gave each of the 8 runs 2-3 s, and none finished): each run gets NVSHMEM_RUN_MIN_S,
    and with less than that left the rest are named as not run."""
    _, results, run = machine
    proc, calls = run("nvshmem", str(results), NVSHMEM_PASS_WHEN="always", GPU_CHECK_BUDGET_S="60")
    runner = [line for line in calls.splitlines() if "-m harness.nvshmem_selftest" in line]
    assert len(runner) == 8 and all(int(line.split("--deadline ")[1].split()[0]) >= 15 for line in runner), runner
    proc, calls = run("nvshmem", str(results), NVSHMEM_PASS_WHEN="always", GPU_CHECK_BUDGET_S="35")
    again = [line for line in calls.splitlines() if "-m harness.nvshmem_selftest" in line]
    assert again == runner  # the calls log holds both commands' calls: the second made none
    summary = (results / "nvshmem_summary.txt").read_text().splitlines()
    assert len(summary) == 8 and all("not run (" in line for line in summary), summary
    assert proc.returncode != 0


def test_nvshmem_stage_fails_when_nothing_works_or_nvshmem_is_not_built(machine):
    _, results, run = machine
    proc, calls = run("nvshmem", str(results), NVSHMEM_PASS_WHEN="never")
    assert proc.returncode == 1 and "worked with 2 PEs (mps/vmm): none; with 4 PEs: none" in proc.stdout
    assert _selftests(calls)[-1] == "mps-control quit"  # the daemon it started is stopped
    proc, calls = run("nvshmem", str(results), HAS_NVSHMEM_RC="1")
    assert proc.returncode == 1 and "built without NVSHMEM" in proc.stdout
    assert sum(line.startswith("selftest mps=") for line in calls.splitlines()) == 8  # the first run's only


def test_nvshmem_stage_reports_an_mps_daemon_that_does_not_start(machine):
    _, results, run = machine
    proc, calls = run("nvshmem", str(results), MPS_START_FAILS="1")
    assert proc.returncode == 0, proc.stdout
    summary = (results / "nvshmem_summary.txt").read_text().splitlines()
    assert len(summary) == 5 and summary[4] == "mps=on: nvidia-cuda-mps-control -d failed: cannot start MPS"
    assert "mps-control quit" not in calls


def test_nvshmem_ep_stage_runs_every_case_across_processes_and_fails_with_one(machine):
    _, results, run = machine
    proc, calls = run("nvshmem-ep", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    [runner] = [line for line in calls.splitlines() if "-m harness.nvshmem_cases" in line]
    assert f"--out {results}/nvshmem_cases --timeout 20" in runner
    assert "exit 0: nvshmem_cases: 12 of 12 cases match the oracle" in proc.stdout
    proc, _ = run("nvshmem-ep", str(results), CASES_RC="1")
    assert proc.returncode == 1 and "11 of 12" in (results / "nvshmem_cases.log").read_text()
    proc, calls = run("nvshmem-ep", str(results), HAS_NVSHMEM_RC="1")
    assert proc.returncode == 1 and "built without NVSHMEM" in proc.stdout
    assert "nvshmem_cases --out" not in calls.split("has_nvshmem")[-1]


def test_soak_stage_runs_processes_the_receive_path_and_two_nodes_within_the_budget(machine):
    _, results, run = machine
    proc, calls = run("soak", str(results), GPU_CHECK_BUDGET_S="300")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = [line for line in calls.splitlines() if "-m harness.soak" in line]

    def mode(r):
        return "processes" if "--processes" in r else r.split("--data-path ")[1].split()[0]

    assert [(mode(r), r.split("--ranks-per-node ")[1].split()[0], r.split("--calls ")[1].split()[0]) for r in runs] == [
        ("processes", "8", "2000"), ("receive", "8", "2000"), ("direct", "4", "500")]
    assert "--data-path" not in runs[0] and "--timeout-s " in runs[0]
    budgets = [int(r.split("--budget-s ")[1].split()[0]) for r in runs]
    assert all(0 < b < 300 for b in budgets) and 100 < budgets[0] < 150  # half of what is left, less 10 s
    assert all(f"--out {results}/soak_" in r and "--check-every 50" in r for r in runs)
    proc, _ = run("soak", str(results), SOAK_FAILS="1")
    assert proc.returncode == 1 and "FAILED: call 700" in proc.stdout


@pytest.mark.slow  # the full tier (scripts/test.sh --full): an nvcc build
def test_micro_stage_builds_and_runs_the_microbenchmarks_without_the_extension(machine):
    repo, results, run = machine
    proc, calls = run("micro", str(results), GPU_CHECK_COMMIT="abc1234")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "setup.py build_ext" not in calls and "needs no hybrid_ep._C: not built" in proc.stdout
    [build] = [line for line in calls.splitlines() if line.startswith("nvcc ")]
    assert "-arch=sm_90a" in build and f"{repo}/csrc/microbench/main.cu" in build
    assert "-o build/microbench/hybrid_ep_microbench" in build
    assert [line for line in calls.splitlines() if line.startswith("microbench ")] == ["microbench all"]
    doc = json.loads((results / "micro.json").read_text())
    assert doc["metadata"]["tool"] == "hybrid_ep_microbench" and doc["metadata"]["config"]["commit"] == "abc1234"
    assert doc["measurements"]["M2"][0]["gbps_per_sm"] == 33.6
    summary = (results / "gpu_check_summary.txt").read_text()
    assert "microbench exit 0: microbench: done" in summary
    assert any(line.startswith("C_load ") and "33.6" in line for line in summary.splitlines())  # micro.txt
    assert (results / "micro.jsonl").read_text().count("\n") == 2 and (results / "micro_build.log").exists()
    # a second command finds the program up to date, and runs what GPU_CHECK_MICRO names
    before = len(calls)
    proc, calls = run("micro", str(results), GPU_CHECK_MICRO="--quick tma reduce")
    assert proc.returncode == 0 and "nvcc " not in calls[before:] and "not rebuilt" in proc.stdout
    assert "microbench --quick tma reduce" in calls[before:].splitlines()
    assert json.loads((results / "micro.json").read_text())["metadata"]["config"]["command"] == (
        "hybrid_ep_microbench --quick tma reduce")


def test_micro_stage_reports_a_failed_measurement_a_failed_build_and_no_gpu(machine):
    repo, results, run = machine
    proc, _ = run("micro", str(results / "a"), MICRO_RC="1")
    assert proc.returncode == 1 and (results / "a" / "micro.json").exists()  # the lines are kept
    proc, calls = run("micro", str(results / "b"), MICRO_NO_GPU="1")
    assert proc.returncode == 3 and "microbench exit 3: microbench: no CUDA device (stub)" in proc.stdout
    assert "micro.json not written: tools.microbench: " in proc.stdout and "no device line" in proc.stdout
    (repo / "build" / "microbench" / "hybrid_ep_microbench").unlink()
    before = len(calls)
    proc, calls = run("micro", str(results / "c"), NVCC_FAILS="1")
    assert proc.returncode == 1 and "microbenchmark build failed" in proc.stdout
    assert "main.cu(1): error: boom" in proc.stdout and "microbench " not in calls[before:]


def test_micro_with_other_stages_builds_the_extension_once_and_a_micro_edit_keeps_it(machine):
    repo, results, run = machine
    proc, calls = run("micro,bench", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert calls.count("setup.py build_ext") == 1 and "microbench all" in calls and "-m hybrid_ep.bench" in calls
    later = time.time() + 5
    os.utime(repo / "csrc" / "microbench" / "main.cu", (later, later))
    proc, calls = run("build", str(results))
    assert calls.count("setup.py build_ext") == 1 and "not rebuilt" in proc.stdout  # not a source of hybrid_ep._C


def test_ncu_l1tex_stage_profiles_dispatch_and_the_copy_patterns(machine):
    _, results, run = machine
    proc, calls = run("ncu-l1tex", str(results))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ncu = [line for line in calls.splitlines() if line.startswith("ncu ")]
    assert len(ncu) == 5
    metrics = ("--metrics breakdown:l1tex__throughput.avg.pct_of_peak_sustained_active,"
               "l1tex__m_l1tex2xbar_write_bytes.sum.per_cycle_active,l1tex__m_xbar2l1tex_read_bytes.sum.per_cycle_active")
    assert all(metrics in line for line in ncu)
    # the counts by kind: request cycles, plain global stores (requests and sectors), duration, clock
    for counted in ("l1tex__m_l1tex2xbar_req_cycles_active.sum", "l1tex__t_requests_pipe_lsu_mem_global_op_st.sum",
                    "l1tex__t_sectors_pipe_lsu_mem_global_op_red.sum", "gpu__time_duration.sum",
                    "sm__cycles_elapsed.max"):
        assert all(counted in line for line in ncu), counted
    expected = (("dispatch_direct_kernel", "direct", "-w 8 --sms 1 --tokens 4096"),
                ("dispatch_direct_kernel", "direct", "-w 8 --sms 1 --tokens 4096 --dtype fp8"),
                ("dispatch_direct_kernel", "direct", "-w 2 --sms 1 --tokens 2048"),
                ("dispatch_receive_kernel", "receive", "-w 8 --sms 8 --tokens 4096"))  # the last: 2026-11-24's path
    for line, (kernel, path, shape) in zip(ncu, expected):
        assert f"--kernel-name regex:{kernel} --launch-skip 2 --launch-count 1" in line
        assert line.endswith(f"PATH_ENV={path}")
        assert f"-m harness.emulated_check {shape} --hidden 8192 --topk 8 --experts 16" in line
    assert "--kernel-name regex:tma_kernel" in ncu[4] and "hybrid_ep_microbench tma-profile |" in ncu[4]
    for name in ("ncu_l1tex_dispatch_direct_w8_1sm.txt", "ncu_l1tex_dispatch_direct_w8_1sm_fp8.txt",
                 "ncu_l1tex_dispatch_direct_w2_1sm.txt", "ncu_l1tex_dispatch_w8_8sm.txt", "ncu_l1tex_tma.txt"):
        assert "==PROF== Disconnected" in (results / name).read_text()


def _probe_table(results: Path) -> dict[str, list[str]]:
    """racecheck_probe_summary.txt: case -> [hazards, expected, verdict]."""
    rows = (results / "racecheck_probe_summary.txt").read_text().splitlines()
    assert rows[0].split() == ["case", "hazards", "expected", "verdict"]
    return {row.split()[0]: row.split(None, 3)[1:] for row in rows[1:]}


def test_racecheck_probe_stage_runs_each_case_alone_under_racecheck(machine):
    repo, results, run = machine
    proc, calls = run("racecheck-probe", str(results), HAZARDS_racy="4", HAZARDS_mbar_syncwarp_writers="2")
    assert proc.returncode == 0, proc.stdout + proc.stderr  # an ordered case flagged is the finding
    assert "setup.py build_ext" not in calls and "needs no hybrid_ep._C: not built" in proc.stdout
    [build] = [line for line in calls.splitlines() if line.startswith("nvcc ")]
    assert "-arch=sm_90a" in build and "-lineinfo" in build and f"{repo}/csrc/tools/racecheck_probe.cu" in build
    assert "-o build/racecheck_probe/racecheck_probe" in build
    runs = [line.split(" | ")[0] for line in calls.splitlines() if line.startswith("compute-sanitizer")]
    assert runs == [f"compute-sanitizer --tool racecheck --error-exitcode 99 --print-limit 50 "
                    f"build/racecheck_probe/racecheck_probe {case}"
                    for case in ("syncthreads", "racy", "mbar_syncwarp_writers")] + [
        # then the one ordered case flagged, again, with racecheck's trace of what it synchronised
        "compute-sanitizer --tool racecheck --racecheck-trace-sync yes --print-limit 50 "
        "build/racecheck_probe/racecheck_probe mbar_syncwarp_writers"]
    assert "RACECHECK SUMMARY: 2 hazards" in (results / "racecheck_probe_mbar_syncwarp_writers_trace.log").read_text()
    assert _probe_table(results) == {
        "syncthreads": ["0", "0", "clean"],
        "racy": ["4", ">0", "flagged: racy"],
        "mbar_syncwarp_writers": ["2", "0", "flagged although ordered: a limit of racecheck"]}
    assert "every value read was right" in (results / "racecheck_probe_racy.log").read_text()
    assert "flagged although ordered" in (results / "gpu_check_summary.txt").read_text()
    before = len(calls)  # a second command finds the program up to date
    proc, calls = run("racecheck-probe", str(results), HAZARDS_racy="4")
    assert proc.returncode == 0 and "nvcc " not in calls[before:] and "not rebuilt" in proc.stdout


@pytest.mark.parametrize("env, case, verdict", [
    ({"HAZARDS_racy": "4", "HAZARDS_syncthreads": "1"}, "syncthreads",
     "FAILED: racecheck flags what __syncthreads orders"),
    ({}, "racy", "FAILED: racecheck missed the race"),
    ({"HAZARDS_racy": "4", "PROBE_WRONG": "mbar_syncwarp_writers"}, "mbar_syncwarp_writers",
     "FAILED: exit 1; racecheck_probe: mbar_syncwarp_writers: ordered, 8 rounds: 1 values wrong"),
])
def test_racecheck_probe_stage_fails_on_a_wrong_control_or_a_wrong_value(machine, env, case, verdict):
    _, results, run = machine
    proc, _ = run("racecheck-probe", str(results), **env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert _probe_table(results)[case][2].startswith(verdict)
    others = [row[2] for name, row in _probe_table(results).items() if name != case]
    assert not any(v.startswith("FAILED") for v in others)


def _lease_variants() -> list[tuple[str, str, dict[str, str]]]:
    """(name, shape, {knob: value}) of each combine variant gpu_short_lease.sh times, read from
    the script."""
    text = Path(REPO, "scripts", "gpu_short_lease.sh").read_text()
    block = text[text.index("variants=("):text.index("variants_end=")]
    out = []
    for entry in re.findall(r'"([^"]+)"', block):
        name, shape, *settings = entry.split()
        out.append((name, shape, dict(setting.split("=") for setting in settings)))
    return out


def test_every_combine_variant_the_lease_times_passes_the_oracle_first():
    """Each knob combination the lease times is one the oracle tests run, on the CPU model and on
    the GPU (helpers.LEASE_COMBINE_VARIANTS), and the lease's oracle stage selects those tests."""
    from helpers import LEASE_COMBINE_VARIANTS

    tested = {(stage or "route", wait or "observe", warps or "4") for stage, wait, warps in LEASE_COMBINE_VARIANTS}
    tested |= {("route", "converged", "4"), ("route", "elect", "4"), ("route", "observe", "8")}  # each knob alone
    variants = _lease_variants()
    assert len(variants) >= 12
    for name, shape, knobs in variants:
        assert shape in ("seed", "dsv3"), name
        assert set(knobs) <= {"COMBINE_STAGE", "REDUCER_WAIT", "REDUCER_WARPS"}, name
        combo = (knobs.get("COMBINE_STAGE", "route"), knobs.get("REDUCER_WAIT", "observe"),
                 knobs.get("REDUCER_WARPS", "4"))
        assert combo in tested, (name, combo)
    text = Path(REPO, "scripts", "gpu_short_lease.sh").read_text()
    assert 'GPU_CHECK_TEST_K="direct_combine_variants or store_runs"' in text


@pytest.mark.slow  # the full tier (scripts/test.sh --full): the whole lease script
def test_short_lease_runs_every_part_in_order_and_packs_the_logs(machine):
    """scripts/gpu_short_lease.sh in the order of what a lease must settle: the decisions first
    (the microbenchmarks, the oracle on the variants the lease times, the seed bf16 baseline, fp8
    with a row a store and with store runs, the DeepSeek-V3-like layer, the combine's variants at
    both shapes and 1 and 2 SMs per rank, ncu at the bench's point), then the GPU tests, the process
    bench's emulation points alone, one domain of 36 ranks, the processes (8 processes beside the
    emulation, every layout, bf16 and fp8; then the seed point with 3 direct-combine stages), the
    bench's sweeps, DeepEP beside hybrid-ep, then what earlier runs measured (the
    DeepSeek-V3-like layer on the receive path, the racecheck probe); logs packed after every part."""
    import tarfile

    _, results, run = machine
    results.mkdir()
    proc, calls = run(str(results), script="gpu_short_lease.sh", GPU_CHECK_COMMIT="0123abc")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    processes = [line for line in calls.splitlines() if "-m hybrid_ep.bench.processes" in line]
    assert len(processes) == 5, processes
    # the emulation points alone first (the last runs' illegal memory access): without MPS, under
    # MPS, under memcheck; then every point, then 3 stages
    alone = "--pool none --nodes 1 --shapes seed --dtypes bf16 fp8 --sms 1 --iters 3"
    assert all(alone in line for line in processes[:3])
    assert processes[2].startswith("compute-sanitizer --tool memcheck")
    assert "--pool none" not in processes[3] and "--dtypes bf16 fp8" in processes[3]
    assert "--nodes 1 --shapes seed --sms 1" in processes[4]
    assert "DIRECT_COMBINE_STAGES=3 " in processes[4] and "DIRECT_COMBINE_STAGES= " in processes[3]
    bench_lines = [line for line in calls.splitlines()
                   if line.startswith("python3 -m hybrid_ep.bench") and "bench.processes" not in line]

    def bench(folder: str) -> str:  # the one bench run into FOLDER (the stub echoes "ARGS | ENV")
        [line] = [line for line in bench_lines if f"/{folder} | " in line]
        return line

    shapes = {"seed": "--hidden 8192 --tokens 4096 --topk 8 --experts 16",
              "dsv3": "--hidden 7168 --tokens 4096 --topk 8 --experts 256"}
    defaults = "DIRECT_COMBINE_STAGES= REDUCER_WAIT= REDUCER_WARPS= COMBINE_STAGE= STORE_RUNS= "
    for folder, shape, dtype in (("bench_seed", "seed", "bf16"), ("bench_fp8", "seed", "fp8"),
                                 ("bench_fp8_runs", "seed", "fp8"), ("bench_dsv3_direct", "dsv3", "bf16")):
        line = bench(folder)
        assert f"--emulate 8 {shapes[shape]} --dtype {dtype} --sms 1 2" in line, line
        assert (defaults.replace("STORE_RUNS= ", "STORE_RUNS=1 ") if folder == "bench_fp8_runs" else defaults) in line
    assert bench("bench_dsv3_receive").endswith("DATA_PATH=receive STORE_GROUPS=")
    variants = _lease_variants()
    for name, shape, knobs in variants:  # both SM counts, bf16, the direct path, what each sets
        line = bench(f"combine_variants/{name}_{shape}")
        assert f"--emulate 8 {shapes[shape]} --dtype bf16 --sms 1 2 " in line and "DATA_PATH=direct " in line, line
        for knob in ("COMBINE_STAGE", "REDUCER_WAIT", "REDUCER_WARPS"):
            assert f"{knob}={knobs.get(knob, '')} " in line, (knob, line)
    summary = (results / "summary.txt").read_text()
    first, last = variants[0], variants[-1]
    order = ["micro exit", "build exit", "oracle exit", "bench seed exit", "bench fp8 exit",
             "bench fp8 store runs exit", "bench dsv3 direct exit", f"combine {first[0]} {first[1]} exit",
             f"combine {last[0]} {last[1]} exit",
             "ncu exit", "test exit", "emulation alone, no MPS", "emulation alone, under MPS",
             "emulation alone, memcheck", "processes exit", "processes, 3 combine stages exit", "bench exit",
             "deepep exit", "bench dsv3 receive exit", "racecheck probe exit"]
    at = [summary.index(step) for step in order]
    assert at == sorted(at), summary
    assert "build exit 0: no carried build at build/gpu-prebuilt: building here" in summary
    # the oracle stage: the variants' and the store runs' GPU tests alone
    [oracle] = [line for line in calls.splitlines() if "-m pytest" in line and "TEST_K=direct_combine" in line]
    assert "-k direct_combine_variants or store_runs" in oracle
    deepep = next(line for line in calls.splitlines() if "--backends cuda deepep" in line)  # 8 processes, MPS
    assert "--device cuda -w 8 --backends cuda deepep --hidden 8192 --tokens 4096 --topk 8 --experts 16" in deepep
    assert "--sms 2 8" in deepep and "mps-control -d" in calls and "mps-control quit" in calls
    assert "deepep exit 0: no DeepEP wheel at build/deepep/deep_ep-*.whl: hybrid-ep alone" in summary
    with tarfile.open(results / "logs_short_lease.tgz") as packed:
        names = packed.getnames()
    for log in ("./bench_seed.log", "./bench_fp8.log", "./bench_fp8_runs.log", "./bench_dsv3_direct.log",
                f"./combine_variants/{last[0]}_{last[1]}.log", "./oracle/gpu_check_summary.txt",
                "./bench_dsv3_receive.log", "./summary.txt",
                "./deepep/bench_deepep.log", "./deepep/gpu_check_summary.txt", "./processes/processes.log",
                "./processes_3_stages/processes.log", "./emulation_alone/no_mps.log",
                "./emulation_alone/mps/processes.log", "./emulation_alone/memcheck.log"):
        assert log in names, names
    assert [n for n in names if n.endswith(".ncu-rep")] == [] and "./ncu/ncu_details.txt" in names
    assert not (results / "logs_short_lease.tgz.part").exists()
    assert "-m harness.soak" not in calls  # the second call's
    [profiled] = [line for line in calls.splitlines() if line.startswith("ncu ") and "--export" in line]
    assert "regex:dispatch_direct_kernel|combine_direct_kernel" in profiled and "SourceCounters" in profiled
    assert "--dtype fp8 " in profiled and "--sms 1 " in profiled  # fp8's dispatch at the bench's point
    assert "--clock-control none" in profiled


def test_short_lease_packs_its_logs_after_every_part(machine):
    """A call killed between parts still returns what ran: the archive is written after each
    part (a part's own log in it once its line is in the summary)."""
    import tarfile

    _, results, run = machine
    results.mkdir()
    proc, _ = run(str(results), script="gpu_short_lease.sh", SHORT_LEASE_END_S="45")
    summary = (results / "summary.txt").read_text()
    assert "micro exit" in summary
    with tarfile.open(results / "logs_short_lease.tgz") as packed:
        names = packed.getnames()
    assert "./micro_stage.out" in names and "./summary.txt" in names, names


@pytest.mark.slow  # the full tier (scripts/test.sh --full): waits out a budget
def test_short_lease_ends_in_its_time_and_says_which_parts_it_left_out(machine):
    """A test stage that hangs takes what is left; the parts after it are not run, and said so."""
    _, results, run = machine
    results.mkdir()
    start = time.monotonic()
    proc, calls = run(str(results), script="gpu_short_lease.sh", SHORT_LEASE_END_S="50", PYTEST_HANGS="1")
    assert time.monotonic() - start < 50
    summary = (results / "summary.txt").read_text()
    # the first tests the lease runs, the oracle on the combine's variants (on a loaded machine the
    # first parts are slow)
    assert "oracle exit 137" in summary or "oracle not run" in summary
    for part in ("bench seed", "bench fp8", "bench dsv3 direct", "test", "processes", "bench", "deepep",
                 "racecheck probe"):
        assert f"{part} not run: " in summary and " s left of 50" in summary, part
    assert "-m hybrid_ep.bench" not in calls


def test_second_call_runs_what_the_first_left_in_order_and_packs_its_own_archive(machine):
    """gpu_short_lease.sh --second: the NVSHMEM cases, the soak, the NVSHMEM self-test, then
    memcheck and synccheck, each bounded by what is left of its 270 s."""
    import tarfile

    _, results, run = machine
    results.mkdir()
    proc, calls = run("--second", str(results), script="gpu_short_lease.sh", GPU_CHECK_COMMIT="0123abc")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = (results / "summary.txt").read_text()
    order = ["build exit", "nvshmem-ep exit", "soak exit", "nvshmem exit", "sanitize exit"]
    at = [summary.index(step) for step in order]
    assert at == sorted(at), summary
    assert "nvshmem-ep exit 0: " in summary and "12 of 12 cases" in summary
    assert len([line for line in calls.splitlines() if "-m harness.soak" in line]) == 3
    tools = [line.split()[2] for line in calls.splitlines() if line.startswith("compute-sanitizer --tool")]
    assert tools == ["memcheck", "memcheck", "synccheck", "synccheck"], tools  # each on both paths
    assert "-m hybrid_ep.bench --" not in calls and "-m pytest" not in calls  # the first call's parts
    with tarfile.open(results / "logs_second_call.tgz") as packed:
        names = packed.getnames()
    assert "./sanitize/sanitizer_summary.txt" in names and "./nvshmem-ep/nvshmem_cases.log" in names, names
    assert "./soak/soak_processes_g8.log" in names, names
    assert not (results / "logs_short_lease.tgz").exists()


def test_second_call_ends_in_its_time(machine):
    _, results, run = machine
    results.mkdir()
    proc, _ = run("--second", str(results), script="gpu_short_lease.sh", SHORT_LEASE_END_S="35")
    summary = (results / "summary.txt").read_text()
    assert "sanitize not run: " in summary and " s left of 35" in summary


def test_every_extension_import_check_loads_torch_first():
    """hybrid_ep._C needs libc10 and libtorch already loaded (its NEEDED entries resolve to the
    ones `import torch` brought in), and `import hybrid_ep` no longer imports torch: a bare
    `import hybrid_ep._C` fails on the GPU machine with "libc10.so: cannot open shared object
    file", which made the 2026-11-27 run's first call rebuild, then skip every stage needing it."""
    import re

    text = (Path(REPO) / "scripts" / "gpu_check.sh").read_text()
    checks = re.findall(r"-c '(import [^']*hybrid_ep\._C[^']*)'", text)
    assert len(checks) >= 3, checks  # the two load checks and has_nvshmem
    for code in checks:
        assert code.startswith("import torch, "), code
