"""The cuda kernels (csrc/kernels) on the CPU model of the device layer, against the oracle.

The same kernel sources nvcc compiles run here as fibers (hybrid_ep._model), through the
same engine and single-GPU emulation as on a GPU, on CPU tensors: W virtual ranks, their
registered buffers and peer pointers, one launch per kernel for all of them. Every rank's
dispatch must equal the oracle bitwise, its combine must be within the fp32 accumulation
bound plus one rounding, and a dispatch that reuses the handle must give the same rows.
Each case runs under two seeds of the model's schedule and bulk-copy delays (and of the
data). The model shows logic, not speed or the memory model (docs/dev/cpu_model.md).
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib
import re

import pytest
import torch

from harness.emulated import (
    GroupCache,
    buffer_key,
    check_emulated,
    check_emulated_autograd,
    emulated_group_for,
    on_device,
)
from harness.emulated_check import main as emulated_check_main
from harness.faults import ranks_absent
from helpers import LEASE_COMBINE_VARIANTS
from hybrid_ep.backends.cuda import launch
from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.backends.cuda.engine import RoutingError
from hybrid_ep.backends.cuda.layout import rdma_layout, registered_layout
from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.verify.cases import Case, make_rank_inputs
from hybrid_ep.verify.compare import assert_combine_close, combine_tolerance
from hybrid_ep.verify.oracle import combine_oracle, dispatch_oracle

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

MODEL_SMS = 2  # SMs per rank unless a test says otherwise: fewer fibers, same code paths
SEEDS = (0, 1)
PATHS = launch.DATA_PATHS  # direct: rows straight to their final rows; receive: through receive buffers

_cached = GroupCache("cpu")


def group_for(case: Case, sms: int = MODEL_SMS, path: str = "direct") -> EmulatedGroup:
    return _cached(case, num_sms_dispatch=sms, num_sms_combine=sms, data_path=path)


def _case(W, **kw):
    base = dict(world_size=W, ranks_per_node=W, num_experts=2 * W, hidden=256, tokens=(17,) * W, topk=2,
                dtype=torch.bfloat16, backend="cuda")
    base.update(kw)
    return Case(**base)


CASES = [
    # world sizes (3 is not a power of two), odd and zero token counts, top-k 1 / 2 / 8
    _case(1, hidden=128, tokens=(17,), topk=1),
    _case(1, dtype=torch.float32, tokens=(0,), topk=1),
    _case(2, tokens=(0, 17)),
    _case(2, hidden=2048, tokens=(64, 1)),
    _case(3, tokens=(17, 1, 0)),
    _case(3, num_experts=9, hidden=128, tokens=(64, 0, 17), topk=8, dtype=torch.float32),
    _case(4, num_experts=16, tokens=(1, 17, 0, 64), topk=8),
    _case(8, num_experts=16, tokens=(64, 17, 0, 33, 1, 64, 5, 9), topk=8),  # a full NVLink node
    # more tokens than the count kernel's 1024 threads: counts carried across tiles
    _case(2, hidden=128, dtype=torch.float32, tokens=(1100, 1030), num_experts=6),
    # dtypes: fp32, fp16, fp8 with its scales
    _case(4, hidden=128, dtype=torch.float32, tokens=(17, 1, 0, 33)),
    _case(2, dtype=torch.float16, tokens=(17, 33)),
    _case(4, num_experts=32, dtype=FP8_DTYPE, tokens=(64, 17, 1, 0), topk=8),
    _case(3, hidden=128, dtype=FP8_DTYPE, tokens=(17, 64, 1), pad_multiple=16),
    # fp8 whose rows' scales are whole 16-byte units (H % 512 == 0): the direct dispatch copies them 16 bytes a lane;
    # 6 scales a row (a lane's 4 and another's 2, rows 24 bytes apart) and 132 (two passes of the warp)
    _case(2, num_experts=4, hidden=768, dtype=FP8_DTYPE, tokens=(17, 5)),
    _case(2, hidden=16896, dtype=FP8_DTYPE, tokens=(3, 2)),
    _case(4, num_experts=16, hidden=512, dtype=FP8_DTYPE, tokens=(64, 17, 1, 0), topk=8),
    # MXFP8's 1x32 E8M0 scales: the same bytes a row as 1x128 fp32 ones (fp8.wire_scales)
    _case(3, hidden=128, dtype=FP8_DTYPE, tokens=(17, 64, 0), pad_multiple=16, scale_format="mxfp8"),
    _case(2, hidden=16896, dtype=FP8_DTYPE, tokens=(3, 2), scale_format="mxfp8"),
    # the reducers' straight block for the widest segments, its last vector clamped: 7 whole
    # vectors a thread (H = 7168, with weights) and 7 or 8 (H = 7200: the last round partial)
    _case(2, hidden=7168, apply_probs=True, tokens=(5, 3)),
    _case(2, hidden=7200, tokens=(3, 2)),
    # rows longer than one FIFO stage (48 KiB: two segments per row)
    _case(2, hidden=12288, dtype=torch.float32, tokens=(3, 2)),
    # routing shapes: dropped routes, one hot expert, skew
    _case(4, num_experts=16, drop_fraction=0.3, topk=8, tokens=(64, 17, 0, 33)),
    _case(4, routing="one-expert", tokens=(33,) * 4),
    _case(3, routing="one-expert", topk=1, tokens=(64, 64, 64)),
    _case(4, routing="zipf", num_experts=32, topk=8, tokens=(64, 63, 1, 0)),
    # padding and minimum rows per expert
    _case(4, pad_multiple=16, tokens=(17, 0, 3, 40)),
    _case(2, num_experts=8, hidden=128, pad_multiple=16, min_rows_per_expert=16, tokens=(5, 0)),
    _case(4, num_experts=32, min_rows_per_expert=8, tokens=(5, 0, 1, 2)),
    _case(4, num_experts=16, apply_probs=True, topk=8, dtype=torch.float32, tokens=(64, 17, 0, 5)),
    # combine's wire: fp32 partials for bf16 / fp16 rows (the default is the rows' dtype)
    _case(4, num_experts=16, topk=8, tokens=(64, 17, 0, 33), wire_dtype=torch.float32),
    _case(3, dtype=torch.float16, apply_probs=True, tokens=(17, 64, 5), wire_dtype=torch.float32),
    # static size: overflow (drops counted), larger (trailing zero rows), zero, fp8 overflow
    _case(4, num_experts=16, num_out_tokens=10, topk=8, tokens=(64, 17, 0, 5)),
    _case(3, num_out_tokens=200, pad_multiple=16, tokens=(64, 17, 0)),
    _case(2, num_out_tokens=0, tokens=(8, 8)),
    _case(4, num_experts=16, num_out_tokens=37, dtype=FP8_DTYPE, topk=8, tokens=(64, 17, 1, 0)),
    _case(4, num_experts=16, num_out_tokens=37, hidden=512, dtype=FP8_DTYPE, topk=8, tokens=(64, 17, 1, 0)),
    _case(4, num_experts=16, num_out_tokens=37, hidden=512, dtype=FP8_DTYPE, topk=8, tokens=(64, 17, 1, 0),
          scale_format="mxfp8"),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_kernels_match_the_oracle(case, seed, path):
    model.set_seed(seed)
    case = dataclasses.replace(case, seed=seed)
    check_emulated(group_for(case, path=path), case)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_the_receive_path_on_two_slot_rings(case):
    """Every case with the combine's rings at their fewest slots (ring_chunks=2): a source of
    more than 64 tokens turns each ring over, its expert hosts waiting for its credits."""
    model.set_seed(2)
    group = _cached(case, num_sms_dispatch=MODEL_SMS, num_sms_combine=MODEL_SMS, data_path="receive", ring_chunks=2)
    check_emulated(group, dataclasses.replace(case, seed=2))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("sms", [1, 3, 8])
def test_sm_count_per_call_gives_the_oracle_result(sms, path):
    case = _case(4, num_experts=16, topk=8, tokens=(64, 17, 0, 33))
    group = group_for(case, path=path)
    model.set_seed(sms)
    check_emulated(group, case, num_sms=sms)


@pytest.mark.parametrize("path", PATHS)
def test_twenty_four_calls_on_one_buffer(path):
    """Monotonic flags and flow control across calls: one buffer, other routings, token
    counts and dtypes every call, no reset in between."""
    first = _case(3, tokens=(64, 17, 0))
    group = group_for(first, path=path)
    dtypes = (torch.bfloat16, torch.float32, FP8_DTYPE, torch.float16)
    for call in range(24):
        case = _case(3, seed=call, dtype=dtypes[call % 4], topk=1 + call % 2,
                     tokens=(64, (17 * call) % 65, call % 3), drop_fraction=0.25 * (call % 2))
        assert buffer_key(case) == buffer_key(first)
        model.set_seed(call)
        check_emulated(group, case)
    assert group_for(first, path=path) is group


def test_missing_rank_times_out_in_dispatch_naming_rank_peer_phase_and_call(monkeypatch):
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    group = EmulatedGroup(4, 256, 64, 8, num_sms_dispatch=2, num_sms_combine=2, device="cpu")
    try:
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(16, 256, generator=gen).to(torch.bfloat16) for _ in range(4)]
        idx = [torch.randint(0, 8, (16, 1), generator=gen) for _ in range(4)]
        with ranks_absent(group, {3}):
            group.dispatch(xs, idx, num_out_tokens=64)
        with pytest.raises(RuntimeError, match=r"rank [012] gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for "
                                               r"peer rank 3 in dispatch count exchange \(call 1,"):
            group.synchronize()
        with pytest.raises(RuntimeError, match="can not be used after this error"):
            group.dispatch(xs, idx, num_out_tokens=64)
    finally:
        group.close()


# What a rank that never arrives leaves its peers waiting for, on each path.
MISSING_PHASE = {
    "combine": {"receive": "combine partial sums", "direct": r"the direct path \(waiting for the peer to publish"},
    "dispatch": {"receive": "dispatch rows", "direct": r"the direct path \(waiting for the peer to publish"},
}


@pytest.mark.parametrize("path", PATHS)
def test_missing_rank_in_combine_times_out_naming_it(monkeypatch, path):
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    case = _case(3, tokens=(17, 9, 4))
    group = EmulatedGroup(3, 256, 17, 6, num_sms_dispatch=2, num_sms_combine=2, device="cpu", data_path=path)
    try:
        xs, idx, weights, _ = on_device(make_rank_inputs(case), "cpu")
        res = group.dispatch(xs, idx, weights)
        group.synchronize()
        outs = [r.tokens.clone() for r in res]
        with ranks_absent(group, {2}):
            group.combine(outs, [r.handle for r in res])
        with pytest.raises(RuntimeError, match=rf"rank [01] gave up .* waiting for peer rank 2 in "
                                               rf"{MISSING_PHASE['combine'][path]}.* \(call 1,"):
            group.synchronize()
    finally:
        group.close()


def _direct_dispatch_with_a_stall(key: int) -> tuple[str, float]:
    """Rank 1's 64 tokens all go to rank 0's experts (rank 0 has none), direct path, one SM per
    rank (rank r's block is block r); the direct dispatch runs with the hold `key`
    (model.hold_at). Returns the error the group raised and the virtual time the call took.
    One launch runs every rank here, so a wait on another rank that is missing or passes too
    early shows only when that rank is stalled."""
    group = EmulatedGroup(2, 256, 64, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu", data_path="direct")
    try:
        xs = [torch.zeros(0, 256, dtype=torch.bfloat16), torch.randn(64, 256).to(torch.bfloat16)]
        idx = [torch.zeros(0, 2, dtype=torch.int64), torch.tensor([[0, 1]] * 64)]
        model.hold_at(key, "dispatch_direct")
        before = model.stats()["virtual_ns"]
        res = group.dispatch(xs, idx, num_out_tokens=128)
        took_s = (model.stats()["virtual_ns"] - before) / 1e9
        assert res[0].handle.data_path == "direct"
        with pytest.raises(RuntimeError) as err:
            group.synchronize()
        return str(err.value), took_s
    finally:
        group.close()


def test_a_destination_waits_for_its_direct_writers(monkeypatch):
    """The direct dispatch's completion count: a rank's kernel ends only once every source has
    written its rows of the call. With rank 1's bulk stores stalled, rank 0 gives up after
    HYBRID_EP_TIMEOUT_S naming rank 1, and not before (a count of the previous call
    passes at once: scripts/model_mutations.py, direct-done-of-the-previous-call)."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    message, took_s = _direct_dispatch_with_a_stall(model.STORES_OF_BLOCK + 1)
    assert re.search(r"rank 0 gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for peer rank 1 in the direct "
                     r"path's dispatch \(waiting for the peer to finish writing this rank's rows\) \(call 1,",
                     message), message
    assert 1.0 <= took_s < 2.0, took_s


def test_a_source_waits_for_a_late_destination_to_publish(monkeypatch):
    """A source writes a destination's rows only where the destination published them for this
    call: with rank 0's block starting late, rank 1 gives up after HYBRID_EP_TIMEOUT_S naming
    rank 0 (tensors published by the previous call would pass at once:
    direct-tensors-of-the-previous-call)."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    message, took_s = _direct_dispatch_with_a_stall(model.START_OF_BLOCK + 0)
    assert re.search(r"rank 1 gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for peer rank 0 in the direct path "
                     r"\(waiting for the peer to publish its tensors of the call\) \(call 1,", message), message
    assert 1.0 <= took_s < 2.0, took_s


@pytest.mark.parametrize("size", ["dynamic", "static"])
@pytest.mark.parametrize("ranks_per_node", [2, 1], ids=["one-node", "two-nodes"])
def test_a_call_waits_for_its_peers_to_finish_the_previous_one(monkeypatch, ranks_per_node, size):
    """Flow control, the count kernel's peers warp: a call overwrites a peer's count row (and, in
    the dispatch kernel, its receive rows) only once that peer is done with the previous call.
    With the words of call 1 taken back to 0, as if the peer still read that call (on one node
    rank 1's done flag, which both ranks wait on; across nodes each rank's RDMA done word of the
    other, so that no rank waits for a count row instead), call 2 gives up after
    HYBRID_EP_TIMEOUT_S in the flow control's phase, and not before: the tally warps count
    meanwhile and the whole block returns (a peers warp that skips its wait passes at once:
    scripts/model_mutations.py, count-peers-skip-flow-control). With a dynamic size the host's
    read raises and no dispatch kernel runs; with a static one the dispatch kernel runs in the
    aborted launch and must return without publishing or reading tensors (the race check showed
    a peer's read of them racing with their publish when it did)."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    group = EmulatedGroup(2, 128, 64, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu",
                          ranks_per_node=ranks_per_node)
    try:
        xs = [torch.randn(64, 128).to(torch.bfloat16) for _ in range(2)]
        idx = [torch.tensor([[0, 3]] * 64) for _ in range(2)]
        group.dispatch(xs, idx, num_out_tokens=128)
        group.synchronize()
        if ranks_per_node == 2:
            words, phase = [group.buffers._owned[1][0] + registered_layout(group.config).done_dispatch], "dispatch flow"
        else:  # rank r's region holds the other node's word at 8 * node
            done_dispatch = rdma_layout(group.config).done_dispatch
            words = [group.rdma._owned[r][0] + done_dispatch + 8 * (1 - r) for r in range(2)]
            phase = "inter-node flow"
        for word in words:
            done = ctypes.c_uint64.from_address(word)
            assert done.value == 1  # the peer finished call 1
            done.value = 0
        before = model.stats()["virtual_ns"]
        with pytest.raises(RuntimeError) as err:
            group.dispatch(xs, idx, num_out_tokens=None if size == "dynamic" else 128)
            group.synchronize()
        took_s = (model.stats()["virtual_ns"] - before) / 1e9
    finally:
        group.close()
    peer = "rank 1" if ranks_per_node == 2 else "rank [01] on node [01]"
    assert re.search(rf"rank [01] gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for peer {peer} in {phase} "
                     rf"control .*\(call 2, expected 1, saw 0\)", str(err.value)), str(err.value)
    assert 1.0 <= took_s < 2.0, took_s


def test_a_stalled_store_warp_is_named_by_the_ring_it_starves(monkeypatch):
    """One rank, no peer to wait for: with the direct dispatch's bulk stores held, its rings fill
    and the warps that fill them wait for a free stage until twice HYBRID_EP_TIMEOUT_S; the
    record names the ring, the side (a free stage) and what stopped freeing it, the store warps,
    not "a bulk copy never completed"."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    group = EmulatedGroup(1, 256, 1024, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu", data_path="direct")
    try:
        x = torch.randn(1024, 256).to(torch.bfloat16)
        model.hold_at(model.STORES_OF_BLOCK + 0, "dispatch_direct")
        before = model.stats()["virtual_ns"]
        res = group.dispatch([x], [torch.tensor([[0, 1]] * 1024)], num_out_tokens=2048)
        took_s = (model.stats()["virtual_ns"] - before) / 1e9
        assert res[0].handle.data_path == "direct"
        with pytest.raises(RuntimeError) as err:
            group.synchronize()
    finally:
        group.close()
    assert re.search(r"rank 0 gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting in its shared-memory pipeline for a "
                     r"free stage of the direct dispatch's (FIFO|route-table ring) \(call 1\): the store warps",
                     str(err.value)), str(err.value)
    assert 2.0 <= took_s < 3.0, took_s


def test_routing_errors_are_reported_by_the_kernel():
    group = EmulatedGroup(2, 256, 8, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu")
    try:
        xs = [torch.ones(2, 256, dtype=torch.bfloat16) for _ in range(2)]
        idx = [torch.tensor([[0], [1]]), torch.tensor([[2], [9]])]
        group.dispatch(xs, idx, num_out_tokens=8)
        with pytest.raises(RoutingError, match=re.escape("topk_idx values must be in [-1, 3] (num_experts=4), got 9 "
                                                         "at token 1 on rank 1") + "$"):
            group.synchronize()
    finally:
        group.close()
    group = EmulatedGroup(2, 256, 8, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu")
    try:
        idx = [torch.tensor([[0, 1], [3, 3]]), torch.tensor([[2, 1], [0, 2]])]
        group.dispatch([torch.ones(2, 256, dtype=torch.bfloat16)] * 2, idx, num_out_tokens=8)
        with pytest.raises(RoutingError, match="topk_idx routes token 1 to the same expert twice on rank 0: expert 3$"):
            group.synchronize()
    finally:
        group.close()


def test_fp8_redispatch_needs_its_scales():
    case = _case(2, dtype=FP8_DTYPE, tokens=(9, 4))
    group = group_for(case)
    res = check_emulated(group, case)
    xs, _, _, _ = on_device(make_rank_inputs(case), "cpu")
    with pytest.raises(ValueError, match="scales"):
        group.redispatch(xs, [r.handle for r in res])


def test_combine_of_a_misaligned_view():
    """expert_out starting 2 bytes past a 16-byte boundary is copied before the kernel's
    16-byte loads (the model would stop a misaligned bulk copy)."""
    case = _case(2, tokens=(17, 5))
    group = group_for(case)
    inputs = make_rank_inputs(case)
    xs, idx, weights, _ = on_device(inputs, "cpu")
    res = group.dispatch(xs, idx, weights)
    gen = torch.Generator().manual_seed(3)
    outs = []
    for r in res:
        R, H = r.tokens.shape
        view = torch.randn(R * H + 1, generator=gen).to(torch.bfloat16)[1:].view(R, H)
        assert view.data_ptr() % 16 != 0
        outs.append(view)
    ys = group.combine(outs, [r.handle for r in res])
    group.synchronize()
    run = dispatch_oracle(group.config, xs, idx, weights)
    want_y, magnitude = combine_oracle(group.config, run, outs, idx)
    for r in range(2):
        assert_combine_close(ys[r], want_y[r], magnitude[r], case.topk, f"rank {r}")


def test_autograd_through_dispatch_and_combine():
    case = _case(4, num_experts=8, topk=4, hidden=128, dtype=torch.float32, tokens=(33, 0, 17, 5),
                 drop_fraction=0.2)
    check_emulated_autograd(group_for(case), case)


def test_the_gpu_scripts_check_runs_on_the_model(capsys):
    """The runner that compute-sanitizer wraps on a GPU, here on the model."""
    assert emulated_check_main(["--device", "cpu", "--preset", "small", "--calls", "2"]) == 0
    assert capsys.readouterr().out.count("matches the oracle") == 6


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_peer_lost_between_layout_and_dispatch_aborts_cleanly(monkeypatch, seed, path):
    """Rank 2 exchanges counts, then never runs its dispatch kernel: every other rank gives up
    in the middle of its pipeline (rows from rank 2 never come). The model checks that each
    block leaves together (warp-uniform decisions) and only after its bulk loads landed and its
    bulk stores read their shared memory; the error names rank 2 and the phase."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    model.set_seed(seed)
    case = _case(3, hidden=2048, tokens=(64, 40, 64), topk=2)
    group = EmulatedGroup(3, 2048, 64, 6, num_sms_dispatch=2, num_sms_combine=2, device="cpu", data_path=path)
    try:
        xs, idx, weights, _ = on_device(make_rank_inputs(case), "cpu")
        with ranks_absent(group, after_count={2}):
            group.dispatch(xs, idx, weights, num_out_tokens=256)
        with pytest.raises(RuntimeError, match=rf"rank [01] gave up after 1 s .* waiting for peer rank 2 in "
                                               rf"{MISSING_PHASE['dispatch'][path]}.* \(call 1,"):
            group.synchronize()
    finally:
        group.close()


# The kernel names fault injection goes by (each launcher names its kernel).
KERNEL_NAMES = {"dispatch": {"receive": "dispatch_receive", "direct": "dispatch_direct"},
                "combine": {"receive": "combine_receive", "direct": "combine_direct"}}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kernel", ["dispatch", "combine"])
def test_an_abort_at_any_point_leaves_every_block_cleanly(kernel, path):
    """The launch's abort flag raised at one scheduling round after another, as a failing
    peer would: whatever each block was doing, it must leave with its warps together, after
    its bulk loads landed and its bulk stores read their shared memory (the model stops the
    launch otherwise), and the next call must refuse the buffer only if an error was
    recorded (an injected abort records none). The injections must fire: the first always
    (every launch has a first round), and at least a quarter of them (the measured rounds
    include the count kernel's, and each run has its own schedule)."""
    case = _case(2, hidden=2048, tokens=(64, 48), topk=2)
    xs, idx, weights, _ = on_device(make_rank_inputs(case), "cpu")
    # How many scheduling rounds the launch takes undisturbed, then aborts spread over them.
    group = EmulatedGroup(2, 2048, 64, 4, num_sms_dispatch=2, num_sms_combine=2, device="cpu", data_path=path)
    res = group.dispatch(xs, idx, weights)
    before = model.stats()["rounds"]
    if kernel == "dispatch":
        group.dispatch(xs, idx, weights)
    else:
        group.combine([r.tokens for r in res], [r.handle for r in res])
    rounds = model.stats()["rounds"] - before
    group.close()
    assert rounds >= 3
    name = KERNEL_NAMES[kernel][path]
    injected = sorted({1 + i * rounds // 40 for i in range(40)})
    fired = []
    for round_ in injected:
        group = EmulatedGroup(2, 2048, 64, 4, num_sms_dispatch=2, num_sms_combine=2, device="cpu", data_path=path)
        try:
            model.set_seed(round_)
            if kernel == "dispatch":
                model.inject_abort(group.engine.abort.data_ptr(), round_, name)
                group.dispatch(xs, idx, weights)
            else:
                res = group.dispatch(xs, idx, weights)
                model.inject_abort(group.engine.abort.data_ptr(), round_, name)
                group.combine([r.tokens for r in res], [r.handle for r in res])
            group.synchronize()  # raises if the model found a defect on the way out
            fired.append(int(group.engine.abort.item()) == 1)
        finally:
            group.close()
    assert fired[0] and 4 * sum(fired) >= len(fired), f"{sum(fired)} of {len(fired)} injected aborts fired"


def test_interleaved_calls_on_two_handles():
    """As with recomputation in training: two dispatches, then the combines in reverse order.
    A combine reads only its own handle's layout, so the second dispatch must not disturb
    the first one's combine."""
    case_a = _case(3, tokens=(64, 17, 5), seed=1)
    case_b = dataclasses.replace(case_a, seed=2, tokens=(9, 64, 33), topk=1)
    group = group_for(case_a)
    model.set_seed(5)
    inputs = [make_rank_inputs(c) for c in (case_a, case_b)]
    dispatched = []
    for inp in inputs:
        xs, idx, weights, _ = on_device(inp, "cpu")
        dispatched.append((group.dispatch(xs, idx, weights), xs, idx, weights))
    gen = torch.Generator().manual_seed(11)
    outs = [[torch.randn(r.tokens.shape, generator=gen).to(torch.bfloat16) for r in res] for res, *_ in dispatched]
    ys = {}
    for which in (1, 0):
        ys[which] = group.combine(outs[which], [r.handle for r in dispatched[which][0]])
    group.synchronize()
    for which, case in ((0, case_a), (1, case_b)):
        res, xs, idx, weights = dispatched[which]
        run = dispatch_oracle(group.config, xs, idx, weights)
        want_y, magnitude = combine_oracle(group.config, run, outs[which], idx)
        for r in range(3):
            assert_combine_close(ys[which][r], want_y[r], magnitude[r], case.topk, f"handle {which} rank {r}")


def test_a_pipeline_timeout_names_the_ring_the_side_and_the_call():
    """A stage of the block's own rings that never completes depends on no other rank: the
    record names no peer (-1) but the ring (site) and the barrier it waited on (observed: 0 for
    data, 1 for a free stage), and the message names what stopped: the ring's producer or its
    consumer."""
    group = EmulatedGroup(2, 256, 8, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu")
    try:
        record = {"phase": group.ext.PHASES["pipeline"], "rank": 1, "peer": -1, "call": 5, "expected": 0}
        data = group.engine._describe({**record, "site": group.ext.PIPE_SITES["send_fifo"], "observed": 0})
        assert data.startswith("hybrid_ep cuda backend: rank 1 gave up after")
        assert ("waiting in its shared-memory pipeline for data in the dispatch's send FIFO (call 5): the bulk "
                "loads of this rank's token rows stopped making progress") in data, data
        free = group.engine._describe({**record, "site": group.ext.PIPE_SITES["direct_combine_routes"], "observed": 1})
        assert ("waiting in its shared-memory pipeline for a free stage of the direct combine's route ring "
                "(call 5): the reducers stopped making progress") in free, free
        assert "peer rank" not in data + free
    finally:
        group.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_bf16_wire_rounds_once_per_hop_within_the_oracle_bound(path):
    """The same combine over a bf16 wire and an fp32 wire. On the receive path the bf16
    partials are rounded on their hop, so the results differ, each within its own bound, and
    the bf16 wire's result falls outside the fp32 wire's bound somewhere (the hop's term is
    needed, not slack). On the direct path no partial crosses a link: both are the fp32 sum
    rounded once, bit for bit."""
    case = _case(4, num_experts=8, topk=4, hidden=2048, tokens=(64, 64, 64, 64), seed=3)
    group = group_for(case, path=path)
    model.set_seed(3)
    xs, idx, weights, _ = on_device(make_rank_inputs(case), "cpu")
    res = group.dispatch(xs, idx, weights)
    gen = torch.Generator().manual_seed(9)
    outs = [torch.randn(r.tokens.shape, generator=gen).to(torch.bfloat16) for r in res]
    handles = [r.handle for r in res]
    y_bf16 = group.combine(outs, handles)
    y_fp32 = group.combine(outs, handles, wire_dtype=torch.float32)
    group.synchronize()
    run = dispatch_oracle(group.config, xs, idx, weights)
    want_y, magnitude = combine_oracle(group.config, run, outs, idx)
    outside_fp32_bound = 0
    for r in range(4):
        assert_combine_close(y_bf16[r], want_y[r], magnitude[r], case.topk, f"bf16 wire rank {r}")
        assert_combine_close(y_fp32[r], want_y[r], magnitude[r], case.topk, f"fp32 wire rank {r}", torch.float32)
        tol32 = combine_tolerance(want_y[r], magnitude[r], torch.bfloat16, case.topk, torch.float32)
        outside_fp32_bound += int(((y_bf16[r].double() - want_y[r]).abs() > tol32).sum())
    if path == "direct":
        assert all(torch.equal(a, b) for a, b in zip(y_bf16, y_fp32))
        assert outside_fp32_bound == 0
    else:
        assert not all(torch.equal(a, b) for a, b in zip(y_bf16, y_fp32))
        assert outside_fp32_bound > 0


def test_small_rows_are_batched_in_one_stage():
    """256-byte rows: 32 to a stage, so a chunk's rows move in one bulk copy per FIFO stage;
    chunks of 17 and 33 rows leave partial stages."""
    shape = launch.fifo_shape(128 * 2, model.device_properties(0)[1], pipelines=launch.DISPATCH_PIPELINES)
    assert shape.rows_per_stage == 32
    case = _case(3, hidden=128, tokens=(64, 17, 33), topk=2)
    for seed in (0, 1):
        model.set_seed(seed)
        check_emulated(group_for(case), dataclasses.replace(case, seed=seed))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("groups", ["0", "1", "7"])
def test_every_store_queue_depth_gives_the_oracle_result(monkeypatch, groups, path):
    """The stores' queue (HYBRID_EP_STORE_GROUPS) only changes when stages are released: none
    held (0), the default's one, and the most the ring allows (7, cut to stages - 1, or to
    (stages - 1) / 2 for the direct dispatch's two store threads). Rows of
    two segments and small batched rows, so every ring wraps several times. Every kernel with
    a store queue: the receive path's dispatch and combine, the direct path's dispatch."""
    monkeypatch.setenv(launch.STORE_GROUPS_ENV, groups)
    for case in (_case(2, hidden=12288, dtype=torch.float32, tokens=(9, 4)),
                 _case(3, hidden=128, tokens=(64, 17, 33), topk=2)):
        group = emulated_group_for(case, "cpu", num_sms_dispatch=1, num_sms_combine=1, data_path=path)
        try:
            for seed in SEEDS:
                model.set_seed(seed)
                check_emulated(group, dataclasses.replace(case, seed=seed))
            kinds = {key[0]: a for key, a in group.engine._launch_cache.items()}
            if path == "receive":
                receive_dispatch, receive_combine = kinds["dispatch_receive"], kinds["combine_receive"]
                assert receive_dispatch.store_groups == min(int(groups), receive_dispatch.fifo_stages - 1)
                assert receive_combine.store_groups == min(int(groups), receive_combine.host_out_stages - 1)
            else:
                direct = kinds["dispatch_direct"]
                assert direct.store_groups == min(int(groups), (direct.fifo_stages - 1) // 2)  # two store threads
                assert set(kinds) == {"dispatch_direct", "combine_direct"}
        finally:
            group.close()


def _direct_combines_checked(case):
    """The LaunchArgs of every direct combine a group of `case` launched, the oracle matched
    under each seed of SEEDS (direct path, 1 SM per rank)."""
    group = emulated_group_for(case, "cpu", num_sms_dispatch=1, num_sms_combine=1, data_path="direct")
    try:
        for seed in SEEDS:
            model.set_seed(seed)
            check_emulated(group, dataclasses.replace(case, seed=seed))
        return [a for key, a in group.engine._launch_cache.items() if key[0] == "combine_direct"]
    finally:
        group.close()


def _set_knobs(monkeypatch, knobs):
    for name, value in knobs:
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("stages, wait, warps", [("2", None, None), ("3", None, None), (None, "elect", None),
                                                 ("2", "elect", None), (None, None, "8"), ("3", "elect", "8"),
                                                 (None, "converged", None), ("2", "converged", "8")])
def test_the_direct_combine_variants_give_the_oracle_result(monkeypatch, stages, wait, warps, nodes):
    """The direct combine's measurement knobs (the lease's sweep): HYBRID_EP_DIRECT_COMBINE_STAGES cuts its
    rings to a few stages per pipeline, the fewest (2) and an odd count, so each ring wraps many
    times per token, with node partials in the stages across nodes; HYBRID_EP_REDUCER_WAIT=elect
    leaves the other lanes' observation of each stage to the agreement's __syncwarp, =converged has
    every lane wait for it itself;
    HYBRID_EP_REDUCER_WARPS=8 spreads each segment over 8 reducer warps (a vector a thread here:
    the bounded loop). Every launch takes what was asked."""
    _set_knobs(monkeypatch, ((launch.DIRECT_COMBINE_STAGES_ENV, stages), (launch.REDUCER_WAIT_ENV, wait),
                             (launch.REDUCER_WARPS_ENV, warps)))
    combines = _direct_combines_checked(_case(4, hidden=2048, tokens=(9, 0, 17, 4), topk=3, ranks_per_node=4 // nodes))
    assert combines
    for a in combines:
        assert stages is None or a.src_stages == int(stages)
        assert a.reducer_wait == launch.REDUCER_WAITS[wait or "observe"]
        assert a.reducer_warps == int(warps or launch.REDUCER_WARPS_NARROW)


# Each combination the GPU lease times (helpers.LEASE_COMBINE_VARIANTS) takes about 40 s on the
# model: CI runs the first (token stages, the named hand-off, 8 warps), --full every one.
LEASE_VARIANTS = [LEASE_COMBINE_VARIANTS[0]] + [pytest.param(*v, marks=pytest.mark.slow)
                                                 for v in LEASE_COMBINE_VARIANTS[1:]]
# What each combination meets: odd token counts and a rank without tokens; routes clipped by
# num_out_tokens with an fp8 dispatch at top-8; rows of 7168 columns (token stages of 2048, 2048,
# 2048, 1024 columns at top-3) with routing weights applied and, across nodes, an fp32 wire.
LEASE_COMBINE_CASES = {
    "odd tokens": _case(4, hidden=2048, tokens=(9, 0, 17, 4), topk=3),
    "clipped fp8 top-8": _case(4, num_experts=16, num_out_tokens=37, hidden=512, dtype=FP8_DTYPE, topk=8,
                               tokens=(33, 17, 1, 0)),
    "7168 weighted": _case(4, hidden=7168, tokens=(5, 0, 9, 3), topk=3, apply_probs=True,
                           wire_dtype=torch.float32),
}


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("stage, wait, warps", LEASE_VARIANTS)
def test_every_combination_the_lease_times_gives_the_oracle_result(monkeypatch, stage, wait, warps, nodes):
    """Each knob combination of the direct combine the GPU lease times, not only each knob alone:
    route or token stages, every hand-off (observe, converged, elect, one waiter and a named
    barrier per reducer group), 4 or 8 reducer warps, one node and two, under both seeds, on each
    case of LEASE_COMBINE_CASES. Every launch takes what was asked; a token stage holds 32 KiB."""
    _set_knobs(monkeypatch, ((launch.DIRECT_COMBINE_STAGES_ENV, None), (launch.COMBINE_STAGE_ENV, stage),
                             (launch.REDUCER_WAIT_ENV, wait), (launch.REDUCER_WARPS_ENV, warps)))
    for name, base in LEASE_COMBINE_CASES.items():
        combines = _direct_combines_checked(dataclasses.replace(base, ranks_per_node=4 // nodes))
        assert combines, name
        for a in combines:
            assert a.combine_stage == launch.COMBINE_STAGES[stage]
            assert a.reducer_wait == launch.REDUCER_WAITS[wait or "observe"]
            assert a.reducer_warps == int(warps or launch.REDUCER_WARPS_NARROW)
            assert stage == "route" or a.src_stage_bytes == launch.TOKEN_STAGE_BYTES


def _one_source_dispatch(monkeypatch, runs: str, expert_of) -> tuple[list[torch.Tensor], int]:
    """Rank 0's 64 tokens of 128 bf16 columns (32 rows to a FIFO stage) dispatched at top-1 to
    experts expert_of(t) of 2 ranks (one each), direct path, with HYBRID_EP_STORE_RUNS=runs:
    each rank's received rows and the bulk copies the call made."""
    monkeypatch.setenv(launch.STORE_RUNS_ENV, runs)
    group = EmulatedGroup(2, 128, 64, 2, num_sms_dispatch=1, num_sms_combine=1, device="cpu", data_path="direct")
    try:
        gen = torch.Generator().manual_seed(5)
        xs = [torch.randn(64, 128, generator=gen).to(torch.bfloat16), torch.zeros(0, 128, dtype=torch.bfloat16)]
        idx = [torch.tensor([[expert_of(t)] for t in range(64)]), torch.zeros(0, 1, dtype=torch.int64)]
        model.set_seed(0)
        before = model.stats()["copies"]
        res = group.dispatch(xs, idx)
        group.synchronize()
        return [r.tokens.clone() for r in res], model.stats()["copies"] - before
    finally:
        group.close()


def test_store_runs_merge_exactly_the_rows_that_follow_each_other(monkeypatch):
    """A run is a stage's consecutive rows bound for consecutive rows of one rank, and nothing
    else: tokens alternating between the two ranks' experts (consecutive rows there, but not
    consecutive in a stage) take a store each, as without runs; tokens all to one expert take one
    store per stage of 32 rows, 62 fewer for 64 tokens. The received rows are the same."""
    alternate = [_one_source_dispatch(monkeypatch, runs, lambda t: t % 2) for runs in ("0", "1")]
    assert alternate[1][1] == alternate[0][1]
    one = [_one_source_dispatch(monkeypatch, runs, lambda t: 1) for runs in ("0", "1")]
    assert one[0][1] - one[1][1] == 64 - 2
    for (rows0, _), (rows1, _) in (alternate, one):
        assert all(torch.equal(a, b) for a, b in zip(rows0, rows1))


@pytest.mark.parametrize("nodes", [1, 2])
def test_store_runs_give_the_oracle_result_in_fewer_stores(monkeypatch, nodes):
    """HYBRID_EP_STORE_RUNS=1: the direct dispatch stores a stage's consecutive rows bound for
    consecutive rows of one rank as one bulk store. fp8 rows of 8 KiB (two to a stage) and bf16
    rows of 256 bytes (32 to a stage) to few experts, so runs are common; routes clipped by
    num_out_tokens end a run where the rows end. The same results as a row a store, in fewer
    bulk copies (the model counts them: stats()["copies"])."""
    cases = (_case(4, num_experts=4, hidden=8192, dtype=FP8_DTYPE, topk=2, tokens=(17, 5, 0, 9)),
             _case(4, num_experts=4, hidden=128, topk=2, num_out_tokens=21, tokens=(64, 17, 0, 33)))
    copies = {}  # (runs, case) -> bulk copies of the call
    for runs in ("0", "1"):
        _set_knobs(monkeypatch, ((launch.STORE_RUNS_ENV, runs),))
        for i, base in enumerate(cases):
            case = dataclasses.replace(base, ranks_per_node=4 // nodes)
            group = emulated_group_for(case, "cpu", num_sms_dispatch=1, num_sms_combine=1, data_path="direct")
            try:
                model.set_seed(0)
                before = model.stats()["copies"]
                check_emulated(group, case)
                copies[runs, i] = model.stats()["copies"] - before
                [a] = [a for key, a in group.engine._launch_cache.items() if key[0] == "dispatch_direct"]
                assert a.store_runs == int(runs)
            finally:
                group.close()
    for i in range(len(cases)):  # each case merges rows: fp8's two a stage as bf16's 32
        assert copies["1", i] < copies["0", i], (i, copies)


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("hidden, dtype, wire, probs", [(7168, torch.bfloat16, None, False),
                                                        (8192, torch.float32, None, False),
                                                        (6144, torch.bfloat16, torch.float32, True)])
def test_eight_reducer_warps_add_the_widest_segments(monkeypatch, hidden, dtype, wire, probs, nodes):
    """HYBRID_EP_REDUCER_WARPS=8 at the segments its straight block adds (every vector of a
    thread but the last whole: 6144 to 8192 bf16 columns at 8 warps): 7168 clamps the last vector
    of half the threads, 6144 fills exactly 3 of the 4 (one node: each row one segment); fp32
    stages hold 4096 columns, 4 of a thread's 8 vectors of 4 columns; weighted parts
    (apply_probs), and across nodes an fp32 wire adds node partials of another dtype (add_from)."""
    _set_knobs(monkeypatch, ((launch.DIRECT_COMBINE_STAGES_ENV, None), (launch.REDUCER_WAIT_ENV, None),
                             (launch.REDUCER_WARPS_ENV, "8")))
    case = _case(4, hidden=hidden, dtype=dtype, tokens=(5, 0, 9, 3), topk=3, ranks_per_node=4 // nodes,
                 wire_dtype=wire, apply_probs=probs)
    group = emulated_group_for(case, "cpu", num_sms_dispatch=1, num_sms_combine=1, data_path="direct")
    try:
        model.set_seed(0)
        check_emulated(group, case)
        [a] = [a for key, a in group.engine._launch_cache.items() if key[0] == "combine_direct"]
        assert a.reducer_warps == launch.REDUCER_WARPS_WIDE
        stage_elem = 4 if dtype == torch.float32 or (wire == torch.float32 and nodes > 1) else 2
        assert a.seg_cols == min(hidden, 16384 // stage_elem)  # stages of 16 KiB
    finally:
        group.close()


@pytest.mark.parametrize("stages", [3, 5])
@pytest.mark.parametrize("nodes", [1, 2])
def test_the_direct_dispatch_refuses_an_odd_fifo_stage_count(monkeypatch, stages, nodes):
    """The direct dispatch's two store threads take alternate items of its FIFO. With an odd
    number of stages a stage's rounds alternate between them, and a thread may wait on round
    r + 1 of a stage whose round r (the other thread's) has not landed: a parity wait one phase
    ahead of the barrier passes at once, and the stores read the stage before its load (on
    a217aab: rank 0's rows 238-239 wrong at W = 4 as 2 nodes of 2, H = 2048 fp32, and 1 to 5 of
    100 seeds on one node). The plan keeps the count even (launch.direct_fifo_shape); a plan
    that did not is refused by the kernel's launcher, one node and two, with the reason."""
    monkeypatch.setattr(launch, "direct_fifo_shape",
                        lambda row_bytes, smem: launch.fifo_shape(row_bytes, smem, max_stages=stages))
    case = _case(2, ranks_per_node=2 // nodes, hidden=2048, dtype=torch.float32, tokens=(100, 61))
    group = emulated_group_for(case, "cpu", num_sms_dispatch=1, num_sms_combine=1, data_path="direct")
    try:
        with pytest.raises(RuntimeError, match="fifo_stages must be a multiple of the block's store threads"):
            check_emulated(group, case)
    finally:
        group.close()


def test_the_direct_combine_refuses_a_reducer_warp_count_it_was_not_built_for(monkeypatch):
    """The kernel is instantiated for 4 and 8 reducer warps per pipeline; a plan that asked for
    another count (the variable's check bypassed) is refused by the launcher with the reason,
    not run as one of the two."""
    monkeypatch.setattr(launch, "reducer_warps_override", lambda environ=None: 6)
    _direct_combine_refused(r"reducer_warps must be 4 or 8")


def test_the_direct_combine_refuses_token_stages_bulk_copies_cannot_align_to(monkeypatch):
    """A token stage's parts are bulk-loaded to offsets within it, which must start 16-byte
    aligned: a plan whose stage bytes are not a multiple of 16 is refused by the launcher with
    the reason (the kernel used to take it)."""
    monkeypatch.setattr(launch, "combine_stage_override", lambda environ=None: "token")
    monkeypatch.setattr(launch, "TOKEN_STAGE_BYTES", 32 * 1024 + 8)
    _direct_combine_refused(r"a token stage's bytes must be a multiple of 16")


def _direct_combine_refused(reason: str) -> None:
    """A two-rank call on the direct path whose combine launch the launcher refuses with `reason`."""
    case = _case(2, hidden=2048, tokens=(9, 4))
    group = emulated_group_for(case, "cpu", num_sms_dispatch=1, num_sms_combine=1, data_path="direct")
    try:
        with pytest.raises(RuntimeError, match=reason):
            check_emulated(group, case)
    finally:
        group.close()


def test_wire_dtype_must_be_the_rows_dtype_or_fp32():
    case = _case(2, tokens=(9, 4))
    group = group_for(case)
    res = check_emulated(group, case)
    outs = [r.tokens for r in res]
    with pytest.raises(ValueError, match="wire_dtype must be the dtype of expert_out .bfloat16. or float32, "
                                         "got float16"):
        group.combine(outs, [r.handle for r in res], wire_dtype=torch.float16)
