"""The peer-memory protocol between processes, on the CPU model's memory (memfd chunks, mapped
shared at each process's own addresses, handed over as file descriptors on a Unix socket).

Run on every rank of a gloo pool (tests/model/test_peer_memory.py). The count kernel's count exchange
is the one part stood in for: the agreement words and each rank's rows are all-gathered over
gloo, exactly the numbers the kernel hands every rank. Everything else is the code the cuda
backend runs: agreement.Agreement decides, peer_memory grows, exports, imports, maps and
retires. A direct call then proves the mapping: every rank writes its mark into every node
peer's block through its own view (another address than the owner's), and the owner reads the
marks through its own.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from ..backends.cuda import peer_memory
from ..backends.cuda.arena import arena_take, memory_tensor
from ..config import BufferConfig

H = 1024  # fp32 rows of 4 KiB: a few hundred rows take more than one CHUNK


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _chunk_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("hybrid_ep_peer_chunk" in line for line in f)


def run_protocol_on_rank(world_size: int, ranks_per_node: int, calls: list[list[int]], fail_import: tuple | None,
                         trim_at: int | None, release_before_trim: bool) -> dict:
    """calls[n][d]: rank d's rows in call n. fail_import: (call, rank) whose fetches fail in that
    call. trim_at: the call before which every rank asks to release unused memory."""
    from ..backends.cuda import load_extension
    from ..backends.cuda.peer_setup import close_peer_memory, process_agreement

    rank = dist.get_rank()
    fds_before, maps_before = _open_fds(), _chunk_mappings()
    ext = load_extension("cpu")
    config = BufferConfig(H, 4096, 2 * world_size, world_size, ranks_per_node).validate()
    agreement = process_agreement(ext, config, dist.group.WORLD, rank, torch.device("cpu"))
    own, views = agreement.own[0], agreement.views[0]
    G = ranks_per_node
    node = range(rank // G * G, rank // G * G + G)
    out = {"paths": [], "extents": [], "marks_ok": [], "mapped": []}
    live = []  # blocks of earlier calls kept alive (layers in flight)
    real_fetch = peer_memory.fetch_chunk
    for n, rows in enumerate(calls):
        if trim_at == n:
            if release_before_trim:
                del live[1:]  # the first call's block stays: its chunk is not free
            agreement.trim_requested = True
        if fail_import is not None and fail_import == (n, rank):
            peer_memory.fetch_chunk = lambda *a, **k: None
        words = agreement.words(0)[0]
        peer_memory.fetch_chunk = real_fetch
        gathered = [None] * world_size
        dist.all_gather_object(gathered, words)  # what the count kernel's count rows carry
        read_row = []
        for d in range(world_size):
            read_row += [rows[d]] + list(gathered[d])
        decision = agreement.decide_read(read_row, None, torch.float32, False)
        out["paths"].append("direct" if decision.direct else "receive")
        offset = -1
        if decision.direct:
            taken = arena_take([own.arena], [rows[rank]], H, torch.float32, False, 0, decision.limits)
            assert taken.failed < 0, f"rank {rank} call {n}: the agreed block does not fit"
            live.append(taken.tensors()[0])
            offset = live[-1][0].data_ptr() - own.base
        offsets = [None] * world_size
        dist.all_gather_object(offsets, offset)
        if decision.direct:
            for d in node:  # write this rank's mark into every node rank's block through this rank's view
                base = own.base if d == rank else views.bases[d]
                memory_tensor(base + offsets[d], 4 * world_size, torch.device("cpu")).view(torch.int32)[rank] = \
                    1000 * (n + 1) + rank
            dist.barrier()
            seen = memory_tensor(own.base + offset, 4 * world_size, torch.device("cpu")).view(torch.int32)
            out["marks_ok"].append(all(int(seen[d]) == 1000 * (n + 1) + d for d in node))
        out["extents"].append(own.extent)
        out["mapped"].append(own.mapped)
        dist.barrier()
    out["grown"], out["imports"], out["failed_imports"] = own.grown, views.imports, views.failed_imports
    out["reads"], out["directs"] = agreement.reads, agreement.directs
    live.clear()
    close_peer_memory(agreement)
    out["fds_leaked"] = _open_fds() - fds_before
    out["mappings_left"] = _chunk_mappings() - maps_before
    return out


def run_dead_peer_on_rank(world_size: int) -> dict:
    """The last rank goes away (its memory and its server closed, as a crash would) after every
    rank agreed that it grows: the others' fetches of its chunk fail at once, they say they are
    not ready, and nothing waits."""
    from ..backends.cuda import load_extension
    from ..backends.cuda.peer_setup import close_peer_memory, process_agreement

    rank = dist.get_rank()
    ext = load_extension("cpu")
    config = BufferConfig(H, 4096, 2 * world_size, world_size, world_size).validate()
    agreement = process_agreement(ext, config, dist.group.WORLD, rank, torch.device("cpu"))
    gone = world_size - 1
    dist.barrier()
    if rank == gone:
        close_peer_memory(agreement)
        dist.barrier()
        return {"ready": None, "seconds": 0.0}
    dist.barrier()
    agreement.state[gone].target = peer_memory.CHUNK  # every rank agreed it grows
    start = time.monotonic()
    words = agreement.words(0)[0]
    seconds = time.monotonic() - start
    close_peer_memory(agreement)
    return {"ready": words[0], "seconds": seconds}
