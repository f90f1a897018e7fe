"""How a rank hands its peer-memory chunks to the peers of its node: file descriptors over a
Unix socket (SCM_RIGHTS), to the job's own processes only.

Each rank's peer memory (peer_memory.py) runs one server thread on an abstract Unix socket
named by a random token the group shares when the buffer is made, so no earlier job's socket
can be joined and nothing is left in the file system or /dev/shm (an abstract socket goes
with its process). The name is public (every user of the host reads it in /proc/net/unix), so
it proves nothing. Who may take a chunk (docs/security.md):
- both ends check the other's credentials (SO_PEERCRED): only a process of the same user is
  served or trusted;
- both ends prove they hold the job's secret (JobKey: 32 random bytes that rank 0 hands every
  rank through the process group, never through the environment, the store or a name): the
  owner opens with a fresh nonce, the asker answers with an HMAC of it and its request, the
  owner's reply carries an HMAC of the asker's own nonce. Another job of the same user, or a
  process that read the token, gets nothing and is told nothing.

A peer asks for the chunk at an offset of the owner's memory, saying after which of the
agreement's reads it expects it (the growth every rank computed at that read), and gets its
bytes and descriptor. A chunk the owner has not made yet is answered with bytes 0 and no
descriptor, at once; one whose growth after that read (or a later one) failed, with REFUSED: a
refusal of an earlier read's growth does not stop a peer that expects the retry. The owner
grows after the same count read that tells its peers it will (agreement.py), and a peer's next
call may come first: the importer then asks again until the chunk comes, the owner refuses it,
or the call's deadline passes (one deadline for all of a call's waits, whatever the number of
peers). A peer that is gone answers nothing (its abstract socket went with its process): the
importer stops at once.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import threading
import time

_NONCE = 16
_PROOF = 32  # HMAC-SHA256
_HELLO = struct.Struct(f"<{_NONCE}s")  # the owner's nonce
_REQUEST = struct.Struct(f"<qq{_NONCE}s{_PROOF}s")  # offset, read, the asker's nonce, its proof
_REPLY = struct.Struct(f"<qq{_PROOF}s")  # offset, bytes (0: not made yet, REFUSED: its growth failed), proof
_FACTS = struct.Struct("<qqq")  # owner, offset, read or bytes: what a proof covers besides the nonce
REFUSED = -1
_CRED = struct.Struct("3i")  # pid, uid, gid
SERVER_WAIT_S = 5.0  # the longest an owner's server waits for one asker's request (it serves one at a time)


def new_token() -> str:
    """A name no earlier job's socket has (128 random bits). Public once a socket is bound."""
    return secrets.token_hex(16)


class JobKey:
    """The job's secret: proofs that a request, a reply or a store record comes from a process
    of this job (HMAC-SHA256). Made on rank 0 and handed to every rank through the process
    group; never written where another process can read it."""

    def __init__(self, secret: bytes):
        if len(secret) < 16:
            raise ValueError("a job key needs at least 16 random bytes")
        self._secret = bytes(secret)

    @classmethod
    def new(cls) -> "JobKey":
        return cls(secrets.token_bytes(32))

    @property
    def secret(self) -> bytes:
        """The bytes to hand to the other ranks (through the process group only)."""
        return self._secret

    def proof(self, kind: bytes, *parts: bytes) -> bytes:
        return hmac.new(self._secret, kind + b"".join(parts), hashlib.sha256).digest()

    def verify(self, proof: bytes, kind: bytes, *parts: bytes) -> bool:
        return hmac.compare_digest(proof, self.proof(kind, *parts))

    def __repr__(self) -> str:  # never the secret, in a log or a traceback
        return "JobKey(...)"


def _address(token: str, rank: int) -> bytes:
    return f"\0hybrid_ep/{token}/{rank}".encode()


def _peer_uid(sock: socket.socket) -> int:
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))[1]


