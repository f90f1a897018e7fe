"""Registered buffers set up across processes (gloo ranks) on the CPU model's memory, which a
peer opens by its handle as CUDA IPC opens device memory: a rank that fails in a step of the
setup (its allocation, its opens of the node peers' buffers, the handle probe) makes every rank
raise the same SetupError naming it, within a bound and not at the process group's timeout, each
rank having freed and closed what it had (the model's allocations, its mappings and descriptors
counted before and after); a new buffer works afterwards. Ranks whose layouts differ in any field
that places a region raise alike, the review's pair whose totals collide included."""

from __future__ import annotations

import ctypes
import os
import time

import pytest
import torch

from hybrid_ep.backends.cuda.errors import SetupError
from hybrid_ep.backends.cuda.layout import layout_fields, registered_layout
from hybrid_ep.backends.cuda.registered import check_same_layout
from hybrid_ep.config import BufferConfig

pytestmark = pytest.mark.faults

CONFIG = BufferConfig(256, 64, 8, 4, 4).validate()  # 4 ranks, one node: each opens its 3 peers
NBYTES = registered_layout(CONFIG).total
BOUND_S = 10.0  # far above a step (well under a second); the pools' process group waits 300 s


class _Faulty:
    """hybrid_ep._model with one of its calls failing on this rank as the driver's would: "open"
    corrupts the handle of its second peer (the model refuses it, as cudaIpcOpenMemHandle
    refuses a stale handle) after the first opened, "allocate" runs out of memory."""

    def __init__(self, ext, fault: str | None):
        self._ext, self._fault, self._opens = ext, fault, 0

    def __getattr__(self, name):
        return getattr(self._ext, name)

    def allocate_registered(self, nbytes, kind, device):
        if self._fault == "allocate":
            raise RuntimeError("hybrid_ep: cudaMalloc of the registered buffer: out of memory")
        return self._ext.allocate_registered(nbytes, kind, device)

    def open_peer(self, handle, nbytes, kind, device):
        self._opens += 1
        if self._fault == "open" and self._opens == 2:
            handle = handle[:-16] + bytes(16)  # the memfd's name no longer matches
        return self._ext.open_peer(handle, nbytes, kind, device)


def _held(model) -> tuple[int, int, int]:
    """What the model holds in this process: its allocations, the mappings of registered buffers,
    the open descriptors."""
    with open("/proc/self/maps") as maps:
        mapped = sum("hybrid_ep_registered" in line for line in maps)
    return len(model.allocations()), mapped, len(os.listdir("/proc/self/fd"))


def _a_buffer_works(model, config: BufferConfig, rank: int) -> list[int]:
    """A new buffer of every rank: each writes its rank into its own buffer's first word and reads
    every node peer's through its mapping."""
    import torch.distributed as dist

    from hybrid_ep.backends.cuda.registered import RegisteredBuffers

    buffers = RegisteredBuffers.exchanged(model, config, dist.group.WORLD, rank, torch.device("cpu"))
    try:
        table = buffers.tables[0].tolist()
        ctypes.c_int64.from_address(table[rank]).value = 1000 + rank
        dist.barrier()
        return [ctypes.c_int64.from_address(base).value for base in table]
    finally:
        dist.barrier()  # every peer read before any unmaps
        buffers.close()


def _set_up_with_a_fault(fault: str, failing: int):
    import hybrid_ep._model as model
    import torch.distributed as dist

    from hybrid_ep.backends.cuda.registered import RegisteredBuffers

    rank = dist.get_rank()
    if fault == "handle env" and rank == failing:
        os.environ["HYBRID_EP_HANDLE"] = "nvlink"
    ext = _Faulty(model, fault if rank == failing else None)
    dist.barrier()
    before = _held(model)
    start = time.monotonic()
    try:
        RegisteredBuffers.exchanged(ext, CONFIG, dist.group.WORLD, rank, torch.device("cpu")).close()
        outcome = ("built", None, None)
    except SetupError as err:
        outcome = (str(err), err.rank, sorted(err.failures))
    waited = time.monotonic() - start
    os.environ.pop("HYBRID_EP_HANDLE", None)
    after = _held(model)
    seen = _a_buffer_works(model, CONFIG, rank)
    return outcome, waited, before, after, _held(model), seen


