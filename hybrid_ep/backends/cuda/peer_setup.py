"""Making and closing the peer memory of a buffer (peer_memory.py) and its agreement
(agreement.py): one rank per process (CudaBackend), or every virtual rank of an emulation of
separate processes in one (EmulatedGroup(separate_processes=True)), with the same objects."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...config import timeout_seconds
from .agreement import Agreement
from .chunk_channel import ChunkServer, new_token
from .peer_memory import CHUNK, OwnMemory, PeerViews, reservation_bytes, round_up


def _node_peers(config, rank: int) -> list[int]:
    G = config.ranks_per_node
    first = rank // G * G
    return [p for p in range(first, first + G) if p != rank]


def _make(ext, config, ranks: list[int], device: torch.device, token: str, reserve: int,
          stage_combines: bool) -> Agreement:
    own, views, servers = [], [], []
    try:
        for r in ranks:
            server = ChunkServer(token, r)
            servers.append(server)
            own.append(OwnMemory(ext, device, server, reserve))
            peers = _node_peers(config, r)
            views.append(PeerViews(ext, device, token, peers, reserve, timeout_seconds()) if peers else None)
    except BaseException:
        _close(own, views, servers)
        raise
    agreement = Agreement(config, ranks, own, views, stage_combines)
    agreement.servers = servers
    return agreement


def _close(own, views, servers) -> None:
    for v in views:
        if v is not None:
            v.close()
    for m in own:
        m.close()
    for s in servers:
        s.close()


def close_peer_memory(agreement: Agreement) -> None:
    """Unmaps every view, releases every chunk and reservation, stops the servers: nothing of the
    buffer's peer memory is left (descriptors, mappings, sockets)."""
    _close(agreement.own, agreement.views, getattr(agreement, "servers", []))
    agreement.own, agreement.views, agreement.servers = [], [], []


def _presized(agreement: Agreement, nbytes: int) -> None:
    """Every rank's memory pre-sized to `nbytes` and mapped by its node peers (the caller made
    sure of both): every rank may use it from the first call, static sizes included."""
    for st in agreement.state:
        st.target = st.acked = nbytes
    agreement.limit = [nbytes] * agreement.W
    agreement.ledger = [nbytes] * agreement.W


def peer_agreement(ext, config, device: torch.device, reserve: int, stage_combines: bool = True) -> Agreement:
    """All W virtual ranks of an emulation, each with memory of its own and views of its node
    peers' at other addresses, pre-sized by config.peer_memory_bytes."""
    agreement = _make(ext, config, list(range(config.world_size)), device, new_token(), reserve, stage_combines)
    presize = round_up(config.peer_memory_bytes or 0, CHUNK)
    if presize:
        for m in agreement.own:
            why = m.grow_to(presize)
            if why is not None:
                close_peer_memory(agreement)
                raise MemoryError(f"hybrid_ep: could not pre-size peer memory (peer_memory_bytes): {why}")
        for r, v in enumerate(agreement.views):
            for p in (v.bases if v is not None else ()):
                why = v.sync(p, presize)
                if why is not None:
                    close_peer_memory(agreement)
                    raise RuntimeError(f"hybrid_ep: rank {r} could not map rank {p}'s peer memory: {why}")
        _presized(agreement, presize)
    return agreement


def process_agreement(ext, config, group, rank: int, device: torch.device,
                      stage_combines: bool = True) -> Agreement | None:
    """This process's rank: a token the group shares (collective), its memory and its views of its
    node peers', pre-sized by config.peer_memory_bytes (collective). None on every rank where some
    rank could not set up (no Unix sockets, no POSIX file descriptor handles): the buffer then
    takes the receive path, as today's receive-only jobs do."""
    W = dist.get_world_size(group)
    tokens = [None] * W
    dist.all_gather_object(tokens, new_token() if rank == 0 else None, group=group)
    agreement, error = None, None
    try:
        agreement = _make(ext, config, [rank], device, tokens[0], reservation_bytes(device), stage_combines)
    except (RuntimeError, OSError) as e:
        error = f"rank {rank}: {e}"
    presize = round_up(config.peer_memory_bytes or 0, CHUNK)
    if agreement is not None and presize:
        error = agreement.own[0].grow_to(presize)
    errors = [None] * W
    dist.all_gather_object(errors, error, group=group)
    if agreement is not None and presize and not any(errors):
        views = agreement.views[0]
        for p in (views.bases if views is not None else ()):
            why = views.sync(p, presize)
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
