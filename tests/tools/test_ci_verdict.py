"""scripts/test.sh's exit status, the verdict CI reads: 0 only when pytest and the nvcc compile
check both pass, 1 when either fails or pytest collects nothing. Run on a tree of stubs (its
environment, lint, compile check and Python), so the script's own control flow is what is
tested: its EXIT trap once turned every passing run into exit 1."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

# The stub Python: `-m pytest` exits with STUB_PYTEST_RC, anything else (the version line) prints.
STUB_PYTHON = """#!/usr/bin/env bash
for a in "$@"; do [ "$a" = pytest ] && { echo "stub pytest"; exit "${STUB_PYTEST_RC:-0}"; }; done
echo "stub Megatron-Core"
"""


def _tree(root: Path) -> Path:
    (root / "scripts").mkdir(parents=True)
    shutil.copy(Path(REPO, "scripts", "test.sh"), root / "scripts" / "test.sh")
    stubs = {"python": STUB_PYTHON,
             "scripts/env.sh": f'#!/usr/bin/env bash\necho "{root}/python"\n',
             "scripts/lint.sh": "#!/usr/bin/env bash\nexit \"${STUB_LINT_RC:-0}\"\n",
             "scripts/compile_csrc.sh": "#!/usr/bin/env bash\necho stub compile\nexit \"${STUB_COMPILE_RC:-0}\"\n"}
    for path, text in stubs.items():
        (root / path).write_text(text)
        (root / path).chmod(0o755)
    return root


@pytest.mark.parametrize("pytest_rc, compile_rc, lint_rc, want", [
    (0, 0, 0, 0), (1, 0, 0, 1), (0, 1, 0, 1), (5, 0, 0, 1), (2, 0, 0, 2), (0, 0, 1, 1)])
def test_the_exit_status_is_the_verdict_of_pytest_and_the_compile_check(tmp_path, pytest_rc, compile_rc, lint_rc,
                                                                        want):
    root = _tree(tmp_path)
    env = {**os.environ, "STUB_PYTEST_RC": str(pytest_rc), "STUB_COMPILE_RC": str(compile_rc),
           "STUB_LINT_RC": str(lint_rc), "HYBRID_EP_TEST_WORKERS": "1"}
    env.pop("HYBRID_EP_LINT", None)
    run = subprocess.run(["bash", str(root / "scripts" / "test.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == want, run.stdout + run.stderr
    if lint_rc == 0:
        assert f"test.sh: pytest exit {pytest_rc}, nvcc compile check exit {compile_rc}" in run.stdout
        assert "stub compile" in run.stdout


def test_a_run_that_stops_early_stops_the_compile_checks_jobs(tmp_path):
    """A lint finding ends the run before pytest; the compile check beside it, and the compiler
    jobs it started, end with it (the check's per-file jobs once kept compiling for minutes)."""
    root = _tree(tmp_path)
    pid_file = tmp_path / "job.pid"
    (root / "scripts" / "compile_csrc.sh").write_text(
        f"#!/usr/bin/env bash\nsleep 120 &\necho $! > {pid_file}\nwait\n")
    env = {**os.environ, "STUB_LINT_RC": "1", "HYBRID_EP_TEST_WORKERS": "1"}
    env.pop("HYBRID_EP_LINT", None)
    # lint fails once the check's job runs (else it could fail before the job starts)
    (root / "scripts" / "lint.sh").write_text(
        f"#!/usr/bin/env bash\nwhile [ ! -s {pid_file} ]; do sleep 0.05; done\nexit 1\n")
    run = subprocess.run(["bash", str(root / "scripts" / "test.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1, run.stdout + run.stderr
    job = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _alive(job) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = _alive(job)
    if alive:
        os.kill(job, signal.SIGKILL)
    assert not alive, "the compile check's job outlived the run"


def _alive(pid: int) -> bool:
    """Whether pid runs (a zombie, dead but not reaped by its init, counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
