"""Registered buffers: one per rank, allocated once, zeroed, and opened by every peer.

Production: each process allocates its own buffer and the handles travel over
torch.distributed (all_gather_object); peers open them as CUDA IPC or fabric handles. Each step
that can fail on one rank (the handle kind's probe, the allocation, the peers' opens) ends in one
gather of every rank's outcome (errors.SetupStep): a rank that fails makes every rank raise the
same SetupError, each having released what it allocated or opened, where the others would wait in
the next collective until the process group's timeout.
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

from ...config import BufferConfig
from ...logs import log_once
from ...topology import TROUBLESHOOTING, local_host
from .errors import SetupStep
from .layout import SHAPE_ARGUMENTS, layout_fields, registered_layout

IPC, FABRIC = 0, 1
HANDLE_ENV = "HYBRID_EP_HANDLE"
_log = logging.getLogger("hybrid_ep")


def _log_choice(kind: str, reason: str) -> None:
    log_once(_log, logging.INFO, f"hybrid_ep: registered buffers use {kind} handles ({reason})")


def _ranks_text(ranks: list[int]) -> str:
    """"rank 3", "ranks 0-2, 5": consecutive ranks as a range."""
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"


def _per_rank(values: list) -> str:
    """Every rank's value, the ranks of each value together: "2 on ranks 0, 2-3; 4 on rank 1"."""
    by_value: dict = {}
    for r, v in enumerate(values):
        by_value.setdefault(v, []).append(r)
    return "; ".join(f"{v} on {_ranks_text(ranks)}" for v, ranks in by_value.items())


