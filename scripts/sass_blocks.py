#!/usr/bin/env python3
"""The basic blocks of one kernel in `cuobjdump -sass` output: per block its first address, its
instruction count and its opcodes, so a hot loop's instructions per byte can be counted where
no GPU can profile it (a straight-line block runs every instruction it lists).

    nvcc -std=c++17 -O3 --expt-relaxed-constexpr -I csrc -gencode=arch=compute_90a,code=sm_90a \\
        -c csrc/kernels/direct.cu -o /tmp/direct.o
    cuobjdump -sass /tmp/direct.o > /tmp/direct.sass
    python scripts/sass_blocks.py /tmp/direct.sass combine_direct_kernelI13__nv_bfloat16 --with LDS.128 --min 100

A block starts at the function's first instruction, at every branch target and after every
branch or exit. An opcode is the instruction's first word without its predicate (`@P0`).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import Counter

_FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
_INSTRUCTION = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_TARGET = re.compile(r"\b(?:BRA|BRX|JMP|CALL\.REL(?:\.NOINC)?)\s+(?:\S+,\s*)?(0x[0-9a-f]+)")
_ENDS_BLOCK = re.compile(r"\b(?:BRA|BRX|JMP|EXIT|RET|CALL)\b")


def functions(text: str) -> dict[str, list[tuple[int, str]]]:
    """Every function's instructions, in address order: name -> [(address, text)]."""
    out: dict[str, list[tuple[int, str]]] = {}
    current = None
    for line in text.splitlines():
        m = _FUNCTION.match(line)
        if m:
            current = out.setdefault(m.group(1), [])
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(2)))
    return out


def opcode(instruction: str) -> str:
    words = instruction.split()
    return words[1] if words[0].startswith("@") and len(words) > 1 else words[0]


def blocks(instructions: list[tuple[int, str]]) -> list[list[tuple[int, str]]]:
    """The function cut at its leaders (first instruction, branch targets, after a branch)."""
    if not instructions:
        return []
    leaders = {instructions[0][0]}
    for i, (_, text) in enumerate(instructions):
        m = _TARGET.search(text)
        if m:
            leaders.add(int(m.group(1), 16))
        if _ENDS_BLOCK.search(text) and i + 1 < len(instructions):
            leaders.add(instructions[i + 1][0])
    out: list[list[tuple[int, str]]] = []
    for address, text in instructions:
        if address in leaders or not out:
            out.append([])
        out[-1].append((address, text))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sass", help="cuobjdump -sass output")
    p.add_argument("function", help="a substring of the (mangled) kernel name; exactly one function must match")
    p.add_argument("--with", dest="with_ops", nargs="*", default=[], help="only blocks holding one of these opcodes")
    p.add_argument("--min", type=int, default=0, help="only blocks of at least this many instructions")
    args = p.parse_args(argv)
    with open(args.sass) as f:
        found = {name: ins for name, ins in functions(f.read()).items() if args.function in name}
    if len(found) != 1:
        print(f"sass_blocks: function '{args.function}' matches {len(found)} functions: {sorted(found)}",
              file=sys.stderr)
        return 2
    (name, instructions), = found.items()
    print(f"{name}: {len(instructions)} instructions")
    for block in blocks(instructions):
        ops = Counter(opcode(t) for _, t in block)
        if len(block) < args.min or (args.with_ops and not any(o in ops for o in args.with_ops)):
            continue
        mix = ", ".join(f"{o} {n}" for o, n in ops.most_common())
        print(f"  0x{block[0][0]:05x}  {len(block):4d}  {mix}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
