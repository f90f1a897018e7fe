"""Bad expert ids found by the count kernel (csrc/kernels/count.cuh), on the CPU model.

A dynamic-size dispatch (num_out_tokens=None) makes no host check of topk_idx on the cuda
backend: the count kernel counts a bad route (an id outside [-1, E), or a token's second
route to one expert) as not routed, completes the count exchange on every rank and publishes
its first bad token in its count row; the host reads the lowest bad rank's route with the
output sizes and raises on every rank alike, and the call still completes (the count
kernel publishes the done flags), so the next call on the same buffer runs. With a static
size the dispatch kernel follows unread and returns at its start on the info's word; the
count kernel records the route, which the next call or synchronize() raises on every rank
alike, and the buffer stays usable.
"""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch

from harness.emulated import check_emulated, emulated_group_for, on_device
from hybrid_ep.backends.cuda.engine import RoutingError
from hybrid_ep.verify.cases import Case, make_rank_inputs

pytestmark = pytest.mark.model

TIMEOUT_S = 2  # a rank that waited for a peer's counts or rows would give up and say so

# (world size, ranks per node, data path): one node of 3 and of 4 ranks on both paths, and
# 4 ranks as 2 nodes (the hierarchical path shares the count kernel; the direct path needs
# one node).
TOPOLOGIES = [(3, 3, "receive"), (3, 3, "direct"), (4, 4, "receive"), (4, 4, "direct"), (4, 2, "receive")]


def _case(W: int, G: int, **kw) -> Case:
    base = dict(world_size=W, ranks_per_node=G, num_experts=2 * W, hidden=128, tokens=(17, 40, 33, 9)[:W], topk=3,
                dtype=torch.bfloat16, backend="cuda", drop_fraction=0.2)
    base.update(kw)
    return Case(**base)


def _bad(idx: torch.Tensor, kind: str, E: int) -> tuple[torch.Tensor, int, int]:
    """idx with one bad route of `kind`: (the copy, the token, the id the error names)."""
    bad = idx.clone()
    first, last = 0, idx.shape[0] - 1
    if kind == "E at the first token":
        bad[first, 1] = E
        return bad, first, E
    if kind == "-2 at the last token":
        bad[last, 0] = -2
        return bad, last, -2
    if kind == "2**40 at the last token":  # the id's high word travels too
        bad[last, 2] = 2**40
        return bad, last, 2**40
    token = first if kind == "twice at the first token" else last
    expert = (E - 1) if int(bad[token, 0]) != E - 1 else 0
    bad[token, 0], bad[token, 2] = expert, expert  # the second is the bad route
    return bad, token, expert


def _message(E: int, rank: int, token: int, expert: int) -> str:
    if -1 <= expert < E:
        return f"topk_idx routes token {token} to the same expert twice on rank {rank}: expert {expert}"
    return f"topk_idx values must be in [-1, {E - 1}] (num_experts={E}), got {expert} at token {token} on rank {rank}"


KINDS = ["E at the first token", "-2 at the last token", "twice at the first token", "twice at the last token",
         "2**40 at the last token"]


