"""How a rank hands its peer-memory chunks to the peers of its NVLink domain on other hosts:
fabric handles published in the process group's store.

A Unix socket (chunk_channel.py) cannot leave a host. Where the NVLink domain spans hosts (the
GPU fabric's clique of a GB200 NVL72, hybrid_ep/topology.py), a rank with peers on other hosts
makes its chunks exportable as fabric handles too (CU_MEM_HANDLE_TYPE_FABRIC: 64 opaque bytes,
no file descriptor, which the driver imports only in a process with an IMEX channel) and
publishes each chunk as a record (offset, bytes, handle) in the store every rank of the job
already reaches: torch.distributed's rendezvous store (the TCPStore of torchrun and srun jobs),
under the buffer's random token, the owner's rank and the chunk's offset. Peers on the same host
keep the file-descriptor channel. A record is written when the owner grows (before the count
exchange that announces it), read by a peer before its next call that reads, and withdrawn when
the owner retires the chunk or closes: the store carries a handful of records per growth, never
one per call.

A read never waits: it asks with compare_set for a value no record has, which returns the record,
or that value where there is none, at once (Store.get would wait for the key up to the store's
timeout, which set_timeout would change for every user of the store). So a peer whose owner has
not published yet, has withdrawn, or whose store is gone gets None, as with the socket.
"""

from __future__ import annotations

import struct

import torch.distributed as dist

_RECORD = struct.Struct("<qq")  # offset, bytes (0: withdrawn); the handle's bytes follow
_ABSENT = b"\0hybrid_ep: no record"  # what no record is: compare_set's answer where the key is absent
_STORE_ERRORS = (RuntimeError, OSError, ValueError)  # DistStoreError and DistNetworkError are RuntimeErrors


def group_store():
    """The store of the default process group (every rank of the job reaches it)."""
    return dist.distributed_c10d._get_default_store()


def _key(owner: int, offset: int) -> str:
    return f"{owner}/{offset}"


class FabricBoard:
    """One rank's records of its chunks in the store, and its reads of its peers' records."""

    def __init__(self, store, token: str, rank: int):
        self.store = dist.PrefixStore(f"hybrid_ep/{token}/", store)
        self.rank = rank
        self._published: set[int] = set()
        self.published = 0  # records written (tests)

    def publish(self, offset: int, nbytes: int, handle: bytes) -> None:
        """The chunk at `offset` of this rank's memory, for peers on other hosts (a store error raises)."""
        self.store.set(_key(self.rank, offset), _RECORD.pack(offset, nbytes) + bytes(handle))
        self._published.add(offset)
        self.published += 1

    def withdraw(self, offset: int) -> None:
        """The record at `offset` deleted (marked withdrawn where the store cannot delete): peers
        that read it get None."""
        if offset in self._published:
            self._published.discard(offset)
            self._delete(offset)

    def _delete(self, offset: int) -> None:
        key = _key(self.rank, offset)
        try:
            self.store.delete_key(key)
        except _STORE_ERRORS:
            try:
                self.store.set(key, _RECORD.pack(offset, 0))
            except _STORE_ERRORS:
                pass  # the store is gone with the job: nobody reads it any more

    def fetch(self, owner: int, offset: int) -> tuple[int, bytes] | None:
        """(bytes, fabric handle) of the owner's chunk at `offset`, or None at once where the owner
        has not published it (yet), has withdrawn it, or the store does not answer."""
        try:
            got = self.store.compare_set(_key(owner, offset), _ABSENT, _ABSENT)
        except _STORE_ERRORS:
            return None
        if got == _ABSENT or len(got) <= _RECORD.size:
            return None
        at, nbytes = _RECORD.unpack_from(got)
        if at != offset or nbytes <= 0:
            return None
        return nbytes, bytes(got[_RECORD.size:])

    def close(self) -> None:
        """Every record of this rank deleted from the store."""
        for offset in list(self._published):
            self.withdraw(offset)
