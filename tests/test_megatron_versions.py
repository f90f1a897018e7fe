"""The Megatron-Core floor (megatron_patches/versions.py): setup.py's extra installs it, apply()
refuses older releases by name, and CI's test command says which version it ran."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

from megatron_patches import versions

pytestmark = pytest.mark.megatron

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_setup_extra_installs_the_floor():
    probe = ("import runpy, setuptools; setuptools.setup = lambda **kw: print(kw['extras_require']['megatron']); "
             "runpy.run_path('setup.py')")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, HYBRID_EP_SKIP_CUDA_BUILD="1", HYBRID_EP_SKIP_MODEL_BUILD="1"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[-1] == f"['megatron-core>={versions.MEGATRON_CORE_FLOOR}', 'psutil']"


def test_older_release_is_refused_by_name():
    with pytest.raises(RuntimeError, match=re.escape(
            f"megatron_patches needs Megatron-Core >= {versions.MEGATRON_CORE_FLOOR}, found 0.16.1")):
        versions.check_megatron_core("0.16.1")
    versions.check_megatron_core(f"{versions.MEGATRON_CORE_FLOOR}.0rc1")
    versions.check_megatron_core("1.0.0")


def test_apply_refuses_an_older_imported_megatron(monkeypatch):
    pytest.importorskip("megatron.core")
    from megatron.core import package_info

    import megatron_patches

    monkeypatch.setattr(package_info, "__version__", "0.16.1")
    with pytest.raises(RuntimeError, match=r"needs Megatron-Core >= [\d.]+, found 0.16.1 \(from .*megatron/core\)"):
        megatron_patches.apply()


def test_ci_states_the_version_it_ran():
    pytest.importorskip("megatron.core")
    from megatron.core import package_info

    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_patches.versions"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.fullmatch(rf"Megatron-Core {re.escape(package_info.__version__)} from /\S+/megatron/core\n", out.stdout)
    assert "-m megatron_patches.versions" in (REPO / "scripts" / "test.sh").read_text()
