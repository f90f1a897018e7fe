"""CPU parts of `python -m hybrid_ep.bench --emulate`: the plain-PyTorch baseline moves the
same rows as the oracle, the table and plot render, and without a GPU it exits cleanly."""

from __future__ import annotations

import pytest
import torch

from hybrid_ep.bench import emulated
from hybrid_ep.bench.cli import main
from hybrid_ep.config import BufferConfig
from hybrid_ep.synthetic import iter_rank_routings
from hybrid_ep.testing.oracle import combine_oracle, dispatch_oracle


def test_index_select_baseline_moves_the_oracle_rows():
    W, T, H, E, K = 3, 11, 8, 6, 2
    cfg = BufferConfig(H, T, E, W, W).validate()
    idx = list(iter_rank_routings("uniform", [T] * W, E, K, seed=5))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(T, H, generator=gen) for _ in range(W)]
    dispatch, combine, rows = emulated.torch_movement(xs, idx, E // W)
    run = dispatch_oracle(cfg, xs, idx)
    rows.zero_()
    dispatch()
    assert torch.equal(rows, torch.cat([r.tokens for r in run.ranks]))
    y = combine()
    want_y, _ = combine_oracle(cfg, run, [r.tokens for r in run.ranks], idx)
    torch.testing.assert_close(y.double(), torch.cat(want_y), rtol=1e-6, atol=1e-6)


def test_table_and_plot(tmp_path):
    doc = {
        "date": "2026-11-21", "device": "GPU", "copy_gbps": 3000.0,
        "config": {"world_size": 8, "hidden": 8192, "tokens_per_rank": 4096, "topk": 8, "experts": 16,
                   "dtype": "bf16", "routing": "uniform"},
        "runs": [{"sms_per_rank": s, "dispatch_ms": 1.0 / s, "dispatch_dest_gbps_per_sm": 60.0,
                  "dispatch_copy_fraction": 0.1 * s, "combine_ms": 2.0 / s, "combine_dest_gbps_per_sm": 50.0,
                  "combine_copy_fraction": 0.05 * s} for s in (1, 2, 4)],
        "index_select_index_add": {"dispatch_ms": 0.5, "combine_ms": 0.7},
        "host_time": {"one rank": {"ranks": 1, "median_us": 21.5}},
    }
    table = emulated.format_table(doc)
    assert "8 virtual ranks" in table and "   4 " in table and "21.5 us" in table
    emulated._plot(doc, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_emulate_without_a_gpu_exits_with_a_message(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the behaviour without a GPU")
    assert main(["--emulate", "2", "--out", str(tmp_path)]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
