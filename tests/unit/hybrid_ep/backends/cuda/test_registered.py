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


class SharingExt(FailingExt):
    """FailingExt whose peers open, as CUDA IPC handles on one machine would (the probe refuses
    fabric handles, as a machine without an IMEX channel does)."""

    def __init__(self):
        super().__init__(allowed=4)
        self.opened = []

    def fabric_probe(self, device_index):
        return "no fabric handles here"

    def open_peer(self, handle, size, kind, device_index):
        self.opened.append(size)
        return 1 << 40

    def close_peer(self, ptr, size, kind):
        pass


def _exchange_on_rank(ring_dtype_bytes):
    import torch.distributed as dist

    from hybrid_ep.config import BufferConfig

    rank = dist.get_rank()
    ring = torch.bfloat16 if ring_dtype_bytes[rank] == 2 else torch.float32
    ext = SharingExt()
    try:
        buffers = RegisteredBuffers.exchanged(ext, BufferConfig(256, 16, 4, 2, 2, ring_dtype=ring).validate(),
                                              dist.group.WORLD, rank, torch.device("cpu"))
    except ValueError as err:
        return str(err), ext.live, ext.opened
    buffers.close()
    return "built", ext.live, ext.opened


def test_ranks_whose_layouts_differ_all_raise_before_opening_a_peer(pool_for):
    """One rank with bf16 rings, the other with fp32 ones: each would write its peer's rings at
    its own strides. Every rank raises, naming the field and each rank's value and what shapes
    the layout, frees what it allocated and opens no peer; alike layouts open each other."""
    got = pool_for(2).run(_exchange_on_rank, [((2, 4),)] * 2)
    for message, live, opened in got:
        assert message.startswith("HybridEPBuffer: the EP ranks disagree on the registered buffer's layout: "
                                  "shape.ring_elem_bytes (set by ring_dtype) is 2 on rank 0; 4 on rank 1 (the "
                                  "buffer's bytes: ")
        assert "ring_chunks and ring_dtype shape it" in message and live == {} and opened == []
    assert [r[0] for r in pool_for(2).run(_exchange_on_rank, [((2, 2),)] * 2)] == ["built", "built"]
