"""The emulated bench's host-time loop on the CPU model: it must time the data path the
sweep measured (the direct path's host loop once fell back to the receive path on a GPU
because the timed points' outputs still held the arena)."""

import functools
import types

import pytest
import torch

from hybrid_ep.bench import emulated
from hybrid_ep.bench.kernel_times import CallKernels

pytestmark = pytest.mark.model


@pytest.fixture
def cpu_sweep(monkeypatch):
    """emulated._sweep_one_world with its GPU-only parts replaced: groups on the CPU model,
    each timed callable run once, no SM clock or index_select baseline."""
    pytest.importorskip("hybrid_ep._model")
    from hybrid_ep import logs
    from hybrid_ep.backends.cuda import emulation

    monkeypatch.setattr(emulation, "EmulatedGroup", functools.partial(emulation.EmulatedGroup, device="cpu"))
    monkeypatch.setattr(logs, "_said", set())  # the receive path lines are logged once per process

    def once(fn, warmup, iters, flush):
        fn()
        return 1.0

    monkeypatch.setattr(emulated, "_median_ms", once)

    def kernels(fn, calls, before):  # the profiler's CUDA activity: here the kernels' names only
        fn()
        return CallKernels({"count_kernel": 0.25, "dispatch_direct_kernel": 0.5}, 3.0, 0.125)

    monkeypatch.setattr(emulated, "profiled_kernels", kernels)
    monkeypatch.setattr(emulated, "gpu_sm_clock_mhz", lambda: None)
    monkeypatch.setattr(emulated, "torch_movement", lambda xs, idxs, L: (lambda: None, lambda: None, None))
    return emulated._sweep_one_world


@pytest.mark.slow  # the full tier (scripts/test.sh --full): a timed host loop
def test_host_loop_times_the_direct_path(cpu_sweep, capsys, caplog):
    W, H, T, E, K = 2, 256, 64, 16, 8
    args = types.SimpleNamespace(routing="uniform", seed=0, zipf_exponent=1.0, group_limit=None)
    props = types.SimpleNamespace(multi_processor_count=132)
    rows, host, _ = cpu_sweep(W, args, H, T, E, K, torch.bfloat16, [1], 1, 1, None, 1e12, torch.device("cpu"),
                              props)
    assert [r["data_path"] for r in rows] == ["direct"]
    assert rows[0]["dispatch_outside_kernels_ms"] == pytest.approx(0.25)  # 1 ms timed, 0.75 in kernels
    assert rows[0]["dispatch_other_kernels_ms"] == pytest.approx(0.125)
    assert host["data_path"] == "direct", capsys.readouterr().err
    # nor did a warm-up call fall back (on 2026-11-26 the H100's W = 2 sweep logged one)
    assert not [r.message for r in caplog.records if "took the receive path" in r.getMessage()]
    assert host["ranks"] == W and host["median_us"] > 0
    # the host time by function: the package's own host path among the top entries
    assert len(host["profile"]) == 15 and any("hybrid_ep/" in p["function"] for p in host["profile"])
    assert "host time by function" in capsys.readouterr().err


@pytest.mark.slow  # the full tier: a timed host loop, as above
def test_the_sweep_across_nodes_takes_the_direct_path(cpu_sweep, capsys):
    """The bench's sweep as 2 nodes of 2 measures the direct path across nodes (the default
    where it can run): the H200 run of 2026-11-27 measured the receive path there because the
    sweep asked for the direct path only on one node."""
    W, H, T, E, K = 4, 256, 32, 16, 4
    args = types.SimpleNamespace(routing="uniform", seed=0, zipf_exponent=1.0, group_limit=None)
    props = types.SimpleNamespace(multi_processor_count=132)
    rows, host, _ = cpu_sweep(W, args, H, T, E, K, torch.bfloat16, [1], 1, 1, None, 1e12, torch.device("cpu"),
                              props, nodes=2)
    assert [r["data_path"] for r in rows] == ["direct"]
    assert host["data_path"] == "direct", capsys.readouterr().err