@pytest.mark.parametrize("fault, failing, words", [
    ("open", 1, "rank 1 failed opening its node peers' registered buffers: RuntimeError: hybrid_ep: "
                "cudaIpcOpenMemHandle: the memory's owner released it"),
    ("allocate", 0, f"rank 0 failed allocating its registered buffer ({NBYTES} bytes): RegisteredAllocationError: "
                    f"hybrid_ep: could not allocate the registered buffer of rank 0 ({NBYTES} bytes; on cpu, after "
                    "returning PyTorch's cached blocks): hybrid_ep: cudaMalloc of the registered buffer: out of "
                    "memory. memory_plan() lists what the buffer holds by region"),
    ("handle env", 2, "rank 2 failed probing fabric handles (HYBRID_EP_HANDLE): ValueError: HYBRID_EP_HANDLE must "
                      "be auto, ipc or fabric, got 'nvlink'"),
])
def test_a_rank_that_fails_in_setup_makes_every_rank_raise_the_same_error(pool_for, fault, failing, words):
    got = pool_for(4).run(_set_up_with_a_fault, [(fault, failing)] * 4)
    messages = {outcome[0] for outcome, *_ in got}
    assert len(messages) == 1, messages
    [message] = messages
    assert message.startswith(f"hybrid_ep: {words}. Every rank of the group raised this error"), message
    for rank, (outcome, waited, before, after, final, seen) in enumerate(got):
        assert outcome[1:] == (failing, [failing])
        assert waited < BOUND_S, f"rank {rank} raised after {waited:.2f} s"
        assert after == before == final, f"rank {rank} holds (allocations, mappings, descriptors) {before} -> {after}"
        assert seen == [1000, 1001, 1002, 1003]


def _exchange_layouts(configs: list[BufferConfig]):
    import hybrid_ep._model as model
    import torch.distributed as dist

    from hybrid_ep.backends.cuda.registered import RegisteredBuffers

    rank = dist.get_rank()
    before = _held(model)
    try:
        RegisteredBuffers.exchanged(model, configs[rank], dist.group.WORLD, rank, torch.device("cpu")).close()
        message = "built"
    except ValueError as err:
        message = str(err)
    return message, before == _held(model)


# The review's pair: totals equal (8,489,984 bytes), regions elsewhere (recv_rows at 35,840 and 68,608).
BF16_E16 = BufferConfig(2048, 128, 16, 8, 8, ring_chunks=4, ring_dtype=torch.bfloat16).validate()
FP32_E64 = BufferConfig(2048, 128, 64, 8, 8, ring_chunks=2, ring_dtype=torch.float32).validate()


def test_layouts_with_the_same_total_and_other_regions_are_refused_naming_the_field():
    fields = [dict(layout_fields(c)) for c in (BF16_E16, FP32_E64)]
    assert fields[0]["reg.total"] == fields[1]["reg.total"] == 8489984
    assert (fields[0]["reg.recv_rows"], fields[1]["reg.recv_rows"]) == (35840, 68608)
    with pytest.raises(ValueError) as err:
        check_same_layout([layout_fields(c) for c in (BF16_E16, FP32_E64) * 4])
    assert str(err.value) == (
        "HybridEPBuffer: the EP ranks disagree on the registered buffer's layout: shape.local_experts (set by "
        "num_experts / world_size) is 2 on ranks 0, 2, 4, 6; 8 on ranks 1, 3, 5, 7 (the buffer's bytes: 8489984 on "
        "ranks 0-7); build it alike on every rank: hidden_dim, max_tokens_per_rank, num_experts, world_size, "
        "ranks_per_node, ring_chunks and ring_dtype shape it")
    # a field past the shape: the same shape, a layout built otherwise (another build of csrc)
    other = [(name, value + 128 if name == "reg.recv_rows" else value) for name, value in layout_fields(BF16_E16)]
    with pytest.raises(ValueError, match=r"layout: reg.recv_rows is 35840 on rank 0; 35968 on rank 1 \(the "):
        check_same_layout([layout_fields(BF16_E16), other])
    check_same_layout([layout_fields(BF16_E16)] * 8)  # alike: nothing raised


