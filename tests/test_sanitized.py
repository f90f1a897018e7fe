"""The native modules' tests on AddressSanitizer + UBSan builds (scripts/sanitize.py).

A read past a table seldom crashes: in the planner it picks a wrong slot and the balancer
migrates experts to a placement nobody planned; in the kernels' CPU model it is an index that
corrupts a GPU buffer silently. The sanitized builds turn either into a report. The two
modules run in two processes at once (the suite itself uses one core).
"""

import os
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
