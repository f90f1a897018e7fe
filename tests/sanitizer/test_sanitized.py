"""The native modules' tests on sanitized builds (scripts/sanitize.py), subsets sized for
the full tier (scripts/test.sh --full: every test here is slow).

A read past a table seldom crashes: in the planner it picks a wrong slot and the balancer
migrates experts to a placement nobody planned; in the kernels' CPU model it is an index that
corrupts a GPU buffer silently. The AddressSanitizer + UBSan builds turn either into a report.
A read that no barrier, mbarrier or flag orders after the write it needs passes on the model
whenever the schedule happens to run the write first; the ThreadSanitizer build of the model
reports it whatever the schedule.

Each sanitized module is built once into BUILD_DIR, a cache kept between runs (CI keeps
~/.cache/hybrid-ep as it keeps the virtualenv) and reused while csrc/ and the compile commands
are unchanged; each run is a subset that executes what its whole test file executes of the
native code, in less time: PLANNER_TESTS and MODEL_CASES below say how that was checked. The
three sanitized modules (planner and model on AddressSanitizer + UBSan, model on
ThreadSanitizer) are each built and run by tests of their own xdist group, so pytest-xdist's
workers take them in parallel with each other and with the rest of the suite. The full runs,
for changes under csrc/: python scripts/sanitize.py --all (CONTRIBUTING.md).
"""

import os
import re
import signal
import subprocess
import sys

import pytest

from helpers import REPO

pytestmark = [pytest.mark.sanitizer, pytest.mark.slow]

SCRIPT = os.path.join(REPO, "scripts", "sanitize.py")
CANNOT_CHECK = 3  # scripts/sanitize.py's exit status when this machine has no sanitizer runtime
LIMIT_S = 540  # a run still going then has hung: stop it inside pytest's 600 s per test
# HYBRID_EP_SANITIZE_CACHE names another folder (an empty one: the builds from scratch)
BUILD_DIR = os.environ.get("HYBRID_EP_SANITIZE_CACHE") or os.path.join(
    os.path.expanduser("~"), ".cache", "hybrid-ep", "sanitized")

# The planner's tests less two sweeps and the three longest searches (half the file's time),
# which run no line of csrc/balancer or its binding that the other tests do not run: gcov of
# the native module built with --coverage, 2026-11-26: the subset runs 1457 of the 1457 lines
# the whole file runs.
PLANNER_TESTS = ("not test_refit_bound_is_below_the_exact_fewest_changes"
                 " and not test_never_worse_than_eplb_or_greedy[topk-zipf-1.0]"
                 " and not test_restarts_reach_where_the_most_loaded_first_refit_is_stuck"
                 " and not test_count_shift_then_exchange_reaches_the_move_target"
                 " and not test_exchanges_run_within_a_budget_per_call")
# On the sanitized model, as -k over the model's test files: the model's self-tests; oracle
# cases on schedule seed 0, on one node fp8 rows with scales and padding rows (the entry and
# padding warps), rows over one FIFO stage (column segments), static size with overflow, an
# fp32 wire for fp16 rows with routing weights applied (the reducers' conversions), more tokens
# than one layout tile, minimum rows per expert, and on several nodes (the RDMA, forwarding and
# node-partial roles) fp8 with overflow, rows over one stage, padding and minimum rows; the
# timeouts, aborts and routing errors. Together they run every line of csrc/kernels,
# csrc/common, csrc/transport and the model's runtime that the three whole files run (gcov of
# the model, 2026-11-25: 1891 of 1892; combine.cuh's compaction of pending chunks runs only on
# some schedules), in under a tenth of the time.
MODEL_FILES = ["tests/model/test_device_model.py", "tests/model/test_kernels_model.py",
               "tests/model/test_hierarchy_model.py"]
MODEL_CASES = ("test_device_model"
               " or (test_kernels_match_the_oracle and -0- and (float8_e4m3fn and pad16 or H12288 or out10"
               " or W3xG3 and wire or 1100 or min16))"
               " or (hierarchical_kernels_match_the_oracle and (out37 or min16 or H12288))"
               " or missing or peer_lost or abort_at_any_point or routing_errors")
# The race check: fp8 rows with padding on one node of three ranks, and two nodes of one rank:
# every warp role, and 1016 of the 1053 lines of csrc/kernels and csrc/transport that all the
# oracle cases run (gcov, 2026-11-25); and the direct combine's other instantiation, 8 reducer
# warps per pipeline (HYBRID_EP_REDUCER_WARPS=8), at 7168 columns on one node and two (20 s), and
# its reducers' converged stage wait (HYBRID_EP_REDUCER_WAIT=converged: each lane's own acquire).
RACE_FILES = MODEL_FILES[1:]
RACE_CASES = ("(test_kernels_match_the_oracle and W3xG3 and float8_e4m3fn and pad16 and -0-) or "
              "(hierarchical_kernels_match_the_oracle and W2xG1 and H128) or "
              "(eight_reducer_warps_add_the_widest_segments and 7168) or "
              "(direct_combine_variants_give_the_oracle_result and converged)")


