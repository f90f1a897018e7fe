"""Peer memory across the hosts of one NVLink domain (a GB200 NVL72's clique), on the CPU model:
gloo processes given different host names hand their chunks to peers on "other hosts" as the
model's stand-in for fabric handles (64 opaque bytes, no file descriptor) published in the group's
store (fabric_channel.py), and to peers on their own host as file descriptors, as before. The
growth protocol is the one of tests/model/test_peer_memory.py (hybrid_ep/testing/peer_cases.py):
announced on the count exchange, mapped before the next call that reads, no host collective of
its own; here with a refused export and import (no IMEX channel) and a peer that goes away."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_ep.backends.cuda import load_extension
from hybrid_ep.backends.cuda.fabric_channel import FabricBoard
from hybrid_ep.testing.cases import Case
from hybrid_ep.testing.emulated import check_emulated, emulated_group_for
from hybrid_ep.testing.peer_cases import run_dead_peer_on_rank, run_protocol_on_rank

pytestmark = pytest.mark.model

HOSTS = ["host-a", "host-a", "host-b", "host-b"]  # one NVLink domain of 4 ranks on two hosts of 2
RISING = [[40] * 4, [40] * 4, [300, 40, 40, 300], [300, 40, 40, 300], [700, 300, 900, 40], [700, 300, 900, 40]]


def _run(pool_for, calls, refuse=None, hosts=HOSTS):
    W = len(hosts)
    return pool_for(W).run(run_protocol_on_rank, [(W, W, calls, None, None, False, hosts, refuse)] * W, timeout_s=240)


def test_peers_on_other_hosts_map_fabric_handles_and_same_host_peers_file_descriptors(pool_for):
    got = _run(pool_for, RISING)
    assert [g["paths"] for g in got] == [["receive", "direct"] * 3] * 4
    assert all(all(g["marks_ok"]) and len(g["marks_ok"]) == 3 for g in got)  # written through every view
    grown = [g["grown"] for g in got]
    assert grown[0] == 3 and grown[3] == 2 and min(grown) >= 1
    for r, g in enumerate(got):
        same = r ^ 1  # the other rank of its host
        other = [d for d in range(4) if d // 2 != r // 2]
        assert g["imports"] == sum(grown) - grown[r]
        assert g["fabric_imports"] == sum(grown[d] for d in other)  # from the other host: fabric handles only
        assert g["published"] == grown[r]  # every chunk in the store once
        assert g["served"] == grown[r] and got[same]["imports"] - got[same]["fabric_imports"] == grown[r]
        assert g["fds_leaked"] == 0 and g["mappings_left"] == 0 and g["records_left"] == 0


def test_one_host_keeps_file_descriptors_and_writes_nothing_to_the_store(pool_for):
    got = _run(pool_for, RISING[:4], hosts=["one"] * 4)
    assert [g["paths"] for g in got] == [["receive", "direct"] * 2] * 4
    assert all(g["fabric_imports"] == 0 and g["published"] == 0 and g["imports"] > 0 for g in got)


def test_a_refused_fabric_import_takes_that_call_to_the_receive_path_and_the_next_goes_direct(pool_for):
    calls = [[40] * 4, [300] * 4, [300] * 4, [300] * 4]
    got = _run(pool_for, calls, refuse=(2, 1, "import"))
    # Call 1 grows every rank; rank 1 cannot import rank 2's and 3's chunks in call 2 (its fd
    # import of rank 0's works), so call 2 goes receive everywhere; it imports before call 3.
    assert [g["paths"] for g in got] == [["receive", "receive", "receive", "direct"]] * 4
    assert got[1]["failed_imports"] >= 1 and all(got[r]["failed_imports"] == 0 for r in (0, 2, 3))
    assert all(g["grown"] == 2 for g in got)  # calls 0 and 1: nobody grew again for the refused import
    assert all(g["fds_leaked"] == 0 and g["mappings_left"] == 0 and g["records_left"] == 0 for g in got)


def test_a_refused_fabric_export_costs_the_growth_and_the_next_call_grows_again(pool_for):
    calls = [[40] * 4, [300] * 4, [300] * 4, [300] * 4]
    got = _run(pool_for, calls, refuse=(1, 0, "export"))
    # Rank 0 cannot export its new chunk in call 1: the chunk is released, its extent word says so
    # at call 2, which grows it (receive), and call 3 goes direct.
    assert [g["paths"] for g in got] == [["receive", "receive", "receive", "direct"]] * 4
    assert got[0]["failed_growths"] == 1 and got[0]["grown"] == 2 and got[0]["published"] == 2
    assert all(g["fds_leaked"] == 0 and g["mappings_left"] == 0 and g["records_left"] == 0 for g in got)


@pytest.mark.parametrize("crash", [False, True])
def test_a_peer_on_another_host_that_is_gone_costs_a_not_ready_word_not_a_wait(pool_for, crash):
    # crash: its records stay in the store, and the chunks they name are gone: the import is refused.
    got = pool_for(3).run(run_dead_peer_on_rank, [(3, ["a", "a", "b"], crash)] * 3, timeout_s=120)
    assert [g["ready"] for g in got[:2]] == [0, 0]
    assert all(g["seconds"] < 5.0 and g["failed_imports"] == 1 for g in got[:2])


def test_the_stand_in_fabric_handle_is_no_file_descriptor_and_refuses_a_released_chunk():
    ext = load_extension("cpu")
    handle, fd = ext.peer_create(1 << 16, 0, True)
    plain, plain_fd = ext.peer_create(1 << 16, 0)
    try:
        data = ext.peer_export_fabric(handle)
        assert isinstance(data, bytes) and len(data) == 64
        with pytest.raises(RuntimeError, match="not made for fabric handles"):
            ext.peer_export_fabric(plain)
        mine = ext.peer_import_fabric(data, 0)  # another descriptor of the same memory
        base = ext.peer_reserve(2 << 16)
        try:
            ext.peer_map(base, 1 << 16, handle, 0)
            ext.peer_map(base + (1 << 16), 1 << 16, mine, 0)
            from hybrid_ep.backends.cuda.arena import memory_tensor

            a, b = (memory_tensor(base + o, 16, torch.device("cpu")) for o in (0, 1 << 16))
            a[:] = 7
            assert b.tolist() == [7] * 16
            del a, b
            ext.peer_unmap(base, 1 << 16)
            ext.peer_unmap(base + (1 << 16), 1 << 16)
        finally:
            ext.peer_free_reservation(base, 2 << 16)
        ext.peer_release(mine)
        with pytest.raises(ValueError, match="64 bytes"):
            ext.peer_import_fabric(data[:32], 0)
    finally:
        import os

        os.close(fd)
        os.close(plain_fd)
        ext.peer_release(handle)
        ext.peer_release(plain)
    with pytest.raises(RuntimeError, match="cuMemImportFromShareableHandle \\(fabric\\)"):
        ext.peer_import_fabric(data, 0)  # released by its owner


def test_store_records_are_read_without_waiting():
    import time

    import torch.distributed as dist

    from hybrid_ep.backends.cuda.chunk_channel import JobKey

    store, key = dist.HashStore(), JobKey.new()
    owner, reader = FabricBoard(store, "t", 0, key), FabricBoard(store, "t", 1, key)
    start = time.monotonic()
    assert "not published" in reader.fetch(0, 0)  # at once, not after the store's timeout
    owner.publish(0, 4096, b"h" * 64)
    assert reader.fetch(0, 0) == (4096, b"h" * 64, 1) and "not published" in reader.fetch(0, 4096)
    reader.taken(0, 1)
    owner.withdraw(0)
    assert "not published" in reader.fetch(0, 0)
    owner.publish(0, 8192, b"g" * 64)  # the offset grown again after a retire: a later serial
    assert reader.fetch(0, 0) == (8192, b"g" * 64, 2)
    owner.close()
    assert "not published" in reader.fetch(0, 0) and not store.check(["hybrid_ep/t//0/0"])
    assert time.monotonic() - start < 1.0


def test_the_kernels_go_direct_across_hosts_of_one_domain(monkeypatch):
    """The emulation of separate processes with its 4 virtual ranks on two "hosts": the direct
    kernels write and read through views mapped from fabric handles, against the oracle."""
    from hybrid_ep.backends.cuda import emulation, peer_setup

    hosts = ["a", "a", "b", "b"]
    monkeypatch.setattr(emulation, "peer_agreement", lambda *a, **k: peer_setup.peer_agreement(*a, **k, hosts=hosts))
    case = Case(world_size=4, ranks_per_node=4, num_experts=8, hidden=2048, tokens=(7, 0, 9, 5), topk=2,
                backend="cuda")
    group = emulated_group_for(dataclasses.replace(case, tokens=(160,) * 4), "cpu", separate_processes=True,
                               num_sms_dispatch=1, num_sms_combine=1)
    try:
        paths = []
        for n, tokens in enumerate([case.tokens, case.tokens, (100, 160, 120, 150), (100, 160, 120, 150)]):
            res = check_emulated(group, dataclasses.replace(case, tokens=tokens, seed=n // 2))
            paths.append(res[0].handle.data_path)
        assert paths == ["receive", "direct", "receive", "direct"]
        views = group.peer.views
        assert all(v.remote == {d for d in range(4) if d // 2 != r // 2} for r, v in enumerate(views))
        assert all(v.fabric_imports > 0 and v.imports > v.fabric_imports for v in views)
    finally:
        group.close()