@pytest.mark.parametrize("W,G,path", TOPOLOGIES, ids=[f"W{w}G{g}-{p}" for w, g, p in TOPOLOGIES])
def test_a_bad_route_raises_on_every_rank_and_the_next_call_runs(monkeypatch, W, G, path):
    """One rank's bad route of each kind in turn: the dynamic dispatch raises the route's
    ValueError (naming topk_idx, the rank, the token and the id) and leaves the buffer usable:
    the next call, with good routing, matches the oracle."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", str(TIMEOUT_S))
    case = _case(W, G)
    group = emulated_group_for(case, "cpu", data_path=path, num_sms_dispatch=2, num_sms_combine=2)
    try:
        E, rank = case.num_experts, W - 2
        xs, idx, weights, _ = on_device(make_rank_inputs(case), "cpu")
        for n, kind in enumerate(KINDS):
            bad, token, expert = _bad(idx[rank], kind, E)
            with pytest.raises(RoutingError) as err:
                group.dispatch(xs, idx[:rank] + [bad] + idx[rank + 1:], weights)
            assert str(err.value) == _message(E, rank, token, expert), kind
            assert group.engine.failure is None, kind
            if n % 2:  # a good call between, and two bad calls back to back
                check_emulated(group, case)
        check_emulated(group, case)
    finally:
        group.close()


def test_the_lowest_bad_rank_is_named_on_every_rank(monkeypatch):
    """Two ranks with bad routes: every rank's host reads the same word, rank 1's (the lowest),
    not rank 3's, although rank 3's bad token comes first."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", str(TIMEOUT_S))
    case = _case(4, 4)
    group = emulated_group_for(case, "cpu", num_sms_dispatch=1, num_sms_combine=1)
    try:
        E = case.num_experts
        xs, idx, weights, _ = on_device(make_rank_inputs(case), "cpu")
        late, token, expert = _bad(idx[1], "twice at the last token", E)
        early, _, _ = _bad(idx[3], "E at the first token", E)
        with pytest.raises(RoutingError) as err:
            group.dispatch(xs, [idx[0], late, idx[2], early], weights)
        assert str(err.value) == _message(E, 1, token, expert)
        read = group.engine._workspaces  # every rank's info holds the same word
        words = {tuple(ws.i64[i, ws.layout.info // 8 + group.engine.info.bad_route:][:3].tolist())
                 for kept in read.values() for ws in kept[-1:] for i in range(4)}
        assert words == {(1, token, expert)}, words
        check_emulated(group, case)
    finally:
        group.close()


STATIC_ROWS = 64  # num_out_tokens of the static-size calls


def _with_bad_route(idx: list[torch.Tensor], rank: int, kind: str, E: int) -> tuple[list[torch.Tensor], int, int]:
    """Every rank's topk_idx, rank's with one bad route of `kind`: (the list, token, id)."""
    bad, token, expert = _bad(idx[rank], kind, E)
    return idx[:rank] + [bad] + idx[rank + 1:], token, expert


def _static_group(monkeypatch, W: int, G: int, path: str):
    """A static-size case on a group of `path` (waits bounded by TIMEOUT_S): (case, group,
    every rank's x, topk_idx and weights)."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", str(TIMEOUT_S))
    case = _case(W, G, num_out_tokens=STATIC_ROWS)
    group = emulated_group_for(case, "cpu", data_path=path, num_sms_dispatch=2, num_sms_combine=2)
    return (case, group, *on_device(make_rank_inputs(case), "cpu")[:3])


@pytest.mark.parametrize("W,G,path", TOPOLOGIES, ids=[f"W{w}G{g}-{p}" for w, g, p in TOPOLOGIES])
def test_a_static_call_with_a_bad_route_is_raised_next_and_the_buffer_stays_usable(monkeypatch, W, G, path):
    """num_out_tokens given: nothing reads the counts before the dispatch kernel, so the call
    returns; its count kernel completed it and its dispatch kernel moved nothing. The next
    call (it launches nothing), or synchronize(), raises the route's ValueError once for every
    rank, no wait ran out, and the call after it, good routing on the same buffer, matches the
    oracle; also after two refused calls back to back (the even kinds then the odd ones)."""
    case, group, xs, idx, weights = _static_group(monkeypatch, W, G, path)
    try:
        E, rank = case.num_experts, W - 2
        for n, kind in enumerate(KINDS):
            bad, token, expert = _with_bad_route(idx, rank, kind, E)
            group.dispatch(xs, bad, weights, num_out_tokens=STATIC_ROWS)
            with pytest.raises(RoutingError) as err:
                if n % 2:
                    group.synchronize()
                else:
                    group.dispatch(xs, idx, weights, num_out_tokens=STATIC_ROWS)
            assert str(err.value) == _message(E, rank, token, expert), kind
            assert group.engine.failure is None and int(group.engine.abort) == 0, kind
            group.synchronize()  # raised once
            if n % 2:
                check_emulated(group, case)
        check_emulated(group, dataclasses.replace(case, num_out_tokens=None))
    finally:
        group.close()


COMBINE_TOPOLOGIES = [(3, 3, "receive"), (3, 3, "direct"), (4, 2, "receive")]


@pytest.mark.parametrize("W,G,path", COMBINE_TOPOLOGIES, ids=[f"W{w}G{g}-{p}" for w, g, p in COMBINE_TOPOLOGIES])
def test_a_combine_on_a_refused_calls_handle_moves_nothing(monkeypatch, W, G, path):
    """The host raises the route before it launches a combine on the refused call's handle.
    Where it could not know yet (on a GPU the count kernel may not have run when the host
    polls; here the poll is skipped), the combine kernels return at their start on every rank
    alike: no wait runs out, and the buffer's next calls match the oracle."""
    case, group, xs, idx, weights = _static_group(monkeypatch, W, G, path)
    try:
        E, rank = case.num_experts, W - 1
        bad, token, expert = _with_bad_route(idx, rank, "E at the first token", E)
        res = group.dispatch(xs, bad, weights, num_out_tokens=STATIC_ROWS)
        outs = [torch.ones(STATIC_ROWS, case.hidden, dtype=case.dtype) for _ in res]
        handles = [r.handle for r in res]
        group.engine._reported = lambda: False  # the host has not seen the record yet
        ys = group.combine(outs, handles)
        del group.engine._reported
        assert [tuple(y.shape) for y in ys] == [(t, case.hidden) for t in case.tokens]
        assert group.engine.failure is None and int(group.engine.abort) == 0
        with pytest.raises(RoutingError) as err:
            group.combine(outs, handles)
        assert str(err.value) == _message(E, rank, token, expert)
        check_emulated(group, case)
        check_emulated(group, dataclasses.replace(case, num_out_tokens=None))
    finally:
        group.close()


class _Ops(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def test_a_dynamic_dispatch_runs_no_routing_check_on_the_host(single_rank_group):
    """The checks that read values (min, max, the sort for duplicates, the stack read back)
    are gone from the dynamic dispatch's host path, through the API of the emulation and of a
    one-rank HybridEPBuffer over the cuda backend."""
    from hybrid_ep.bench.host import _single_rank_buffer

    case = _case(2, 2)
    checks = {"sort", "min", "max", "stack", "any"}
    group = emulated_group_for(case, "cpu", num_sms_dispatch=1, num_sms_combine=1)
    try:
        xs, idx, weights, _ = on_device(make_rank_inputs(case), "cpu")
        with _Ops() as mode:
            group.dispatch(xs, idx, weights)
        assert checks.isdisjoint(mode.ops), mode.ops
    finally:
        group.close()
    one = _case(1, 1, tokens=(17,), num_experts=4)
    group = emulated_group_for(one, "cpu", num_sms_dispatch=1, num_sms_combine=1)
    try:
        buf = _single_rank_buffer(group)
        xs, idx, weights, _ = on_device(make_rank_inputs(one), "cpu")
        with _Ops() as mode:
            buf.dispatch(xs[0], idx[0], weights[0])
        assert checks.isdisjoint(mode.ops), mode.ops
        bad, token, expert = _bad(idx[0], "twice at the first token", one.num_experts)
        with pytest.raises(ValueError) as err:
            buf.dispatch(xs[0], bad, weights[0])
        assert str(err.value) == _message(one.num_experts, 0, token, expert)
    finally:
        group.close()