def _start(build_dir: str, *args: str) -> subprocess.Popen:
    # in its own process group, so that a hang stops its compilers and pytest too
    return subprocess.Popen([sys.executable, SCRIPT, "--build-dir", build_dir, *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(runs: dict[str, subprocess.Popen]) -> dict[str, str]:
    """Each run's output; all stopped and the test failed past LIMIT_S, skipped where it cannot check."""
    outs = {}
    try:
        for name, proc in runs.items():
            outs[name] = proc.communicate(timeout=LIMIT_S)[0]
    except subprocess.TimeoutExpired:
        for proc in runs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
        pytest.fail(f"scripts/sanitize.py ran past {LIMIT_S} s")
    for name, proc in runs.items():
        if proc.returncode == CANNOT_CHECK:
            pytest.skip(outs[name].strip().splitlines()[-1])
    return outs


def _passed(out: str) -> int:
    return sum(int(n) for n in re.findall(r"(\d+) passed", out))


def _assert_clean(name: str, run: subprocess.Popen) -> None:
    out = _finish({name: run})[name]
    assert run.returncode == 0, f"{name}:\n{out[-6000:]}"
    assert "Sanitizer" not in out, f"{name}:\n{out[-6000:]}"
    assert _passed(out) > 0 and " failed" not in out, f"{name}:\n{out[-2000:]}"


@pytest.mark.xdist_group("sanitized-planner")
def test_the_planner_passes_its_tests_on_a_sanitized_build():
    _assert_clean("planner", _start(BUILD_DIR, "--module", "planner", "-q", "-p", "no:cacheprovider",
                                    "tests/unit/hybrid_ep/balancer/test_planner.py", "-k", PLANNER_TESTS))


@pytest.mark.xdist_group("sanitized-model")
def test_the_model_passes_its_tests_on_a_sanitized_build():
    _assert_clean("model", _start(BUILD_DIR, "--module", "model", "-q", "-p", "no:cacheprovider", *MODEL_FILES,
                                  "-k", MODEL_CASES))


@pytest.mark.xdist_group("sanitized-thread")  # one build of the model for ThreadSanitizer, for both
def test_the_race_check_reports_a_read_before_its_bulk_load_and_a_read_without_a_barrier():
    """The model's self-tests that read too early: one before its bulk load lands, one what
    another warp writes with no barrier between. Both pass on the model (they are not its
    errors); under ThreadSanitizer each must be a data race naming the two sides."""
    run = _start(BUILD_DIR, "--module", "model", "--sanitizer", "thread", "-q", "-p", "no:cacheprovider",
                 "tests/model/test_device_model.py", "-k", "missing_wait or without_a_barrier")
    out = _finish({"race": run})["race"]
    assert run.returncode != 0, out[-4000:]
    assert re.search(r"\d+ passed", out) and " failed" not in out, out[-4000:]
    races = out.split("WARNING: ThreadSanitizer: data race")[1:]
    assert len(races) == 2, out[-6000:]
    copy_race = next(r for r in races if "bulk copies of warp 0" in r)
    assert re.search(r"Write of size \d+ .* by thread T\d+:", copy_race)  # the bulk load, named by ...
    assert "'run_selftest kernel, block 0, bulk copies of warp 0'" in copy_race
    assert "'run_selftest kernel, block 0, thread 0'" in copy_race  # ... and its early reader
    plain_race = next(r for r in races if r is not copy_race)
    assert "'run_selftest kernel, block 0, thread 0'" in plain_race
    assert "'run_selftest kernel, block 0, thread 32'" in plain_race
    assert plain_race.count("selftest.cpp:") >= 2


@pytest.mark.xdist_group("sanitized-thread")
def test_the_kernels_have_no_data_race_on_the_model():
    """RACE_CASES under the race check: layout, dispatch and combine with bulk copies, rings
    and flags, on one node and across two. The whole model suite under it is
    python scripts/sanitize.py --module model --sanitizer thread."""
    run = _start(BUILD_DIR, "--module", "model", "--sanitizer", "thread", "-q", "-p", "no:cacheprovider",
                 *RACE_FILES, "-k", RACE_CASES)
    out = _finish({"race": run})["race"]
    assert run.returncode == 0, out[-6000:]
    assert "ThreadSanitizer" not in out, out[-6000:]
    assert _passed(out) > 0 and " failed" not in out and " skipped" not in out, out[-2000:]
