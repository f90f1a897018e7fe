"""PeakMemoryMeter: exact peaks of known allocations, views and in-place results counted once,
frees lowering the live count, storages grown in place, autograd's saved tensors."""

from __future__ import annotations

import threading

import pytest
import torch

from hybrid_ep.peak_memory import PeakMemoryMeter

pytestmark = pytest.mark.unit

F32 = 4


def test_known_allocations_and_frees_give_the_exact_peak():
    with PeakMemoryMeter() as meter:
        a = torch.empty(1000)
        b = torch.empty(500, dtype=torch.float64)
        assert (meter.live_bytes, meter.peak_bytes) == (1000 * F32 + 500 * 8, 8000)
        del a
        assert (meter.live_bytes, meter.peak_bytes) == (4000, 8000)
        c = torch.empty(250, dtype=torch.int16)
        assert (meter.live_bytes, meter.peak_bytes) == (4500, 8000)
        d = torch.empty(2000)
        assert (meter.live_bytes, meter.peak_bytes) == (12500, 12500)
        del b, d
    assert (meter.live_bytes, meter.peak_bytes) == (500, 12500)
    del c
    assert meter.live_bytes == 0


def test_views_in_place_results_and_aliases_count_once():
    with PeakMemoryMeter() as meter:
        a = torch.zeros(100, 10)
        views = [a[3:], a.t(), a.view(10, 100), a.reshape(-1), a.detach(), a.as_strided((5,), (2,)), a[:, 1]]
        a.add_(1).mul_(2)
        torch.add(a, 1, out=a)
        same = torch.empty(0).set_(a.untyped_storage())
        assert meter.peak_bytes == meter.live_bytes == 1000 * F32
        del a, same
        assert meter.live_bytes == 1000 * F32  # the views keep the storage
        views.clear()
        assert meter.live_bytes == 0


def test_storages_from_before_the_meter_count_nothing():
    weight = torch.randn(64, 64)
    with PeakMemoryMeter() as meter:
        wt = weight.t()
        weight.mul_(0.5)
        y = torch.empty(8, 64) @ wt  # new: 8 x 64 plus the empty input
    assert meter.peak_bytes == 2 * 8 * 64 * F32
    del weight, wt, y
    assert meter.live_bytes == 0  # the one from before was never counted, nor subtracted


def test_a_free_inside_the_window_lowers_the_live_count_and_the_next_window():
    with PeakMemoryMeter() as meter:
        big = torch.ones(4096)
        small = big[:10].clone()
        del big
        assert meter.live_bytes == 10 * F32 and meter.peak_bytes == 4106 * F32
        meter.reset_peak()
        assert meter.peak_bytes == 10 * F32
        other = torch.ones(100)
        assert meter.peak_bytes == 110 * F32
    del small, other
    assert meter.live_bytes == 0


def test_a_storage_grown_in_place_counts_at_its_new_size():
    with PeakMemoryMeter() as meter:
        a = torch.empty(10)
        a.resize_(1000)
        assert meter.live_bytes == 1000 * F32  # the 10-element block was freed by the move
        out = torch.empty(0)
        torch.cat([a, a], out=out)
        assert meter.live_bytes == 3000 * F32
    pre = torch.empty(0)
    with PeakMemoryMeter() as grown:
        torch.cat([torch.ones(50)], out=pre)  # an output from before the meter, grown by out=
        assert (grown.live_bytes, grown.peak_bytes) == (50 * F32, 100 * F32)  # the ones were freed
        pre.resize_(200)
    assert grown.live_bytes == grown.peak_bytes == 200 * F32


def test_tensors_from_python_data_are_counted():
    with PeakMemoryMeter() as meter:
        t = torch.tensor([1.0, 2.0, 3.0])
        i = torch.as_tensor([[1, 2], [3, 4]])
    assert meter.live_bytes == 3 * F32 + 4 * 8
    del t, i


def test_autograd_saved_tensors_live_until_backward_frees_them():
    w = torch.randn(32, 32, requires_grad=True)
    x = torch.randn(16, 32)
    act = 16 * 32 * F32
    with PeakMemoryMeter() as meter:
        h = (x @ w).relu()
        assert meter.peak_bytes == 2 * act  # the product and relu's result, then the product is freed
        y = (h * h).sum()
        del h
        assert meter.live_bytes == act + F32  # relu and mul saved h: it lives on in the graph, and y
        y.backward()
    assert meter.live_bytes == 32 * 32 * F32 + F32  # the graph is freed: w.grad and y are left
    # mm's backward makes w.grad while the gradient it consumes (as large as h) is alive.
    assert meter.peak_bytes >= 32 * 32 * F32 + act + F32
    w.grad = None
    del y
    assert meter.live_bytes == 0


def test_frees_on_another_thread_are_counted():
    with PeakMemoryMeter() as meter:
        box = [torch.empty(256)]
    worker = threading.Thread(target=box.clear)
    worker.start()
    worker.join()
    assert (meter.live_bytes, meter.peak_bytes) == (0, 256 * F32)


def test_the_device_filter_leaves_other_devices_out():
    with PeakMemoryMeter(device="cuda") as cuda_only, PeakMemoryMeter(device="cpu") as cpu_only:
        t = torch.empty(100)
    assert cuda_only.peak_bytes == 0 and cpu_only.peak_bytes == 100 * F32
    del t