def test_ranks_whose_layouts_collide_in_size_all_raise_and_free_what_they_allocated(pool_for):
    """The review's pair on 8 ranks of one node, every other rank with each: every rank raises the
    same error before opening a peer and holds nothing after."""
    got = pool_for(8).run(_exchange_layouts, [([BF16_E16, FP32_E64] * 4,)] * 8)
    assert {message for message, _ in got} == {got[0][0]} and all(freed for _, freed in got)
    assert got[0][0].startswith("HybridEPBuffer: the EP ranks disagree on the registered buffer's layout: "
                                "shape.local_experts")


class _NvshmemExt:
    """Stands in for hybrid_ep._C's NVSHMEM calls on one rank: init and malloc succeed; what was
    called is recorded (the real ones run in the GPU tier)."""

    def __init__(self):
        self.calls: list[str] = []
        self.rank = self.n = None

    def has_nvshmem(self):
        return True

    def nvshmem_unique_id(self):
        return b"uid"

    def nvshmem_init(self, rank, n, uid):
        self.calls.append("init")
        self.rank, self.n = rank, n

    def nvshmem_my_pe(self):
        return self.rank

    def nvshmem_n_pes(self):
        return self.n

    def nvshmem_malloc(self, nbytes):
        self.calls.append("malloc")
        return 1 << 30

    def nvshmem_free(self, ptr):
        self.calls.append("free")


def _nvshmem_regions_with_a_small_heap(small_on: int):
    import torch.distributed as dist

    from hybrid_ep.backends.cuda import nvshmem
    from hybrid_ep.backends.cuda.registered import NvshmemRegions

    rank = dist.get_rank()
    nvshmem._session, nvshmem._finalized = None, False  # a worker's first NVSHMEM
    if rank == small_on:
        os.environ[nvshmem.HEAP_ENV] = "1M"  # smaller than the heap the region needs
    ext = _NvshmemExt()
    start = time.monotonic()
    try:
        regions = NvshmemRegions(ext, 4 << 20, dist.group.WORLD, torch.device("cpu"))
        outcome = f"built, PEs {regions.pes.tolist()}"
        regions.close()
    except SetupError as err:
        outcome = str(err)
    finally:
        os.environ.pop(nvshmem.HEAP_ENV, None)
        nvshmem._session = None
    return outcome, time.monotonic() - start, ext.calls


def test_a_rank_whose_nvshmem_heap_is_too_small_stops_every_rank_before_nvshmem_starts(pool_for):
    """NVSHMEM_SYMMETRIC_SIZE too small on rank 1 only: every rank raises the same SetupError
    naming it before any enters NVSHMEM's bootstrap (which would wait for rank 1 in NVSHMEM, past
    any timeout of the group); with the heap alike, the regions are made on every rank."""
    got = pool_for(2).run(_nvshmem_regions_with_a_small_heap, [(1,)] * 2)
    assert {outcome for outcome, _, _ in got} == {
        "hybrid_ep: rank 1 failed preparing NVSHMEM, the inter-node transport: NvshmemHeapTooSmall: "
        "NVSHMEM_SYMMETRIC_SIZE=1M (1048576 bytes) is smaller than the 37748736 bytes this rank's buffers need "
        "(memory_plan() lists them): unset NVSHMEM_SYMMETRIC_SIZE or set it to at least 37748736. Every rank of the "
        "group raised this error and released what it had set up for the buffer; fix the cause on that rank and "
        "create the buffer again"}
    assert all(calls == [] and waited < BOUND_S for _, waited, calls in got)
    got = pool_for(2).run(_nvshmem_regions_with_a_small_heap, [(-1,)] * 2)
    assert [(outcome, calls) for outcome, _, calls in got] == [("built, PEs [0, 1]", ["init", "malloc", "free"])] * 2
