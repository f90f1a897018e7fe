"""Reference backend: ranks that make different calls, or reuse different handles, all raise the
same ValueError before any rows move (never wrong rows, never a gloo abort), and the group stays
usable; ranks that reuse the same handle get what a new dispatch of the routing gives."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import hybrid_ep as hep

pytestmark = pytest.mark.unit

H = 128


def _buffer(W: int, ranks_per_node: int = 1):
    return hep.HybridEPBuffer(None, H, 8, 2 * W, ranks_per_node=ranks_per_node, backend="reference")


def _routings(W: int) -> dict[str, torch.Tensor]:
    """Top-1 routings of 2W tokens: A sends token t to rank t % W, "same" to rank (t + 1) % W
    (the same counts, other rows), "other" sends every token to rank 0 (other counts)."""
    t = torch.arange(2 * W)
    return {"A": (t % W * 2)[:, None], "same": ((t + 1) % W * 2)[:, None], "other": 0 * t[:, None]}


def _round_trip_works(W: int) -> bool:
    """After the error the group still works: a new buffer's dispatch and combine give x back."""
    x = torch.randn(2 * W, H)
    buf = _buffer(W)
    res = buf.dispatch(x, _routings(W)["A"])
    return torch.equal(buf.combine(res.tokens, res.handle), x)


def _mismatch(what: str):
    """Rank 0 does one thing, the other ranks another; returns (error text, group works after)."""
    rank, W = dist.get_rank(), dist.get_world_size()
    first = rank == 0
    x = torch.arange(2 * W * H, dtype=torch.float32).view(2 * W, H) + 1000 * rank
    routes = _routings(W)
    buf = _buffer(W, W if what == "ranks_per_node" and first else 1)
    try:
        if what == "ranks_per_node":
            buf.dispatch(x, routes["A"])
        elif what.startswith("handles"):  # rank 0 uses the handle of dispatch #1, the others #2
            call, counts = what.split(", ")[1:]
            b = routes["same" if counts == "same counts" else "other"]
            if call == "probs backward":  # through autograd: x takes no gradient, the weights do
                weights = torch.ones(2 * W, 1, requires_grad=True)
                ra, rb = hep.dispatch(buf, x, routes["A"], weights), hep.dispatch(buf, x, b, weights)
                for res in (ra, rb) if first else (rb, ra):  # micro-batches taken in another order
                    res.probs.sum().backward()
            else:
                ra, rb = buf.dispatch(x, routes["A"]), buf.dispatch(x, b)
                mine = ra if first else rb
                buf.dispatch(x, handle=mine.handle) if call == "dispatch" else buf.combine(mine.tokens, mine.handle)
        elif what == "static handles":  # rank 0 reuses static dispatch #1's handle, the others #2's
            ra, rb = (buf.dispatch(x, routes[k], num_out_tokens=4 * W) for k in ("A", "same"))
            buf.dispatch(x, handle=(ra if first else rb).handle)
        elif what == "static vs exact":
            buf.dispatch(x, routes["A"], num_out_tokens=4 * W if first else None)
        elif what == "count checksum":  # two buffers used crosswise: every rank's buf holds a dispatch #1
            pair = (buf, _buffer(W)) if first else (_buffer(W), buf)
            results = [b.dispatch(x, routes[k]) for b, k in zip(pair, ("A", "other"))]
            buf.dispatch(x, handle=results[pair.index(buf)].handle)
        else:
            res = buf.dispatch(x, routes["A"])
            if what == "fresh vs reuse":
                buf.dispatch(x, routes["A"]) if first else buf.dispatch(x, handle=res.handle)
            elif what == "dispatch vs combine":
                buf.dispatch(x, handle=res.handle) if first else buf.combine(res.tokens, res.handle)
            elif what == "combine vs probs backward":
                buf.combine(res.tokens, res.handle) if first else buf._return_row_values(res.probs, res.handle)
            elif what == "combine with vs without the weights":  # dispatch's backward sends both back at once
                if first:
                    buf._combine_and_return_row_values(res.tokens, res.probs, res.handle)
                else:
                    buf.combine(res.tokens, res.handle)
    except ValueError as err:
        return str(err), _round_trip_works(W)
    return "no error", _round_trip_works(W)


def _per_rank(W: int, first: str, rest: str) -> str:
    return ", ".join(f"rank {r}: {first if r == 0 else rest}" for r in range(W))


