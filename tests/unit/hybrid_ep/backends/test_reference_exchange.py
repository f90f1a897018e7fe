"""Reference backend: the collectives each call makes. A dispatch with a new routing exchanges its
counts (with the agreement header) and then its rows; every other call exchanges its rows only;
dispatch's backward sends the row and routing-weight gradients back in one exchange; with a
static output size the counts ride with the rows."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist

import hybrid_ep as hep

pytestmark = pytest.mark.unit

COLLECTIVES = ("all_to_all_single", "all_to_all", "all_gather", "all_gather_into_tensor", "all_reduce", "broadcast",
               "barrier", "gather", "scatter", "reduce_scatter_tensor", "send", "recv", "isend", "irecv")


def _collectives_per_call():
    rank, W = dist.get_rank(), dist.get_world_size()
    counted = collections.Counter()
    originals = {name: getattr(dist, name) for name in COLLECTIVES}

    def counting(name, fn):
        def call(*args, **kwargs):
            counted[name] += 1
            return fn(*args, **kwargs)
        return call

    calls = {}

    def count(label, fn):
        counted.clear()
        out = fn()
        calls[label] = dict(counted)
        return out

    torch.manual_seed(rank)
    T = 4 + rank
    idx = torch.stack([torch.randperm(2 * W)[:2] for _ in range(T)])
    x, w = torch.randn(T, 64), torch.rand(T, 2)
    for name, fn in originals.items():
        setattr(dist, name, counting(name, fn))
    try:
        buf = hep.HybridEPBuffer(None, 64, 8, 2 * W, backend="reference")
        res = count("dispatch with a routing", lambda: buf.dispatch(x, idx, w))
        count("dispatch with a handle", lambda: buf.dispatch(x, handle=res.handle))
        count("combine", lambda: buf.combine(res.tokens, res.handle))
        count("probs backward", lambda: buf._return_row_values(res.probs, res.handle))
        static = count("static dispatch with a routing", lambda: buf.dispatch(x, idx, w, num_out_tokens=2 * T))
        count("static combine", lambda: buf.combine(static.tokens, static.handle))
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        r = hep.dispatch(buf, xg, idx, wg)
        y = hep.combine(buf, r.tokens * r.probs[:, None], r.handle)
        count("backward of combine, then of dispatch", lambda: y.sum().backward())
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    same_counts = (torch.equal(static.handle.count_matrix_WW.cpu(), res.handle.count_matrix_WW.cpu())
                   and torch.equal(static.handle.node_counts_WN.cpu(), res.handle.node_counts_WN.cpu()))
    return calls, same_counts, wg.grad is not None and bool(wg.grad.abs().sum() > 0)


@pytest.mark.parametrize("W", [2, 3])
def test_one_count_exchange_per_routing_and_rows_only_otherwise(pool_for, W):
    """Before: every call began with an all_gather of the agreement fields (2 collectives each,
    6 for the backward of dispatch + combine)."""
    a2a = {"all_to_all_single": 1}
    for calls, same_counts, weights_learn in pool_for(W).run(_collectives_per_call, timeout_s=120):
        assert calls == {
            "dispatch with a routing": {"all_to_all_single": 2},  # counts + header, then rows
            "dispatch with a handle": a2a, "combine": a2a, "probs backward": a2a,
            "static dispatch with a routing": a2a, "static combine": a2a,
            "backward of combine, then of dispatch": {"all_to_all_single": 2},
        }
        assert same_counts  # the static blocks' headers carry the exact count matrix (traffic accounting)
        assert weights_learn  # the one exchange back also carried the routing-weight gradients


def test_group_timeout_follows_hybrid_ep_timeout_only_when_set(single_rank_group, monkeypatch):
    """NCCL collectives of the reference backend are bounded by the group's own timeout (its
    watchdog); HYBRID_EP_TIMEOUT_S sets it, and without it the group keeps its own (the EP group
    may carry other collectives). Checked on a gloo group, whose timeout reads back the same way."""
    import datetime

    from hybrid_ep.backends.reference_exchange import ReferenceExchange

    options = single_rank_group._get_backend(torch.device("cpu")).options
    before = options._timeout
    try:
        monkeypatch.delenv("HYBRID_EP_TIMEOUT_S", raising=False)
        ReferenceExchange.bound_group(single_rank_group)
        assert options._timeout == before
        monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "7.5")
        ReferenceExchange.bound_group(single_rank_group)
        assert options._timeout == datetime.timedelta(seconds=7.5)
    finally:
        dist.set_timeout(before, single_rank_group)
