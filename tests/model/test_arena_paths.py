"""The direct path's two places for outputs, on the CPU model. Ranks that share a process take
the direct path on outputs from PyTorch's allocator, and an engine that drives only some ranks
without peer memory the receive path. With separate processes emulated (peer memory): an
expert_out outside peer memory is copied into the rank's expert-out block (one inside is not),
and its users on different streams are ordered; a loop of buffer calls that drops its outputs
stays direct in peer memory pre-sized for one call."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import logging

import pytest
import torch

from harness.emulated import check_emulated, emulated_group_for, on_device
from hybrid_ep import logs
from hybrid_ep.backends.cuda.arena import call_bytes
from hybrid_ep.backends.cuda.expert_out_order import StreamOrder
from hybrid_ep.verify.cases import Case, make_rank_inputs
from hybrid_ep.verify.compare import assert_combine_close
from hybrid_ep.verify.oracle import combine_oracle, dispatch_oracle

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

FALLBACK = "took the receive path"
PEER_BYTES = 1 << 20  # holds many calls of _case's shape and their expert-out blocks


def _case(**kw) -> Case:
    base = dict(world_size=3, ranks_per_node=3, num_experts=6, hidden=256, tokens=(20, 9, 14), topk=2,
                dtype=torch.bfloat16, backend="cuda")
    return Case(**{**base, **kw})


def _group(case: Case, **kw):
    return emulated_group_for(case, "cpu", num_sms_dispatch=2, num_sms_combine=2, **kw)


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """The once-per-process receive path lines, as if no call had taken it yet in this process."""
    monkeypatch.setattr(logs, "_said", set())
    caplog.set_level(logging.WARNING, logger="hybrid_ep")
    return caplog


def _layer_inputs(case: Case, seed: int):
    return on_device(make_rank_inputs(dataclasses.replace(case, seed=seed)), torch.device("cpu"))[:3]


def _assert_combines(ys, config, run, outs, idx, case, where):
    want, magnitude = combine_oracle(config, run, outs, idx, False)
    for r in range(case.world_size):
        assert_combine_close(ys[r], want[r], magnitude[r], case.topk, f"{where}, rank {r}")


def test_one_process_goes_direct_on_torch_outputs():
    """Ranks that share a process address each other's tensors as they are: the direct path's
    outputs are ordinary tensors from PyTorch's allocator, nothing lies in registered memory,
    and combine reads an expert_out where it lies (no copy)."""
    case = _case()
    group = _group(case)
    try:
        engine = group.engine
        assert engine.data_path == "direct" and engine.arenas == [] and engine.peer is None
        for seed in (0, 1):
            res = check_emulated(group, dataclasses.replace(case, seed=seed))
            assert [r.handle.data_path for r in res] == ["direct"] * 3
            registered = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in group.buffers.tables]
            for r in res:
                assert r.tokens._base is None and r.tokens.untyped_storage().nbytes() == r.tokens.nbytes
                assert not any(lo <= r.tokens.data_ptr() < hi for lo, hi in registered)
    finally:
        group.close()


def test_without_peer_memory_ranks_in_separate_processes_take_the_receive_path():
    """One rank per process (an engine that drives one rank of the group): without peer memory
    its peers can not reach its tensors, so the buffer takes the receive path, and asking for
    the direct path is refused with the reason."""
    from hybrid_ep.backends.cuda.engine import Engine

    case = _case()
    group = _group(case)
    try:
        b = group.buffers
        engine = Engine(group.ext, group.config, [0], b.tables[:1], group.device)
        assert engine.data_path == "receive" and engine.arenas == [] and engine.peer is None
        with pytest.raises(ValueError, match="data_path=direct needs one node whose ranks address each other"):
            Engine(group.ext, group.config, [0], b.tables[:1], group.device, data_path="direct")
    finally:
        group.close()


def test_combines_on_another_stream_wait_for_the_last_user_of_the_expert_out_block():
    """The CPU model has no streams: the engine's stream getter and the order's device hooks
    are replaced by recording ones. A combine that copies into the expert-out block on the last
    user's stream enqueues no wait; one on another stream waits for the marker recorded after
    the last copying combine's kernel, before its copy; a combine whose expert_out is in the
    block already copies nothing and neither waits nor records. Every combine matches the
    oracle."""
    case = _case(peer_memory_bytes=PEER_BYTES)
    group = _group(case, separate_processes=True)
    engine = group.engine
    try:
        stream, log = [1], []

        def record():
            log.append(("record", stream[0]))
            return len(log) - 1

        engine.expert_out_order = StreamOrder(torch.device("cpu"), record=record,
                                              wait=lambda marker: log.append(("wait", stream[0], marker)))
        engine._stream = lambda: stream[0]
        copy = engine._into_expert_out_block

        def logged_copy(i, x, p, copy_x, copy_p):
            if i == 0 and copy_x:
                log.append(("copy", stream[0]))
            return copy(i, x, p, copy_x, copy_p)

        engine._into_expert_out_block = logged_copy
        xs, idx, w = _layer_inputs(case, 0)
        res = group.dispatch(xs, idx, w)
        assert res[0].handle.data_path == "direct"
        run = dispatch_oracle(group.config, xs, idx, w, None, None)
        gen = torch.Generator().manual_seed(3)
        for s in (1, 1, 2, 3):
            stream[0] = s
            outs = [torch.randn(r.tokens.shape, generator=gen).to(torch.bfloat16) for r in res]
            ys = group.combine(outs, [r.handle for r in res])
            _assert_combines(ys, group.config, run, outs, idx, case, f"combine on stream {s}")
        stream[0] = 4
        inside = [group.in_peer_memory(i, torch.randn(r.tokens.shape, generator=gen).to(torch.bfloat16))
                  for i, r in enumerate(res)]
        ys = group.combine(inside, [r.handle for r in res])
        _assert_combines(ys, group.config, run, inside, idx, case, "combine of an expert_out in the expert-out block")
        assert log == [("copy", 1), ("record", 1), ("copy", 1), ("record", 1),
                       ("wait", 2, 3), ("copy", 2), ("record", 2),
                       ("wait", 3, 6), ("copy", 3), ("record", 3)]
        assert engine.expert_out_order.last_stream == 3 and engine.expert_out_copies == 4
    finally:
        group.close()


T1, H1, E1, K1 = 64, 256, 8, 8
ONE_CALL = call_bytes(T1 * K1, H1, torch.bfloat16)  # peer memory pre-sized for one call of this shape


@contextlib.contextmanager
def _one_rank_direct_buffer():
    """A HybridEPBuffer of one rank over the cuda backend on the CPU model (direct path, separate
    processes emulated, peer memory pre-sized for one call) and a routing of T1 tokens to K1 of
    E1 experts: (buf, group, x, idx, w)."""
    from hybrid_ep.backends.cuda.emulation import EmulatedGroup
    from hybrid_ep.bench.host import _single_rank_buffer, _world_of_one

    g = EmulatedGroup(1, H1, T1, E1, device="cpu", data_path="direct", num_sms_dispatch=1, num_sms_combine=1,
                      peer_memory_bytes=ONE_CALL, separate_processes=True)
    try:
        with _world_of_one():
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(T1, H1, generator=gen).to(torch.bfloat16)
            idx = torch.argsort(torch.rand(T1, E1, generator=gen), dim=1)[:, :K1].contiguous()
            yield _single_rank_buffer(g), g, x, idx, torch.rand(T1, K1, generator=gen)
    finally:
        g.close()


def test_a_buffer_loop_stays_direct_in_peer_memory_of_one_call(fresh_log):
    """HybridEPBuffer's last_call records each call without keeping its handle, so with the
    peer memory of one call every call of a loop that drops its outputs goes direct, and the
    record still reports the call's traffic."""
    with _one_rank_direct_buffer() as (buf, g, x, idx, w):
        paths = []
        for _ in range(4):
            res = buf.dispatch(x, idx, w, num_out_tokens=T1 * K1)
            y = buf.combine(res.tokens, res.handle)
            paths.append(res.handle.data_path)
            assert buf.last_call.handle is res.handle  # while the caller keeps it
            del res
        assert paths == ["direct"] * 4
        assert not [r for r in fresh_log.records if FALLBACK in r.getMessage()]
        assert buf.last_call.handle is None  # the record did not keep it
        g.synchronize()
        # One row per token and destination rank: T1, all on this rank.
        traffic = buf.last_traffic
        assert (traffic.op, traffic.rows) == ("combine", T1), traffic
        # Combine sums a token's K1 routes, each its own row here: K1 x its row, exactly.
        torch.testing.assert_close(y.float(), K1 * x.float(), rtol=0, atol=0)


def test_a_training_forward_loop_stays_direct_in_peer_memory_of_one_call(fresh_log):
    """hybrid_ep.dispatch + combine with inputs that ask for gradients, outputs dropped after
    each pair: the autograd graph must not keep a call's peer memory block past its outputs (it kept
    it while dispatch returned a copy of the probs: every other call then took the receive
    path)."""
    import hybrid_ep as hep

    with _one_rank_direct_buffer() as (buf, g, x, idx, w):
        x, w = x.requires_grad_(), w.requires_grad_()
        paths = []
        for _ in range(4):
            res = hep.dispatch(buf, x, idx, w, num_out_tokens=T1 * K1)
            y = hep.combine(buf, res.tokens, res.handle)
            paths.append(res.handle.data_path)
            assert y.requires_grad and res.probs.requires_grad
            out = y.detach()  # not in peer memory; y's graph holds the call's handle
            del res, y
        assert paths == ["direct"] * 4
        assert not [r for r in fresh_log.records if FALLBACK in r.getMessage()]
        g.synchronize()
        torch.testing.assert_close(out.float(), K1 * x.detach().float(), rtol=0, atol=0)
