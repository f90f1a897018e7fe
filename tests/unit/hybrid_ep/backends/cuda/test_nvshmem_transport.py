"""The NVSHMEM transport between real processes: 2 and 4 PEs on the one GPU (NVSHMEM's
several-PEs-per-GPU mode), initialised through hybrid_ep/backends/cuda/nvshmem.py, each
sending a pattern to the next with put_signal and put + fence + signal
(tests/harness/nvshmem_selftest.py). Skips without CUDA or without NVSHMEM in the build;
the runner's reports are checked on the CPU."""

from __future__ import annotations

import json

import pytest
import torch

from harness import nvshmem_selftest

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def built():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    try:
        import hybrid_ep._C as ext
    except ImportError as exc:
        pytest.skip(f"hybrid_ep._C is not built: {exc}")
    if not ext.has_nvshmem():
        pytest.skip("hybrid_ep._C was built without NVSHMEM")
    return ext


@pytest.mark.gpu
@pytest.mark.parametrize("procs", [2, 4])
def test_every_pe_receives_the_previous_pes_pattern(built, procs, tmp_path):
    calls, nbytes = 3, 1 << 20
    ok, lines = nvshmem_selftest.run(procs, nbytes=nbytes, calls=calls, timeout_s=20.0, deadline_s=240.0,
                                     out=tmp_path)
    logs = "\n".join((tmp_path / f"rank{r}.log").read_text()[-2000:] for r in range(procs))
    assert ok, "\n".join(lines) + "\n" + logs
    for rank in range(procs):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["stage"] == "done" and result["pes"] == list(range(procs))
        got = [(r["call"], r["mismatches"], r["first_bad"], r["timed_out"], r["signal_put"], r["signal_fenced"],
                r["signal_empty"]) for r in result["runs"]]
        assert got == [(e, 0, -1, False, e, e, e) for e in range(1, calls + 1)]
        region = built.nvshmem_selftest_region_bytes(nbytes)
        assert region == 128 + 2 * nbytes
        assert result["heap_bytes"] >= region


def test_bad_arguments_are_refused_before_any_process_starts(tmp_path):
    with pytest.raises(ValueError, match=r"procs must be an int in 2..8"):
        nvshmem_selftest.run(1, out=tmp_path)
    with pytest.raises(ValueError, match="nbytes must be a positive multiple of 32"):
        nvshmem_selftest.run(2, nbytes=100, out=tmp_path)
    assert list(tmp_path.iterdir()) == []


def _result(**runs_and_fields):
    base = {"rank": 1, "procs": 4, "bytes": 64, "stage": "done", "ok": True, "status": "initialised",
            "heap_bytes": 1 << 25}
    return {**base, **runs_and_fields}


def _run(call, **fields):
    return {"call": call, "mismatches": 0, "first_bad": -1, "timed_out": False, "signal_put": call,
            "signal_fenced": call, "signal_empty": call, "seconds": 0.5 * call, **fields}


def test_reports_name_the_rank_the_sender_and_what_went_wrong():
    good = _result(runs=[_run(1), _run(2)])
    assert nvshmem_selftest.describe(good) == (
        "rank 1/4: 2 calls of 64 bytes correct, initialised, heap 33554432 bytes, slowest call 1.0000 s")
    late = _result(ok=False, runs=[_run(1), _run(2, timed_out=True, signal_put=1, signal_fenced=2, signal_empty=1)])
    assert nvshmem_selftest.describe(late) == (
        "rank 1/4: call 2: the signals from rank 0 did not arrive in time (put_signal word 1, fenced word 2, "
        "0-byte put_signal word 1, expected 2)")
    wrong = _result(ok=False, runs=[_run(1, mismatches=3, first_bad=7)])
    assert nvshmem_selftest.describe(wrong) == "rank 1/4: call 1: 3 words from rank 0 differ, first at word 7"
    failed = _result(rank=0, ok=False, stage="nvshmem init", error="NvshmemInitError: boom")
    assert nvshmem_selftest.describe(failed) == "rank 0/4: failed at nvshmem init: NvshmemInitError: boom"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the report of PEs that find no GPU")
def test_pes_without_a_gpu_report_where_they_stopped(tmp_path):
    ok, lines = nvshmem_selftest.run(2, nbytes=64, calls=1, deadline_s=240.0, out=tmp_path)
    assert not ok
    assert [line.split(":")[0] + ":" + line.split(":")[1] for line in lines] == [
        "rank 0/2: failed at cuda device", "rank 1/2: failed at cuda device"]
    assert all(json.loads((tmp_path / f"rank{r}.json").read_text())["stage"] == "cuda device" for r in (0, 1))


# -- dispatch and combine across NVSHMEM processes (harness.nvshmem_cases) ---------

def test_nvshmem_cases_span_several_nodes_and_the_features():
    from harness import nvshmem_cases
    from hybrid_ep.fp8 import FP8_DTYPE

    cases = nvshmem_cases.default_cases()
    for case in cases:
        cfg = case.config  # validates
        assert 2 <= case.world_size <= 4 and cfg.num_nodes >= 2, str(case)
    assert {(c.world_size, c.ranks_per_node) for c in cases} == {(2, 1), (3, 1), (4, 1), (4, 2)}
    assert {c.dtype for c in cases} == {torch.bfloat16, FP8_DTYPE, torch.float32}
    assert any(c.num_out_tokens is not None and c.num_out_tokens < sum(c.tokens) for c in cases)  # overflow
    assert any(sum(c.tokens) == 0 for c in cases) and any(c.routing == "one-expert" for c in cases)
    assert any(c.drop_fraction > 0 for c in cases) and any(c.wire_dtype == torch.float32 for c in cases)


def test_nvshmem_cases_cli_refuses_without_a_device_or_a_matching_case(tmp_path, capsys):
    from harness import nvshmem_cases

    if torch.cuda.is_available():
        assert nvshmem_cases.main(["--out", str(tmp_path), "--only", "no such case"]) == 2
        assert "no case name contains 'no such case'" in capsys.readouterr().err
    else:
        assert nvshmem_cases.main(["--out", str(tmp_path)]) == 2
        assert "needs a CUDA device" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.gpu
def test_dispatch_and_combine_across_nvshmem_processes_match_the_oracle(built, tmp_path):
    """Processes on the one GPU, each one rank: 2 nodes of 1, 3 nodes with dropped routes,
    2 nodes of 2 with fp8 and with a static size that overflows; the NVSHMEM instantiation of
    the kernels, checked against the oracle like every backend."""
    from harness import nvshmem_cases

    wanted = ("W2xG1 E4 H2048", "W3xG1 E6 H2048 T[17, 0, 40] K6", "float8_e4m3fn", "out10")
    cases = [c for c in nvshmem_cases.default_cases() if any(w in str(c) for w in wanted)]
    assert len(cases) == 4
    results = nvshmem_cases.run(cases, tmp_path, timeout_s=40.0, progress=lambda line: None)
    assert {r["case"]: r["ok"] for r in results} == {str(c): True for c in cases}, results
