"""The cuda backend's per-call host path (engine.Engine with ext.HostPath), on the CPU model.

In static-size mode a dispatch + combine pair allocates only what the caller gets (output
rows and probs, combine's y), runs no other tensor operation and reads nothing back, in the
engine and through the API (EmulatedGroup, and HybridEPBuffer over the cuda backend: the
routing is not masked per call, since the kernels never read an unused route's weight); the
per-call tables reuse the engine's workspace once nothing refers to them, and never while a
handle or a view of them lives. A dynamic-size dispatch makes only its outputs between its host
read and the dispatch launch. The error messages of bad arguments are the engine's own,
word for word. The bench's host mode (hybrid_ep.bench.host) runs.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import re

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.handle import DispatchHandle
from hybrid_ep.routing import Routing, normalize_routing

pytestmark = pytest.mark.model

W, H, T, E, K = 2, 256, 16, 4, 2
STATIC = W * T * K  # every route of every rank fits: nothing dropped


class _Ops(TorchDispatchMode):
    """Every aten operation run inside while `counting`, counted by name."""

    def __init__(self, counting: bool = True):
        super().__init__()
        self.ops = collections.Counter()
        self.counting = counting

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.counting:
            self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, H, generator=gen) for _ in range(W)]
    idx = [torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous() for _ in range(W)]
    ws = [torch.rand(T, K, generator=gen) for _ in range(W)]
    return xs, idx, ws


PEER_BYTES = 1 << 20  # peer memory pre-sized for every call here (ranks in separate processes, emulated)


@pytest.fixture(params=["receive", "direct", "peer"])
def group(request):
    """The receive path; the direct path on outputs from PyTorch's allocator (ranks in one
    process); the direct path in peer memory (ranks in separate processes, emulated)."""
    peer = request.param == "peer"
    g = EmulatedGroup(W, H, T, E, num_sms_dispatch=1, num_sms_combine=1, device="cpu",
                      data_path="direct" if peer else request.param, peer_memory_bytes=PEER_BYTES if peer else None,
                      separate_processes=peer)
    yield g
    g.close()


def _assert_outputs_only(mode, group, receive_ops: dict, ranks: int = W) -> None:
    """The operations of the receive path are `receive_ops`, its out rows and probs among the
    empties; so are the direct path's on outputs from PyTorch's allocator. In peer memory those
    two are the tensors of one block per rank, which the extension makes (DLPack, no tensor
    operation): the same minus those empties."""
    ops = dict(mode.ops)
    if group.engine.arenas:
        receive_ops = dict(receive_ops, empty=receive_ops["empty"] - 2 * ranks)
        receive_ops = {k: v for k, v in receive_ops.items() if v}
    assert ops == receive_ops, mode.ops


def _engine_pair(group, xs, routings):
    e = group.engine
    res = e.dispatch_ranks(xs, [None] * W, routings, STATIC, 1)
    ys = e.combine_ranks([r.rows_RH for r in res], [r.send for r in res], [r.recv for r in res],
                   [r.probs_R for r in res], True, 1)
    return res, ys


def test_static_pair_allocates_only_its_outputs_and_reads_nothing_back(group):
    xs, idx, ws = _inputs()
    routings = [normalize_routing(T, E, x.device, topk_idx=i, topk_weights=w, check_values=False)
                for x, i, w in zip(xs, idx, ws)]
    res, _ = _engine_pair(group, xs, routings)
    first = res[0].send.call.ptr
    del res
    with _Ops() as mode:
        res, ys = _engine_pair(group, xs, routings)
    # out rows + probs per rank, y per rank: nothing else, no view, no copy, no item().
    _assert_outputs_only(mode, group, {"empty": 3 * W})
    assert res[0].send.data_path == group.engine.data_path
    assert res[0].send.call.ptr == first, "the per-call tables were allocated again"
    group.synchronize()
    for r in range(W):  # the results are right: apply_probs sums weight x row over the routes
        want = (ws[r][:, :, None] * xs[r][:, None, :]).sum(dim=1)
        torch.testing.assert_close(ys[r], want, rtol=1e-5, atol=1e-5)


API_PAIR = {"empty": 3}  # per rank on the receive path: out rows + probs, combine's y; no routing op, no view


def test_api_pair_allocates_only_its_outputs(group):
    xs, idx, ws = _inputs()
    for _ in range(2):  # the second leaves a workspace as referenced as in steady state
        res = group.dispatch(xs, idx, ws, num_out_tokens=STATIC)
        group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
    del res
    with _Ops() as mode:
        res = group.dispatch(xs, idx, ws, num_out_tokens=STATIC)
        ys = group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
    _assert_outputs_only(mode, group, {k: v * W for k, v in API_PAIR.items()})
    group.synchronize()
    for r in range(W):
        want = (ws[r][:, :, None] * xs[r][:, None, :]).sum(dim=1)
        torch.testing.assert_close(ys[r], want, rtol=1e-5, atol=1e-5)
        # tokens_per_expert, read when asked for: every route fits, so one row per route to r
        routes = [int(((i // (E // W)) == r).sum()) for i in idx]
        assert int(res[r].tokens_per_expert.sum()) == sum(routes)
        assert torch.equal(res[r].tokens_per_expert, res[r].handle.tokens_per_expert)


def test_a_call_without_weights_runs_no_routing_op(group):
    """topk_weights None (1.0 per route, as the GPU bench calls it): the engine reads ones it
    keeps; no comparison and cast per rank and call (on a GPU two kernel launches, the
    Tensor.to the bench's profile put first), only the outputs."""
    xs, idx, _ = _inputs()
    for _ in range(2):
        res = group.dispatch(xs, idx, num_out_tokens=STATIC)
        group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
    del res
    with _Ops() as mode:
        res = group.dispatch(xs, idx, num_out_tokens=STATIC)
        ys = group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
    _assert_outputs_only(mode, group, {k: v * W for k, v in API_PAIR.items()})
    group.synchronize()
    for r in range(W):
        torch.testing.assert_close(ys[r], xs[r] * K, rtol=1e-5, atol=1e-5)  # K routes of weight 1
        routed = res[r].probs[:int(res[r].tokens_per_expert.sum())]
        assert torch.equal(routed, torch.ones_like(routed))
        assert torch.equal(res[r].handle.routing.topk_weights_TK, torch.ones(T, K))  # made when read


def test_buffer_pair_allocates_only_its_outputs(single_rank_group):
    """HybridEPBuffer over the cuda backend, one rank per process: its last_call keeps the
    last handle, and still no dispatch allocates a new workspace."""
    from hybrid_ep.bench.host import _single_rank_buffer

    g = EmulatedGroup(1, H, T, E, num_sms_dispatch=1, num_sms_combine=1, device="cpu")
    try:
        buf = _single_rank_buffer(g)
        xs, idx, ws = _inputs()
        x, i, w = xs[0], idx[0], ws[0]
        for _ in range(2):
            res = buf.dispatch(x, i, w, num_out_tokens=T * K)
            buf.combine(res.tokens, res.handle, apply_probs=True)
        del res
        with _Ops() as mode:
            res = buf.dispatch(x, i, w, num_out_tokens=T * K)
            y = buf.combine(res.tokens, res.handle, apply_probs=True)
        _assert_outputs_only(mode, g, API_PAIR, ranks=1)
        # The record of the last call is made when read (the call only notes it), once.
        record = buf.last_call
        assert record is buf.last_call and record.kind == "combine" and record.handle is res.handle
        assert record.dtype == x.dtype and record.counts.dest is res.handle.dest
        assert torch.equal(record.counts.count_matrix_WW, res.handle.count_matrix_WW)
        g.synchronize()
        torch.testing.assert_close(y, (w[:, :, None] * x[:, None, :]).sum(dim=1), rtol=1e-5, atol=1e-5)
    finally:
        g.close()


@pytest.mark.parametrize("path", ["receive", "direct"])
def test_training_pair_adds_only_the_probs_detach(path):
    """hybrid_ep.dispatch / combine with inputs asking for gradients (Megatron's forward): the
    buffer pair's allocations plus one detach (the probs dispatch returns, a new tensor over
    the handle's), no copy; and the gradients reach x and the weights."""
    import hybrid_ep as hep
    from hybrid_ep.bench.host import _single_rank_buffer, _world_of_one

    g = EmulatedGroup(1, H, T, E, num_sms_dispatch=1, num_sms_combine=1, device="cpu", data_path=path)
    try:
        with _world_of_one():
            buf = _single_rank_buffer(g)
            xs, idx, ws = _inputs()
            x, w = xs[0].clone().requires_grad_(), ws[0].clone().requires_grad_()
            for _ in range(2):
                res = hep.dispatch(buf, x, idx[0], w, num_out_tokens=T * K)
                hep.combine(buf, res.tokens, res.handle, apply_probs=True)
            del res
            with _Ops() as mode:
                res = hep.dispatch(buf, x, idx[0], w, num_out_tokens=T * K)
                y = hep.combine(buf, res.tokens, res.handle, apply_probs=True)
            assert res.handle.data_path == path
            _assert_outputs_only(mode, g, {**API_PAIR, "detach": 1}, ranks=1)
            y.sum().backward()
            g.synchronize()
            routed = (idx[0] >= 0)
            torch.testing.assert_close(w.grad, torch.where(routed, x.detach().sum(dim=1, keepdim=True), 0.0),
                                       rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(x.grad, torch.where(routed, w.detach(), 0.0).sum(dim=1, keepdim=True)
                                       .expand(T, H), rtol=1e-5, atol=1e-5)
    finally:
        g.close()


class _Calls:
    """A proxy of the engine's HostPath that notes the name of each call into it."""

    def __init__(self, host):
        self.host, self.calls = host, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.host, name)


def test_static_dispatch_is_one_call_into_the_host_path(group):
    """A static-size dispatch is one call into the extension's host path: in peer memory
    dispatch_into launches both kernels and returns the blocks' tensors."""
    xs, idx, ws = _inputs()
    e = group.engine
    e.host = proxy = _Calls(e.host)
    try:
        res = group.dispatch(xs, idx, ws, num_out_tokens=STATIC)
    finally:
        e.host = proxy.host
    arena = bool(e.arenas)
    assert arena == (e.peer is not None)
    assert proxy.calls == ["dispatch_into" if arena else "dispatch"]
    for i, r in enumerate(res):
        assert r.tokens.shape == (STATIC, H) and r.probs.shape == (STATIC,)
        assert not arena or (e.arenas[i].contains(r.tokens) and e.arenas[i].contains(r.probs))
    ys = group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
    group.synchronize()
    for r in range(W):
        want = (ws[r][:, :, None] * xs[r][:, None, :]).sum(dim=1)
        torch.testing.assert_close(ys[r], want, rtol=1e-5, atol=1e-5)


def test_unrouted_weights_are_never_read(group):
    """The weights reach the kernels as given: an unused route's weight, nan here, changes
    nothing; the routing's own topk_weights_TK still reads 0 there."""
    xs, idx, ws = _inputs(4)
    idx = [i.clone() for i in idx]
    for i in idx:
        i[::3, 1] = -1
    nan = [torch.where(i >= 0, w, float("nan")) for i, w in zip(idx, ws)]
    zero = [torch.where(i >= 0, w, 0.0) for i, w in zip(idx, ws)]
    got = group.dispatch(xs, idx, nan, num_out_tokens=STATIC)
    ys_got = group.combine([r.tokens for r in got], [r.handle for r in got], apply_probs=True)
    want = group.dispatch(xs, idx, zero, num_out_tokens=STATIC)
    ys_want = group.combine([r.tokens for r in want], [r.handle for r in want], apply_probs=True)
    group.synchronize()
    for g, w_, yg, yw, z in zip(got, want, ys_got, ys_want, zero):
        assert torch.equal(g.tokens, w_.tokens) and torch.equal(g.probs, w_.probs)
        assert torch.equal(yg, yw) and not yg.isnan().any()
        assert torch.equal(g.handle.routing.topk_weights_TK, z)


def test_handle_and_result_are_read_only(group):
    xs, idx, ws = _inputs()
    res = group.dispatch(xs, idx, ws, num_out_tokens=STATIC)[0]
    h = res.handle
    with pytest.raises(dataclasses.FrozenInstanceError):
        h.rank = 1
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'routing'"):
        del h.routing
    with pytest.raises(dataclasses.FrozenInstanceError):
        res.tokens = None
    with pytest.raises(AttributeError):  # slotted: no field can be added either
        h.extra = 1
    assert not hasattr(h, "__dict__") and not hasattr(res, "__dict__")
    assert res.tokens_per_expert is res.tokens_per_expert  # the handle's, read once
    assert torch.equal(res.tokens_per_expert, h.tokens_per_expert)
    with pytest.raises(AttributeError):
        h.routing.topk_idx_TK = None
    probs = torch.zeros_like(h.probs_R)
    other = h.replace(probs_R=probs)
    assert other.probs_R is probs and other.routing is h.routing and other.dest is h.dest
    assert torch.equal(other.count_matrix_WW, h.count_matrix_WW)
    with pytest.raises(TypeError, match="no field 'probs'"):
        h.replace(probs=probs)
    # The copy keeps the rows per link computed from the counts, unless the counts change.
    counts = h.row_counts
    assert h.replace(probs_R=probs).row_counts is counts and int(counts.received.sum()) > 0
    none = h.replace(count_matrix_WW=torch.zeros_like(h.count_matrix_WW))
    assert int(none.row_counts.received.sum()) == 0 and h.row_counts is counts
    # autograd's copy with its differentiable probs: replace(probs_R=...) by position.
    copy = h._with_probs(probs)
    assert copy.probs_R is probs and copy.row_counts is counts and copy.routing is h.routing
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'probs_R'"):
        copy.probs_R = None
    # The fields by position (a backend's per-call path) or by name: the same handle.
    named = DispatchHandle(owner=h.owner, config=h.config, rank=h.rank, routing=h.routing, source=h.source,
                           dest=h.dest, probs_R=h.probs_R, num_out_tokens=h.num_out_tokens, serial=3)
    fields = ("owner", "config", "rank", "routing", "source", "dest", "probs_R", "num_out_tokens", "num_recv_rows",
              "checksum")
    assert all(getattr(named, f) is getattr(h, f) for f in fields) and (named.serial, h.serial) == (3, 0)
    assert torch.equal(named.count_matrix_WW, h.count_matrix_WW)
    group.synchronize()


def test_dynamic_dispatch_reads_back_once(group):
    xs, idx, ws = _inputs()
    routings = [normalize_routing(T, E, x.device, topk_idx=i, topk_weights=w) for x, i, w in zip(xs, idx, ws)]
    group.engine.dispatch_ranks(xs, [None] * W, routings, None, 1)
    with _Ops() as mode:
        group.engine.dispatch_ranks(xs, [None] * W, routings, None, 1)
    # out rows + probs per rank, and the needed rows and bad route of every rank read in one gather
    _assert_outputs_only(mode, group, {"empty": 2 * W, **READ_BACK})


READ_BACK = {"slice": 1}  # call.i64[:, needed:] with bad_route: one gather; .cpu() of a CPU tensor is no operation


class _AfterRead:
    """A proxy of the engine's HostPath that has `mode` count only between the count kernel's
    return (the host read follows) and the dispatch launch: on a GPU the GPU idles there."""

    def __init__(self, host, mode: _Ops):
        self.host, self.mode, self.launches = host, mode, 0

    def dispatch_count(self, *args):
        self.host.dispatch_count(*args)
        self.mode.counting = True

    def dispatch_rows(self, *args):
        return self._launch(self.host.dispatch_rows, args)

    def dispatch_rows_into(self, *args):
        return self._launch(self.host.dispatch_rows_into, args)  # blocks of peer memory: their tensors

    def _launch(self, launch, args):
        self.mode.counting = False
        self.launches += 1
        return launch(*args)

    def set_agree(self, *args):  # before the count kernel (peer memory)
        self.host.set_agree(*args)


def test_dynamic_dispatch_makes_only_its_outputs_after_the_read(group):
    """Between the host read and the dispatch launch a dynamic-size dispatch makes its
    outputs and nothing else: rows and probs per rank, nothing in peer memory (its tensors
    come from the extension); the gather of the output
    sizes and the results are made before and after."""
    xs, idx, ws = _inputs()
    e = group.engine
    routings = [normalize_routing(T, E, x.device, topk_idx=i, topk_weights=w) for x, i, w in zip(xs, idx, ws)]
    e.dispatch_ranks(xs, [None] * W, routings, None, 1)
    mode = _Ops(counting=False)
    host = e.host
    e.host = proxy = _AfterRead(host, mode)
    try:
        with mode:
            res = e.dispatch_ranks(xs, [None] * W, routings, None, 1)
    finally:
        e.host = host
    assert proxy.launches == 1 and res[0].send.data_path == e.data_path
    assert dict(mode.ops) == ({} if e.arenas else {"empty": 2 * W}), mode.ops
    ys = e.combine_ranks([r.rows_RH for r in res], [r.send for r in res], [r.recv for r in res],
                   [r.probs_R for r in res], True, 1)
    group.synchronize()
    for r in range(W):
        want = (ws[r][:, :, None] * xs[r][:, None, :]).sum(dim=1)
        torch.testing.assert_close(ys[r], want, rtol=1e-5, atol=1e-5)


def test_live_handles_keep_their_tables(group):
    """A workspace is reused only once no handle and no view of it lives: the tables of a
    kept handle still give its combine after other dispatches."""
    xs, idx, ws = _inputs(1)
    kept = group.dispatch(xs, idx, ws, num_out_tokens=STATIC)
    kept_tpe = kept[0].tokens_per_expert.clone()
    view = kept[1].handle.count_matrix_WW  # a view alone must keep the workspace too
    counts = view.clone()
    held = kept[0].handle.source.call
    for seed in (2, 3):
        other = group.dispatch(*_inputs(seed), num_out_tokens=STATIC)
        assert other[0].handle.source.call is not held
        del other
    ys = group.combine([r.tokens for r in kept], [r.handle for r in kept], apply_probs=True)
    group.synchronize()
    assert torch.equal(kept[0].tokens_per_expert, kept_tpe)
    for r in range(W):
        want = (ws[r][:, :, None] * xs[r][:, None, :]).sum(dim=1)
        torch.testing.assert_close(ys[r], want, rtol=1e-5, atol=1e-5)
    held_ptr = held.ptr
    del kept, held, ys
    again = group.dispatch(xs, idx, ws, num_out_tokens=STATIC)
    assert again[0].handle.source.call.ptr != held_ptr, "reused the tables a live view still reads"
    group.synchronize()
    assert torch.equal(view, counts)


def test_launches_off_runs_no_kernel(group):
    xs, idx, ws = _inputs()
    ext = group.ext
    ext.set_launches_enabled(False)
    try:
        assert not ext.launches_enabled()
        res = group.dispatch(xs, idx, ws, num_out_tokens=STATIC)
        out = [torch.full_like(r.tokens, 7.0) for r in res]
        ys = group.combine(out, [r.handle for r in res])
        assert all(r.tokens.shape == (STATIC, H) for r in res) and all(y.shape == (T, H) for y in ys)
    finally:
        ext.set_launches_enabled(True)
    res = group.dispatch(xs, idx, ws, num_out_tokens=STATIC)
    ys = group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
    group.synchronize()
    want = (ws[0][:, :, None] * xs[0][:, None, :]).sum(dim=1)
    torch.testing.assert_close(ys[0], want, rtol=1e-5, atol=1e-5)


def test_host_path_checks_its_rank_count(group):
    e = group.engine
    args = e._launch_args(1, "float32", H, "combine_receive", "float32")
    with pytest.raises(ValueError, match=rf"this host path drives {W} rank\(s\), got 1"):
        e.host.combine(args, False, 0, [e.ext.CombineInputs(num_tokens=T, topk=K, part=0,
                                                            layout=e.ext.workspace_layout(e.geo, 2, K, False, True),
                                                            topk_idx=0, expert_out=0, probs=0, y=0, num_rows=0)])


def test_the_seams_structs_are_struct_sequences_built_by_name(group):
    """What crosses into the host path per rank is one of the extension's struct sequences
    (bindings/seam.h): built by field name, in any order, and read by name; a field missing,
    unknown or given by position is an error naming the struct and its fields."""
    ext = group.engine.ext
    layout = ext.workspace_layout(group.engine.geo, 2, K, False, True)
    assert set(ext.DispatchInputs.__match_args__) == {"num_tokens", "topk", "x", "x_scales", "topk_idx",
                                                      "topk_weights"}
    d = ext.DispatchInputs(topk_weights=4, topk_idx=3, x_scales=2, x=1, topk=K, num_tokens=T)
    assert (d.num_tokens, d.topk, d.x, d.x_scales, d.topk_idx, d.topk_weights) == (T, K, 1, 2, 3, 4)
    o = ext.DispatchOutputs(probs=2, scales=0, rows=1, num_rows=5)
    assert (o.num_rows, o.rows, o.scales, o.probs) == (5, 1, 0, 2)
    c = ext.CombineInputs(num_rows=6, y=5, probs=4, expert_out=3, topk_idx=2, layout=layout, part=1, topk=K,
                          num_tokens=T)
    assert (c.num_tokens, c.topk, c.part, c.topk_idx, c.expert_out, c.probs, c.y, c.num_rows) == (T, K, 1, 2, 3, 4,
                                                                                                  5, 6)
    assert c.layout is layout
    name = re.escape(ext.__name__)
    fields = "num_rows, rows, scales, probs"
    with pytest.raises(TypeError, match=rf"^{name}\.DispatchOutputs\(\) takes its fields by name: {fields}$"):
        ext.DispatchOutputs(rows=1, scales=0, probs=2)  # num_rows missing
    with pytest.raises(TypeError, match=rf"^{name}\.DispatchOutputs\(\) takes its fields by name: {fields}$"):
        ext.DispatchOutputs((5, 1, 0, 2))
    with pytest.raises(TypeError, match=rf"^{name}\.DispatchOutputs\(\) has no field row \(its fields: {fields}\)$"):
        ext.DispatchOutputs(num_rows=5, row=1, scales=0, probs=2)


def test_the_host_path_names_the_struct_and_field_it_can_not_read(group):
    """A plain tuple or another struct where the host path reads one of its structs is a
    TypeError naming the struct and its fields; a field of the wrong type a TypeError, one out of
    its C++ type's range an OverflowError, each naming the struct and field. A dispatch whose
    outputs are bad launches neither kernel."""
    e, ext = group.engine, group.engine.ext
    name = re.escape(ext.__name__)
    layout = ext.workspace_layout(e.geo, 2, K, False, True)
    combine = e._launch_args(1, "float32", H, "combine_receive", "float32")
    dispatch = e._launch_args(1, "float32", H, "dispatch_receive")
    def dispatch_inputs(**fields):
        return ext.DispatchInputs(**{**dict(num_tokens=T, topk=K, x=64, x_scales=0, topk_idx=128, topk_weights=256),
                                     **fields})

    good_in = dispatch_inputs()
    good_out = ext.DispatchOutputs(num_rows=T, rows=64, scales=0, probs=128)

    def combine_inputs(**fields):
        values = dict(num_tokens=T, topk=K, part=64, layout=layout, topk_idx=0, expert_out=128, probs=256, y=512,
                      num_rows=8)
        return ext.CombineInputs(**{**values, **fields})

    ext.set_launches_enabled(False)  # nothing below may get as far as a launch; none runs if one did
    before = ext.launches_made()
    try:
        with pytest.raises(TypeError, match=rf"^inputs\[0\]: a {name}\.CombineInputs \("
                                            r"num_tokens, topk, part, layout, topk_idx, expert_out, probs, y, "
                                            r"num_rows\), got tuple$"):
            e.host.combine(combine, False, 0, [(T, K, 64, layout, 0, 128, 256, 512, 8)] * W)
        with pytest.raises(TypeError, match=rf"^outputs\[1\]: a {name}\.DispatchOutputs .*, "
                                            rf"got {name}\.DispatchInputs$"):
            e.host.dispatch(dispatch, False, 0, 0, layout, STATIC, [good_in] * W, [good_out, good_in])
        with pytest.raises(TypeError, match=rf"^{name}\.CombineInputs\.y: an int, got float$"):
            e.host.combine(combine, False, 0, [combine_inputs(y=512.0)] * W)
        with pytest.raises(TypeError, match=rf"^{name}\.CombineInputs\.layout: a WorkspaceLayout "
                                            r"\(workspace_layout\(\)\), got int$"):
            e.host.combine(combine, False, 0, [combine_inputs(layout=0)] * W)
        with pytest.raises(TypeError, match=rf"^{name}\.DispatchInputs\.x: an int, got Tensor$"):
            e.host.dispatch_count(dispatch, 0, 0, layout, STATIC, [dispatch_inputs(x=torch.zeros(1))] * W, False)
        with pytest.raises(OverflowError, match=rf"^{name}\.DispatchInputs\.num_tokens: 4294967296 is out of range "
                                                r"of int32$"):
            e.host.dispatch_count(dispatch, 0, 0, layout, STATIC, [dispatch_inputs(num_tokens=1 << 32)] * W, False)
        with pytest.raises(OverflowError, match=rf"^{name}\.DispatchOutputs\.rows: -64 is out of range of uint64$"):
            e.host.dispatch(dispatch, False, 0, 0, layout, STATIC, [good_in] * W,
                            [good_out, ext.DispatchOutputs(num_rows=T, rows=-64, scales=0, probs=128)])
        assert ext.launches_made() == before
    finally:
        ext.set_launches_enabled(True)


# The engine's messages for bad arguments, word for word (the top-k limit's: hybrid_ep.limits').
def test_bad_argument_messages_are_unchanged(group):
    e = group.engine
    xs, idx, ws = _inputs()
    routings = [normalize_routing(T, E, x.device, topk_idx=i, topk_weights=w) for x, i, w in zip(xs, idx, ws)]
    wide = Routing(torch.arange(17).repeat(T, 1))  # past the limit normalize_routing keeps (hybrid_ep.limits)
    with pytest.raises(ValueError) as err:
        e.dispatch_ranks(xs, [None] * W, [wide, routings[1]], STATIC, 1)
    assert str(err.value) == "topk_idx has 17 routes per token; a token may have at most 16"  # hybrid_ep.limits' words
    with pytest.raises(TypeError) as err:
        e.dispatch_ranks([xs[0], xs[1].to(torch.bfloat16)], [None] * W, routings, STATIC, 1)
    assert str(err.value) == "x on rank 1 is torch.bfloat16 but rank 0's is torch.float32; one call moves one dtype"
    fp8 = [x.to(torch.float8_e4m3fn) for x in xs]
    with pytest.raises(ValueError) as err:
        e.dispatch_ranks(fp8, [None] * W, routings, STATIC, 1)
    assert str(err.value) == ("scales: fp8 x on rank 0 needs its float32 scales [num_tokens, hidden_dim / 128] "
                              "(a re-dispatch with a reused handle too)")
    with pytest.raises(ValueError) as err:
        e.dispatch_ranks(fp8, [torch.ones(T, 1)] * W, routings, STATIC, 1)
    assert str(err.value) == "scales on rank 0 must have shape [16, 2], got [16, 1]"
    with pytest.raises(ValueError) as err:
        e.dispatch_ranks(xs, [None] * W, routings, STATIC, 10_000)
    assert str(err.value).startswith("num_sms (dispatch)=10000 x 2 rank(s) in one launch needs 20000 co-resident "
                                     "blocks, but the device holds ")

    res = e.dispatch_ranks(xs, [None] * W, routings, STATIC, 1)
    sends, recvs, probs = [r.send for r in res], [r.recv for r in res], [r.probs_R for r in res]
    rows = [r.rows_RH for r in res]
    with pytest.raises(ValueError) as err:
        e.combine_ranks(rows, sends, recvs, probs, False, 1, torch.bfloat16)
    assert str(err.value) == "wire_dtype must be the dtype of expert_out (float32) or float32, got bfloat16"
    with pytest.raises(ValueError) as err:
        e.combine_ranks([torch.zeros(STATIC, 2 * H)] * W, sends, recvs, probs, False, 1)
    assert str(err.value) == "expert_out rows have 512 columns; the buffer holds 256"
    with pytest.raises(ValueError) as err:
        e.combine_ranks([rows[0], rows[1][:, :128].contiguous()], sends, recvs, probs, False, 1)
    assert str(err.value) == ("expert_out on rank 1 is torch.float32 [128 columns] but rank 0's is torch.float32 "
                              "[256]; one call moves one dtype and width")
    with pytest.raises(ValueError) as err:
        e.combine_ranks(rows, sends, recvs, probs, False, 0)
    assert str(err.value) == "num_sms (combine) must be >= 1, got 0"
    group.synchronize()  # nothing of the refused calls reached a kernel


def test_bench_host_mode_writes_its_json(tmp_path):
    from hybrid_ep.bench import host

    out = tmp_path / "host.json"
    assert host.main(["--worlds", "1", "2", "--paths", "direct", "peer", "--iters", "3", "--warmup", "1",
                      "--hidden", "128", "--tokens", "8", "--topk", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "not a GPU number" in doc["what"]
    assert doc["cpu_heap"].startswith(("glibc mallopt", "default ("))
    assert [(p["world_size"], p["data_path"]) for p in doc["points"]] == [(1, "direct"), (1, "peer"), (2, "direct"),
                                                                         (2, "peer")]
    for p in doc["points"]:
        if p["data_path"] == "peer":  # every pair on peer memory, on the ledger: direct, no host read
            levels = 5 if p["world_size"] == 1 else 2
            assert p["peer_pairs"] == levels * 4 == p["peer_direct_dispatches"] and p["peer_reads"] == 0
        levels = ("engine", "group") + (("buffer", "autograd", "training") if p["world_size"] == 1 else ())
        assert [k for k in host.LEVELS if k in p] == list(levels)
        for level in levels:
            q = p[level]
            assert q["cpu_us_per_pair_per_rank"] == pytest.approx(q["cpu_us_per_pair"] / p["world_size"])


def test_bench_host_mode_times_fp8_rows_with_their_scales(tmp_path):
    """--dtype fp8: the same pairs with fp8 rows and their scales (no training level: fp8 rows
    are not differentiable); the scales' output is made each call, so fp8 does more host work."""
    from hybrid_ep.bench import host

    out = tmp_path / "fp8.json"
    assert host.main(["--dtype", "fp8", "--worlds", "1", "2", "--paths", "direct", "peer", "--iters", "3",
                      "--warmup", "1", "--hidden", "256", "--tokens", "8", "--topk", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["metadata"]["config"]["dtype"] == "fp8"
    for p in doc["points"]:
        assert p["dtype"] == "fp8"
        levels = ("engine", "group") + (("buffer", "autograd") if p["world_size"] == 1 else ())
        assert [k for k in host.LEVELS if k in p] == list(levels)
        if p["data_path"] == "peer":  # fp8 on the ledger too: every pair direct, no host read
            assert p["peer_pairs"] == len(levels) * 4 == p["peer_direct_dispatches"] and p["peer_reads"] == 0
    with pytest.raises(SystemExit):
        host.main(["--dtype", "fp8", "--dynamic", "--worlds", "1"])


def test_bench_host_dynamic_mode_times_both_windows(tmp_path):
    from hybrid_ep.bench import host

    out = tmp_path / "dynamic.json"
    assert host.main(["--dynamic", "--worlds", "2", "--paths", "direct", "receive", "peer", "--iters", "2",
                      "--warmup", "1", "--hidden", "128", "--tokens", "8", "--topk", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert "dynamic-size dispatch" in doc["what"] and doc["metadata"]["config"]["dynamic"] is True
    assert [(p["world_size"], p["data_path"], p["num_out_tokens"]) for p in doc["points"]] == [
        (2, "direct", None), (2, "receive", None), (2, "peer", None)]
    for p in doc["points"]:
        for window in ("before_count", "after_read"):
            q = p[window]
            assert q["cpu_us_per_call"] > 0
            assert q["cpu_us_per_rank"] == pytest.approx(q["cpu_us_per_call"] / 2)


@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_fp8_outputs_in_peer_memory_are_the_receive_paths(static):
    """fp8 rows, their scales and probs in blocks of peer memory (the one order of a
    dispatch's outputs: HostPath.dispatch_into, or dispatch_rows_into on the blocks after the read)
    hold what the receive path's outputs from PyTorch's allocator hold."""
    from hybrid_ep.fp8 import quantize_fp8

    Hq = 512  # fp8 scales of whole 16-byte units
    gen = torch.Generator().manual_seed(3)
    q = [quantize_fp8(torch.randn(T, Hq, generator=gen)) for _ in range(W)]
    idx = [torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous() for _ in range(W)]
    ws = [torch.rand(T, K, generator=gen) for _ in range(W)]
    got = {}
    for path in ("receive", "peer"):
        peer = path == "peer"
        g = EmulatedGroup(W, Hq, T, E, num_sms_dispatch=1, num_sms_combine=1, device="cpu",
                          data_path="direct" if peer else path, peer_memory_bytes=PEER_BYTES if peer else None,
                          separate_processes=peer)
        try:
            res = g.dispatch([x for x, _ in q], idx, ws, scales=[s for _, s in q],
                             num_out_tokens=STATIC if static else None)
            g.synchronize()
            assert bool(g.engine.arenas) == peer
            assert all(not peer or g.engine.arenas[i].contains(r.scales) for i, r in enumerate(res))
            got[path] = [(r.tokens.view(torch.uint8).clone(), r.scales.clone(), r.probs.clone()) for r in res]
        finally:
            g.close()
    for (rows, scales, probs), (rows_p, scales_p, probs_p) in zip(got["receive"], got["peer"]):
        assert torch.equal(rows, rows_p) and torch.equal(scales, scales_p) and torch.equal(probs, probs_p)
