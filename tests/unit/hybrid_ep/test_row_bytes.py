"""Rows must be a multiple of 16 bytes on every backend (docs/architecture.md, Public API).

The cuda kernels copy rows in 16-byte units; the reference backend refuses the same shapes,
so a hidden size that runs on the CPU runs on a GPU. Checked where a user meets it first:
the buffer and its calls, the benchmark and the traffic model.
"""

from __future__ import annotations

import pytest
import torch

import hybrid_ep as hep
from hybrid_ep.bench import main as bench_main
from hybrid_ep.rows import row_bytes_rule
from hybrid_ep.traffic.cli import main as traffic_main

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("hidden, dtype, ok_multiple", [
    (4, torch.float32, 4), (8, torch.bfloat16, 8), (8, torch.float16, 8), (16, torch.float8_e4m3fn, 16),
])
def test_smallest_rows(hidden, dtype, ok_multiple):
    assert row_bytes_rule(hidden, dtype) is None and row_bytes_rule(7168, dtype) is None
    rule = row_bytes_rule(hidden + 2, dtype)
    assert f"must be a multiple of {ok_multiple} for" in rule


def test_hidden_dim_that_fits_no_dtype_is_refused_at_construction(single_rank_group):
    with pytest.raises(ValueError, match=r"hidden_dim must be a multiple of 4, got 6: every backend moves rows "
                                         r"in multiples of 16 bytes"):
        hep.HybridEPBuffer(single_rank_group, 6, 8, 4, backend="reference")


def test_dispatch_refuses_a_bf16_row_of_200_bytes_on_the_reference_backend(single_rank_group):
    buf = hep.HybridEPBuffer(single_rank_group, 100, 8, 4, backend="reference")
    x = torch.zeros(2, 100, dtype=torch.bfloat16)
    idx = torch.zeros(2, 1, dtype=torch.int64)
    words = ("x: a row of 100 bfloat16 values is 200 bytes; every backend needs rows of a multiple of 16 bytes, "
             "so the hidden size must be a multiple of 8 for bfloat16")
    with pytest.raises(ValueError) as info:
        buf.dispatch(x, idx)
    assert str(info.value) == words
    with pytest.raises(ValueError, match="x: a row of 100 bfloat16"):
        hep.dispatch(buf, x.requires_grad_(), idx)
    # fp32 rows of the same hidden size are 400 bytes: fine.
    res = buf.dispatch(torch.ones(2, 100), idx)
    assert res.tokens.shape == (2, 100) and torch.equal(res.tokens, torch.ones(2, 100))


def test_combine_refuses_expert_out_rows_that_are_too_narrow(single_rank_group):
    buf = hep.HybridEPBuffer(single_rank_group, 4, 8, 4, backend="reference")
    res = buf.dispatch(torch.ones(3, 4), torch.zeros(3, 1, dtype=torch.int64))
    with pytest.raises(ValueError, match="expert_out: a row of 4 bfloat16 values is 8 bytes"):
        buf.combine(res.tokens.to(torch.bfloat16), res.handle)
    assert torch.equal(buf.combine(res.tokens, res.handle), torch.ones(3, 4))


@pytest.mark.parametrize("flags, words", [
    (["--hidden", "100"], "argument --hidden: 100 with --dtype bf16: a row of 100 bfloat16 values is 200 bytes"),
    (["--hidden", "102", "--dtype", "fp32"], "argument --hidden: 102 with --dtype fp32: a row of 102 float32"),
])
def test_bench_refuses_before_starting_ranks(tmp_path, capsys, flags, words):
    assert bench_main([*flags, "--device", "cpu", "--out", str(tmp_path / "never")]) == 2
    err = capsys.readouterr().err
    assert f"hybrid-ep-bench: error: {words}" in err and "multiple of 16 bytes" in err
    assert not (tmp_path / "never").exists()


def test_traffic_refuses_and_names_the_dtype_flag(capsys):
    with pytest.raises(SystemExit) as info:
        traffic_main(["--hidden", "100", "--combine-dtype", "bf16", "--dispatch-dtype", "fp32"])
    assert info.value.code == 2
    assert ("hybrid-ep-traffic: error: --hidden (100) with --combine-dtype bf16: a row of 100 bfloat16 values is "
            "200 bytes") in capsys.readouterr().err
    assert traffic_main(["--hidden", "100", "--dispatch-dtype", "fp32", "--combine-dtype", "fp32",
                         "--nodes", "2", "--ranks-per-node", "2", "--experts", "8", "--tokens", "16"]) == 0
