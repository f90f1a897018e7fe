"""The peer-memory protocol between processes, on the CPU model's memory (memfd chunks, mapped
shared at each process's own addresses, handed over as file descriptors on a Unix socket, or,
between ranks given different hosts, as the model's stand-in for fabric handles published in the
group's store).

Run on every rank of a gloo pool (tests/model/test_peer_memory.py). The count kernel's count exchange
is the one part stood in for: the agreement words and each rank's rows are all-gathered over
gloo, exactly the numbers the kernel hands every rank. Everything else is the code the cuda
backend runs: agreement.Agreement decides, peer_memory grows, exports, imports, maps and
retires. A direct call then proves the mapping: every rank writes its mark into every node
peer's block through its own view (another address than the owner's), and the owner reads the
marks through its own.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

import torch
import torch.distributed as dist

from .. import topology
from ..backends.cuda import peer_memory
from ..backends.cuda.arena import arena_take, memory_tensor
from ..backends.cuda.fabric_channel import group_store
from ..config import BufferConfig, timeout_seconds

H = 1024  # fp32 rows of 4 KiB: a few hundred rows take more than one CHUNK


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _chunk_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("hybrid_ep_peer_chunk" in line for line in f)


NO_IMEX = "failed (CUresult 800): no IMEX channel is open to this process"


class RefusingExtension:
    """The extension, with its fabric-handle calls refused while `refused` names them ("export",
    "import"), as the driver refuses them without an IMEX channel."""

    def __init__(self, ext):
        self._ext, self.refused = ext, set()

    def __getattr__(self, name):
        return getattr(self._ext, name)

    def peer_export_fabric(self, handle):
        if "export" in self.refused:
            raise RuntimeError(f"hybrid_ep: cuMemExportToShareableHandle (peer memory, fabric) {NO_IMEX}")
        return self._ext.peer_export_fabric(handle)

    def peer_import_fabric(self, fabric_handle, device):
        if "import" in self.refused:
            raise RuntimeError(f"hybrid_ep: cuMemImportFromShareableHandle (peer memory, fabric) {NO_IMEX}")
        return self._ext.peer_import_fabric(fabric_handle, device)


@contextlib.contextmanager
def on_host(name: str | None):
    """This process's host name, as the members compare it, is `name` (None: the real one)."""
    real = topology.this_host
    if name is not None:
        topology.this_host = lambda: name
    try:
        yield
    finally:
        topology.this_host = real


def _records_left(token: str, rank: int, offsets: list[int]) -> int:
    """This rank's chunk records still in the group's store."""
    store = dist.PrefixStore(f"hybrid_ep/{token}/", group_store())  # as FabricBoard keys them
    return sum(store.check([f"{rank}/{o}"]) for o in offsets)


def run_protocol_on_rank(world_size: int, ranks_per_node: int, calls: list[list[int]], fail_import: tuple | None,
                         trim_at: int | None, release_before_trim: bool, hosts: list[str] | None = None,
                         refuse: tuple | None = None, slow: tuple | None = None) -> dict:
    """calls[n][d]: rank d's rows in call n. fail_import: (call, rank) whose fetches fail in that
    call. trim_at: the call before which every rank asks to release unused memory. hosts: each
    rank's host name (None: the machine's). refuse: (call, rank, "export" or "import"): the
    fabric-handle call refused on that rank in that call. slow: (call, rank, seconds, fail): that
    rank's growth in that call lands that many seconds late (a thread of the test makes it, and
    the rank waits for it before its next call), as on a host behind its peers: their next call
    comes first; fail: the growth then fails."""
    with on_host(None if hosts is None else hosts[dist.get_rank()]):
        return _run_protocol(world_size, ranks_per_node, calls, fail_import, trim_at, release_before_trim, refuse,
                             slow)


