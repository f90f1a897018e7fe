"""The native modules' tests on sanitized builds (scripts/sanitize.py).

A read past a table seldom crashes: in the planner it picks a wrong slot and the balancer
migrates experts to a placement nobody planned; in the kernels' CPU model it is an index that
corrupts a GPU buffer silently. The AddressSanitizer + UBSan builds turn either into a report.
A read that no barrier, mbarrier or flag orders after the write it needs passes on the model
whenever the schedule happens to run the write first; the ThreadSanitizer build of the model
reports it whatever the schedule. The two AddressSanitizer runs go in two processes at once
(the suite itself uses one core).
"""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "sanitize.py")
CANNOT_CHECK = 3
LIMIT_S = 560  # both runs together, inside pytest's 600 s per test (they took 307 s on 2 cores)


def test_native_modules_pass_their_tests_on_sanitized_builds():
    # each run in its own process group, so a timeout stops its compilers and pytest too
    runs = {m: subprocess.Popen([sys.executable, SCRIPT, "--module", m], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
            for m in ("planner", "model")}
    deadline = time.monotonic() + LIMIT_S
    try:
        outs = {m: p.communicate(timeout=max(deadline - time.monotonic(), 1))[0] for m, p in runs.items()}
    except subprocess.TimeoutExpired:
        for p in runs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
        pytest.fail(f"scripts/sanitize.py ran past {LIMIT_S} s")
    for m, p in runs.items():
        if p.returncode == CANNOT_CHECK:
            pytest.skip(outs[m].strip().splitlines()[-1])
    for m, p in runs.items():
        out = outs[m]
        assert p.returncode == 0, f"{m}:\n{out[-6000:]}"
        assert "Sanitizer" not in out, f"{m}:\n{out[-6000:]}"
        assert " passed" in out and " failed" not in out, f"{m}:\n{out[-2000:]}"


def test_the_race_check_reports_a_read_before_its_bulk_load_and_a_read_without_a_barrier():
    """The model's self-tests that read too early: one before its bulk load lands, one what
    another warp writes with no barrier between. Both pass on the model (they are not its
    errors); under ThreadSanitizer each must be a data race naming the two sides."""
    run = subprocess.run([sys.executable, SCRIPT, "--module", "model", "--sanitizer", "thread", "-q",
                          "-p", "no:cacheprovider", "tests/test_device_model.py", "-k",
                          "missing_wait or without_a_barrier"],
                         cwd=REPO, text=True, capture_output=True, timeout=300)
    out = run.stdout + run.stderr
    if run.returncode == CANNOT_CHECK:
        pytest.skip(out.strip().splitlines()[-1])
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


def test_the_kernels_have_no_data_race_on_the_model():
    """The W = 2 oracle cases (layout, dispatch and combine: bulk copies, rings, flags) and one
    two-node case under the race check. The whole model suite under it takes about 40 minutes
    on the 2-core VM: python scripts/sanitize.py --module model --sanitizer thread."""
    run = subprocess.run([sys.executable, SCRIPT, "--module", "model", "--sanitizer", "thread", "-q",
                          "-p", "no:cacheprovider", "tests/test_kernels_model.py", "tests/test_hierarchy_model.py",
                          "-k", "W2xG2 or W2xG1"],
                         cwd=REPO, text=True, capture_output=True, timeout=560)
    out = run.stdout + run.stderr
    if run.returncode == CANNOT_CHECK:
        pytest.skip(out.strip().splitlines()[-1])
    assert run.returncode == 0, out[-6000:]
    assert "ThreadSanitizer" not in out, out[-6000:]
    assert re.search(r"\d+ passed", out) and " failed" not in out and " skipped" not in out, out[-2000:]
