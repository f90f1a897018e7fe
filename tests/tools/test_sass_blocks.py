"""scripts/sass_blocks.py on a hand-written `cuobjdump -sass` excerpt: where blocks start (the
first instruction, branch targets, after a branch or exit), what each counts, which function
is read."""

from __future__ import annotations

import importlib.util
import os

import pytest

from helpers import REPO

pytestmark = pytest.mark.unit

SASS = """
	code for sm_90a
		Function : _Z5otherv
        /*0000*/                   EXIT ;                                   /* 0x000000000000794d */
		Function : _ZN9hybrid_ep6kernelI13__nv_bfloat16EEvv
        /*0000*/                   LDC R1, c[0x0][0x28] ;                   /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 BRA 0x50 ;                               /* 0x0000000000008947 */
        /*0020*/                   LDS.128 R4, [R2] ;                       /* 0x0000000002047984 */
        /*0030*/                   SHF.L.U32 R8, R4, 0x10, RZ ;             /* 0x0000001004087819 */
        /*0040*/                   FADD R9, R9, R8 ;                        /* 0x0000000809097221 */
        /*0050*/                   FADD R9, R9, R4 ;                        /* 0x0000000409097221 */
        /*0060*/               @P1 EXIT ;                                   /* 0x000000000000194d */
        /*0070*/                   BRA 0x70 ;                               /* 0xfffffffc00fc7947 */
"""


def _module():
    spec = importlib.util.spec_from_file_location("sass_blocks", os.path.join(REPO, "scripts", "sass_blocks.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blocks_start_at_targets_and_after_branches():
    m = _module()
    fns = m.functions(SASS)
    assert sorted(fns) == ["_Z5otherv", "_ZN9hybrid_ep6kernelI13__nv_bfloat16EEvv"]
    blocks = m.blocks(fns["_ZN9hybrid_ep6kernelI13__nv_bfloat16EEvv"])
    assert [[a for a, _ in b] for b in blocks] == [[0x00, 0x10], [0x20, 0x30, 0x40], [0x50, 0x60], [0x70]]
    assert m.opcode("@!P0 BRA 0x50") == "BRA" and m.opcode("LDS.128 R4, [R2]") == "LDS.128"


def test_the_report_counts_a_blocks_opcodes(tmp_path, capsys):
    path = tmp_path / "k.sass"
    path.write_text(SASS)
    assert _module().main([str(path), "kernelI13", "--with", "LDS.128"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == ["_ZN9hybrid_ep6kernelI13__nv_bfloat16EEvv: 8 instructions",
                   "  0x00020     3  LDS.128 1, SHF.L.U32 1, FADD 1"]


@pytest.mark.parametrize("name", ["nothing", "_Z"])  # no function, two functions
def test_a_name_must_match_exactly_one_function(tmp_path, capsys, name):
    path = tmp_path / "k.sass"
    path.write_text(SASS)
    assert _module().main([str(path), name]) == 2
    assert "matches" in capsys.readouterr().err
