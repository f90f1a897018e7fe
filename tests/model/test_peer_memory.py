"""The peer-memory protocol between gloo processes, with real shared mappings (memfd chunks,
mapped at each process's own addresses, file descriptors over a Unix socket) standing in for
device memory; the count kernel's count exchange stood in for by an all-gather of the same
numbers (tests/harness/peer_cases.py). The code under test is the cuda backend's own
(agreement.py, peer_memory.py, chunk_channel.py, peer_setup.py)."""

from __future__ import annotations

import pytest

from harness.peer_cases import run_dead_peer_on_rank, run_protocol_on_rank

pytestmark = pytest.mark.model

RISING = [[40] * 3, [40] * 3, [300, 40, 40], [300, 40, 40], [700, 300, 900], [700, 300, 900], [1500, 40, 40],
          [1500, 40, 40]]


def _run(pool_for, W, G, calls, fail_import=None, trim_at=None, release=False, slow=None):
    pool = pool_for(W)
    return pool.run(run_protocol_on_rank, [(W, G, calls, fail_import, trim_at, release, None, None, slow)] * W,
                    timeout_s=240)


def test_rising_sizes_grow_on_the_call_that_needs_it_and_go_direct_from_the_next(pool_for):
    got = _run(pool_for, 3, 3, RISING)
    # The first call of each new peak takes the receive path (and grows), the next goes direct.
    want = ["receive", "direct"] * 4
    assert [g["paths"] for g in got] == [want] * 3
    assert all(all(g["marks_ok"]) and len(g["marks_ok"]) == 4 for g in got)  # through every view
    # Several growths in a row on the rank whose rows rose, none on a rank whose rows did not.
    assert got[0]["grown"] == 4 and got[1]["grown"] == 2 and got[2]["grown"] == 2
    assert got[0]["extents"][-1] > got[0]["extents"][4] > got[0]["extents"][2] > 0
    # Each peer imported every chunk of the other two ranks exactly once.
    assert [g["imports"] for g in got] == [got[1]["grown"] + got[2]["grown"], got[0]["grown"] + got[2]["grown"],
                                            got[0]["grown"] + got[1]["grown"]]
    assert all(g["fds_leaked"] == 0 and g["mappings_left"] == 0 for g in got)


def test_a_failed_import_takes_that_call_to_the_receive_path_and_the_next_goes_direct(pool_for):
    calls = [[40] * 3, [300] * 3, [300] * 3, [300] * 3]
    got = _run(pool_for, 3, 3, calls, fail_import=(2, 1))
    # Call 1 grows every rank; rank 1 can not import in call 2, so call 2 goes receive on every
    # rank; it imports before call 3, which goes direct.
    assert [g["paths"] for g in got] == [["receive", "receive", "receive", "direct"]] * 3
    assert got[1]["failed_imports"] >= 1 and got[0]["failed_imports"] == 0
    assert all(g["grown"] == 2 for g in got)  # calls 0 and 1; nobody grew again for the failed import
    assert all(g["fds_leaked"] == 0 and g["mappings_left"] == 0 for g in got)


def test_a_growth_that_lands_after_a_peers_next_call_began_is_waited_for(pool_for):
    # Rank 0 grows in call 1, 1.5 s late: ranks 1 and 2 reach call 2 first and wait for its chunk
    # (the H200's test of a call larger than the peer memory saw that call go receive).
    calls = [[40] * 3, [300, 40, 40], [300, 40, 40]]
    got = _run(pool_for, 3, 3, calls, slow=(1, 0, 1.5, False))
    assert [g["paths"] for g in got] == [["receive", "receive", "direct"]] * 3
    assert all(g["failed_imports"] == 0 for g in got)
    assert all(g["words_s"][2] > 0.5 for g in got[1:])  # they waited for the chunk
    assert all(all(g["marks_ok"]) for g in got)  # written through the views of the late chunk
    assert all(g["fds_leaked"] == 0 and g["mappings_left"] == 0 for g in got)


def test_a_late_growth_that_fails_is_refused_to_the_waiting_peers(pool_for):
    calls = [[40] * 3, [300, 40, 40], [300, 40, 40], [300, 40, 40]]
    got = _run(pool_for, 3, 3, calls, slow=(1, 0, 1.5, True))
    # Call 2: rank 0 did not grow (its words say so) and its peers are not ready: receive, and
    # rank 0 grows again; call 3 goes direct.
    assert [g["paths"] for g in got] == [["receive", "receive", "receive", "direct"]] * 3
    assert got[0]["failed_growths"] == 1
    assert all(g["failed_imports"] == 1 for g in got[1:])
    # They stopped at the refusal, not at the buffer's timeout (100 s).
    assert all(1.0 < g["words_s"][2] < 30.0 for g in got[1:])
    assert all(g["fds_leaked"] == 0 and g["mappings_left"] == 0 for g in got)


def test_released_memory_shrinks_after_every_peer_unmapped_it(pool_for):
    calls = [[40] * 3, [40] * 3, [1500] * 3, [1500] * 3, [40] * 3, [40] * 3, [40] * 3]
    got = _run(pool_for, 3, 3, calls, trim_at=4, release=True)  # all blocks but call 1's released first
    assert [g["paths"] for g in got] == [["receive", "direct"] * 3 + ["direct"]] * 3
    for g in got:
        small, peak = g["extents"][1], g["extents"][3]
        assert small < peak
        # Retired on the trim call (out of the arena, still mapped), released once every peer
        # unmapped it; the chunk that holds the live block stays, and serves without growing.
        assert g["extents"][4] == small and g["mapped"][4] == peak
        assert g["mapped"][5] == g["extents"][5] == g["extents"][6] == small
        assert g["fds_leaked"] == 0 and g["mappings_left"] == 0


def test_two_nodes_agree_on_one_path_and_map_only_their_own_node(pool_for):
    calls = [[40] * 4, [300, 40, 40, 900], [300, 40, 40, 900]]
    got = _run(pool_for, 4, 2, calls)
    assert [g["paths"] for g in got] == [["receive", "receive", "direct"]] * 4
    # A rank imports only its node peer's chunks: ranks 0 and 1 form one node, 2 and 3 the other.
    assert [g["imports"] for g in got] == [got[1]["grown"], got[0]["grown"], got[3]["grown"], got[2]["grown"]]
    assert all(g["fds_leaked"] == 0 and g["mappings_left"] == 0 for g in got)


def test_a_peer_that_is_gone_costs_a_not_ready_word_not_a_wait(pool_for):
    got = pool_for(3).run(run_dead_peer_on_rank, [(3,)] * 3, timeout_s=120)
    assert [g["ready"] for g in got[:2]] == [0, 0]
    assert all(g["seconds"] < 5.0 for g in got[:2])
