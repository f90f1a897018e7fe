"""The one rule for integer and real-number arguments, and the error that names them.

An integer argument is an int (numpy integers too) that is not a bool: True would otherwise
pass as 1. A count or a size adds a lower bound. Every such check in hybrid_ep and
megatron_patches goes through here. The caller names the argument, so each error says which
one was wrong; `require_int` raises in the package's words, and callers with their own
(a file's field, a flag, an option) test with `is_int` / `is_real` and word the error.
"""

from __future__ import annotations

import math
import numbers


def is_int(value, lo: int | None = None, hi: int | None = None) -> bool:
    """An integer that is not a bool, in [lo, hi] where given."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        return False
    # typeshed's numbers.Integral declares no comparisons; every integral type compares with int
    return (lo is None or value >= lo) and (hi is None or value <= hi)  # type: ignore[operator]


def is_real(value, *, finite: bool = False) -> bool:
    """A real number (an integer too) that is not a bool; with finite, not nan or +-inf either."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    return not finite or math.isfinite(value)


def require_int(name: str, value, lo: int | None = None, *, what: str = "an int"):
    """`value`, an integer >= lo. Otherwise TypeError "<name> must be <what>, got <type>" for
    anything but an integer (a bool, a float, None) and ValueError "<name> must be >= <lo>,
    got <value>" for one below lo."""
    if not is_int(value):
        raise TypeError(f"{name} must be {what}, got {type(value).__name__}")
    if lo is not None and value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value
