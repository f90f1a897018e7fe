"""Registered buffers: a failed allocation leaves nothing allocated behind it."""

from __future__ import annotations

import pytest
import torch

from hybrid_ep.backends.cuda.registered import RegisteredBuffers

pytestmark = pytest.mark.unit


class FailingExt:
    """Allocations that run out of memory after `allowed` of them; frees are recorded."""

    def __init__(self, allowed: int):
        self.allowed, self.live = allowed, {}

    def allocate_registered(self, nbytes, kind, device_index):
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
    with pytest.raises(RuntimeError, match="out of memory") as failure:
        RegisteredBuffers.emulated(ext, 1 << 20, 6, torch.device("cpu"), arena_bytes=1 << 20)
    # the traceback (held here, as pytest holds a failed test's) keeps the half-built object
    assert failure.value.__traceback__ is not None
    assert ext.live == {}


def test_emulated_buffers_keep_every_rank_when_all_fit():
    ext = FailingExt(6)
    buffers = RegisteredBuffers.emulated(ext, 1 << 20, 6, torch.device("cpu"), arena_bytes=1 << 20)
    assert len(ext.live) == 6 and len(buffers.arena_bases) == 6
    buffers.close()
    assert ext.live == {}

