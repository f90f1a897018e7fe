"""The process bench's emulation points on the CPU model: the plain emulation and the peer
emulation (each rank's peer memory mapped by the others, as separate processes map it) both time
direct-path calls of the shape asked for, one node and two."""

from __future__ import annotations

import pytest

from hybrid_ep.testing.process_bench import emulated_points

pytestmark = pytest.mark.model

TINY = dict(hidden=256, experts=16, topk=2, tokens=12)


@pytest.mark.parametrize("ranks_per_node", [8, 4])
@pytest.mark.parametrize("peer", [False, True], ids=["emulation", "emulation_peer"])
def test_emulation_points_time_direct_calls(peer, ranks_per_node):
    points = emulated_points(TINY, ranks_per_node, [1, 2], 1, peer=peer, device="cpu")
    assert [p["sms"] for p in points] == [1, 2]
    for p in points:
        assert p["data_path"] == "direct", p  # the peer emulation's growth happened in its untimed first pair
        assert 0 < p["rows_rank0"] <= 8 * TINY["tokens"] * TINY["topk"]  # routes from every rank
        assert p["dispatch_ms"] > 0 and p["combine_ms"] > 0
        # both rates count the same destination bytes
        assert p["dispatch_gbps_per_sm"] * p["dispatch_ms"] == pytest.approx(p["combine_gbps_per_sm"] * p["combine_ms"])
