"""How a rank hands its peer-memory chunks to the peers of its node: file descriptors over a
Unix socket (SCM_RIGHTS).

Each rank's peer memory (peer_memory.py) runs one server thread on an abstract Unix socket
named by a random token the group shares when the buffer is made, so no earlier job's socket
can be joined and nothing is left in the file system or /dev/shm (an abstract socket goes
with its process). Both ends check the other's credentials (SO_PEERCRED): only a process of
the same user is served or trusted. A peer asks for the chunk at an offset of the owner's memory
and gets its bytes and descriptor. A chunk the owner has not made yet is answered with bytes 0
and no descriptor, at once; one whose growth failed (refused) with bytes -1. The owner grows
after the same count read that tells its peers it will (agreement.py), and a peer's next call
may come first: the importer then asks again until the chunk comes, the owner refuses it, or
its wait ends (`wait_s`, the buffer's timeout). A peer that is gone answers nothing (its
abstract socket went with its process): the importer stops at once.
"""

from __future__ import annotations

import os
import secrets
import socket
import struct
import threading
import time

_REQUEST = struct.Struct("<q")  # the chunk's offset
_REPLY = struct.Struct("<qq")  # offset, bytes (0: not made yet, REFUSED: its growth failed)
REFUSED = -1
_CRED = struct.Struct("3i")  # pid, uid, gid


def new_token() -> str:
    """A name no earlier job's socket has (128 random bits)."""
    return secrets.token_hex(16)


def _address(token: str, rank: int) -> bytes:
    return f"\0hybrid_ep/{token}/{rank}".encode()


def _peer_uid(sock: socket.socket) -> int:
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]


class ChunkServer:
    """Serves this rank's exported chunks: (bytes, descriptor) by offset."""

    def __init__(self, token: str, rank: int):
        self.address = _address(token, rank)
        self._chunks: dict[int, tuple[int, int]] = {}  # offset -> (bytes, descriptor)
        self._refused: set[int] = set()  # offsets whose growth failed: importers stop waiting
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.bind(self.address)
        self._sock.listen(64)
        self.served = 0  # descriptors sent (tests)
        self._thread = threading.Thread(target=self._serve, name=f"hybrid_ep chunks {rank}", daemon=True)
        self._thread.start()

    def publish(self, offset: int, nbytes: int, fd: int) -> None:
        """The chunk at `offset` of the owner's memory; the server owns `fd` from now on."""
        with self._lock:
            self._chunks[offset] = (nbytes, fd)
            self._refused.discard(offset)

    def refuse(self, offset: int) -> None:
        """The owner's growth at `offset` failed: importers waiting for it stop (until a later
        growth publishes a chunk there)."""
        with self._lock:
            self._refused.add(offset)

    def withdraw(self, offset: int) -> None:
        with self._lock:
            got = self._chunks.pop(offset, None)
        if got is not None:
            os.close(got[1])

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    if _peer_uid(conn) != os.getuid():
                        continue  # another user's process: nothing
                    conn.settimeout(5.0)
                    data = conn.recv(_REQUEST.size, socket.MSG_WAITALL)
                    if len(data) != _REQUEST.size:
                        continue
                    (offset,) = _REQUEST.unpack(data)
                    with self._lock:
                        got = self._chunks.get(offset)
                        if got is None:
                            conn.sendall(_REPLY.pack(offset, REFUSED if offset in self._refused else 0))
                            continue
                        nbytes, fd = got
                        socket.send_fds(conn, [_REPLY.pack(offset, nbytes)], [fd])
                        self.served += 1
                except OSError:
                    continue

    def close(self) -> None:
        if self._sock is None:
            return
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=5.0)
        self._sock = None
        with self._lock:
            chunks, self._chunks = self._chunks, {}
        for _, fd in chunks.values():
            os.close(fd)


def fetch_chunk(token: str, owner: int, offset: int, timeout_s: float,
                wait_s: float = 0.0) -> tuple[int, int] | None:
    """(bytes, a descriptor the caller must close) of the owner's chunk at `offset`, or None when
    the owner refused it, is gone, is not this user's process, or has not made it within
    `wait_s` seconds (asked again every few milliseconds meanwhile)."""
    deadline = time.monotonic() + wait_s
    pause = 2e-4
    while True:
        got = _ask(token, owner, offset, timeout_s)
        if got != 0:
            return got if isinstance(got, tuple) else None
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        time.sleep(min(pause, left))
        pause = min(2 * pause, 5e-3)


def _ask(token: str, owner: int, offset: int, timeout_s: float) -> tuple[int, int] | int | None:
    """One request: (bytes, descriptor), 0 (not made yet), or None (refused, gone, not ours)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout_s)
        try:
            sock.connect(_address(token, owner))
            if _peer_uid(sock) != os.getuid():
                return None
            sock.sendall(_REQUEST.pack(offset))
            msg, fds, _, _ = socket.recv_fds(sock, _REPLY.size, 1, socket.MSG_WAITALL)
        except OSError:
            return None
    if len(msg) != _REPLY.size:
        for fd in fds:
            os.close(fd)
        return None
    at, nbytes = _REPLY.unpack(msg)
    if at != offset or nbytes <= 0 or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return 0 if at == offset and nbytes == 0 and not fds else None
    return nbytes, fds[0]
