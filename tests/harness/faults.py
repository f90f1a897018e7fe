"""Faults the tests inject into the kernels of an emulated group: ranks that never arrive.

`ranks_absent(group, ranks)` makes the virtual ranks `ranks` of an EmulatedGroup (or of any
holder of an Engine) launch none of their kernels inside the block, as a crashed peer would;
their peers then give up after HYBRID_EP_TIMEOUT_S and the error names the rank and the phase
(read it with `group.synchronize()`, inside the block or after it: the kernels were launched
with the ranks absent either way). `after_count` ranks launch a dispatch's count kernel, so
their counts are exchanged, but not its dispatch kernel: a peer lost between the two.

This is the only place that sets Engine.model.absent; no public call takes the ranks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

from hybrid_ep.backends.cuda.model_hooks import AbsentRanks


@contextlib.contextmanager
def ranks_absent(group, ranks: Iterable[int] = (), *, after_count: Iterable[int] = ()) -> Iterator[None]:
    model = getattr(group, "engine", group).model
    before = model.absent
    model.absent = AbsentRanks(frozenset(ranks), frozenset(after_count))
    try:
        yield
    finally:
        model.absent = before
