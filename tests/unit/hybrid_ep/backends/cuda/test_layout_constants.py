"""One home for the buffer layout: csrc's struct sizes, offsets and limits reach the cuda
backend's Python only through the compiled module (csrc/bindings/common.h), never as a number
written a second time in hybrid_ep/backends/cuda/*.py."""

from __future__ import annotations

import ast
import ctypes
import importlib
from pathlib import Path

import pytest

from helpers import REPO
from hybrid_ep.backends.cuda import launch, layout
from hybrid_ep.backends.cuda.engine import check_extension

pytestmark = pytest.mark.unit

CUDA_BACKEND = Path(REPO) / "hybrid_ep" / "backends" / "cuda"

def _exported_ints(module) -> set[str]:
    return {name for name in dir(module) if name.isupper() and isinstance(getattr(module, name), int)}


def _is_number(node: ast.AST) -> bool:
    """A literal integer or arithmetic of literal integers (8 + 8 + 4 + 4, 3 * 4 * 16)."""
    if isinstance(node, ast.Constant):
        return isinstance(node.value, int) and not isinstance(node.value, bool)
    if isinstance(node, ast.BinOp):
        return _is_number(node.left) and _is_number(node.right)
    if isinstance(node, ast.UnaryOp):
        return _is_number(node.operand)
    return False


def literal_constants(path: Path, exported: set[str]) -> list[str]:
    """Assignments in `path` that write one of csrc's numbers: a name the compiled module
    exports, bound to a literal number, or a literal number whose line says it mirrors csrc."""
    source = path.read_text()
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(target, ast.Name) or not _is_number(value):
            continue
        line = lines[node.lineno - 1]
        mirrors_csrc = "csrc" in line or "sizeof" in line or "offsetof" in line
        if target.id in exported or mirrors_csrc:
            found.append(f"{path.name}:{node.lineno}: {line.strip()}")
    return found


def test_no_module_of_the_cuda_backend_writes_a_csrc_number():
    exported = _exported_ints(layout.compiled)
    assert {"LOCAL_STATE_BYTES", "CHUNK_SIGNAL_BYTES", "ERROR_RECORD_CALL_OFFSET", "MAX_TOPK"} <= exported
    files = sorted(CUDA_BACKEND.glob("*.py"))
    assert len(files) >= 10
    found = [hit for path in files for hit in literal_constants(path, exported)]
    assert found == [], "\n".join(["written a second time; take it from the compiled module (layout.compiled):",
                                   *found])


def test_the_check_finds_a_literal_struct_size(tmp_path):
    """The check above can fail: the forms the layout used to have are found."""
    exported = _exported_ints(layout.compiled)
    bad = tmp_path / "bad.py"
    bad.write_text("LOCAL_STATE_BYTES = 8 + 8 + 4 + 4\n"
                   "RECORD_CALL_OFFSET = 16  # common/params.h ErrorRecord: csrc's four int32 words\n"
                   "MAX_TOPK: int = 16\n"
                   "CHUNK_META_HEADER = 16  # csrc/kernels/hierarchy.cuh kChunkMetaHeader\n"
                   "ALIGN = 128  # this plan's own choice\n")
    assert [hit.split(": ", 1)[0] for hit in literal_constants(bad, exported)] == ["bad.py:1", "bad.py:2",
                                                                                     "bad.py:3", "bad.py:4"]


def test_every_layout_constant_is_the_compiled_modules():
    model = importlib.import_module("hybrid_ep._model")
    assert layout.compiled is model  # the CPU model: built by every install, no GPU needed
    modules = {"layout": layout, "launch": launch}
    for name in layout.COMPILED_CONSTANTS:
        owner = next(m for m in modules.values() if hasattr(m, name))
        assert getattr(owner, name) == getattr(model, name), name
    assert layout.MAX_TOPK == model.MAX_TOPK and launch.MAX_BATCH_ROWS == model.CHUNK_TOKENS
    check_extension(model)


class _ErrorRecord(ctypes.Structure):
    """common/params.h ErrorRecord as the host maps it (a test's mirror, checked against the module)."""

    _fields_ = [("phase", ctypes.c_int32), ("rank", ctypes.c_int32), ("peer", ctypes.c_int32),
                ("site", ctypes.c_int32), ("call", ctypes.c_uint64), ("expected", ctypes.c_uint64),
                ("observed", ctypes.c_uint64)]


def test_the_error_record_offsets_the_engine_polls_are_csrcs():
    model = layout.compiled
    assert (model.ERROR_RECORD_PHASE_OFFSET, model.ERROR_RECORD_CALL_OFFSET) == (
        _ErrorRecord.phase.offset, _ErrorRecord.call.offset)
    record = model.ErrorRecord()
    call = ctypes.c_uint64.from_address(record.host_ptr + layout.ERROR_RECORD_CALL_OFFSET)
    assert call.value == 0 and record.read() is None


def test_the_buffer_layouts_come_from_the_extension():
    """The registered buffer's and the RDMA region's offsets are built by csrc (bindings/
    buffer_layout.h) and only read in Python: layout.py places no region itself."""
    from hybrid_ep.config import BufferConfig

    cfg = BufferConfig(256, 64, 8, 4, 2).validate()
    assert isinstance(layout.registered_layout(cfg), layout.compiled.RegLayout)
    assert isinstance(layout.rdma_layout(cfg), layout.compiled.RdmaLayout)
    assert [r.name for r in layout.registered_regions(cfg)][:2] == ["flags+counts", "recv_meta"]
    source = (CUDA_BACKEND / "layout.py").read_text()
    assert "def take(" not in source and "region_bytes" not in source
