"""`hybrid-ep-bench --backends deepep` (hybrid_ep/bench/deepep.py) where DeepEP cannot run: the
flags it refuses, the skip with its reason when deep_ep is missing, its byte accounting against
hybrid-ep's, and its timing loop on a stand-in deep_ep module (the real one needs a GPU)."""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import pytest
import torch

from hybrid_ep.bench import cli, deepep, main
from hybrid_ep.bench.spec import BASELINES, BENCH_BACKENDS, BenchArgError, BenchSpec

pytestmark = pytest.mark.unit

TINY = ["--hidden", "256", "--tokens", "32", "--topk", "4", "--warmup", "1", "--iters", "3", "--device", "cpu"]


def _spec(**changes) -> BenchSpec:
    base = BenchSpec(world_size=4, ranks_per_node=4, hidden=256, tokens=32, topk=4, experts=8, dtype="bf16",
                     routing="uniform", sms=(), backends=("deepep",), warmup=1, iters=3, seed=0, device="cpu")
    return dataclasses.replace(base, **changes)


def test_deepep_is_a_baseline_of_the_bench_not_a_backend_of_the_buffer():
    assert BASELINES == ("deepep",) and BENCH_BACKENDS[-1] == "deepep"


@pytest.mark.parametrize("changes, flag, words", [
    (dict(world_size=6, ranks_per_node=6, experts=12), "--world-size", "run 2, 4, 8 ranks"),
    (dict(world_size=8, ranks_per_node=4, experts=16), "--ranks-per-node", "makes 2 nodes"),
    (dict(sms=(1, 2, 3)), "--sms", "1, 3 with --backends deepep: DeepEP runs SMs in pairs"),
    (dict(dtype="fp32"), "--dtype", "DeepEP dispatches bf16 or fp8"),
])
def test_what_deepeps_intranode_kernels_cannot_run_is_refused_by_its_flag(changes, flag, words):
    spec = _spec(**changes).validate()  # the shape is a valid bench run
    with pytest.raises(BenchArgError) as err:
        deepep.check_spec(spec)
    assert err.value.flag == flag and words in str(err.value)


def test_a_bad_deepep_flag_exits_2_before_any_rank_starts(tmp_path, capsys):
    assert main([*TINY, "-w", "4", "--backends", "reference", "deepep", "--sms", "3", "--out", str(tmp_path)]) == 2
    assert "argument --sms: 3 with --backends deepep" in capsys.readouterr().err


