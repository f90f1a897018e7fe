"""The process bench's emulation points on the CPU model: the plain emulation and the peer
emulation (each rank's peer memory mapped by the others, as separate processes map it) both time
direct-path calls of the shape asked for, one node and two. Its host time per pair times only the
pairs that read nothing back."""

from __future__ import annotations

import pytest
import torch

from hybrid_ep.bench.host import _single_rank_buffer, _world_of_one
from hybrid_ep.testing.process_bench import emulated_points, host_pairs

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


def _one_rank_peer_group():
    """An emulated group of one rank with peer memory (the agreement's ledger and reads as a
    process per GPU has them), on the CPU model."""
    from hybrid_ep.backends.cuda.emulation import EmulatedGroup

    return EmulatedGroup(1, TINY["hidden"], TINY["tokens"], TINY["experts"], device="cpu", data_path="direct",
                         num_sms_dispatch=1, num_sms_combine=1, separate_processes=True)


@pytest.mark.parametrize("ledger_holds", [True, False], ids=["held", "every_pair_reads"])
def test_host_pairs_time_only_the_pairs_that_read_nothing(ledger_holds, monkeypatch):
    group = _one_rank_peer_group()
    try:
        with _world_of_one():
            buf = _single_rank_buffer(group)
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(TINY["tokens"], TINY["hidden"], generator=gen).to(torch.bfloat16)
            idx = torch.argsort(torch.rand(TINY["tokens"], TINY["experts"], generator=gen), dim=1)[:, :2].contiguous()
            w = torch.rand(TINY["tokens"], 2, generator=gen)
            rows = buf.dispatch(x, topk_idx=idx, topk_weights=w).tokens.shape[0]
            if not ledger_holds:  # every call the ledger would hold reads instead
                monkeypatch.setattr(type(group.peer), "decide_ledger", lambda *a, **k: None)
            got = host_pairs(buf, x, idx, w, 6, device="cpu")
    finally:
        group.close()
    assert got["static_rows"] == rows and got["pairs"] == 6
    assert got["pairs_timed"] + got["pairs_that_read"] == 6
    if ledger_holds:
        assert got["pairs_that_read"] == 0 and got["host_us_per_pair"] > 0
    else:
        assert got["pairs_timed"] == 0 and got["host_us_per_pair"] is None
