#!/usr/bin/env python3
"""Group the hazards of `compute-sanitizer --tool racecheck` logs (the `sanitize` stage's
sanitizer_racecheck_<path>.log) by shared-memory site pair: for each (write site, read site)
the reports that name it, the hazard instances racecheck counted, and the emulated_check cases
whose launches they came from. docs/benchmarks/racecheck.md classifies the pairs.

    python scripts/racecheck_classes.py benchmarks/results/2026-11-26-h200/sanitizer_racecheck_*.log

A report ("Error: Race reported between ...") names one access and then one or more others,
each with its count; every pair of a report is a row. The reports printed before a case's
"emulated_check ... call 0" line came from that case's launches. Exit status 1 when a log's
reports do not add up to its RACECHECK SUMMARY line.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict

_FIRST = re.compile(r"Error: Race reported between (Write|Read) access at .* in (\S+:\d+)\s*$")
_OTHER = re.compile(r"^=+\s+and (Write|Read) access at .* in (\S+:\d+) \[(\d+) hazards?\]")
_CASE = re.compile(r"^emulated_check \[\w+\] (W\d+)\S* .*? (bfloat16|float8_e4m3fn|float32|float16) ")
_SUMMARY = re.compile(r"RACECHECK SUMMARY: (\d+) hazards? displayed")
_DTYPES = {"bfloat16": "bf16", "float8_e4m3fn": "fp8", "float32": "fp32", "float16": "fp16"}


def classify(lines):
    """(rows, reports, summary): rows maps (write site, read site) to [reports, hazards, cases]."""
    rows: dict[tuple[str, str], list] = defaultdict(lambda: [0, 0, []])
    pending: list[tuple[str, str]] = []  # pairs of the reports since the last case line
    first = None
    reports, summary = 0, None
    for line in lines:
        if m := _FIRST.search(line):
            first = (m.group(1), m.group(2))
            reports += 1
            named: set[tuple[str, str]] = set()
        elif (m := _OTHER.search(line)) and first is not None:
            kinds = {first[0]: first[1], m.group(1): m.group(2)}
            if len(kinds) == 1:  # two writes (or reads) of one report: keep both, the first as "write"
                kinds = {"Write": first[1], "Read": m.group(2)}
            pair = (kinds["Write"], kinds["Read"])
            row = rows[pair]
            row[0] += pair not in named
            row[1] += int(m.group(3))
            named.add(pair)
            pending.append(pair)
        elif m := _CASE.search(line):
            case = f"{m.group(1)} {_DTYPES[m.group(2)]}"
            for pair in dict.fromkeys(pending):
                if case not in rows[pair][2]:
                    rows[pair][2].append(case)
            pending = []
        elif m := _SUMMARY.search(line):
            summary = int(m.group(1))
    return dict(rows), reports, summary


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="racecheck logs")
    args = parser.parse_args(argv)
    status = 0
    for path in args.logs:
        with open(path, encoding="utf-8", errors="replace") as f:
            rows, reports, summary = classify(f)
        print(f"{path}: {reports} reports; RACECHECK SUMMARY: {summary if summary is not None else 'none'}")
        if summary is not None and summary != reports:
            print(f"  the reports do not add up to the summary's {summary}")
            status = 1
        print(f"  {'write site':<28} {'read site':<28} {'reports':>7} {'hazards':>8}  cases")
        for (write, read), (n, hazards, cases) in sorted(rows.items(), key=lambda kv: (kv[0][0], kv[0][1])):
            print(f"  {write:<28} {read:<28} {n:>7} {hazards:>8}  {', '.join(cases)}")
    return status


if __name__ == "__main__":
    sys.exit(main())
