"""The arena's sub-allocator (backends/cuda/arena.py, its free list and tensors in the CPU
model's extension: csrc/bindings/arena.h) over a CPU region: alignment, the tensors it hands
out, their return when the last view dies, exhaustion, the stream rule, every rank's block in
one call, the bytes one direct call takes and what a training step needs."""

from __future__ import annotations

import gc

import pytest
import torch

from hybrid_ep.backends.cuda import arena as arena_mod
from hybrid_ep.backends.cuda import load_extension
from hybrid_ep.backends.cuda.arena import ALIGN, Arena, aligned, arena_blocks, call_bytes, call_tensors
from hybrid_ep.backends.cuda.expert_out_order import StreamOrder
from hybrid_ep.config import BufferConfig
from hybrid_ep.routing import max_output_rows

pytestmark = pytest.mark.model

CPU = torch.device("cpu")


@pytest.fixture
def region():
    """An ALIGN-aligned CPU region of 16 blocks and an arena over it (the tensor holds the memory)."""
    backing = torch.zeros(17 * ALIGN, dtype=torch.uint8)
    skip = (-backing.data_ptr()) % ALIGN
    region = backing[skip:skip + 16 * ALIGN]
    return region, Arena(region.data_ptr(), region.numel(), CPU)


def test_blocks_are_aligned_typed_and_write_the_region(region):
    mem, a = region
    x = a.empty((3, 5), torch.float32)
    y = a.empty((7,), torch.bfloat16)
    assert x.shape == (3, 5) and x.dtype == torch.float32 and x.is_contiguous()
    assert y.shape == (7,) and y.dtype == torch.bfloat16
    assert (x.data_ptr() - a.base) % ALIGN == 0 and (y.data_ptr() - a.base) % ALIGN == 0
    assert y.data_ptr() - x.data_ptr() == ALIGN  # 60 bytes take one block, first fit
    x.fill_(2.5)
    assert mem[:60].view(torch.float32).tolist() == [2.5] * 15
    assert a.used == 2 * ALIGN
    assert a.contains(x) and a.contains(y) and a.contains(x[1])


def test_a_block_returns_when_its_last_view_dies_and_ranges_merge(region):
    _, a = region
    x, y, z = a.empty((ALIGN,), torch.uint8), a.empty((2 * ALIGN,), torch.uint8), a.empty((ALIGN,), torch.uint8)
    view = y[5:9]
    del y
    gc.collect()
    assert a.used == 4 * ALIGN  # the view keeps y's block
    del view, x, z
    gc.collect()
    assert a.used == 0
    assert a.largest_free() == 16 * ALIGN  # the three ranges and the rest are one again
    big = a.empty((16 * ALIGN,), torch.uint8)
    assert big is not None and big.data_ptr() == a.base


def test_exhaustion_returns_none_and_takes_nothing(region):
    _, a = region
    keep = a.empty((10 * ALIGN,), torch.uint8)
    assert a.empty((7 * ALIGN,), torch.uint8) is None
    assert a.used == 10 * ALIGN
    rest = a.empty((6 * ALIGN,), torch.uint8)
    assert rest is not None
    assert a.empty((1,), torch.uint8) is None
    del keep, rest


def test_a_range_is_reused_only_on_the_stream_it_was_used_on(region):
    _, a = region
    first = a.empty((16 * ALIGN,), torch.uint8, stream=7)
    del first
    gc.collect()
    assert a.empty((ALIGN,), torch.uint8, stream=9) is None  # stream 7 may still use it
    again = a.empty((16 * ALIGN,), torch.uint8, stream=7)
    assert again is not None


def test_tensors_outside_or_across_the_edge_are_not_contained(region):
    mem, a = region
    assert not a.contains(torch.zeros(4))
    assert a.contains(mem[:16 * ALIGN])
    wider = mem.as_strided((16 * ALIGN + 1,), (1,))  # one byte past the end
    assert not a.contains(wider)
    assert a.contains(torch.zeros(0))


