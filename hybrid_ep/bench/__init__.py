"""Dispatch / combine benchmark: `python -m hybrid_ep.bench --help`.

Modules, one job each: spec (validated configuration), cli (flags and the order of a run),
launch (starting the ranks), worker (what each rank runs), inputs (a rank's routing, inputs and
progress line, shared by every backend), timing (one timed call),
metrics (times and bandwidths, docs/benchmarks/README.md), report (tables, results.json), plot (PNGs),
deepep (DeepEP's kernels as the baseline of --backends deepep).
"""


def main(argv: list[str] | None = None) -> int:
    """The CLI; imported on call so that ranks importing `worker` skip matplotlib."""
    from .cli import main as cli_main

    return cli_main(argv)


__all__ = ["main"]
