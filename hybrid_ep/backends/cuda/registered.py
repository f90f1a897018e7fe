"""Registered buffers: one per rank, allocated once, zeroed, and opened by every peer.

Production: each process allocates its own buffer and the handles travel over
torch.distributed (all_gather_object); peers open them as CUDA IPC or fabric handles.
Emulation: one process allocates the buffers of all its virtual ranks on one GPU (or in the
CPU model's host memory) and every virtual rank's peer table points straight at them.
The direct path's outputs are not here: they live in peer memory (peer_memory.py).
"""

from __future__ import annotations

import contextlib
import logging
import os

import torch
import torch.distributed as dist

from ...logs import log_once
from ...topology import TROUBLESHOOTING, local_host

IPC, FABRIC = 0, 1
_log = logging.getLogger("hybrid_ep")


def _log_choice(kind: str, reason: str) -> None:
    log_once(_log, logging.INFO, f"hybrid_ep: registered buffers use {kind} handles ({reason})")


def _handle_kind(ext, group, device_index: int, ranks_per_node: int | None = None) -> int:
    """Fabric handles when they work on every rank (a probe allocation, not the attribute
    alone: without an IMEX channel the driver refuses them), else CUDA IPC, which cannot leave a
    host: a node (NVLink domain) that spans hosts without fabric handles is refused by name
    (hybrid_ep/topology.py limits the domain it finds to the host in that case; this catches a
    probe that changed its answer since). The choice is logged once per process."""
    wanted = os.environ.get("HYBRID_EP_HANDLE", "auto")
    if wanted not in ("auto", "ipc", "fabric"):
        raise ValueError(f"HYBRID_EP_HANDLE must be auto, ipc or fabric, got {wanted!r}")
    why_not = "HYBRID_EP_HANDLE=ipc" if wanted == "ipc" else ext.fabric_probe(device_index)
    W = dist.get_world_size(group)
    answers: list = [None] * W
    dist.all_gather_object(answers, (why_not, local_host(dist.get_rank())), group=group)
    refused = [(r, a) for r, (a, _) in enumerate(answers) if a]
    if wanted == "fabric" and refused:
        rank, why = refused[0]
        raise RuntimeError(f"HYBRID_EP_HANDLE=fabric, but fabric handles do not work on rank {rank}: {why}")
    if refused:
        rank, why = refused[0]
        me, G = dist.get_rank(group), ranks_per_node or W
        first = me // G * G
        hosts = {answers[p][1] for p in range(first, min(first + G, W))}
        if len(hosts) > 1:
            raise RuntimeError(
                f"hybrid_ep: EP ranks {first}..{first + G - 1} (ranks_per_node={G}) share an NVLink domain across "
                f"{len(hosts)} hosts, which only fabric handles cross, but they do not work on rank {rank}: {why}. "
                f"Open an IMEX channel to every process, or pass ranks_per_node as the ranks of one host "
                f"({TROUBLESHOOTING})")
        _log_choice("CUDA IPC", f"fabric handles unavailable on rank {rank}: {why}")
        return IPC
    _log_choice("fabric", "a fabric allocation was created and exported on every rank")
    return FABRIC


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_same_layout(layout_bytes: list[int]) -> None:
    """Every rank writes its peers' buffers at the offsets of its own layout: ranks that built
    theirs from other shapes would write into each other's other regions. Raised on every rank
    alike (each sees every rank's size), before any kernel."""
    if len(set(layout_bytes)) > 1:
        per_rank = ", ".join(f"rank {r}: {b} bytes" for r, b in enumerate(layout_bytes))
        raise ValueError(f"HybridEPBuffer: the EP ranks disagree on the registered buffer's layout ({per_rank}); "
                         "build it alike on every rank: hidden_dim, max_tokens_per_rank, num_experts, "
                         "ranks_per_node, ring_chunks and ring_dtype shape it")


class RegisteredAllocationError(MemoryError):
    """A registered buffer could not be allocated, even after PyTorch's cached blocks were
    returned to the driver."""


def _free_bytes(device: torch.device) -> int | None:
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def allocate(ext, nbytes: int, kind: int, device: torch.device, region: str):
    """ext.allocate_registered, retried once after torch.cuda.empty_cache() (memory PyTorch's
    allocator caches but no tensor uses), then a RegisteredAllocationError that names the
    region, the bytes asked for and the bytes free."""
    index = device.index or 0
    try:
        return ext.allocate_registered(nbytes, kind, index)
    except (RuntimeError, MemoryError) as first:
        if "out of memory" not in str(first):
            raise
        if device.type == "cuda":
            torch.cuda.empty_cache()
        try:
            return ext.allocate_registered(nbytes, kind, index)
        except (RuntimeError, MemoryError) as second:
            if "out of memory" not in str(second):
                raise
            free = _free_bytes(device)
            where = f"{free} bytes free on {device}" if free is not None else f"on {device}"
            raise RegisteredAllocationError(
                f"hybrid_ep: could not allocate the {region} ({nbytes} bytes; {where}, after returning "
                f"PyTorch's cached blocks): {second}. memory_plan() lists what the buffer holds by region"
            ) from second


