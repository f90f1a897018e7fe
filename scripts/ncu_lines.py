"""Warp stall samples per source line, from ncu's per-instruction source table.

`ncu --import R.ncu-rep --page source --csv --print-source cuda,sass` lists every SASS
instruction under the source line it came from (the build has -lineinfo), with its stall
samples; the hot spots of a latency-bound kernel only show once those are summed per line.
Prints, per table, the lines with the most samples and their two main stall reasons.

Usage: python3 scripts/ncu_lines.py TABLE.csv [...] [--top N]   (gpu_check.sh ncu runs it)
"""

from __future__ import annotations

import argparse
import collections
import csv
import os
import sys

SAMPLES = "Warp Stall Sampling (All Samples)"
REASONS = ("stall_barrier", "stall_branch_resolving", "stall_long_sb", "stall_wait", "stall_lg",
           "stall_membar", "stall_mio", "stall_short_sb")


def _number(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


def summarize(path: str, top: int = 15) -> str:
    """The table's kernel, its total samples and its `top` source lines by samples."""
    if top < 1:
        raise ValueError(f"top must be a positive integer, got {top!r}")
    kernel, source_file, header = "?", "?", None
    samples = collections.Counter()            # (file, line) -> samples
    reasons = collections.defaultdict(collections.Counter)
    text = {}
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row:
                continue
            if row[0] in ("Kernel Name", "Function Name"):  # ncu 2025.3 writes the first
                kernel = row[1]
            elif row[0] == "File Path":
                source_file = os.path.basename(row[1])
            elif row[0] == "Line No":
                if SAMPLES not in row:
                    raise ValueError(f"{path}: no '{SAMPLES}' column (profile with --section "
                                     "SourceCounters and import with --print-source cuda,sass)")
                header = row
            elif header and len(row) == len(header) and _number(row[0]) is not None:
                key = (source_file, int(_number(row[0])))
                samples[key] += _number(row[header.index(SAMPLES)]) or 0.0
                text[key] = row[1].strip()[:90]
                for name in REASONS:
                    if name in header:
                        reasons[key][name[len("stall_"):]] += _number(row[header.index(name)]) or 0.0
    if header is None:
        raise ValueError(f"{path}: no per-line table (a 'Line No' header; profile with --section "
                         "SourceCounters and import with --print-source cuda,sass)")
    total = sum(samples.values())
    out = [f"{kernel}: {int(total)} warp samples"]
    for key, n in samples.most_common(top):
        main = ", ".join(f"{r} {c / n:.0%}" for r, c in reasons[key].most_common(2) if c) if n else ""
        out.append(f"  {n / max(total, 1) * 100:5.1f}%  {key[0]}:{key[1]}  {text[key]}  [{main}]")
    return "\n".join(out)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("tables", nargs="+", help="CSV files written by ncu --page source --csv --print-source cuda,sass")
    p.add_argument("--top", type=_positive_int, default=15, help="lines to print per table")
    args = p.parse_args(argv)
    for path in args.tables:
        try:
            print(summarize(path, args.top))
        except (OSError, ValueError) as e:
            print(f"ncu_lines: {e}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
