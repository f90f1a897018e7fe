"""Bad input: a TypeError / ValueError naming the argument, raised before any collective."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import hybrid_ep as hep
from hybrid_ep.fp8 import quantize_fp8

pytestmark = pytest.mark.unit

H, E, T = 128, 4, 6


@pytest.fixture
def buf(single_rank_group):
    return hep.HybridEPBuffer(single_rank_group, H, 16, E, backend="reference")


def _x(n=T, dtype=torch.float32, h=H):
    return torch.randn(n, h).to(dtype)


def _idx(n=T):
    return torch.tensor([[0, 1], [2, 3], [1, -1], [3, 0], [2, 1], [0, 3]], dtype=torch.int64)[:n]


def _w(n=T):
    return torch.full((n, 2), 0.5)


DISPATCH_CASES = [
    # (name, kwargs builder, exception, words the message must contain)
    ("x not a tensor", lambda: dict(x=[[1.0] * H], topk_idx=_idx()), TypeError, "x must be a torch.Tensor"),
    ("x 3-D", lambda: dict(x=torch.zeros(1, T, H), topk_idx=_idx()), ValueError, "x must be [num_tokens, hidden_dim]"),
    ("x int dtype", lambda: dict(x=torch.zeros(T, H, dtype=torch.int32), topk_idx=_idx()), TypeError, "x dtype"),
    ("x wrong hidden", lambda: dict(x=_x(h=64), topk_idx=_idx()), ValueError, "hidden_dim=128"),
    ("too many tokens", lambda: dict(x=_x(17), topk_idx=torch.zeros(17, 1, dtype=torch.int64)), ValueError,
     "max_tokens_per_rank=16"),
    ("x on another device", lambda: dict(x=torch.empty(T, H, device="meta"), topk_idx=_idx()), ValueError,
     "x is on meta"),
    ("topk_idx float", lambda: dict(x=_x(), topk_idx=_idx().float()), TypeError, "topk_idx must be int32 or int64"),
    ("topk_idx 1-D", lambda: dict(x=_x(), topk_idx=_idx()[:, 0]), ValueError, "topk_idx must have 2 dimensions"),
    ("topk_idx rows", lambda: dict(x=_x(), topk_idx=_idx(5)), ValueError, "topk_idx has 5 rows"),
    ("topk_idx >= E", lambda: dict(x=_x(), topk_idx=_idx() + 1), ValueError, "topk_idx values must be in [-1, 3]"),
    ("topk_idx < -1", lambda: dict(x=_x(), topk_idx=_idx() - 2), ValueError, "topk_idx values must be in [-1, 3]"),
    ("topk_idx duplicate", lambda: dict(x=_x(), topk_idx=torch.tensor([[1, 1]] * T)), ValueError,
     "topk_idx routes token 0 to the same expert twice"),
    ("topk_weights shape", lambda: dict(x=_x(), topk_idx=_idx(), topk_weights=torch.ones(T, 3)), ValueError,
     "topk_weights shape"),
    ("topk_weights int", lambda: dict(x=_x(), topk_idx=_idx(), topk_weights=torch.ones(T, 2, dtype=torch.int64)),
     TypeError, "topk_weights must be a floating dtype"),
    ("no routing", lambda: dict(x=_x()), ValueError, "routing is missing"),
    ("two routings", lambda: dict(x=_x(), topk_idx=_idx(), routing_map=torch.zeros(T, E, dtype=torch.bool)),
     ValueError, "not both"),
    ("routing_map dtype", lambda: dict(x=_x(), routing_map=torch.zeros(T, E)), TypeError,
     "routing_map must be torch.bool"),
    ("routing_map shape", lambda: dict(x=_x(), routing_map=torch.zeros(T, E + 1, dtype=torch.bool)), ValueError,
     "routing_map must have shape [num_tokens, num_experts] = [6, 4]"),
    ("probs shape", lambda: dict(x=_x(), routing_map=torch.zeros(T, E, dtype=torch.bool), probs=torch.ones(T, 2)),
     ValueError, "probs shape"),
    ("probs with topk_idx", lambda: dict(x=_x(), topk_idx=_idx(), probs=torch.ones(T, E)), ValueError,
     "probs goes with routing_map"),
    ("topk_weights with routing_map", lambda: dict(x=_x(), routing_map=torch.zeros(T, E, dtype=torch.bool),
                                                   topk_weights=_w()), ValueError, "topk_weights goes with topk_idx"),
    ("fp8 without scales", lambda: dict(x=_x(dtype=torch.float8_e4m3fn), topk_idx=_idx()), ValueError,
     "fp8 x needs scales"),
    ("fp8 scales shape", lambda: dict(x=_x(dtype=torch.float8_e4m3fn), topk_idx=_idx(), scales=torch.ones(T, 2)),
     ValueError, "torch.float32 scales must have shape [6, 1]"),
    ("fp8 mxfp8 scales shape", lambda: dict(x=_x(dtype=torch.float8_e4m3fn), topk_idx=_idx(),
                                            scales=torch.ones(T, 1, dtype=torch.uint8)),
     ValueError, "torch.uint8 scales must have shape [6, 4]"),
    ("fp8 scales dtype", lambda: dict(x=_x(dtype=torch.float8_e4m3fn), topk_idx=_idx(),
                                      scales=torch.ones(T, 1, dtype=torch.bfloat16)), TypeError,
     "scales must be float32 [num_tokens, hidden_dim / 128] (blockwise) or uint8 / float8_e8m0fnu "
     "[num_tokens, hidden_dim / 32] (MXFP8), got torch.bfloat16"),
    ("scales with bf16 x", lambda: dict(x=_x(dtype=torch.bfloat16), topk_idx=_idx(), scales=torch.ones(T, 1)),
     ValueError, "scales are only for float8_e4m3fn x"),
    ("num_out_tokens negative", lambda: dict(x=_x(), topk_idx=_idx(), num_out_tokens=-1), ValueError,
     "num_out_tokens must be >= 0"),
    ("num_out_tokens float", lambda: dict(x=_x(), topk_idx=_idx(), num_out_tokens=4.0), TypeError,
     "num_out_tokens must be an int"),
    ("num_out_tokens past int32", lambda: dict(x=_x(), topk_idx=_idx(), num_out_tokens=2**31), ValueError,
     "num_out_tokens must be at most 2147483647 (output rows are indexed with int32), got 2147483648"),
    # The argument the caller gave, not the buffer's num_sms_dispatch it overrides.
    ("num_sms zero", lambda: dict(x=_x(), topk_idx=_idx(), num_sms=0), ValueError, "num_sms must be >= 1, got 0"),
    ("num_sms float", lambda: dict(x=_x(), topk_idx=_idx(), num_sms=2.0), TypeError, "num_sms must be an int"),
]


@pytest.mark.parametrize("name,make,exc,words", DISPATCH_CASES, ids=[c[0] for c in DISPATCH_CASES])
def test_dispatch_rejects(buf, name, make, exc, words):
    kwargs = make()
    x = kwargs.pop("x")
    with pytest.raises(exc) as info:
        buf.dispatch(x, **kwargs)
    assert words in str(info.value)
    # The autograd version checks the same way.
    with pytest.raises(exc) as info:
        hep.dispatch(buf, x, **kwargs)
    assert words in str(info.value)


def test_fp8_hidden_not_multiple_of_128(single_rank_group):
    buf = hep.HybridEPBuffer(single_rank_group, 100, 8, E, backend="reference")
    x = torch.zeros(2, 100).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="multiple of 128"):
        buf.dispatch(x, torch.zeros(2, 1, dtype=torch.int64), scales=torch.ones(2, 0))


@pytest.fixture
def dispatched(buf):
    return buf.dispatch(_x(), _idx(), _w())


COMBINE_CASES = [
    ("expert_out rows", lambda r: dict(expert_out=torch.zeros(r.tokens.shape[0] + 1, H)), ValueError,
     "expert_out must have shape [rows of the dispatch, hidden_dim]"),
    ("expert_out hidden", lambda r: dict(expert_out=torch.zeros(r.tokens.shape[0], H * 2)), ValueError,
     "expert_out must have shape"),
    ("expert_out fp8", lambda r: dict(expert_out=torch.zeros(r.tokens.shape[0], H).to(torch.float8_e4m3fn)),
     TypeError, "expert_out dtype"),
    ("expert_out not a tensor", lambda r: dict(expert_out=None), TypeError, "expert_out must be a torch.Tensor"),
    ("handle not a handle", lambda r: dict(expert_out=r.tokens, handle="h"), TypeError,
     "handle must be the DispatchHandle"),
    ("apply_probs not bool", lambda r: dict(expert_out=r.tokens, apply_probs=1), TypeError,
     "apply_probs must be a Python bool, got int"),
    ("apply_probs numpy bool", lambda r: dict(expert_out=r.tokens, apply_probs=np.bool_(True)), TypeError,
     "apply_probs must be a Python bool, got numpy.bool"),
    ("wire_dtype bf16", lambda r: dict(expert_out=r.tokens, wire_dtype=torch.bfloat16), ValueError,
     "wire_dtype must be None (the dtype of expert_out) or torch.float32, got torch.bfloat16"),
    ("num_sms zero", lambda r: dict(expert_out=r.tokens, num_sms=0), ValueError, "num_sms must be >= 1, got 0"),
]


@pytest.mark.parametrize("name,make,exc,words", COMBINE_CASES, ids=[c[0] for c in COMBINE_CASES])
def test_combine_rejects(buf, dispatched, name, make, exc, words):
    kwargs = {"handle": dispatched.handle, **make(dispatched)}
    with pytest.raises(exc) as info:
        buf.combine(kwargs.pop("expert_out"), kwargs.pop("handle"), **kwargs)
    assert words in str(info.value)


def test_handle_of_another_buffer(single_rank_group, buf, dispatched):
    other = hep.HybridEPBuffer(single_rank_group, H, 16, E, backend="reference")
    with pytest.raises(ValueError, match="handle was made by another HybridEPBuffer"):
        other.combine(dispatched.tokens, dispatched.handle)
    with pytest.raises(ValueError, match="handle was made by another HybridEPBuffer"):
        other.dispatch(_x(), handle=dispatched.handle)


def test_reused_handle_checks(buf, dispatched):
    with pytest.raises(ValueError, match="pass either handle= or routing"):
        buf.dispatch(_x(), _idx(), handle=dispatched.handle)
    with pytest.raises(ValueError, match="handle was made for 6 tokens but x has 5"):
        buf.dispatch(_x(5), handle=dispatched.handle)
    with pytest.raises(ValueError, match="num_out_tokens=4 differs"):
        buf.dispatch(_x(), handle=dispatched.handle, num_out_tokens=4)


CONSTRUCTOR_CASES = [
    ("hidden_dim 0", dict(hidden_dim=0), ValueError, "hidden_dim must be >= 1"),
    ("hidden_dim float", dict(hidden_dim=128.0), TypeError, "hidden_dim must be an int"),
    ("max_tokens negative", dict(max_tokens_per_rank=-1), ValueError, "max_tokens_per_rank must be >= 0"),
    ("num_experts 0", dict(num_experts=0), ValueError, "num_experts must be >= 1"),
    ("pad_multiple 0", dict(pad_multiple=0), ValueError, "pad_multiple must be >= 1"),
    ("ranks_per_node does not divide", dict(ranks_per_node=2), ValueError,
     "ranks_per_node (2) must divide the EP world size (1)"),
    ("unknown backend", dict(backend="nvshmem"), ValueError, "backend must be one of auto, cuda, reference, got"),
    ("cuda backend missing", dict(backend="cuda"), RuntimeError, "backend='cuda' is not available"),
    ("deepep is no backend", dict(backend="deepep"), ValueError, "backend must be one of auto, cuda, reference, got"),
    ("num_sms_dispatch 0", dict(num_sms_dispatch=0), ValueError, "num_sms_dispatch must be >= 1"),
    ("combine_wire_dtype fp16", dict(combine_wire_dtype=torch.float16), ValueError,
     "combine_wire_dtype must be None (the dtype of expert_out) or torch.float32, got torch.float16"),
    ("ring_dtype fp8", dict(ring_dtype=torch.float8_e4m3fn), ValueError,
     "ring_dtype must be one of torch.float32, torch.bfloat16, torch.float16, got torch.float8_e4m3fn"),
    ("fp32 wire through bf16 rings", dict(ring_dtype=torch.bfloat16, combine_wire_dtype=torch.float32), ValueError,
     "combine_wire_dtype: torch.float32 partial sums are wider than the buffer's rings, sized for torch.bfloat16"),
]


def test_half_rings_refuse_wider_calls_on_every_backend(single_rank_group):
    """The reference backend has no rings, yet refuses what the cuda backend's bf16 rings could not
    carry, by the same words: a run moves to the other backend unchanged."""
    buf = hep.HybridEPBuffer(single_rank_group, H, 16, E, backend="reference", ring_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"x: torch\.float32 rows are wider than the buffer's rings"):
        buf.dispatch(_x(), topk_idx=_idx(), topk_weights=_w())
    res = buf.dispatch(_x(dtype=torch.bfloat16), topk_idx=_idx(), topk_weights=_w())
    with pytest.raises(ValueError, match=r"wire_dtype: torch\.float32 partial sums are wider"):
        buf.combine(res.tokens, res.handle, wire_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"expert_out: torch\.float32 partial sums are wider"):
        buf.combine(res.tokens.float(), res.handle)
    assert buf.combine(res.tokens, res.handle).dtype == torch.bfloat16


@pytest.mark.parametrize("name,kwargs,exc,words", CONSTRUCTOR_CASES, ids=[c[0] for c in CONSTRUCTOR_CASES])
def test_constructor_rejects(single_rank_group, name, kwargs, exc, words):
    args = dict(hidden_dim=H, max_tokens_per_rank=16, num_experts=E)
    args.update(kwargs)
    with pytest.raises(exc) as info:
        hep.HybridEPBuffer(single_rank_group, args.pop("hidden_dim"), args.pop("max_tokens_per_rank"),
                           args.pop("num_experts"), **args)
    assert words in str(info.value)


def test_bad_timeout_env(buf, monkeypatch):
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="HYBRID_EP_TIMEOUT_S must be a number"):
        # A world of one still exchanges counts through the same bounded wait.
        from hybrid_ep.config import timeout_seconds

        timeout_seconds()
    for raw in ("inf", "nan", "0", "-1"):  # no bound, or none at all: refused before any wait
        monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", raw)
        with pytest.raises(ValueError, match="HYBRID_EP_TIMEOUT_S must be a finite number of seconds > 0"):
            timeout_seconds()


def test_group_that_is_not_a_process_group(single_rank_group):
    for group in ("ep", 0):
        with pytest.raises(TypeError, match="group must be a torch.distributed ProcessGroup or None, got "):
            hep.HybridEPBuffer(group, H, 16, E, backend="reference")


def test_autograd_functions_name_a_missing_buffer(buf, dispatched):
    with pytest.raises(TypeError, match=r"hybrid_ep.dispatch: the first argument must be the HybridEPBuffer, "
                                        r"got Tensor"):
        hep.dispatch(_x(), _idx())
    with pytest.raises(TypeError, match="hybrid_ep.combine: the first argument must be the HybridEPBuffer, got str"):
        hep.combine("buf", dispatched.tokens, dispatched.handle)


def test_fp8_helpers_name_rows_that_are_not_2d():
    with pytest.raises(ValueError, match=r"x must be a 2-D tensor \[tokens, hidden\], got \[128\]"):
        hep.quantize_fp8(torch.randn(128))
    q, s = hep.quantize_fp8(torch.randn(2, 128))
    with pytest.raises(ValueError, match=r"q must be a 2-D tensor \[tokens, hidden\], got \[1, 2, 128\]"):
        hep.dequantize_fp8(q[None], s)
    with pytest.raises(ValueError, match=r"scales must be a tensor \[tokens, hidden / 128\], got list"):
        hep.dequantize_fp8(q, s.tolist())


def test_dequantize_fp8_names_scales_of_another_shape():
    q, s = hep.quantize_fp8(torch.randn(2, 256))
    torch.testing.assert_close(hep.dequantize_fp8(q, s), hep.dequantize_fp8(q, s.clone()))
    with pytest.raises(ValueError, match=r"scales must be \[tokens, hidden / 128\] = \[2, 2\], got \[2, 1\]"):
        hep.dequantize_fp8(q, s[:, :1])
    with pytest.raises(ValueError, match="q hidden size 100 must be a multiple of 128"):
        hep.dequantize_fp8(torch.zeros(2, 100).to(q.dtype), s)


def _construct_on_rank(num_experts):
    import hybrid_ep as hep_rank

    try:
        hep_rank.HybridEPBuffer(None, 128, 8, num_experts, backend="reference")
    except ValueError as err:
        return str(err)
    return "no error"


def test_experts_not_divisible_by_world_size(pool_for):
    messages = pool_for(2).run(_construct_on_rank, [(3,), (3,)])
    assert all("num_experts (3) must be divisible by the EP world size (2)" in m for m in messages)


def _dispatch_alone(rank_that_calls, peer_leaves=False):
    """rank_that_calls dispatches; its peer stays idle, or leaves the group as a crashed peer
    does (its connections close). The caller returns (seconds waited, message, its limit)."""
    import gc
    import os
    import time

    import torch.distributed as dist

    import hybrid_ep as hep_rank
    from hybrid_ep.config import timeout_seconds

    if not peer_leaves and dist.get_rank() == rank_that_calls:
        os.environ["HYBRID_EP_TIMEOUT_S"] = "2"  # read once per buffer
    buf = hep_rank.HybridEPBuffer(None, 128, 8, 4, ranks_per_node=1, backend="reference")
    if dist.get_rank() != rank_that_calls:
        if peer_leaves:
            time.sleep(1.0)
            dist.destroy_process_group()
            del buf
            gc.collect()  # nothing left holds the group: its connections close now, as in a crash
        return "idle"
    start = time.monotonic()
    try:
        buf.dispatch(torch.zeros(3, 128), torch.zeros(3, 1, dtype=torch.int64))
    except RuntimeError as err:
        return (time.monotonic() - start, str(err), timeout_seconds())
    return "no error"


def test_missing_peer_times_out(pool_for):
    """A rank whose peer never arrives raises after HYBRID_EP_TIMEOUT_S instead of hanging."""
    with pool_for(2) as pool:  # closed after: the group is unusable after a timeout
        idle, (elapsed, message, limit) = pool.run(_dispatch_alone, [(1,), (1,)])
    assert idle == "idle" and limit == 2
    # it waited its own 2 s, not the pool's 60 s (a loaded machine may add some)
    assert 0.75 * limit < elapsed < 30
    assert "rank 1 of the EP group gave up in dispatch (counts) after" in message
    assert "its call's deadline (HYBRID_EP_TIMEOUT_S=2 s for all of a call's waits)" in message


def test_peer_that_leaves_is_not_reported_as_a_timeout(pool_for):
    """A broken connection fails at once; the message says so instead of blaming HYBRID_EP_TIMEOUT_S."""
    with pool_for(2) as pool:  # closed after (a rank left the group: the pool refuses more tasks anyway)
        (elapsed, message, limit), idle = pool.run(_dispatch_alone, [(0, True), (0, True)])
        assert not pool.usable
    assert idle == "idle" and limit == 60  # the pool's HYBRID_EP_TIMEOUT_S (tests/conftest.py)
    # failed when the peer left (after about 1 s), long before the limit, however loaded the machine
    assert elapsed < limit
    assert "rank 0 of the EP group failed after" in message and "connection to a peer rank broke" in message
    assert "deadline" not in message


def _disagree_on_rank(what):
    import torch.distributed as dist

    import hybrid_ep as hep_rank

    rank = dist.get_rank()
    buf = hep_rank.HybridEPBuffer(None, 16, 8, 8 if what != "num_experts" or rank else 4, ranks_per_node=1,
                                  backend="reference")
    x = torch.randn(4, 16)
    idx = torch.tensor([[0, 2], [1, 3], [2, 0], [3, 1]])
    try:
        if what == "x dtype":  # the same bytes per value: read as the other dtype before the check
            res = buf.dispatch(x.half() if rank == 0 else x.bfloat16(), idx)
        elif what == "num_experts":
            res = buf.dispatch(x, idx)
        else:
            res = buf.dispatch(x, idx)
            if what == "x dtype (handle)":
                buf.dispatch(x.half() if rank == 0 else x.bfloat16(), handle=res.handle)
            elif what == "expert_out dtype":
                buf.combine(res.tokens if rank == 0 else res.tokens.bfloat16(), res.handle)
            elif what == "wire dtype":
                buf.combine(res.tokens.bfloat16(), res.handle, wire_dtype=torch.float32 if rank == 0 else None)
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("what, needle", [
    ("x dtype", "dispatch: the EP ranks disagree on x dtype (rank 0: torch.float16, rank 1: torch.bfloat16)"),
    ("x dtype (handle)", "dispatch: the EP ranks disagree on x dtype (rank 0: torch.float16, rank 1: torch.bfloat16)"),
    ("num_experts", "dispatch: the EP ranks disagree on num_experts (rank 0: 4, rank 1: 8)"),
    ("expert_out dtype", "combine: the EP ranks disagree on expert_out dtype (rank 0: torch.float32, rank 1: "
                         "torch.bfloat16)"),
    ("wire dtype", "combine: the EP ranks disagree on wire dtype (rank 0: torch.float32, rank 1: torch.bfloat16)"),
])
def test_ranks_that_disagree_on_the_row_format_all_raise(pool_for, what, needle):
    """Rows travel as raw bytes: a rank sending fp16 where its peer expects bf16 would be read
    as garbage, and rows of another width break the all-to-all (gloo aborts the process). The
    format travels with the counts (or in a small exchange of its own), and every rank raises."""
    messages = pool_for(2).run(_disagree_on_rank, [(what,), (what,)])
    assert all(needle in m for m in messages), messages


def test_quantize_fp8_rejects_bad_hidden():
    with pytest.raises(ValueError, match="multiple of 128"):
        quantize_fp8(torch.zeros(2, 100))
