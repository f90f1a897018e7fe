"""The native modules' tests on AddressSanitizer + UBSan builds (scripts/sanitize.py).

A read past a table seldom crashes: in the planner it picks a wrong slot and the balancer
migrates experts to a placement nobody planned; in the kernels' CPU model it is an index that
corrupts a GPU buffer silently. The sanitized builds turn either into a report. The two
modules run in two processes at once (the suite itself uses one core).
"""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "scripts", "sanitize.py")
CANNOT_CHECK = 3


def test_native_modules_pass_their_tests_on_sanitized_builds():
    runs = {m: subprocess.Popen([sys.executable, SCRIPT, "--module", m], cwd=REPO, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            for m in ("planner", "model")}
    outs = {m: p.communicate(timeout=560)[0] for m, p in runs.items()}
    for m, p in runs.items():
        if p.returncode == CANNOT_CHECK:
            pytest.skip(outs[m].strip().splitlines()[-1])
    for m, p in runs.items():
        out = outs[m]
        assert p.returncode == 0, f"{m}:\n{out[-6000:]}"
        assert "Sanitizer" not in out, f"{m}:\n{out[-6000:]}"
        assert " passed" in out and " failed" not in out, f"{m}:\n{out[-2000:]}"