def test_call_tensors_take_call_bytes_or_nothing(region):
    _, a = region
    R, H = 3, 128
    need = call_bytes(R, H, torch.bfloat16, fp8=False)
    assert need == 3 * ALIGN + ALIGN  # rows 768 bytes, probs 12: no combine room any more (expert_out_order.py)
    out, scales, probs = call_tensors(a, R, H, torch.bfloat16, False)
    assert out.shape == (R, H) and probs.shape == (R,) and scales is None
    assert probs.data_ptr() == out.data_ptr() + 3 * ALIGN
    assert a.used == need
    del out, probs
    gc.collect()
    assert call_tensors(a, 64, H, torch.bfloat16, True) is None  # too big: nothing stays taken
    assert a.used == 0


def test_every_ranks_block_in_one_call_or_none_taken():
    """arena_blocks: one block per arena; where one can not hold its block, its index comes
    back and no arena keeps a block."""
    backing = torch.zeros(40 * ALIGN, dtype=torch.uint8)
    skip = (-backing.data_ptr()) % ALIGN
    big = Arena(backing.data_ptr() + skip, 16 * ALIGN, CPU)
    small = Arena(backing.data_ptr() + skip + 16 * ALIGN, 8 * ALIGN, CPU)
    R, H = 8, 128  # 8 blocks of rows, 1 of probs
    got = arena_blocks([big, small], [R, 4], H, torch.bfloat16, False)
    (out0, sc0, probs0), (out1, sc1, probs1) = got
    assert out0.shape == (R, H) and out0.dtype == torch.bfloat16 and probs0.shape == (R,) and sc0 is None
    assert out1.shape == (4, H) and probs1.dtype == torch.float32 and sc1 is None
    assert out0.data_ptr() == big.base and out1.data_ptr() == small.base
    out1.fill_(3.0)
    assert backing[skip + 16 * ALIGN:skip + 16 * ALIGN + 4 * H * 2].view(torch.bfloat16).eq(3.0).all()
    del got, out0, probs0, out1, probs1
    gc.collect()
    assert big.used == 0 and small.used == 0
    assert arena_blocks([big, small], [R, R], H, torch.bfloat16, False) == 1  # 9 blocks do not fit in 8
    assert big.used == 0 and small.used == 0 and big.largest_free() == 16 * ALIGN


@pytest.mark.parametrize("dtype, fp8", [(torch.bfloat16, False), (torch.float32, False),
                                        (torch.float8_e4m3fn, True)])
def test_the_extensions_block_layout_is_call_bytes_for_any_rows(dtype, fp8):
    """The extension places a block's tensors by the rule call_bytes sizes them with (both
    homes of the rule agree), for any number of rows, none included."""
    ext = load_extension("cpu")
    layout = arena_mod.block_layout(ext, 384, dtype, fp8)
    for rows in (0, 1, 3, 255, 256, 1000):
        assert layout.nbytes(rows) == call_bytes(rows, 384, dtype, fp8)


def test_fp8_calls_carry_their_scales_in_the_block(region):
    _, a = region
    R, H = 2, 256
    assert call_bytes(R, H, torch.float8_e4m3fn, fp8=True) == 2 * ALIGN + ALIGN + ALIGN  # rows 512, scales 16, probs
    out, scales, probs = call_tensors(a, R, H, torch.float8_e4m3fn, True)
    assert scales.shape == (R, 2) and scales.dtype == torch.float32
    assert scales.data_ptr() == out.data_ptr() + 2 * ALIGN and probs.data_ptr() == out.data_ptr() + 3 * ALIGN
    assert a.used == 4 * ALIGN


