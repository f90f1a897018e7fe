"""The CPU model's payload-free mode (hybrid_ep._model.set_payload(False)), which lets the timing
model run the bench's own shape: its bulk copies are timed but move no bytes.

What it may change is only the payload (the rows the bulk copies carry); every launch's timing
report, the schedule and whatever the kernels decide by must be those of a run with payload,
on both data paths; it is off by default and after a timing job; and no check of results
accepts a payload-free run's outputs.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from hybrid_ep.verify import compare
from tools.timing import constants, driver, predict

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

# Small, but with every stage of the bench's calls: several chunks per rank, rows batched per
# stage, top-k over two ranks' experts, 1 and 2 SMs per rank.
SHAPE = predict.Shape(world_size=2, nodes=1, hidden=512, tokens=96, topk=4, experts=8, seed=0)


@pytest.fixture(autouse=True)
def payload_restored():
    assert model.payload()  # the default, and what every test leaves behind
    yield
    model.set_payload(True)


def _job(payload: bool) -> dict:
    return predict.job(SHAPE, SHAPE.tokens, [1, 2], [constants.load_table(constants.H200).costs()], payload=payload)


@pytest.mark.parametrize("path", ["direct", "receive"])
def test_payload_free_runs_give_the_same_timing_reports(path, monkeypatch):
    monkeypatch.setenv("HYBRID_EP_DATA_PATH", path)
    with_rows = driver.run_job(_job(True))
    without = driver.run_job(_job(False))
    assert model.payload()  # the driver turns it back on
    for a, b in zip(with_rows["runs"], without["runs"], strict=True):
        for kernel in ("dispatch", "combine"):
            assert a[kernel]["stats"] == b[kernel]["stats"]  # the same schedule, round for round
            assert a[kernel]["launches"] == b[kernel]["launches"]  # every report, to the nanosecond
    launches = [r["kernel"] for run in without["runs"] for k in ("dispatch", "combine") for r in run[k]["launches"]]
    want = ["count", "dispatch_direct", "combine_direct"] if path == "direct" else [
        "count", "dispatch_receive", "combine_receive"]
    assert launches == want * 2
    for run in without["runs"]:
        for kernel in ("dispatch", "combine"):
            main = run[kernel]["launches"][-1]
            assert main["copies"] > 0 and main["copy_bytes"] >= main["copies"] * 16  # bytes costed, not moved
            assert main["time_ns"] > 0


def test_fp8_jobs_dispatch_fp8_rows_with_their_scales(monkeypatch):
    """A job with "dtype": "fp8" (predict --dtype fp8) dispatches float8 rows and their scales,
    with payload and without, to the same reports: at H = 512 the direct dispatch's rows carry
    half the bytes in half the loads (a chunk's 32 rows of 512 bytes fill one 16 KiB stage,
    bf16's 1024-byte rows two), and its route table stores each route's scales by plain stores,
    not copies."""
    monkeypatch.setenv("HYBRID_EP_DATA_PATH", "direct")
    fp8 = dataclasses.replace(SHAPE, dtype="fp8")
    tables = [constants.load_table(constants.H200).costs()]
    job = predict.job(fp8, fp8.tokens, [1], tables)
    assert job["dtype"] == "fp8" and "dtype" not in predict.job(SHAPE, SHAPE.tokens, [1], tables)
    with_rows = driver.run_job(job)
    without = driver.run_job(predict.job(fp8, fp8.tokens, [1], tables, payload=False))
    bf16 = driver.run_job(predict.job(SHAPE, SHAPE.tokens, [1], tables))
    main = [r["dispatch"]["launches"][-1] for r in (with_rows["runs"][0], without["runs"][0], bf16["runs"][0])]
    assert main[0] == main[1]
    chunks = SHAPE.world_size * -(-SHAPE.tokens // 32)
    assert main[0]["copies"] == main[2]["copies"] - chunks
    assert main[0]["copy_bytes"] == main[2]["copy_bytes"] // 2


def _calls(path: str, payload: bool):
    from hybrid_ep.backends.cuda.emulation import EmulatedGroup
    from hybrid_ep.synthetic import iter_rank_routings

    W, T, H = SHAPE.world_size, SHAPE.tokens, SHAPE.hidden
    # The direct path in peer memory (separate processes emulated): fresh zeroed memory, so a
    # payload-free run's rows show that no bulk store wrote them (outputs from PyTorch's
    # allocator start as anything).
    peer = path == "direct"
    group = EmulatedGroup(W, H, T, SHAPE.experts, device=torch.device("cpu"), data_path=path,
                          peer_memory_bytes=1 << 22 if peer else None, separate_processes=peer)
    idxs = list(iter_rank_routings("uniform", [T] * W, SHAPE.experts, SHAPE.topk, 0))
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=gen).to(torch.bfloat16) for _ in range(W)]
    model.set_seed(3)
    model.set_payload(payload)
    try:
        res = group.dispatch(xs, idxs, num_sms=2)
        ys = group.combine([r.tokens for r in res], [r.handle for r in res], num_sms=2)
        group.synchronize()
        # copies: the direct path's rows live in the group's arena, unmapped by close()
        return [(r.tokens_per_expert.clone(), r.probs.clone(), r.tokens.clone()) for r in res], ys
    finally:
        model.set_payload(True)
        group.close()


@pytest.mark.parametrize("path", ["direct", "receive"])
def test_payload_free_runs_keep_what_the_kernels_decide_by(path):
    """Counts and routing weights are control (plain code), the rows payload (bulk copies):
    a bulk copy that carried something a kernel branches on would make the two runs differ
    here, or hang."""
    (res, ys), (res0, ys0) = _calls(path, True), _calls(path, False)
    for (counts, probs, rows), (counts0, probs0, rows0) in zip(res, res0, strict=True):
        assert torch.equal(counts, counts0) and int(counts.sum()) > 0
        assert torch.equal(probs, probs0)
        assert rows.shape == rows0.shape and int(rows.view(torch.int16).count_nonzero()) > 0
        if path == "direct":  # output rows in the arena, a fresh zero mapping the stores never wrote
            assert int(rows0.view(torch.int16).count_nonzero()) == 0
    assert [y.shape for y in ys] == [y.shape for y in ys0]


def test_a_payload_free_runs_outputs_cannot_be_checked():
    from hybrid_ep.verify.oracle import OracleDispatch

    want = OracleDispatch(tokens=torch.zeros(2, 16, dtype=torch.bfloat16), scales=None,
                          probs=torch.zeros(2), tokens_per_expert=torch.tensor([2]), num_dropped=0, num_needed_rows=2)
    got = {"tokens": want.tokens.clone(), "scales": None, "probs": want.probs.clone(),
           "tokens_per_expert": want.tokens_per_expert.clone(), "num_dropped": 0}
    compare.assert_dispatch_matches(got, want)  # with payload: a match
    y = torch.zeros(2, 16, dtype=torch.bfloat16)
    compare.assert_combine_close(y, y.double(), y.double(), num_terms=1)
    model.set_payload(False)
    with pytest.raises(RuntimeError, match="payload-free"):
        compare.assert_dispatch_matches(got, want)
    with pytest.raises(RuntimeError, match="payload-free"):
        compare.assert_combine_close(y, y.double(), y.double(), num_terms=1)


def test_a_driver_without_payload_free_mode_says_so():
    class Old:  # an older checkout's model, as the calibration builds run
        pass

    with pytest.raises(RuntimeError, match="no payload-free mode"):
        driver._set_payload(Old(), False)
