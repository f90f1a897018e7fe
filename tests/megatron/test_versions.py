"""The Megatron-Core floor (megatron_patches/versions.py): pyproject.toml's extra installs it, apply()
refuses older releases by name, and CI's test command says which version it ran."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import tomllib

from megatron_patches import versions

pytestmark = pytest.mark.megatron

REPO = pathlib.Path(__file__).resolve().parents[2]


def test_the_megatron_extra_installs_the_floor():
    """pyproject.toml's static metadata names the floor a second time: the two must agree."""
    with open(REPO / "pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["megatron"] == [f"megatron-core>={versions.MEGATRON_CORE_FLOOR}", "psutil"]


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


@pytest.mark.slow  # the full tier (scripts/test.sh --full): scripts/test.sh prints the line each run
def test_ci_states_the_version_it_ran():
    pytest.importorskip("megatron.core")
    from megatron.core import package_info

    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "megatron_patches.versions"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert re.fullmatch(rf"Megatron-Core {re.escape(package_info.__version__)} from /\S+/megatron/core\n", out.stdout)
    assert "-m megatron_patches.versions" in (REPO / "scripts" / "test.sh").read_text()