def _run_protocol(world_size, ranks_per_node, calls, fail_import, trim_at, release_before_trim, refuse, slow) -> dict:
    from ..backends.cuda import load_extension
    from ..backends.cuda.peer_setup import close_peer_memory, process_agreement

    rank = dist.get_rank()
    fds_before, maps_before = _open_fds(), _chunk_mappings()
    ext = RefusingExtension(load_extension("cpu"))
    config = BufferConfig(H, 4096, 2 * world_size, world_size, ranks_per_node).validate()
    agreement = process_agreement(ext, config, dist.group.WORLD, rank, torch.device("cpu"))
    own, views = agreement.own[0], agreement.views[0]
    token = views.token if views is not None else None
    G = ranks_per_node
    node = range(rank // G * G, rank // G * G + G)
    out = {"paths": [], "extents": [], "marks_ok": [], "mapped": [], "words_s": []}
    live = []  # blocks of earlier calls kept alive (layers in flight)
    real_fetch = peer_memory.fetch_chunk
    late: list[threading.Thread] = []  # a growth landing late (slow)
    for n, rows in enumerate(calls):
        for t in late:
            t.join()
        late.clear()
        if trim_at == n:
            if release_before_trim:
                del live[1:]  # the first call's block stays: its chunk is not free
            agreement.trim_requested = True
        if fail_import is not None and fail_import == (n, rank):
            peer_memory.fetch_chunk = lambda *a, **k: "its import fails in this call (test)"
        if refuse is not None and refuse[:2] == (n, rank):
            ext.refused.add(refuse[2])
        started = time.monotonic()
        words = agreement.words(0, time.monotonic() + timeout_seconds())[0]
        out["words_s"].append(time.monotonic() - started)  # how long mapping the peers' growth took
        peer_memory.fetch_chunk = real_fetch
        gathered = [None] * world_size
        dist.all_gather_object(gathered, words)  # what the count kernel's count rows carry
        read_row = []
        for d in range(world_size):
            read_row += [rows[d]] + list(gathered[d])
        if slow is not None and slow[:2] == (n, rank):
            own.grow_to = _late(own, ext, slow[2], slow[3], late)
        decision = agreement.decide_read(read_row, None, torch.float32, False)  # grows (or cannot export)
        own.__dict__.pop("grow_to", None)
        ext.refused.clear()
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
    out["fabric_imports"], out["failed_growths"] = views.fabric_imports, own.failed_growths
    out["published"] = own.board.published if own.board is not None else 0
    out["served"] = agreement.servers[0].served
    out["reads"], out["directs"] = agreement.reads, agreement.directs
    offsets = [c.offset for c in own.chunks + own.retiring]
    live.clear()
    close_peer_memory(agreement)
    out["fds_leaked"] = _open_fds() - fds_before
    out["mappings_left"] = _chunk_mappings() - maps_before
    out["records_left"] = _records_left(token, rank, offsets) if token is not None else 0
    return out


def _late(own, ext, seconds: float, fail: bool, threads: list):
    """own.grow_to, made `seconds` later by a thread (appended to `threads`); fail: it fails."""
    real = type(own).grow_to

    def grow(extent, read):
        time.sleep(seconds)
        if fail:
            ext.peer_create = _refused_create
        try:
            real(own, extent, read)
        finally:
            ext.__dict__.pop("peer_create", None)

    def start(extent, read=0):
        threads.append(threading.Thread(target=grow, args=(extent, read)))
        threads[-1].start()
        return None

    return start


def _refused_create(nbytes, device, fabric=False):
    raise RuntimeError("hybrid_ep: cuMemCreate (peer memory) failed (CUresult 2): out of memory")


def run_dead_peer_on_rank(world_size: int, hosts: list[str] | None = None, crash: bool = False) -> dict:
    """The last rank goes away (its memory and its server closed, as a crash would) after every
    rank agreed that it grows: the others' fetches of its chunk fail at once, they say they are
    not ready, and nothing waits. hosts: each rank's host name. crash: the last rank grew first
    and leaves its records in the store (a process that exited): its peers on other hosts read
    them and their imports are refused."""
    with on_host(None if hosts is None else hosts[dist.get_rank()]):
        return _dead_peer(world_size, crash)


def _dead_peer(world_size: int, crash: bool) -> dict:
    from ..backends.cuda import load_extension
    from ..backends.cuda.peer_setup import close_peer_memory, process_agreement

    rank = dist.get_rank()
    ext = load_extension("cpu")
    config = BufferConfig(H, 4096, 2 * world_size, world_size, world_size).validate()
    agreement = process_agreement(ext, config, dist.group.WORLD, rank, torch.device("cpu"))
    gone = world_size - 1
    dist.barrier()
    if rank == gone:
        boards = agreement.boards
        if crash:  # grown and published, then gone without withdrawing
            assert agreement.own[0].grow_to(peer_memory.CHUNK) is None
            agreement.own[0].board, agreement.boards = None, []
        close_peer_memory(agreement)
        dist.barrier()
        dist.barrier()
        for board in boards:  # the store's records of the crashed rank, cleared for the next test
            board._published.add(0)
            board.close()
        return {"ready": None, "seconds": 0.0, "failed_imports": 0}
    dist.barrier()
    agreement.state[gone].target = peer_memory.CHUNK  # every rank agreed it grows
    start = time.monotonic()
    words = agreement.words(0, time.monotonic() + timeout_seconds())[0]
    seconds = time.monotonic() - start
    failed = agreement.views[0].failed_imports
    close_peer_memory(agreement)
    dist.barrier()
    return {"ready": words[0], "seconds": seconds, "failed_imports": failed}