class ChunkServer:
    """Serves this rank's exported chunks: (bytes, descriptor) by offset, to the job's processes."""

    def __init__(self, token: str, rank: int, key: JobKey):
        self.address, self.rank, self._key = _address(token, rank), rank, key
        self._chunks: dict[int, tuple[int, int]] = {}  # offset -> (bytes, descriptor)
        self._refused: dict[int, int] = {}  # offset -> the read whose growth there failed
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        self._sock.bind(self.address)
        self._sock.listen(64)
        self.served = 0  # descriptors sent (tests)
        self.turned_away = 0  # askers without the job's proof, or of another user (tests)
        self._thread = threading.Thread(target=self._serve, name=f"hybrid_ep chunks {rank}", daemon=True)
        self._thread.start()

    def publish(self, offset: int, nbytes: int, fd: int) -> None:
        """The chunk at `offset` of the owner's memory; the server owns `fd` from now on."""
        with self._lock:
            self._chunks[offset] = (nbytes, fd)
            self._refused.pop(offset, None)

    def refuse(self, offset: int, read: int) -> None:
        """The owner's growth at `offset` after agreement read `read` failed: importers that
        expect that growth (or an earlier one) stop waiting; those that expect a later one (the
        retry) are told "not yet"."""
        with self._lock:
            self._refused[offset] = max(read, self._refused.get(offset, read))

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
                    self._answer(conn)
                except OSError:
                    continue

    def _answer(self, conn: socket.socket) -> None:
        if _peer_uid(conn) != os.getuid():
            self.turned_away += 1
            return  # another user's process: nothing
        conn.settimeout(SERVER_WAIT_S)
        nonce = secrets.token_bytes(_NONCE)
        conn.sendall(_HELLO.pack(nonce))
        data = conn.recv(_REQUEST.size, socket.MSG_WAITALL)
        if len(data) != _REQUEST.size:
            return
        offset, read, asker_nonce, proof = _REQUEST.unpack(data)
        if not self._key.verify(proof, b"ask", nonce, _FACTS.pack(self.rank, offset, read)):
            self.turned_away += 1
            return  # not the job's: nothing, not even whether the chunk exists
        with self._lock:
            got = self._chunks.get(offset)
            if got is None:
                refused = self._refused.get(offset)
                nbytes = REFUSED if refused is not None and refused >= read else 0
                conn.sendall(_REPLY.pack(offset, nbytes, self._reply_proof(asker_nonce, offset, nbytes)))
                return
            nbytes, fd = got
            socket.send_fds(conn, [_REPLY.pack(offset, nbytes, self._reply_proof(asker_nonce, offset, nbytes))], [fd])
            self.served += 1

    def _reply_proof(self, asker_nonce: bytes, offset: int, nbytes: int) -> bytes:
        return self._key.proof(b"give", asker_nonce, _FACTS.pack(self.rank, offset, nbytes))

    def close(self) -> None:
        if self._sock is None:
            return
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        self._thread.join(timeout=SERVER_WAIT_S + 1.0)
        self._sock = None
        with self._lock:
            chunks, self._chunks = self._chunks, {}
        for _, fd in chunks.values():
            os.close(fd)


def fetch_chunk(token: str, key: JobKey, owner: int, offset: int, read: int,
                deadline: float) -> tuple[int, int] | str:
    """(bytes, a descriptor the caller must close) of the owner's chunk at `offset`, expected
    after agreement read `read`, or why not: the owner refused it, is gone, is not this user's
    or this job's process, or did not make it before `deadline` (time.monotonic(); asked again
    every few milliseconds meanwhile, each request within what is left)."""
    pause = 2e-4
    while True:
        got = _ask(token, key, owner, offset, read, deadline)
        if got != 0:
            return got
        left = deadline - time.monotonic()
        if left <= 0:
            return "it had not made the chunk when the call's deadline (HYBRID_EP_TIMEOUT_S) passed"
        time.sleep(min(pause, left))
        pause = min(2 * pause, 5e-3)


def _ask(token: str, key: JobKey, owner: int, offset: int, read: int,
         deadline: float) -> tuple[int, int] | int | str:
    """One request: (bytes, descriptor), 0 (not made yet), or why not."""
    left = deadline - time.monotonic()
    if left <= 0:
        return "the call's deadline (HYBRID_EP_TIMEOUT_S) passed"
    nonce = secrets.token_bytes(_NONCE)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(left)
        try:
            sock.connect(_address(token, owner))
        except OSError:
            return "it is gone (its socket answers nothing)"
        try:
            if _peer_uid(sock) != os.getuid():
                return "its socket belongs to another user"
            hello = sock.recv(_HELLO.size, socket.MSG_WAITALL)
            if len(hello) != _HELLO.size:
                return "it closed the connection"
            (owner_nonce,) = _HELLO.unpack(hello)
            proof = key.proof(b"ask", owner_nonce, _FACTS.pack(owner, offset, read))
            sock.sendall(_REQUEST.pack(offset, read, nonce, proof))
            msg, fds, _, _ = socket.recv_fds(sock, _REPLY.size, 1, socket.MSG_WAITALL)
        except TimeoutError:
            return "it did not answer before the call's deadline (HYBRID_EP_TIMEOUT_S) passed"
        except OSError as e:
            return f"the connection failed ({e})"
    if len(msg) != _REPLY.size:
        _close(fds)
        return "it did not answer (a process without the job's key is told nothing)"
    at, nbytes, proof = _REPLY.unpack(msg)
    if not key.verify(proof, b"give", nonce, _FACTS.pack(owner, at, nbytes)):
        _close(fds)
        return "its answer does not carry the job's proof"
    if at != offset:
        _close(fds)
        return f"it answered for offset {at}, not {offset}"
    if nbytes == REFUSED:
        _close(fds)
        return "its growth failed"
    if nbytes == 0 and not fds:
        return 0
    if nbytes <= 0 or len(fds) != 1:
        _close(fds)
        return f"its answer is malformed ({nbytes} bytes, {len(fds)} descriptors)"
    return nbytes, fds[0]


def _close(fds) -> None:
    for fd in fds:
        os.close(fd)
