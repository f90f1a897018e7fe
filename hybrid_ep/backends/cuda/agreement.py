"""PathVote: the ranks of one node, one process each, agree on every dispatch's data path.

The direct path's kernels on every rank wait for every peer's published tensors, and the
receive path's for every peer's rows: a call runs only if every rank chose the same path. A
rank whose arena can not hold its output of a call (arena.py) must take every rank with it
to the receive path, so each dispatch that prefers the direct path votes: each rank writes
(call number, can go direct) into a word of host shared memory that the node's processes
map, then reads every rank's word of that call; the call goes direct only if all can.

Two rows of words, by the parity of the call number, suffice: a rank writes call n + 2's
word only after every rank wrote call n + 1's, which each did only after reading call n's.
The wait is bounded by HYBRID_EP_TIMEOUT_S, like every wait of the backend. A vote is a host
barrier of the node's processes per dispatch, where a dynamic-size dispatch already waits
for every rank (its layout kernel exchanges counts before the host reads the output size).

Where the node's processes can not share host memory (an NVLink domain spanning several
hosts), `PathVote.create` returns None on every rank and the buffer takes the receive path.
"""

from __future__ import annotations

import time
from multiprocessing import resource_tracker, shared_memory

import torch.distributed as dist

from ...config import timeout_seconds


class PathVote:
    def __init__(self, words: memoryview, shm: shared_memory.SharedMemory, rank: int, world_size: int,
                 timeout_s: float):
        self._words, self._shm, self.rank, self.world_size = words, shm, rank, world_size
        self.timeout_s = timeout_s
        self.calls = 0

    @classmethod
    def create(cls, group, rank: int) -> "PathVote | None":
        """Collective over `group` (every rank of one node): rank 0 makes the shared words,
        the others map them; None on every rank where some rank could not."""
        W = dist.get_world_size(group)
        shm, error = None, None
        if rank == 0:
            shm = shared_memory.SharedMemory(create=True, size=2 * W * 8)
            shm.buf[:] = bytes(2 * W * 8)
        names = [None] * W
        dist.all_gather_object(names, shm.name if shm is not None else None, group=group)
        if rank != 0:
            try:
                shm = shared_memory.SharedMemory(name=names[0])
                # The creator unlinks it; without this, this process's resource tracker would
                # unlink it a second time at exit and warn.
                resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001
            except OSError as e:  # another host: not in this machine's shared memory
                error = f"rank {rank}: {e}"
        errors = [None] * W
        dist.all_gather_object(errors, error, group=group)
        if rank == 0:
            shm.unlink()  # every rank mapped it (or failed to): the name is no longer needed
        if any(errors):
            if shm is not None:
                shm.close()
            return None
        return cls(shm.buf.cast("q"), shm, rank, W, timeout_seconds())

    def __call__(self, ok: bool) -> bool:
        """Whether every rank can go direct on this call (every rank calls once per dispatch
        that prefers the direct path)."""
        self.calls += 1
        n, W = self.calls, self.world_size
        row = (n % 2) * W
        self._words[row + self.rank] = 2 * n + int(ok)
        deadline, pause, agreed = None, 0.0, True
        for peer in range(W):
            while True:
                word = self._words[row + peer]
                if word >> 1 == n:
                    agreed &= bool(word & 1)
                    break
                now = time.monotonic()
                if deadline is None:
                    deadline = now + self.timeout_s
                elif now > deadline:
                    raise RuntimeError(
                        f"hybrid_ep cuda backend: rank {self.rank} gave up after {self.timeout_s:g} s "
                        f"(HYBRID_EP_TIMEOUT_S) waiting for peer rank {peer} to vote on the data path of "
                        f"dispatch {n}: a peer did not make the same call")
                time.sleep(pause)
                pause = min(2 * pause + 1e-6, 1e-4)
        return agreed

    def close(self) -> None:
        if self._shm is not None:
            self._words.release()
            self._shm.close()
            self._shm = None