def _cases():
    cases = []
    for W in (2, 3):
        handles = "the handle (" + _per_rank(W, "dispatch #1", "dispatch #2") + ")"
        cases += [
            (W, "handles, dispatch, same counts", f"hybrid_ep dispatch: the EP ranks disagree on {handles}"),
            (W, "handles, dispatch, other counts", f"hybrid_ep dispatch: the EP ranks disagree on {handles}"),
            (W, "handles, combine, same counts", f"hybrid_ep combine: the EP ranks disagree on {handles}"),
            (W, "handles, probs backward, other counts",
             f"hybrid_ep probs backward: the EP ranks disagree on {handles}"),
            (W, "ranks_per_node", "hybrid_ep dispatch: the EP ranks disagree on ranks_per_node ("
             + _per_rank(W, W, 1) + "); every rank must build its buffer with the same ranks_per_node"),
            (W, "fresh vs reuse", "hybrid_ep: the EP ranks disagree on the call ("
             + _per_rank(W, "dispatch with a routing", "dispatch with a handle") + "); every rank must make "
             "the same calls in the same order"),
            (W, "dispatch vs combine", "hybrid_ep: the EP ranks disagree on the call ("
             + _per_rank(W, "dispatch with a handle", "combine") + ")"),
            (W, "combine vs probs backward", "hybrid_ep: the EP ranks disagree on the call ("
             + _per_rank(W, "combine", "probs backward") + ")"),
            (W, "count checksum", "hybrid_ep dispatch: the EP ranks disagree on the handle (rank 0: dispatch #1 "
             "with count checksum "),
            (W, "static handles", f"hybrid_ep dispatch: the EP ranks disagree on {handles}"),
            (W, "static vs exact", "hybrid_ep dispatch: the EP ranks disagree on a static output size "
             "(num_out_tokens) (" + _per_rank(W, True, False) + "); every rank must make the same call"),
            (W, "combine with vs without the weights", "hybrid_ep combine: the EP ranks disagree on routing-weight "
             "gradients sent back (" + _per_rank(W, True, False) + ")"),
        ]
    return cases


@pytest.mark.parametrize("W, what, needle", _cases(), ids=[f"W{W}-{what}" for W, what, _ in _cases()])
def test_ranks_that_disagree_all_raise_the_same_error(pool_for, W, what, needle):
    """Before the fix: other handles gave wrong rows or uninitialised memory and no error;
    other calls or ranks_per_node sent messages of other lengths and gloo aborted a rank. The
    header rides in the call's own exchange: each peer's receive is posted at the longest message
    of the buffer, so a peer in another call delivers a shorter message that its header names."""
    out = pool_for(W).run(_mismatch, [(what,)] * W, timeout_s=120)
    messages = [m for m, _ in out]
    assert len(set(messages)) == 1 and needle in messages[0], messages
    assert all(ok for _, ok in out), "the group did not work after the error"


def _reuse_matches_fresh(fp8: bool):
    rank, W = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)
    T = 3 + 2 * rank
    buf = _buffer(W)
    idx = torch.stack([torch.randperm(2 * W)[:2] for _ in range(T)])
    weights = torch.rand(T, 2)
    x1, x2 = torch.randn(T, H), torch.randn(T, H)
    (x1, s1), (x2, s2) = (hep.quantize_fp8(x) if fp8 else (x, None) for x in (x1, x2))
    first = buf.dispatch(x1, idx, weights, scales=s1)
    reused = buf.dispatch(x2, scales=s2, handle=first.handle)
    fresh = buf.dispatch(x2, idx, weights, scales=s2)
    out = torch.randn(fresh.tokens.shape[0], H)
    checks = {
        "serials": (first.handle.serial, fresh.handle.serial) == (1, 2),
        "tokens": torch.equal(reused.tokens.view(torch.uint8), fresh.tokens.view(torch.uint8)),
        "scales": (reused.scales is None) == (not fp8) and (not fp8 or torch.equal(reused.scales, fresh.scales)),
        "combine": torch.equal(buf.combine(out, reused.handle, apply_probs=True),
                               buf.combine(out, fresh.handle, apply_probs=True)),
        "probs backward": torch.equal(buf._return_row_values(fresh.probs, reused.handle),
                                      buf._return_row_values(fresh.probs, fresh.handle)),
    }
    return [name for name, ok in checks.items() if not ok]


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("W", [2, 3])
def test_reusing_the_same_handle_matches_a_new_dispatch(pool_for, W, fp8):
    assert pool_for(W).run(_reuse_matches_fresh, [(fp8,)] * W, timeout_s=120) == [[]] * W
