"""Registered buffers: one per rank, allocated once, zeroed, and opened by every peer.

Production: each process allocates its own buffer and the handles travel over
torch.distributed (all_gather_object); peers open them as CUDA IPC or fabric handles.
Emulation: one process allocates the buffers of all its virtual ranks on one GPU and every
virtual rank's peer table points straight at them.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

IPC, FABRIC = 0, 1


def _handle_kind(ext, group, device_index: int) -> int:
    """Fabric handles when every rank's device supports them (and not disabled), else IPC."""
    wanted = os.environ.get("HYBRID_EP_HANDLE", "auto")
    if wanted not in ("auto", "ipc", "fabric"):
        raise ValueError(f"HYBRID_EP_HANDLE must be auto, ipc or fabric, got {wanted!r}")
    mine = bool(ext.fabric_supported(device_index)) and wanted != "ipc"
    flags = [None] * dist.get_world_size(group)
    dist.all_gather_object(flags, mine, group=group)
    if wanted == "fabric" and not all(flags):
        raise RuntimeError("HYBRID_EP_HANDLE=fabric, but not every rank's device supports fabric handles")
    return FABRIC if all(flags) else IPC


class RegisteredBuffers:
    """Own buffers and peer mappings; `tables[i]` is local rank i's [W] table of base pointers."""

    def __init__(self, ext, nbytes: int, device: torch.device):
        self.ext, self.nbytes, self.device = ext, nbytes, device
        self._owned: list[tuple[int, int, int]] = []  # (ptr, bytes, kind) to free
        self._opened: list[tuple[int, int, int]] = []  # (ptr, bytes, kind) to close
        self.tables: list[torch.Tensor] = []

    @classmethod
    def emulated(cls, ext, nbytes: int, world_size: int, device: torch.device) -> "RegisteredBuffers":
        self = cls(ext, nbytes, device)
        bases = []
        for _ in range(world_size):
            ptr, size, _handle = ext.allocate_registered(nbytes, IPC, device.index)
            self._owned.append((ptr, size, IPC))
            bases.append(ptr)
        torch.cuda.synchronize(device)
        table = torch.tensor(bases, dtype=torch.int64, device=device)
        self.tables = [table] * world_size
        return self

    @classmethod
    def exchanged(cls, ext, nbytes: int, group, rank: int, device: torch.device) -> "RegisteredBuffers":
        self = cls(ext, nbytes, device)
        kind = _handle_kind(ext, group, device.index)
        ptr, size, handle = ext.allocate_registered(nbytes, kind, device.index)
        self._owned.append((ptr, size, kind))
        torch.cuda.synchronize(device)  # zeroed before any peer can write into it
        entries = [None] * dist.get_world_size(group)
        dist.all_gather_object(entries, (handle, size), group=group)
        bases = []
        for r, (peer_handle, peer_size) in enumerate(entries):
            if r == rank:
                bases.append(ptr)
                continue
            peer_ptr = ext.open_peer(peer_handle, peer_size, kind, device.index)
            self._opened.append((peer_ptr, peer_size, kind))
            bases.append(peer_ptr)
        self.tables = [torch.tensor(bases, dtype=torch.int64, device=device)]
        dist.barrier(group=group)  # every peer mapped before the first kernel writes
        return self

    def close(self) -> None:
        if not (self._owned or self._opened):
            return
        torch.cuda.synchronize(self.device)
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