def _handle_kind(ext, group, device_index: int, ranks_per_node: int | None = None) -> int:
    """Fabric handles when they work on every rank (a probe allocation, not the attribute
    alone: without an IMEX channel the driver refuses them), else CUDA IPC, which cannot leave a
    host: a node (NVLink domain) that spans hosts without fabric handles is refused by name
    (hybrid_ep/topology.py limits the domain it finds to the host in that case; this catches a
    probe that changed its answer since). Every rank decides from every rank's answers (one
    gather), so each raises the same error or makes the same choice; the choice is logged once
    per process."""
    W = dist.get_world_size(group)
    with SetupStep(group, f"probing fabric handles ({HANDLE_ENV})") as step:
        wanted = os.environ.get(HANDLE_ENV, "auto")
        if wanted not in ("auto", "ipc", "fabric"):
            raise ValueError(f"{HANDLE_ENV} must be auto, ipc or fabric, got {wanted!r}")
        why_not = f"{HANDLE_ENV}=ipc" if wanted == "ipc" else ext.fabric_probe(device_index)
        step.share((wanted, why_not, local_host(dist.get_rank())))
    answers = step.shared
    if len({a[0] for a in answers}) > 1:
        raise ValueError(f"{HANDLE_ENV} differs between the EP ranks ({_per_rank([a[0] for a in answers])}): "
                         "set it alike on every rank")
    refused = [(r, a) for r, (_, a, _) in enumerate(answers) if a]
    if wanted == "fabric" and refused:
        rank, why = refused[0]
        raise RuntimeError(f"{HANDLE_ENV}=fabric, but fabric handles do not work on rank {rank}: {why}")
    if refused:
        rank, why = refused[0]
        G = ranks_per_node or W
        for first in range(0, W, G):  # every node, so that every rank raises for the same one
            hosts = {answers[p][2] for p in range(first, min(first + G, W))}
            if len(hosts) > 1:
                raise RuntimeError(
                    f"hybrid_ep: EP ranks {first}..{first + G - 1} (ranks_per_node={G}) share an NVLink domain "
                    f"across {len(hosts)} hosts, which only fabric handles cross, but they do not work on rank "
                    f"{rank}: {why}. Open an IMEX channel to every process, or pass ranks_per_node as the ranks of "
                    f"one host ({TROUBLESHOOTING})")
        _log_choice("CUDA IPC", f"fabric handles unavailable on rank {rank}: {why}")
        return IPC
    _log_choice("fabric", "a fabric allocation was created and exported on every rank")
    return FABRIC


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_same_layout(placements: list) -> None:
    """Every rank writes its peers' buffers at the offsets of its own layout: ranks that built
    theirs from other shapes would write into each other's other regions, even where the totals
    match. `placements`: every rank's layout_fields. Names the first field that differs, with
    every rank's value; raised on every rank alike (each sees every rank's fields), before any
    peer is opened."""
    fields = [dict(p) for p in placements]
    for name, _ in placements[0]:
        values = [f.get(name) for f in fields]
        if len(set(values)) == 1:
            continue
        part = name.split(".", 1)[1]
        set_by = f" (set by {SHAPE_ARGUMENTS[part]})" if name.startswith("shape.") and part in SHAPE_ARGUMENTS else ""
        totals = [f.get("reg.total") for f in fields]
        raise ValueError(f"HybridEPBuffer: the EP ranks disagree on the registered buffer's layout: {name}{set_by} "
                         f"is {_per_rank(values)} (the buffer's bytes: {_per_rank(totals)}); build it alike on "
                         "every rank: hidden_dim, max_tokens_per_rank, num_experts, world_size, ranks_per_node, "
                         "ring_chunks and ring_dtype shape it")


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
    def exchanged(cls, ext, config: BufferConfig, group, rank: int,
                  device: torch.device) -> "RegisteredBuffers":
        """Every rank's handle goes round the group; only those of this rank's node are opened
        (the others are 0 in the table): a handle from another machine cannot be opened, and
        ranks on other nodes are reached through the RDMA transport alone. The ranks' layouts
        must agree field by field (check_same_layout). A rank that fails to allocate or to open
        a peer makes every rank raise the same SetupError, each having freed and closed what it
        had (SetupStep)."""
        self = cls(ext, registered_layout(config).total, device)
        G, index = config.ranks_per_node, device.index or 0
        kind = _handle_kind(ext, group, index, G)
        with self._freed_on_failure():
            with SetupStep(group, f"allocating its registered buffer ({self.nbytes} bytes)") as step:
                ptr, size, handle = allocate(ext, self.allocation_bytes, kind, device,
                                             f"registered buffer of rank {rank}")
                self._owned.append((ptr, size, kind))
                _synchronize(device)  # zeroed before any peer can write into it
                step.share((handle, size, layout_fields(config)))
            entries = step.shared
            check_same_layout([e[2] for e in entries])
            bases = []
            # The step's gather is the barrier: every peer mapped before the first kernel writes.
            with SetupStep(group, "opening its node peers' registered buffers"):
                for r, (peer_handle, peer_size, _) in enumerate(entries):
                    if r == rank:
                        bases.append(ptr)
                        continue
                    if r // G != rank // G:
                        bases.append(0)
                        continue
                    peer_ptr = ext.open_peer(peer_handle, peer_size, kind, index)
                    self._opened.append((peer_ptr, peer_size, kind))
                    bases.append(peer_ptr)
        self.tables = [torch.tensor(bases, dtype=torch.int64, device=device)]
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
    the region (hybrid_ep.backends.cuda.nvshmem). What a rank checks alone (the build, the heap's
    size, the room left in it) is gathered before the collectives that follow (SetupStep), so a
    rank that fails there makes every rank raise the same SetupError instead of leaving the
    others in NVSHMEM's bootstrap or allocation."""

    kind = "nvshmem"

    def __init__(self, ext, nbytes: int, group, device: torch.device):
        from . import nvshmem

        self._nvshmem = nvshmem
        self.allocation = None
        with SetupStep(group, "preparing NVSHMEM, the inter-node transport") as step:
            step.share(nvshmem.prepare(nbytes, ext=ext)[1] is not None)
        if len(set(step.shared)) > 1:
            raise nvshmem.NvshmemInitError(
                "NVSHMEM is initialised in some processes of the EP group and not in others (initialised on "
                f"{_ranks_text([r for r, s in enumerate(step.shared) if s])}): create every rank's buffers alike")
        with SetupStep(group, "initialising NVSHMEM"):
            nvshmem.initialize(group, nbytes, ext=ext)
        with SetupStep(group, f"finding room for its RDMA region ({nbytes} bytes) in NVSHMEM's symmetric heap"):
            nvshmem.check_room(nbytes)
        self.allocation = nvshmem.allocate(nbytes)  # zeroed, like registered buffers; collective
        try:
            self.pes = torch.tensor(nvshmem.pe_table(group), dtype=torch.int32, device=device)
            # The step's gather is the barrier: every rank's region in place before any rank puts into it.
            with SetupStep(group, "zeroing its RDMA region"):
                _synchronize(device)
        except BaseException:
            self.close()
            raise

    def rank_args(self, i: int) -> tuple[int, int, int]:
        return 0, self.allocation.ptr, self.pes.data_ptr()

    def declared(self) -> list[tuple[int, int]]:
        return []

    def close(self) -> None:
        if self.allocation is not None:
            self._nvshmem.free(self.allocation)
            self.allocation = None
