"""Faults of the peer memory's channels between processes (one process per GPU): every wait of
a call ends by one deadline, a refusal stops only the peers that wait for the growth that
failed, and only the job's processes can take a chunk or publish a record, each of the right
size (docs/security.md). On the CPU model's memory: memfd chunks over Unix sockets, the model's
stand-in for fabric handles in a store."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from hybrid_ep.backends.cuda import load_extension
from hybrid_ep.backends.cuda.chunk_channel import ChunkServer, JobKey, fetch_chunk, new_token
from hybrid_ep.backends.cuda.fabric_channel import FabricBoard
from hybrid_ep.backends.cuda.peer_memory import CHUNK, PeerViews
from hybrid_ep.spawn import ProcessGroupPool
from hybrid_ep.testing.fault_cases import OUTSIDER, silent_peers_on_rank, stalled_owner_on_rank

pytestmark = pytest.mark.faults

T = 1.0  # HYBRID_EP_TIMEOUT_S of these cases: small, so a test measures it


@pytest.fixture(scope="module")
def pool4():
    with ProcessGroupPool(4, env={"HYBRID_EP_TIMEOUT_S": str(T)}, start_method="forkserver") as pool:
        yield pool


def test_three_silent_peers_cost_one_deadline_not_three(pool4):
    """Ranks 1-3 were to grow and never do: rank 0's words took 3.0 s at T = 1 when each peer
    had a wait of its own."""
    got = pool4.run(silent_peers_on_rank, [(T,)] * 4, timeout_s=60)
    first = got[0]
    assert first["ready"] == 0 and first["failed_imports"] == 3
    assert 0.9 * T < first["seconds"] < 1.2 * T, first
    assert all(g["fds_leaked"] == 0 and g["mappings_left"] == 0 for g in got), got


def test_an_owner_that_stalls_after_not_yet_costs_one_deadline(pool4):
    """Rank 1 answered "not yet", then stopped answering: rank 0's fetch took 1.9 s at T = 1 when
    its last request could start just before the deadline and wait a whole timeout more."""
    with ProcessGroupPool(2, env={"HYBRID_EP_TIMEOUT_S": str(T)}, start_method="forkserver") as pool:
        got = pool.run(stalled_owner_on_rank, [(T,)] * 2, timeout_s=60)
    first = got[0]
    assert first["seconds"] < 1.2 * T, first
    assert "did not answer before the call's deadline" in first["why"], first
    assert all(g["fds_leaked"] == 0 and g["mappings_left"] == 0 for g in got), got


def test_a_refusal_stops_the_peers_of_that_growth_not_those_that_wait_for_its_retry():
    """A growth after read 3 failed: a peer asking for that growth is refused at once; one that
    already expects the retry after read 4 waits for it and gets it (the refusal used to stand
    until a chunk was published, so such a peer was turned away at once)."""
    ext = load_extension("cpu")
    token, key = new_token(), JobKey.new()
    server = ChunkServer(token, 1, key)
    handle, fd = ext.peer_create(CHUNK, 0, False)
    try:
        server.refuse(0, 3)
        start = time.monotonic()
        assert fetch_chunk(token, key, 1, 0, 3, start + 5.0) == "its growth failed"
        assert time.monotonic() - start < 0.5
        publish = threading.Timer(0.3, server.publish, (0, CHUNK, fd))
        publish.start()
        start = time.monotonic()
        got = fetch_chunk(token, key, 1, 0, 4, start + 5.0)
        assert isinstance(got, tuple) and got[0] == CHUNK, got
        assert 0.25 < time.monotonic() - start < 2.0
        import os

        os.close(got[1])
        publish.join()
    finally:
        server.close()
        ext.peer_release(handle)


def test_a_process_outside_the_job_gets_no_chunk():
    """The token is readable by every user of the host (/proc/net/unix) and names the socket; a
    process of the same user outside the job, with an empty environment, asks with the token
    alone (as the channel once took requests) and with a made-up proof: no descriptor."""
    ext = load_extension("cpu")
    token, key = new_token(), JobKey.new()
    server = ChunkServer(token, 0, key)
    handle, fd = ext.peer_create(CHUNK, 0, False)
    server.publish(0, CHUNK, fd)
    try:
        from hybrid_ep.testing.fault_cases import tokens_on_this_host

        assert (token, 0) in tokens_on_this_host()  # what any user reads
        out = subprocess.run([sys.executable, "-c", OUTSIDER, token, "0", "0"], capture_output=True, text=True,
                             env={}, timeout=60)
        assert out.returncode == 0, out.stderr
        import json

        got = json.loads(out.stdout)
        assert got["fds"] == 0, got
        assert got["bytes"] <= 2 * 16, got  # the owner's nonces (hello), nothing about the chunk
        assert server.served == 0 and server.turned_away == 1  # the made-up proof; the bare offset never completed
        # the job's own process still gets it
        mine = fetch_chunk(token, key, 0, 0, 0, time.monotonic() + 5.0)
        assert isinstance(mine, tuple) and mine[0] == CHUNK
        import os

        os.close(mine[1])
    finally:
        server.close()
        ext.peer_release(handle)


def _views(store, key, remote_peer=1, reserve=1 << 30):
    ext = load_extension("cpu")
    board = FabricBoard(store, "tok", 0, key)
    return ext, board, PeerViews(ext, torch.device("cpu"), "tok", key, [remote_peer], reserve,
                                 frozenset({remote_peer}), board)


def test_a_record_written_by_another_process_is_refused_before_anything_is_imported():
    """The store is readable and writable by any process that reaches its port: a forged record
    of 1 TiB with a foreign handle was accepted and would have been mapped."""
    store = dist.HashStore()
    ext, board, views = _views(store, JobKey.new())
    forged = FabricBoard(store, "tok", 1, JobKey.new())  # another key: not the job's
    mine, _ = ext.peer_create(CHUNK, 0, True)
    try:
        forged.publish(0, 1 << 40, ext.peer_export_fabric(mine))
        why = views.sync(1, CHUNK, time.monotonic() + T)
        assert "does not carry the job's proof" in why, why
        assert views.fabric_imports == 0 and board.refused_records == 1 and views.mapped(1) == 0
        # a record as the first version wrote them: (offset, bytes) and the handle, no proof
        import struct

        board.store.set("1/0", struct.pack("<qq", 0, 1 << 40) + ext.peer_export_fabric(mine))
        assert "does not carry the job's proof" in views.sync(1, CHUNK, time.monotonic() + T)
        assert views.fabric_imports == 0 and views.mapped(1) == 0
    finally:
        views.close()
        ext.peer_release(mine)


@pytest.mark.parametrize("claimed", [2 * CHUNK, CHUNK + 4096, 1 << 40], ids=["past_the_agreed", "not_whole",
                                                                             "past_the_reservation"])
def test_a_record_of_the_wrong_size_is_refused_before_it_is_mapped(claimed):
    """A chunk's size must be whole CHUNKs ending within the extent every rank agreed on and the
    reservation: the CPU model mapped a record of twice the reservation over a loaded library."""
    store, key = dist.HashStore(), JobKey.new()
    ext, board, views = _views(store, key, reserve=4 * CHUNK)
    owner = FabricBoard(store, "tok", 1, key)  # the job's key: a record of a rank gone wrong
    mine, _ = ext.peer_create(CHUNK, 0, True)
    try:
        owner.publish(0, claimed, ext.peer_export_fabric(mine))
        why = views.sync(1, CHUNK, time.monotonic() + T)
        assert "refused" in why and f"claims {claimed} bytes" in why, why
        assert views.fabric_imports == 0 and views.mapped(1) == 0
    finally:
        views.close()
        ext.peer_release(mine)


def test_an_old_record_written_back_is_refused():
    """A record of the job, taken once and withdrawn, written back by a process that kept it:
    its serial is not above the one taken since."""
    store, key = dist.HashStore(), JobKey.new()
    ext, board, views = _views(store, key)
    owner = FabricBoard(store, "tok", 1, key)
    first, _ = ext.peer_create(CHUNK, 0, True)
    second, _ = ext.peer_create(CHUNK, 0, True)
    try:
        owner.publish(0, CHUNK, ext.peer_export_fabric(first))
        old = board.store.get("1/0")
        assert views.sync(1, CHUNK, time.monotonic() + T) is None and views.fabric_imports == 1
        assert views.sync(1, 0, time.monotonic() + T) is None  # unmapped: the owner retired it
        owner.withdraw(0)
        owner.publish(0, CHUNK, ext.peer_export_fabric(second))
        assert views.sync(1, CHUNK, time.monotonic() + T) is None and views.fabric_imports == 2
        assert views.sync(1, 0, time.monotonic() + T) is None
        board.store.set("1/0", old)
        assert "older than one already taken" in views.sync(1, CHUNK, time.monotonic() + T)
    finally:
        views.close()
        ext.peer_release(first)
        ext.peer_release(second)
