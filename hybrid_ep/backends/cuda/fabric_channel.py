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

The store is no secret: any process that reaches its port reads and writes it, and the key
names the public token. So a record proves itself (docs/security.md): it carries the owner's
serial number of the publication (rising with every record the owner writes) and an HMAC of
owner, offset, bytes, serial and handle under the job's key (chunk_channel.JobKey); a reader
refuses a record without the proof, one whose serial is not above the last it took from that
owner (an old record written back), and peer_memory.py refuses one whose size does not fit the
reservation and the growth every rank agreed on, before anything is imported or mapped.

A read never waits: it asks with compare_set for a value no record has, which returns the record,
or that value where there is none, at once (Store.get would wait for the key up to the store's
timeout, which set_timeout would change for every user of the store). So a peer whose owner has
not published yet, has withdrawn, or whose store is gone is told why at once, as with the socket.
"""

from __future__ import annotations

import struct

import torch.distributed as dist

from .chunk_channel import JobKey

_RECORD = struct.Struct("<qqq")  # offset, bytes (0: withdrawn), serial; the handle's bytes, then the proof, follow
_PROOF = 32
_FACTS = struct.Struct("<qqqq")  # owner, offset, bytes, serial: what a proof covers besides the handle
_ABSENT = b"\0hybrid_ep: no record"  # what no record is: compare_set's answer where the key is absent
_STORE_ERRORS = (RuntimeError, OSError, ValueError)  # DistStoreError and DistNetworkError are RuntimeErrors


def group_store():
    """The store of the default process group (every rank of the job reaches it)."""
    return dist.distributed_c10d._get_default_store()


def _key(owner: int, offset: int) -> str:
    return f"{owner}/{offset}"


class FabricBoard:
    """One rank's records of its chunks in the store, and its reads of its peers' records."""

    def __init__(self, store, token: str, rank: int, key: JobKey):
        self.store = dist.PrefixStore(f"hybrid_ep/{token}/", store)
        self.rank, self._key = rank, key
        self._published: set[int] = set()
        self.published = 0  # records written (tests), also the serial of the last
        self._taken: dict[int, int] = {}  # owner -> the serial of the last record taken from it
        self.refused_records = 0  # records without the job's proof, or older than one taken (tests)

    def _proof(self, owner: int, offset: int, nbytes: int, serial: int, handle: bytes) -> bytes:
        return self._key.proof(b"record", _FACTS.pack(owner, offset, nbytes, serial), handle)

    def publish(self, offset: int, nbytes: int, handle: bytes) -> None:
        """The chunk at `offset` of this rank's memory, for peers on other hosts (a store error raises)."""
        serial = self.published + 1
        handle = bytes(handle)
        self.store.set(_key(self.rank, offset), _RECORD.pack(offset, nbytes, serial) + handle +
                       self._proof(self.rank, offset, nbytes, serial, handle))
        self._published.add(offset)
        self.published = serial

    def withdraw(self, offset: int) -> None:
        """The record at `offset` deleted (marked withdrawn where the store cannot delete): peers
        that read it are told it is withdrawn."""
        if offset in self._published:
            self._published.discard(offset)
            self._delete(offset)

    def _delete(self, offset: int) -> None:
        key = _key(self.rank, offset)
        try:
            self.store.delete_key(key)
        except _STORE_ERRORS:
            try:
                self.store.set(key, _RECORD.pack(offset, 0, 0))
            except _STORE_ERRORS:
                pass  # the store is gone with the job: nobody reads it any more

    def fetch(self, owner: int, offset: int) -> tuple[int, bytes, int] | str:
        """(bytes, fabric handle, serial) of the owner's chunk at `offset`, or at once why not: the owner
        has not published it (yet) or has withdrawn it, the store does not answer, or the record
        is not the job's (no proof, or older than one already taken from that owner)."""
        try:
            got = self.store.compare_set(_key(owner, offset), _ABSENT, _ABSENT)
        except _STORE_ERRORS as e:
            return f"the store did not answer ({e})"
        if got == _ABSENT or len(got) <= _RECORD.size + _PROOF:
            return "it has not published the chunk (or withdrew it)"
        at, nbytes, serial = _RECORD.unpack_from(got)
        handle, proof = bytes(got[_RECORD.size:-_PROOF]), bytes(got[-_PROOF:])
        if at != offset or nbytes <= 0:
            return "it has not published the chunk (or withdrew it)"
        if not self._key.verify(proof, b"record", _FACTS.pack(owner, offset, nbytes, serial), handle):
            self.refused_records += 1
            return "its record in the store does not carry the job's proof (written by another process)"
        if serial <= self._taken.get(owner, 0):
            self.refused_records += 1
            return f"its record in the store is older than one already taken (serial {serial}): written back"
        return nbytes, handle, serial

    def taken(self, owner: int, serial: int) -> None:
        """The record `serial` of `owner` was imported and mapped: no record of that owner as old
        is taken again."""
        self._taken[owner] = max(serial, self._taken.get(owner, 0))

    def close(self) -> None:
        """Every record of this rank deleted from the store."""
        for offset in list(self._published):
            self.withdraw(offset)
