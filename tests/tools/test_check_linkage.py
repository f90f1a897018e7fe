"""scripts/check_linkage.sh --own: an extension that calls its own functions without defining
them links and then fails to import on the GPU machine (the 2026-11-27 run's DeepEP wheel,
whose bindings call kernels its NVSHMEM-free build leaves out); the check refuses it here."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

CHECK = Path(REPO) / "scripts" / "check_linkage.sh"
ANY_LIB = "."  # every needed library allowed: only the own symbols are checked here


def _shared_object(tmp_path: Path, name: str, source: str) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("needs g++ to build the shared objects it checks")
    src, so = tmp_path / f"{name}.cpp", tmp_path / f"{name}.so"
    src.write_text(source)
    subprocess.run(["g++", "-shared", "-fPIC", "-o", str(so), str(src)], check=True)
    return so


DECLARED = "namespace deep_ep { namespace internode_ll { void query_mask_buffer(int* p); } }\n"
CALLER = "void bind(int* p) { deep_ep::internode_ll::query_mask_buffer(p); }\n"


def test_an_own_function_left_undefined_is_refused_by_name(tmp_path):
    so = _shared_object(tmp_path, "calls", DECLARED + CALLER)
    proc = subprocess.run(["bash", str(CHECK), "--own", "deep_ep::", ANY_LIB, str(so)],
                          capture_output=True, text=True)
    assert proc.returncode == 1
    assert "deep_ep::internode_ll::query_mask_buffer" in proc.stderr
    # without --own the same file passes: the needed libraries are all it checks then
    assert subprocess.run(["bash", str(CHECK), ANY_LIB, str(so)], capture_output=True).returncode == 0


def test_an_extension_defining_what_it_calls_passes(tmp_path):
    body = "namespace deep_ep { namespace internode_ll { void query_mask_buffer(int* p) { *p = 0; } } }\n"
    so = _shared_object(tmp_path, "defines", DECLARED + body + CALLER)
    proc = subprocess.run(["bash", str(CHECK), "--own", "deep_ep::", ANY_LIB, str(so)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
