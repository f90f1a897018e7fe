"""The emulated bench's per-kernel times: which profiled kernels are hybrid_ep's, their GPU time
per call, and the time a call spends outside them (the count-to-dispatch host gap that kept
about 2-3 ms of every dynamic-size dispatch on the 2026-11-26 H200 run from shrinking with SMs)."""

import pytest

from hybrid_ep.bench import emulated, kernel_times
from hybrid_ep.bench.kernel_times import CallKernels, kernel_name, other_kernels, per_call_ms

pytestmark = pytest.mark.unit

LAYOUT = "void hybrid_ep::count_impl::count_kernel<hybrid_ep::LoopbackTransport>(hybrid_ep::LaunchArgs)"
DIRECT = "dispatch_direct_impl::dispatch_direct_kernel(LaunchArgs)"
DIRECT_COMBINE = "void combine_direct_impl::combine_direct_kernel<__nv_bfloat16>(LaunchArgs)"
FILL = ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<unsigned char>, "
        "std::array<char*, 1ul>>(int, at::native::FillFunctor<unsigned char>, std::array<char*, 1ul>)")
COPY = "Memcpy DtoH (Device -> Pinned)"


def test_kernel_name_keeps_hybrid_ep_kernels_only():
    assert kernel_name(LAYOUT) == "count_kernel"
    assert kernel_name(DIRECT) == "dispatch_direct_kernel"
    assert kernel_name(DIRECT_COMBINE) == "combine_direct_kernel"
    assert kernel_name(FILL) is None


def test_per_call_ms_sums_each_kernel_over_the_calls():
    events = [(FILL, 50.0), (LAYOUT, 400.0), (DIRECT, 2000.0), (FILL, 50.0), (LAYOUT, 600.0), (DIRECT, 3000.0)]
    assert per_call_ms(events, 2) == {"dispatch_direct_kernel": pytest.approx(2.5), "count_kernel": pytest.approx(0.5)}
    assert per_call_ms([(FILL, 1.0)], 1) == {}
    with pytest.raises(ValueError, match="calls"):
        per_call_ms(events, 0)


def test_other_kernels_count_what_is_not_hybrid_eps():
    events = [(FILL, 50.0), (LAYOUT, 400.0), (COPY, 30.0), (FILL, 70.0), (LAYOUT, 600.0)]
    assert other_kernels(events, 2) == (1.5, pytest.approx(0.075))
    assert other_kernels([(LAYOUT, 1.0)], 1) == (0.0, 0.0)


def test_profiled_kernels_leave_the_flush_out(monkeypatch):
    """The flush's fill runs before every profiled call: its launches and time are profiled
    alone and taken off the other kernels, so only the call's own torch kernels remain."""
    flush, call = object(), object()

    def fake_events(fn, calls, before):
        flush_part = [(FILL, 100.0)] * calls if (fn is flush or before is flush) else []
        call_part = [(LAYOUT, 400.0), (COPY, 20.0), (COPY, 40.0)] * calls if fn is call else []
        return flush_part + call_part

    monkeypatch.setattr(kernel_times, "_cuda_events", fake_events)
    got = kernel_times.profiled_kernels(call, 4, flush)
    assert got.ours == {"count_kernel": pytest.approx(0.4)}
    assert got.other_launches == pytest.approx(2.0)
    assert got.other_ms == pytest.approx(0.06)
    monkeypatch.setattr(kernel_times, "_cuda_events", lambda fn, calls, before: [])
    assert kernel_times.profiled_kernels(call, 4, flush) is None


def test_kernel_rows_give_the_time_outside_the_kernels():
    row = emulated.kernel_rows({"dispatch": CallKernels({"count_kernel": 0.5, "dispatch_direct_kernel": 2.5}, 12.0,
                                                        0.75),
                                "combine": CallKernels({"combine_direct_kernel": 3.0}, 0.0, 0.0)}, 5.0, 3.25)
    assert row["kernels_ms"]["dispatch"] == {"count_kernel": 0.5, "dispatch_direct_kernel": 2.5}
    assert row["dispatch_outside_kernels_ms"] == pytest.approx(2.0)
    assert row["dispatch_other_kernels_ms"] == pytest.approx(0.75) and row["dispatch_other_launches"] == 12.0
    assert row["combine_outside_kernels_ms"] == pytest.approx(0.25)
    assert [k for k in row if k not in emulated.UNITS] == []
    text = emulated.kernel_summary(row)
    assert "count_kernel 0.500" in text and "outside 2.000 ms (other kernels 0.750 ms in 12 launches)" in text


def test_no_profiler_data_is_said_not_invented():
    row = emulated.kernel_rows({"dispatch": None, "combine": CallKernels({"combine_direct_kernel": 1.0}, 1.0, 0.1)},
                               5.0, 1.5)
    assert row["kernels_ms"]["dispatch"] is None
    assert "dispatch_outside_kernels_ms" not in row and "dispatch_other_kernels_ms" not in row
    assert emulated.kernel_summary(row).startswith("dispatch: no profiler data")
