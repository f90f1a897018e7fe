"""A peer that dies in the middle of a call: the others raise within the call's deadline, by
name, and do not hang (the reference backend on gloo ranks: a broken connection is seen at
once; the cuda kernels' absent peer on the CPU model: tests/model/test_kernels_model.py)."""

from __future__ import annotations

import pytest

from hybrid_ep.spawn import ProcessGroupPool
from hybrid_ep.testing.fault_cases import dies_in_a_call_on_rank

pytestmark = pytest.mark.faults

T = 3.0


def test_the_others_raise_within_the_deadline_when_a_peer_dies_in_a_call():
    with ProcessGroupPool(3, env={"HYBRID_EP_TIMEOUT_S": str(T)}, start_method="forkserver") as pool:
        got = pool.run(dies_in_a_call_on_rank, [(2,)] * 3, timeout_s=120)
        assert not pool.usable
    for r, g in enumerate(got[:2]):
        assert g["seconds"] < 1.2 * T, (r, g)
        assert f"rank {r} of the EP group" in g["words"], g["words"]
        assert "connection to a peer rank broke" in g["words"] or "deadline" in g["words"], g["words"]
