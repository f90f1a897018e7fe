"""Growable peer-mapped memory: where the direct path's outputs live when ranks are in separate
processes.

Each rank reserves a range of virtual addresses for its own memory (OwnMemory) and one for each
peer of its node, its NVLink domain (PeerViews); the reservations cost no memory. When a call
needs more than the rank holds, the rank creates a chunk, maps it at the end of its own range,
extends its arena (arena.py: the first-fit sub-allocator the outputs are carved from) and
exports the chunk: as a file descriptor that its peers on the same host fetch over a Unix socket
(chunk_channel.py) and, where the domain spans hosts, as a fabric handle that its peers on other
hosts read from the group's store (fabric_channel.py); each peer maps it at the same offset of
its range for that rank. A free tail can be retired again (shrinking). When which chunk is
mapped where, and which call may use it, is agreement.py's.

The memory calls are the extension's (`ext.peer_*`): CUDA virtual memory management on the GPU
(csrc/transport/peer_memory.cpp: cuMemAddressReserve, cuMemCreate with POSIX file descriptors
and, across hosts, fabric handles, cuMemMap, cuMemSetAccess), memfd chunks mapped shared at
fixed addresses on the CPU model, with a stand-in for fabric handles that is no file descriptor
(csrc/bindings/model_peer_memory.h), so this module and agreement.py run unchanged on both.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from .arena import Arena
from .chunk_channel import ChunkServer, JobKey, fetch_chunk
from .fabric_channel import FabricBoard

CHUNK = 2 << 20  # growth quantum: a multiple of both backends' granularity (the GPU's is 2 MiB)
CPU_RESERVATION = 1 << 36  # bytes of address space per reservation on the CPU model
_log = logging.getLogger("hybrid_ep")


def round_up(n: int, q: int) -> int:
    return (n + q - 1) // q * q


def reservation_bytes(device: torch.device) -> int:
    """Address space for one rank's memory: the device's memory (no rank can hold more)."""
    if device.type == "cuda":
        return round_up(torch.cuda.get_device_properties(device).total_memory, CHUNK)
    return CPU_RESERVATION


@dataclasses.dataclass
class Chunk:
    offset: int
    nbytes: int
    handle: int


def _out_of_memory(error: BaseException) -> bool:
    text = str(error).lower()
    return "out of memory" in text or "curesult 2)" in text or "cannot allocate" in text


class OwnMemory:
    """One rank's peer-mapped memory: the reservation, its chunks (mapped from offset 0 on, without
    gaps), the arena over them, the server that hands the chunks to the node's peers on this host,
    and, where some are on other hosts, the board that publishes them as fabric handles."""

    def __init__(self, ext, device: torch.device, server: ChunkServer | None, reserve: int | None = None,
                 board: FabricBoard | None = None):
        self.ext, self.device, self.server, self.board = ext, torch.device(device), server, board
        self.index = self.device.index or 0
        self.reserved = reserve or reservation_bytes(self.device)
        self.base = ext.peer_reserve(self.reserved)
        self.arena = Arena(self.base, 0, self.device)
        self.chunks: list[Chunk] = []
        self.retiring: list[Chunk] = []  # out of the arena, still mapped until every peer unmapped them
        self.grown = 0  # growths that succeeded (tests, the startup line)
        self.failed_growths = 0

    @property
    def mapped(self) -> int:
        """Bytes mapped from the base on, retiring chunks included."""
        chunks = self.chunks + self.retiring
        return max((c.offset + c.nbytes for c in chunks), default=0)

    @property
    def extent(self) -> int:
        """Bytes of the arena: the chunks not retiring."""
        return self.chunks[-1].offset + self.chunks[-1].nbytes if self.chunks else 0

    def grow_to(self, extent: int, read: int = 0) -> str | None:
        """One chunk mapped at the end so that the arena holds `extent` bytes, the growth every
        rank computed at agreement read `read`; None, or why not (the caller logs it; peers on
        this host waiting for this growth are refused at once, those that expect a later retry
        are not). Out of memory, PyTorch's cached blocks are returned to the driver and the chunk
        is tried once more."""
        offset = self.extent
        why = self._grow(extent)
        if why is not None and self.server is not None:
            self.server.refuse(offset, read)
        return why

    def _grow(self, extent: int) -> str | None:
        nbytes = extent - self.extent
        if nbytes <= 0:
            return None
        if extent > self.reserved:
            return f"{extent} bytes asked for, the reservation holds {self.reserved}"
        offset = self.extent
        try:
            handle, fd = self._create(nbytes)
        except (RuntimeError, MemoryError, OSError) as e:
            self.failed_growths += 1
            return f"could not create a chunk of {nbytes} bytes: {e}"
        try:
            self.ext.peer_map(self.base + offset, nbytes, handle, self.index)
        except (RuntimeError, OSError) as e:
            os.close(fd)
            self.ext.peer_release(handle)
            self.failed_growths += 1
            return f"could not map a chunk of {nbytes} bytes: {e}"
        if self.board is not None:  # peers on other hosts: the chunk's fabric handle in the store
            try:
                self.board.publish(offset, nbytes, self.ext.peer_export_fabric(handle))
            except (RuntimeError, OSError, ValueError) as e:
                os.close(fd)
                self.ext.peer_unmap(self.base + offset, nbytes)
                self.ext.peer_release(handle)
                self.failed_growths += 1
                return f"could not hand a chunk of {nbytes} bytes to peers on other hosts (fabric handle): {e}"
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.chunks.append(Chunk(offset, nbytes, handle))
        if self.server is not None:
            self.server.publish(offset, nbytes, fd)
        else:
            os.close(fd)
        self.arena.grow(extent)
        self.grown += 1
        return None

    def _create(self, nbytes: int):
        fabric = self.board is not None
        try:
            return self.ext.peer_create(nbytes, self.index, fabric)
        except (RuntimeError, MemoryError) as first:
            if not _out_of_memory(first) or self.device.type != "cuda":
                raise
            torch.cuda.empty_cache()
            return self.ext.peer_create(nbytes, self.index, fabric)

    def _withdraw(self, offset: int) -> None:
        if self.server is not None:
            self.server.withdraw(offset)
        if self.board is not None:
            self.board.withdraw(offset)

    def retire_to(self, extent: int) -> bool:
        """The free tail past the chunk boundary `extent` taken out of the arena (its chunks stay
        mapped until release_retired); False when that tail is not free."""
        if extent not in {0} | {c.offset + c.nbytes for c in self.chunks}:
            return False
        keep = [c for c in self.chunks if c.offset < extent]
        if not self.arena.shrink(extent):
            return False
        self.retiring += [c for c in self.chunks if c.offset >= extent]
        self.chunks = keep
        for c in self.retiring:
            self._withdraw(c.offset)
        return True

    def release_retired(self) -> int:
        """Unmaps and releases the retiring chunks (every peer has unmapped them); their bytes."""
        freed = 0
        for c in reversed(self.retiring):
            self.ext.peer_unmap(self.base + c.offset, c.nbytes)
            self.ext.peer_release(c.handle)
            freed += c.nbytes
        self.retiring = []
        return freed

    def close(self) -> None:
        if self.base is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for c in reversed(self.chunks + self.retiring):
            self._withdraw(c.offset)
            self.ext.peer_unmap(self.base + c.offset, c.nbytes)
            self.ext.peer_release(c.handle)
        self.chunks, self.retiring = [], []
        self.ext.peer_free_reservation(self.base, self.reserved)
        self.base = None


class PeerViews:
    """This rank's mappings of its node peers' memory, each at the same offsets as its owner's,
    in a reservation of its own (so at another address than the owner's). Peers in `remote` are on
    other hosts: their chunks come as fabric handles from the board, the others' as file
    descriptors over their Unix sockets."""

    def __init__(self, ext, device: torch.device, token: str, key: JobKey, peers: list[int], reserve: int,
                 remote: frozenset[int] = frozenset(), board: FabricBoard | None = None):
        if remote and board is None:
            raise ValueError("peers on other hosts need a board to read their chunks' fabric handles from")
        self.ext, self.device, self.token, self.key = ext, torch.device(device), token, key
        self.remote, self.board = frozenset(remote), board
        self.index = self.device.index or 0
        self.reserved = reserve
        self.bases = {p: ext.peer_reserve(reserve) for p in peers}
        self.chunks: dict[int, list[Chunk]] = {p: [] for p in peers}
        self.imports = 0  # chunks imported (tests)
        self.fabric_imports = 0  # of them from peers on other hosts, as fabric handles
        self.failed_imports = 0

    def mapped(self, peer: int) -> int:
        chunks = self.chunks[peer]
        return chunks[-1].offset + chunks[-1].nbytes if chunks else 0

    def sync(self, peer: int, extent: int, deadline: float, read: int = 0) -> str | None:
        """Maps the peer's chunks up to `extent` (the growth every rank computed at agreement read
        `read`), or unmaps those past it; None once the mapping reaches exactly `extent`, else why
        not (the peer has not made the chunk by `deadline`, time.monotonic(), refused it, is gone,
        or handed over something that is not the job's or does not fit)."""
        chunks = self.chunks[peer]
        while chunks and chunks[-1].offset >= extent:
            c = chunks.pop()
            self.ext.peer_unmap(self.bases[peer] + c.offset, c.nbytes)
            self.ext.peer_release(c.handle)
        while self.mapped(peer) < extent:
            offset = self.mapped(peer)
            got = self._import(peer, offset, extent, deadline, read)
            if isinstance(got, str):
                self.failed_imports += 1
                return got
            nbytes, handle, serial = got
            try:
                self.ext.peer_map(self.bases[peer] + offset, nbytes, handle, self.index)
            except (RuntimeError, OSError) as e:
                self.ext.peer_release(handle)
                self.failed_imports += 1
                return f"could not map rank {peer}'s chunk at offset {offset}: {e}"
            if serial:
                self.board.taken(peer, serial)
            chunks.append(Chunk(offset, nbytes, handle))
            self.imports += 1
        if self.mapped(peer) != extent:
            return f"rank {peer}'s chunks end at {self.mapped(peer)}, not at {extent}"
        return None

    def _misfit(self, peer: int, offset: int, nbytes: int, extent: int) -> str | None:
        """Why a chunk of `nbytes` at `offset` does not fit the protocol (a growth is a whole
        number of CHUNKs ending within the agreed extent) and this rank's reservation for the
        peer, or None: checked before anything is imported or mapped."""
        if nbytes <= 0 or nbytes % CHUNK:
            return f"rank {peer}'s chunk at offset {offset} claims {nbytes} bytes, not a multiple of {CHUNK}: refused"
        if offset + nbytes > min(extent, self.reserved):
            return (f"rank {peer}'s chunk at offset {offset} claims {nbytes} bytes, past the {extent} bytes every rank "
                    f"agreed it holds (reservation: {self.reserved}): refused")
        return None

    def _import(self, peer: int, offset: int, extent: int, deadline: float,
                read: int) -> tuple[int, int, int] | str:
        """(bytes, handle, the record's serial or 0) of the peer's chunk at `offset`, imported, or why not."""
        if peer in self.remote:
            assert self.board is not None
            published = self.board.fetch(peer, offset)
            if isinstance(published, str):  # not waited for: the store says nothing of a gone owner
                return f"rank {peer} (another host), chunk at offset {offset}: {published}"
            nbytes, fabric_handle, serial = published
            why = self._misfit(peer, offset, nbytes, extent)
            if why is not None:
                return why
            try:
                handle = self.ext.peer_import_fabric(fabric_handle, self.index)
            except (RuntimeError, OSError, ValueError) as e:
                return f"could not import rank {peer}'s chunk at offset {offset} (another host, fabric handle): {e}"
            self.fabric_imports += 1
            return nbytes, handle, serial
        # The owner grows after the read that told this rank it would: wait for it, within the call's deadline.
        got = fetch_chunk(self.token, self.key, peer, offset, read, deadline)
        if isinstance(got, str):
            return f"rank {peer} did not hand over its chunk at offset {offset}: {got}"
        nbytes, fd = got
        try:
            why = self._misfit(peer, offset, nbytes, extent)
            if why is not None:
                return why
            return nbytes, self.ext.peer_import(fd, self.index), 0
        except (RuntimeError, OSError) as e:
            return f"could not import rank {peer}'s chunk at offset {offset}: {e}"
        finally:
            os.close(fd)

    def close(self) -> None:
        if self.device.type == "cuda" and any(self.chunks.values()):
            torch.cuda.synchronize(self.device)
        for peer, base in self.bases.items():
            for c in reversed(self.chunks[peer]):
                self.ext.peer_unmap(base + c.offset, c.nbytes)
                self.ext.peer_release(c.handle)
            self.chunks[peer] = []
            self.ext.peer_free_reservation(base, self.reserved)
        self.bases = {}