class RegisteredBuffers:
    """Own buffers and peer mappings; `tables[i]` is local rank i's [W] table of base pointers
    (0: not mapped here, a rank on another node)."""

    def __init__(self, ext, nbytes: int, device: torch.device):
        self.ext, self.nbytes, self.device = ext, nbytes, device
        self._owned: list[tuple[int, int, int]] = []  # (ptr, bytes, kind) to free
        self._opened: list[tuple[int, int, int]] = []  # (ptr, bytes, kind) to close
        self.tables: list[torch.Tensor] = []

    @property
    def allocation_bytes(self) -> int:
        """Bytes of each rank's allocation: the kernels' regions."""
        return self.nbytes

    @classmethod
    def emulated(cls, ext, nbytes: int, world_size: int, device: torch.device,
                 ranks_per_node: int | None = None) -> "RegisteredBuffers":
        """Each virtual rank's table holds only the ranks of its own node (0 for the others),
        as NVLink would: a kernel that reached across nodes without the transport would
        fault instead of passing."""
        self = cls(ext, nbytes, device)
        G = ranks_per_node or world_size
        bases = []
        with self._freed_on_failure():
            for r in range(world_size):
                ptr, size, _handle = allocate(ext, self.allocation_bytes, IPC, device,
                                              f"registered buffer of virtual rank {r}")
                self._owned.append((ptr, size, IPC))
                bases.append(ptr)
            _synchronize(device)
        self.tables = [torch.tensor([b if p // G == r // G else 0 for p, b in enumerate(bases)], dtype=torch.int64,
                                    device=device) for r in range(world_size)]
        return self

    @classmethod
    def exchanged(cls, ext, nbytes: int, group, rank: int, device: torch.device,
                  ranks_per_node: int | None = None) -> "RegisteredBuffers":
        """Every rank's handle goes round the group; only those of this rank's node are opened
        (the others are 0 in the table): a handle from another machine cannot be opened, and
        ranks on other nodes are reached through the RDMA transport alone."""
        self = cls(ext, nbytes, device)
        G = ranks_per_node or dist.get_world_size(group)
        kind = _handle_kind(ext, group, device.index, G)
        with self._freed_on_failure():
            ptr, size, handle = allocate(ext, self.allocation_bytes, kind, device, f"registered buffer of rank {rank}")
            self._owned.append((ptr, size, kind))
            _synchronize(device)  # zeroed before any peer can write into it
            entries = [None] * dist.get_world_size(group)
            dist.all_gather_object(entries, (handle, size, nbytes), group=group)
            check_same_layout([e[2] for e in entries])
            bases = []
            for r, (peer_handle, peer_size, _) in enumerate(entries):
                if r == rank:
                    bases.append(ptr)
                    continue
                if r // G != rank // G:
                    bases.append(0)
                    continue
                peer_ptr = ext.open_peer(peer_handle, peer_size, kind, device.index)
                self._opened.append((peer_ptr, peer_size, kind))
                bases.append(peer_ptr)
        self.tables = [torch.tensor(bases, dtype=torch.int64, device=device)]
        dist.barrier(group=group)  # every peer mapped before the first kernel writes
        return self

    @contextlib.contextmanager
    def _freed_on_failure(self):
        """Frees what was allocated or opened so far when a step fails (an allocation out of
        memory, a peer that can not be opened): the error's traceback keeps this half-built
        object alive, and with it gigabytes of device memory, until the next collection."""
        try:
            yield
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        if not (self._owned or self._opened):
            return
        _synchronize(self.device)
        for ptr, size, kind in self._opened:
            self.ext.close_peer(ptr, size, kind)
        for ptr, size, kind in self._owned:
            self.ext.free_registered(ptr, size, kind)
        self._owned, self._opened, self.tables = [], [], []

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the driver may already be gone
            pass


class LoopbackRegions:
    """The inter-node transport of the emulation: one RDMA region per virtual rank (zeroed,
    allocated like a registered buffer) and a table of all of them, through which the
    loopback transport puts between virtual nodes."""

    kind = "loopback"

    def __init__(self, ext, nbytes: int, world_size: int, device: torch.device):
        self.ext = ext
        self._owned = [ext.allocate_registered(max(nbytes, 16), IPC, device.index or 0)[:2] for _ in range(world_size)]
        _synchronize(device)
        self.table = torch.tensor([ptr for ptr, _ in self._owned], dtype=torch.int64, device=device)

    def rank_args(self, i: int) -> tuple[int, int, int]:
        """(rdma_regions, rdma_base, rdma_pes) of RankArgs for local rank i."""
        return self.table.data_ptr(), self._owned[i][0], 0

    def declared(self) -> list[tuple[int, int]]:
        """Memory the kernels may touch, for the CPU model's checks."""
        return list(self._owned) + [(self.table.data_ptr(), self.table.numel() * 8)]

    def close(self) -> None:
        for ptr, size in self._owned:
            self.ext.free_registered(ptr, size, IPC)
        self._owned = []

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class NvshmemRegions:
    """The inter-node transport on clusters: this rank's RDMA region is a zeroed block of
    NVSHMEM's symmetric heap (the same offsets on every PE), and the PE of every rank of the
    EP group. NVSHMEM is initialised once per process, over the group, with a heap sized for
    the region (hybrid_ep.backends.cuda.nvshmem)."""

    kind = "nvshmem"

    def __init__(self, ext, nbytes: int, group, device: torch.device):
        from . import nvshmem

        self._nvshmem = nvshmem
        nvshmem.require_built(ext)
        nvshmem.initialize(group, nbytes, ext=ext)
        self.allocation = nvshmem.allocate(nbytes)  # zeroed, like registered buffers
        self.pes = torch.tensor(nvshmem.pe_table(group), dtype=torch.int32, device=device)
        _synchronize(device)
        dist.barrier(group=group)  # every rank's region in place before any rank puts into it

    def rank_args(self, i: int) -> tuple[int, int, int]:
        return 0, self.allocation.ptr, self.pes.data_ptr()

    def declared(self) -> list[tuple[int, int]]:
        return []

    def close(self) -> None:
        if self.allocation is not None:
            self._nvshmem.free(self.allocation)
            self.allocation = None
