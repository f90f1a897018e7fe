"""Making and closing the peer memory of a buffer (peer_memory.py) and its agreement
(agreement.py): one rank per process (CudaBackend), or every virtual rank of an emulation of
separate processes in one (EmulatedGroup(separate_processes=True)), with the same objects.

Each rank's chunks go to its node peers on the same host as file descriptors (chunk_channel.py)
and, where its node (its NVLink domain) spans hosts, to those on other hosts as fabric handles
in the group's store (fabric_channel.py): which peer is on which host comes with the one
exchange setting up already makes (the buffer's token)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ...config import timeout_seconds
from ...topology import local_host
from .agreement import Agreement
from .chunk_channel import ChunkServer, JobKey, new_token
from .fabric_channel import FabricBoard, group_store
from .peer_memory import CHUNK, OwnMemory, PeerViews, reservation_bytes, round_up


def _node_peers(config, rank: int) -> list[int]:
    G = config.ranks_per_node
    first = rank // G * G
    return [p for p in range(first, first + G) if p != rank]


def _make(ext, config, ranks: list[int], device: torch.device, token: str, key: JobKey, reserve: int,
          stage_combines: bool, hosts: list | None = None, store=None) -> Agreement:
    """token: the buffer's public name (sockets, store keys); key: the job's secret, which proves
    requests, replies and records (chunk_channel.JobKey). hosts: each rank's host (None: all on
    one); store: where fabric handles are published, needed where some node spans hosts."""
    own, views, servers, boards = [], [], [], []
    try:
        for r in ranks:
            server = ChunkServer(token, r, key)
            servers.append(server)
            peers = _node_peers(config, r)
            remote = frozenset(p for p in peers if hosts is not None and hosts[p] != hosts[r])
            board = FabricBoard(store, token, r, key) if remote else None
            if board is not None:
                boards.append(board)
            own.append(OwnMemory(ext, device, server, reserve, board))
            views.append(PeerViews(ext, device, token, key, peers, reserve, remote, board) if peers else None)
    except BaseException:
        _close(own, views, servers, boards)
        raise
    agreement = Agreement(config, ranks, own, views, stage_combines)
    agreement.servers, agreement.boards = servers, boards
    return agreement


def _close(own, views, servers, boards) -> None:
    for v in views:
        if v is not None:
            v.close()
    for m in own:
        m.close()
    for s in servers:
        s.close()
    for b in boards:
        b.close()


def close_peer_memory(agreement: Agreement) -> None:
    """Unmaps every view, releases every chunk and reservation, stops the servers and deletes the
    store's records: nothing of the buffer's peer memory is left (descriptors, mappings, sockets,
    records)."""
    _close(agreement.own, agreement.views, getattr(agreement, "servers", []), getattr(agreement, "boards", []))
    agreement.own, agreement.views, agreement.servers, agreement.boards = [], [], [], []


def _presized(agreement: Agreement, nbytes: int) -> None:
    """Every rank's memory pre-sized to `nbytes` and mapped by its node peers (the caller made
    sure of both): every rank may use it from the first call, static sizes included."""
    for st in agreement.state:
        st.target = st.acked = nbytes
    agreement.limit = [nbytes] * agreement.W
    agreement.ledger = [nbytes] * agreement.W


def peer_agreement(ext, config, device: torch.device, reserve: int, stage_combines: bool = True,
                   hosts: list | None = None) -> Agreement:
    """All W virtual ranks of an emulation, each with memory of its own and views of its node
    peers' at other addresses, pre-sized by config.peer_memory_bytes. hosts: each virtual rank's
    host, to hand chunks between "hosts" as fabric handles (in a store of this process)."""
    store = dist.HashStore() if hosts is not None else None
    agreement = _make(ext, config, list(range(config.world_size)), device, new_token(), JobKey.new(), reserve,
                      stage_combines, hosts, store)
    presize = round_up(config.peer_memory_bytes or 0, CHUNK)
    if presize:
        for m in agreement.own:
            why = m.grow_to(presize)
            if why is not None:
                close_peer_memory(agreement)
                raise MemoryError(f"hybrid_ep: could not pre-size peer memory (peer_memory_bytes): {why}")
        deadline = time.monotonic() + timeout_seconds()
        for r, v in enumerate(agreement.views):
            for p in (v.bases if v is not None else ()):
                why = v.sync(p, presize, deadline)
                if why is not None:
                    close_peer_memory(agreement)
                    raise RuntimeError(f"hybrid_ep: rank {r} could not map rank {p}'s peer memory: {why}")
        _presized(agreement, presize)
    return agreement


def process_agreement(ext, config, group, rank: int, device: torch.device,
                      stage_combines: bool = True) -> Agreement | None:
    """This process's rank: a token the group shares and every rank's host (collective), its memory
    and its views of its node peers', pre-sized by config.peer_memory_bytes (collective). None on
    every rank where some rank could not set up (no Unix sockets, no POSIX file descriptor
    handles, no store for peers on other hosts): the buffer then takes the receive path, as
    today's receive-only jobs do."""
    W = dist.get_world_size(group)
    gathered: list = [None] * W
    # rank 0's token (a public name) and the job's key (a secret: it travels only through the
    # process group), and every rank's host
    first = (new_token(), JobKey.new().secret) if rank == 0 else (None, None)
    dist.all_gather_object(gathered, (first, local_host(dist.get_rank())), group=group)
    (token, secret), hosts = gathered[0][0], [host for _, host in gathered]
    agreement, error = None, None
    try:
        G = config.ranks_per_node
        spans = any(hosts[p] != hosts[rank] for p in range(rank // G * G, rank // G * G + G))
        agreement = _make(ext, config, [rank], device, token, JobKey(secret), reservation_bytes(device),
                          stage_combines, hosts, group_store() if spans else None)
    except (RuntimeError, OSError) as e:
        error = f"rank {rank}: {e}"
    presize = round_up(config.peer_memory_bytes or 0, CHUNK)
    if agreement is not None and presize:
        error = agreement.own[0].grow_to(presize)
    errors = [None] * W
    dist.all_gather_object(errors, error, group=group)
    if agreement is not None and presize and not any(errors):
        views = agreement.views[0]
        deadline = time.monotonic() + timeout_seconds()
        for p in (views.bases if views is not None else ()):
            why = views.sync(p, presize, deadline)
            if why is not None:
                error = f"rank {rank} could not map rank {p}'s memory: {why}"
                break
        dist.all_gather_object(errors, error, group=group)
    failed = [e for e in errors if e]
    if failed:
        if agreement is not None:
            close_peer_memory(agreement)
        agreement = None
        agreement_failure[0] = failed[0]
        return None
    if presize:
        _presized(agreement, presize)
    return agreement


agreement_failure: list[str | None] = [None]  # why the last process_agreement gave none (the startup line)
