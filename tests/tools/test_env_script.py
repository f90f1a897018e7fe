"""scripts/env.sh's decisions, run against stand-ins (a python that records what it is asked,
an nvidia-smi that finds a GPU or not) in a scratch copy of the build inputs: the CUDA
extension and the NVSHMEM wheel only where a GPU is visible or HYBRID_EP_FORCE_CUDA_BUILD=1,
one line saying how to force them, each long step announced with its usual time, and no
setuptools warning box."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess
import textwrap

import pytest

pytestmark = pytest.mark.unit

REPO = pathlib.Path(__file__).resolve().parents[2]

# Answers env.sh's questions the way a Python 3.12 with a CUDA 13 torch would; logs each call.
PYTHON = textwrap.dedent('''\
    #!/usr/bin/env bash
    echo "$* | cuda_skip=${HYBRID_EP_SKIP_CUDA_BUILD:-} model_build=${HYBRID_EP_BUILD_MODEL:-}\\
     warnings=${PYTHONWARNINGS:-}" >> "$STUB_LOG"
    case "$*" in
        *"sys.version_info < (3, 10)"*) exit 0 ;;
        *"sys.version_info[0]"*) echo 3.12 ;;
        --version) echo "Python 3.12.1" ;;
        *"torch.cuda.is_available"*) exit "$STUB_TORCH_RC" ;;
        *"torch.version.cuda"*) echo 13 ;;
        *"-m pip show"*) exit 1 ;;
        *"-m pip install -v"*) touch "$STUB_REPO/hybrid_ep/_planner.stub.so"
                               echo "hybrid-ep: building the CPU model of the kernels hybrid_ep._model" ;;
    esac
    exit 0
''')


@pytest.fixture
def scratch(tmp_path):
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    (repo / "hybrid_ep").mkdir()
    (repo / "csrc").mkdir()
    shutil.copy(REPO / "scripts" / "env.sh", repo / "scripts" / "env.sh")
    for name in ("setup.py", "pyproject.toml"):
        shutil.copy(REPO / name, repo / name)
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("python3.12", "venv_python"):
        (stubs / name).write_text(PYTHON)
        (stubs / name).chmod(0o755)
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(stubs / "venv_python", venv / "bin" / "python")
    return tmp_path


def run_env(scratch, *, gpu: bool, torch_sees_gpu: bool = True, force: bool = False):
    """(stdout, stderr, the python calls of this run)."""
    log = scratch / "calls.log"
    log.write_text("")
    smi = scratch / "bin" / "nvidia-smi"
    smi.write_text(f"#!/usr/bin/env bash\n{'echo GPU 0: NVIDIA H100' if gpu else 'exit 9'}\n")
    smi.chmod(0o755)
    env = {"PATH": f"{scratch / 'bin'}:/usr/bin:/bin", "HOME": str(scratch), "STUB_LOG": str(log),
           "STUB_REPO": str(scratch / "repo"), "STUB_TORCH_RC": "0" if torch_sees_gpu else "1",
           "HYBRID_EP_VENV": str(scratch / "venv")}
    if force:
        env["HYBRID_EP_FORCE_CUDA_BUILD"] = "1"
    proc = subprocess.run(["bash", str(scratch / "repo" / "scripts" / "env.sh")], capture_output=True, text=True,
                          env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout, proc.stderr, log.read_text().splitlines()


def _build_calls(calls):
    return [c for c in calls if "-m pip install -v" in c]


def test_no_gpu_skips_the_cuda_extension_and_says_how_to_force_it(scratch):
    out, err, calls = run_env(scratch, gpu=False)
    assert out.strip() == str(scratch / "venv" / "bin" / "python")
    assert ("[env] skipping the CUDA extension hybrid_ep._C and the NVSHMEM install: no GPU visible "
            "(nvidia-smi -L fails); HYBRID_EP_FORCE_CUDA_BUILD=1 builds them anyway") in err.splitlines()
    [build] = _build_calls(calls)
    assert "cuda_skip=1" in build
    assert not any("nvidia-nvshmem" in c for c in calls)
    assert not any("torch.cuda.is_available" in c for c in calls)  # nvidia-smi answered first


def test_a_gpu_torch_cannot_see_counts_as_none(scratch):
    _, err, calls = run_env(scratch, gpu=True, torch_sees_gpu=False)
    assert "no GPU visible to torch (torch.cuda.is_available() is False)" in err
    assert "cuda_skip=1" in _build_calls(calls)[0]


@pytest.mark.parametrize("gpu, force", [(True, False), (False, True)], ids=["gpu_visible", "forced"])
def test_a_visible_gpu_or_the_force_variable_builds_it(scratch, gpu, force):
    _, err, calls = run_env(scratch, gpu=gpu, force=force)
    assert "cuda_skip= " in _build_calls(calls)[0] and "skipping" not in err
    [nvshmem] = [c for c in calls if "install -q nvidia-nvshmem-cu13" in c]
    assert "warnings=ignore" in nvshmem
    assert "hybrid_ep._C (sm_90a and sm_100a)" in err  # the build's announcement names the extension


def test_each_long_step_is_announced_with_its_usual_time_then_timed(scratch):
    _, err, calls = run_env(scratch, gpu=False)
    lines = err.splitlines()
    for what in ("installing torch, Megatron-Core and the test tools into", "building hybrid-ep into"):
        [announce] = [i for i, line in enumerate(lines) if line.startswith(f"[env] {what}")
                      and re.search(r" \((about \d+|\d+ to \d+) (s|min)\b", line)]
        [done] = [i for i, line in enumerate(lines) if line.startswith(f"[env] {what}") and ": done in" in line]
        assert announce < done
    # the dependency install builds nothing (the build step does, once torch is there) and
    # shows no setuptools warning box
    [deps] = [c for c in calls if "[test,megatron,plots]" in c]
    assert "cuda_skip=1 model_build= warnings=ignore" in deps
    assert "model_build=1" in _build_calls(calls)[0]  # the build step is a development build: the CPU model too


def test_the_cuda_decision_is_part_of_the_build_stamp(scratch):
    run_env(scratch, gpu=False)
    _, err, calls = run_env(scratch, gpu=False)
    assert _build_calls(calls) == [] and "building" not in err  # reused
    _, err, calls = run_env(scratch, gpu=False, force=True)
    assert len(_build_calls(calls)) == 1  # forcing the extension rebuilds