@pytest.mark.parametrize("dtype, fp8", [(torch.bfloat16, False), (torch.float8_e4m3fn, True)])
def test_a_blocks_addresses_and_tensors_are_rows_scales_probs(region, dtype, fp8):
    """A direct dispatch's block in the one order of a dispatch's outputs (ext.DispatchOutputs,
    ext.OutputTensors): its addresses and its tensors, the scales absent (0, None) without fp8."""
    _, a = region
    R, H = 2, 256
    taken = arena_mod.arena_take([a], [R], H, dtype, fp8)
    [(rows_at, scales_at, probs_at)] = taken.addresses()
    [(rows, scales, probs)] = taken.tensors()
    assert rows.data_ptr() == rows_at == a.base and rows.shape == (R, H) and rows.dtype == dtype
    assert probs.data_ptr() == probs_at and probs.shape == (R,) and probs.dtype == torch.float32
    if fp8:
        assert scales.data_ptr() == scales_at and scales.shape == (R, 2)
        assert rows_at < scales_at < probs_at
    else:
        assert scales is None and scales_at == 0
    ext = a.ext
    assert ext.OutputTensors.__match_args__ == ("rows", "scales", "probs")
    made = ext.OutputTensors(rows=rows, scales=scales, probs=probs)
    assert (made.rows, made.scales, made.probs) == (rows, scales, probs)
    out = ext.DispatchOutputs(num_rows=R, rows=rows_at, scales=scales_at, probs=probs_at)
    assert (out.num_rows, out.rows, out.scales, out.probs) == (R, rows_at, scales_at, probs_at)


def test_a_calls_bytes_are_its_rows_and_probs_and_the_presize_is_checked():
    cfg = BufferConfig(512, 64, 8, 4, 4).validate()
    rows = max_output_rows(cfg, 2)
    assert call_bytes(rows, 512, torch.float32) == rows * 512 * 4 + rows * 4  # 256-byte multiples here
    with pytest.raises(ValueError, match="peer_memory_bytes"):
        BufferConfig(512, 64, 8, 4, 4, peer_memory_bytes=-1).validate()


def test_a_training_step_holds_one_call_per_layer_in_flight_and_one_gradient_dispatch():
    one = call_bytes(100, 512, torch.bfloat16)
    assert one == aligned(100 * 512 * 2) + aligned(100 * 4)
    assert arena_mod.training_bytes(6, 100, 512, torch.bfloat16) == 7 * one
    assert arena_mod.training_bytes(1, 100, 512, torch.float8_e4m3fn, fp8=True) == 2 * call_bytes(
        100, 512, torch.float8_e4m3fn, True)
    with pytest.raises(ValueError, match="layers_in_flight"):
        arena_mod.training_bytes(0, 100, 512, torch.bfloat16)


def test_blocks_taken_and_freed_on_several_threads_leave_the_arena_whole(region):
    import threading

    _, a = region
    errors = []

    def churn(seed: int):
        try:
            for i in range(300):
                t = a.empty(((seed + i) % 3 + 1, ALIGN // 2), torch.uint8)
                if t is not None:
                    t.fill_(seed)
                    assert bool((t == seed).all())
                del t
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=churn, args=(s,)) for s in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    gc.collect()
    assert errors == []
    assert a.used == 0 and a.largest_free() == 16 * ALIGN


def test_expected_rows_are_the_mean_times_the_imbalance_plus_the_padding_bound():
    assert arena_mod.expected_rows(4096, 8, 1.0, 2) == 32768
    assert arena_mod.expected_rows(4096, 8, 1.5, 2, pad_multiple=16) == 49152 + 2 * 15
    assert arena_mod.expected_rows(10, 3, 1.25, 4, pad_multiple=2, min_rows_per_expert=5) == 38 + 4 * 6
    with pytest.raises(ValueError, match="imbalance"):
        arena_mod.expected_rows(10, 3, 0.5, 4)


def test_the_stream_order_waits_only_where_the_stream_changes():
    """expert_out_order.StreamOrder with recording hooks: a user on the last user's stream enqueues no
    wait; one on another stream waits for the marker recorded after the last user; the
    first user waits for nothing."""
    log = []

    def record():
        log.append(("record", len(log)))
        return len(log) - 1

    order = StreamOrder(CPU, record=record, wait=lambda marker: log.append(("wait", marker)))
    for stream in (1, 1, 2, 2, 1):
        order.before(stream)
        log.append(("use", stream))
        order.after(stream)
    assert log == [("use", 1), ("record", 1), ("use", 1), ("record", 3),
                   ("wait", 3), ("use", 2), ("record", 6), ("use", 2), ("record", 8),
                   ("wait", 8), ("use", 1), ("record", 11)]
    assert order.waits == 2 and order.last_stream == 1

