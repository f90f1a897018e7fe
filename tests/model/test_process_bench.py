"""The processes bench on the CPU model: its emulation points (plain, and each rank's peer memory
mapped by the others as separate processes map it) time direct-path calls in the emulation
bench's unit (one row per token and destination rank), keep every timed call's time and path,
and count fp8's scales; the processes' rows take the slowest rank's median; host time per pair
times only the pairs that read nothing back; the JSON's metadata block is valid."""

from __future__ import annotations

import json

import pytest
import torch

from hybrid_ep.bench import processes
from hybrid_ep.bench.host import _single_rank_buffer, _world_of_one
from hybrid_ep.bench.processes import TOOL, UNITS, emulated_points, host_pairs, process_rows, row_bytes, timed_calls
from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.metadata import metadata, validate

pytestmark = pytest.mark.model

TINY = dict(hidden=256, experts=16, topk=2, tokens=12)


def _dest_rows(shape: dict, W: int = 8) -> int:
    """Rows all ranks receive: one per (token, destination rank) of the inputs the bench draws."""
    L = shape["experts"] // W
    idxs = [processes._inputs(shape, r, torch.bfloat16)[2] for r in range(W)]
    return sum(len({int(e) // L for e in row}) for idx in idxs for row in idx)


@pytest.mark.parametrize("ranks_per_node", [8, 4])
@pytest.mark.parametrize("peer", [False, True], ids=["emulation", "emulation_peer"])
def test_emulation_points_time_direct_calls_in_the_bench_unit(peer, ranks_per_node):
    points = emulated_points(TINY, ranks_per_node, [1, 2], 3, peer=peer, device="cpu")
    assert [p["sms_per_rank"] for p in points] == [1, 2]
    recv = _dest_rows(TINY)
    for p in points:
        assert p["mode"] == ("emulation_peer" if peer else "emulation")
        assert p["data_path"] == "direct", p  # the peer emulation's growth happened in its untimed first pair
        assert p["dispatch"]["paths"] == ["direct"] * 3 and len(p["combine"]["samples_ms"]) == 3
        assert p["recv_rows"] == recv < p["out_rows"]  # the bench's unit, not the expert rows
        assert p["dispatch_ms"] == pytest.approx(sorted(p["dispatch"]["samples_ms"])[1])
        dest_gbps = recv * TINY["hidden"] * 2 / (p["dispatch_ms"] * 1e6)
        assert p["dispatch_dest_gbps_per_sm"] == pytest.approx(dest_gbps / (8 * p["sms_per_rank"]))
        assert set(p) - {"mode", "dispatch", "combine"} <= set(UNITS)


def test_fp8_points_count_the_scales():
    assert row_bytes(256, FP8_DTYPE) == 256 + 2 * 4 and row_bytes(256, torch.bfloat16) == 512
    (p,) = emulated_points(TINY, 8, [1], 1, device="cpu", dtype=FP8_DTYPE)
    assert p["row_bytes"] == 264 and p["combine_row_bytes"] == 512 and p["data_path"] == "direct"
    assert p["dispatch_dest_gbps_per_sm"] == pytest.approx(p["recv_rows"] * 264 / (p["dispatch_ms"] * 1e6) / 8)


def test_process_rows_take_the_slowest_rank_and_all_destination_rows():
    def op(ms):
        return {"median_ms": ms, "samples_ms": [ms], "paths": ["direct"]}

    got = [{"rank": r, "pid": 100 + r, "points": [{"sms": 2, "recv_rows": 10 * (r + 1), "out_rows": 10 * (r + 1) + 1,
                                                    "dispatch": op(1.0 + r), "combine": op(2.0 + 2 * r)}]}
           for r in range(8)]
    (row,) = process_rows(got[::-1], "seed", "bf16", 1)
    assert row["dispatch_ms"] == 8.0 and row["combine_ms"] == 16.0
    assert row["recv_rows"] == 360 and row["out_rows"] == 368
    assert row["dispatch_dest_gbps_per_sm"] == pytest.approx(360 * 8192 * 2 / 8e6 / 16)
    assert [r["rank"] for r in row["ranks"]] == list(range(8)) and row["data_path"] == "direct"


def test_timed_calls_keep_each_call_and_its_result():
    calls = []
    got = timed_calls(lambda: calls.append(1) or len(calls), 4, device="cpu", warmup=2)
    assert [value for _, value in got] == [3, 4, 5, 6] and all(ms >= 0 for ms, _ in got)


def test_the_json_block_is_valid_and_names_every_unit():
    block = metadata(TOOL, device_type="cpu", config={}, units=UNITS, backends=["cuda"])
    assert validate(json.loads(json.dumps(block)))["units"]["recv_rows"].startswith("rows the ranks received")


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


def test_the_emulation_points_can_run_without_the_processes():
    assert processes.parse_args(["--out", "x", "--pool", "none"]).pool == "none"
    assert processes.parse_args(["--out", "x"]).pool == "yes"
    with pytest.raises(SystemExit):  # nothing left to run: argparse names both flags
        processes.parse_args(["--out", "x", "--pool", "none", "--emulation", "none"])
