"""python -m tools.microbench LINES --out DIR [--command TEXT] [--commit SHA]

Reads the JSON lines of one run of hybrid_ep_microbench and writes DIR/micro.json,
DIR/micro.txt (printed too) and DIR/micro_tma.png. Exit status 2 when LINES cannot be read
as one run (the message names the line), else 0: lines of failed kernels are kept and
counted, the program's own exit status says whether the run failed.
"""

from __future__ import annotations

import os
import sys

from hybrid_ep.cli_parser import ArgumentParser

from . import plot, records, report


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m tools.microbench", description=__doc__.split("\n\n")[1])
    p.add_argument("lines", help="the program's stdout: one JSON object per line")
    p.add_argument("--out", required=True, help="folder for micro.json, micro.txt and micro_tma.png")
    p.add_argument("--command", default="hybrid_ep_microbench all", help="the command that printed LINES")
    p.add_argument("--commit", default=None, help="the commit that was measured")
    args = p.parse_args(argv)
    try:
        lines = records.read(args.lines)
    except (OSError, ValueError) as e:
        print(f"tools.microbench: {e}", file=sys.stderr)
        return 2
    doc = report.build(lines, command=args.command, commit=args.commit)
    paths = report.write(doc, args.out)
    png = plot.plot(lines.records.get("M2", []), os.path.join(args.out, "micro_tma.png"))
    sys.stdout.write(report.text(doc))
    print("wrote " + ", ".join(paths + ([png] if png else [])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