def test_without_deep_ep_the_baseline_is_skipped_with_its_reason(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "-w", "2", "--backends", "reference", "deepep", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    doc = json.loads((out / "results.json").read_text())
    assert [run["backend"] for run in doc["runs"]] == ["reference"]
    why = doc["skipped"]["deepep"]
    assert why.startswith("deep_ep does not import (No module named 'deep_ep')")
    assert f"== deepep: not run: {why}" in captured.out and f"deepep: not run: {why}" in captured.err
    # asked for alone, there is nothing to run: the reason is the error
    assert main([*TINY, "-w", "2", "--backends", "deepep", "--out", str(tmp_path / "alone")]) == 2
    assert "argument --backends: 'deepep' is not available here: deep_ep does not import" in capsys.readouterr().err


def test_deep_ep_is_never_run_unasked_even_where_every_rank_has_it():
    usable = {"backends": ["reference", "cuda", "deepep"], "unavailable": {}}
    assert cli._pick_backends(_spec(backends=[]), [usable, usable]) == (["reference", "cuda"], {})
    assert cli._pick_backends(_spec(backends=["deepep"]), [usable, usable]) == (["deepep"], {})


def test_deep_ep_on_the_cpu_says_it_needs_cuda(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_ep", types.ModuleType("deep_ep"))
    assert deepep.unavailable_reason("cpu") == "DeepEP runs on CUDA devices only (--device cuda)"
    assert deepep.unavailable_reason("cuda") in (None, "no CUDA device is visible")


@pytest.mark.parametrize("dtype", ["bf16", pytest.param("fp8", marks=pytest.mark.slow)])  # slow: the full tier
def test_its_bytes_are_hybrid_eps_bytes_for_the_same_routing(tmp_path, capsys, dtype):
    out = tmp_path / "run"
    flags = ["-w", "4", "--experts", "8", "--dtype", dtype, "--backends", "reference", "--out", str(out)]
    assert main([*TINY, *flags]) == 0
    capsys.readouterr()
    [run] = json.loads((out / "results.json").read_text())["runs"]
    spec = _spec(dtype=dtype)
    for rank in run["ranks"]:
        mine = deepep.traffic(spec, rank["rank"])
        for op in ("dispatch", "combine"):
            for key in ("rows", "row_bytes", "algorithm_bytes", "nvlink_bytes", "rdma_bytes"):
                assert mine[op][key] == rank[op][key], (rank["rank"], op, key)
    assert mine["dispatch"]["row_bytes"] == (256 + 2 * 4 if dtype == "fp8" else 512)  # fp8: with its 2 scales
    assert mine["combine"]["row_bytes"] == 512  # bf16 back


class _Config:
    def __init__(self, num_sms: int, chunk: int):
        self.num_sms, self.chunk = num_sms, chunk

    def get_nvl_buffer_size_hint(self, hidden_bytes: int, num_ranks: int) -> int:
        return self.num_sms * self.chunk * hidden_bytes * num_ranks


def _fake_deep_ep(calls: list) -> types.ModuleType:
    """deep_ep's Buffer as the bench uses it, on the CPU and one rank: every token stays."""

    class Buffer:
        num_sms = 20

        def __init__(self, group, num_nvl_bytes, num_rdma_bytes):
            calls.append(("buffer", num_nvl_bytes, num_rdma_bytes))

        @staticmethod
        def set_num_sms(n):
            assert n % 2 == 0
            Buffer.num_sms = n

        @staticmethod
        def get_dispatch_config(num_ranks):
            return _Config(Buffer.num_sms, 6)

        @staticmethod
        def get_combine_config(num_ranks):
            return _Config(Buffer.num_sms, 4)

        def get_dispatch_layout(self, topk_idx, num_experts):
            assert topk_idx.dtype == torch.int64
            in_rank = (topk_idx >= 0).any(dim=1, keepdim=True)
            return in_rank.sum(0), None, torch.bincount(topk_idx[topk_idx >= 0], minlength=num_experts), in_rank, None

        def dispatch(self, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                     config):
            keep = is_token_in_rank[:, 0]
            calls.append(("dispatch", config.num_sms, config.chunk, type(x).__name__))
            recv = (x[0][keep], x[1][keep]) if isinstance(x, tuple) else x[keep]
            return recv, topk_idx[keep], topk_weights[keep], [], ("handle", int(keep.sum())), None

        def combine(self, x, handle, topk_weights, config):
            calls.append(("combine", config.num_sms, config.chunk, x.dtype, x.shape[0] == handle[1]))
            return x, topk_weights, None

    return types.SimpleNamespace(Buffer=Buffer)


@pytest.mark.parametrize("dtype, sms", [("bf16", (2, 4)), ("fp8", ())])
def test_each_sm_count_times_layout_dispatch_and_combine(single_rank_group, monkeypatch, dtype, sms):
    calls: list = []
    monkeypatch.setitem(sys.modules, "deep_ep", _fake_deep_ep(calls))
    monkeypatch.setattr(deepep, "_device", lambda: torch.device("cpu"))
    spec = _spec(world_size=1, ranks_per_node=1, experts=4, dtype=dtype, sms=sms, warmup=2, iters=3)
    results = deepep.run_backend(spec)
    counts = list(sms) or [None]
    assert [r["num_sms"] for r in results] == counts
    hidden_bytes = 256 * 2  # its buffer holds bf16 rows, fp8 ones included
    largest = max(counts, key=lambda n: n or deepep.DEFAULT_SMS) or deepep.DEFAULT_SMS
    assert calls[0] == ("buffer", largest * 6 * hidden_bytes, 0)  # the largest of every config's hint
    x_kind = "tuple" if dtype == "fp8" else "Tensor"
    expected = []
    for n in counts:
        expected += [("dispatch", n or deepep.DEFAULT_SMS, 6, x_kind),
                     ("combine", n or deepep.DEFAULT_SMS, 4, torch.bfloat16, True)] * (2 + 3)
    assert calls[1:] == expected
    for r in results:
        assert r["rank"] == 0 and r["timing"].startswith("time.perf_counter")
        for op in ("dispatch", "combine"):
            assert len(r[op]["samples_ms"]) == 3 and all(s > 0 for s in r[op]["samples_ms"])
            assert r[op]["traffic"] == deepep.traffic(spec, 0)[op]
