"""Registered buffers: a failed allocation is retried once, then raised naming the region and
the bytes, and leaves nothing allocated behind it."""

from __future__ import annotations

import pytest
import torch

from hybrid_ep.backends.cuda.registered import RegisteredAllocationError, RegisteredBuffers

pytestmark = pytest.mark.unit


class FailingExt:
    """Allocations that run out of memory after `allowed` of them; frees are recorded."""

    def __init__(self, allowed: int, transient: int = 0):
        self.allowed, self.live, self.transient, self.calls = allowed, {}, transient, 0

    def allocate_registered(self, nbytes, kind, device_index):
        self.calls += 1
        if self.transient:  # fails this many times, then works (cached blocks were returned)
            self.transient -= 1
            raise RuntimeError("hybrid_ep: cudaMalloc of the registered buffer: out of memory")
        if len(self.live) == self.allowed:
            raise RuntimeError("hybrid_ep: cudaMalloc of the registered buffer: out of memory")
        ptr = 4096 * (len(self.live) + 1)
        self.live[ptr] = nbytes
        return ptr, nbytes, b""

    def free_registered(self, ptr, size, kind):
        assert self.live.pop(ptr) == size


@pytest.mark.parametrize("allowed", [0, 1, 5])
def test_emulated_buffers_free_the_ranks_allocated_before_one_fails(allowed):
    ext = FailingExt(allowed)
    with pytest.raises(RegisteredAllocationError, match=f"registered buffer of virtual rank {allowed} "
                                                        r"\(1048576 bytes; on cpu") as failure:
        RegisteredBuffers.emulated(ext, 1 << 20, 6, torch.device("cpu"))
    assert "out of memory" in str(failure.value) and "memory_plan()" in str(failure.value)
    assert ext.calls == allowed + 2  # the failing allocation was tried twice
    # the traceback (held here, as pytest holds a failed test's) keeps the half-built object
    assert failure.value.__traceback__ is not None
    assert ext.live == {}


def test_emulated_buffers_keep_every_rank_when_all_fit():
    ext = FailingExt(6)
    buffers = RegisteredBuffers.emulated(ext, 1 << 20, 6, torch.device("cpu"))
    assert len(ext.live) == 6 and len(buffers.tables) == 6
    buffers.close()
    assert ext.live == {}



def test_an_allocation_that_fails_once_is_retried():
    ext = FailingExt(6, transient=1)
    buffers = RegisteredBuffers.emulated(ext, 1 << 20, 2, torch.device("cpu"))
    assert ext.calls == 3 and len(ext.live) == 2
    buffers.close()
    assert ext.live == {}


def test_other_allocation_errors_are_not_retried():
    class Broken(FailingExt):
        def allocate_registered(self, nbytes, kind, device_index):
            self.calls += 1
            raise RuntimeError("hybrid_ep: cuMemCreate: invalid argument")

    ext = Broken(6)
    with pytest.raises(RuntimeError, match="invalid argument"):
        RegisteredBuffers.emulated(ext, 1 << 20, 2, torch.device("cpu"))
    assert ext.calls == 1
