"""Counts and sizes as the project's tables, log lines and plot titles print them."""

from __future__ import annotations


def plural(n: int, word: str) -> str:
    """'1 node', '2 nodes'."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def byte_unit(value: float) -> tuple[float, str]:
    """(divisor, unit) that shows value as a short number: up to PiB, since moving every slot
    of a large model's plan is tens of TiB ("9.56e+03 GiB" with GiB the largest unit)."""
    for scale, unit in ((2.0 ** 50, "PiB"), (2.0 ** 40, "TiB"), (2.0 ** 30, "GiB"), (2.0 ** 20, "MiB"),
                        (2.0 ** 10, "KiB")):
        if value >= scale:
            return scale, unit
    return 1.0, "B"
