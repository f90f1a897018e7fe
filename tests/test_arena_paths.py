"""The direct path through each rank's arena, on the CPU model: outputs come from the arena,
a call the arenas can not hold takes the receive path on every rank (one log line per
process) and still matches the oracle, an expert_out outside the arena is copied into the
dispatch's reserve (and one inside is not), and memory_plan() reports the arena."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import logging

import pytest
import torch

from hybrid_ep.backends.cuda import engine as engine_mod
from hybrid_ep.backends.cuda.arena import arena_bytes, call_bytes
from hybrid_ep.backends.cuda.backend import memory_plan
from hybrid_ep.config import BufferConfig
from hybrid_ep.testing.cases import Case, make_rank_inputs
from hybrid_ep.testing.compare import assert_combine_close
from hybrid_ep.testing.emulated import check_emulated, emulated_group_for, on_device
from hybrid_ep.testing.oracle import combine_oracle, dispatch_oracle

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

FALLBACK = "took the receive path instead of the direct path"


def _case(**kw) -> Case:
    base = dict(world_size=3, ranks_per_node=3, num_experts=6, hidden=256, tokens=(20, 9, 14), topk=2,
                dtype=torch.bfloat16, backend="cuda")
    return Case(**{**base, **kw})


def _group(case: Case, **kw):
    return emulated_group_for(case, "cpu", num_sms_dispatch=2, num_sms_combine=2, **kw)


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """The once-per-process fallback line, as if no call had fallen back yet in this process."""
    monkeypatch.setattr(engine_mod, "_fallbacks_logged", set())
    caplog.set_level(logging.WARNING, logger="hybrid_ep")
    return caplog


@pytest.mark.parametrize("num_out_tokens", [None, 40])
def test_a_too_small_arena_falls_back_with_one_log_line_and_matches_the_oracle(fresh_log, num_out_tokens):
    case = _case(num_out_tokens=num_out_tokens, arena_bytes=4096)
    group = _group(case, arena_bytes=4096)
    try:
        assert group.engine.data_path == "direct"  # the buffer's path; its calls can not take it
        for seed in (0, 1):
            res = check_emulated(group, dataclasses.replace(case, seed=seed))
            assert [r.handle.data_path for r in res] == ["receive"] * 3
            assert all(r.handle.source.reserve is None for r in res)
        lines = [r.getMessage() for r in fresh_log.records if FALLBACK in r.getMessage()]
        assert len(lines) == 1, lines
        assert "rank 0's arena can not hold" in lines[0] and "arena_bytes" in lines[0]
    finally:
        group.close()


def test_live_outputs_exhaust_the_arena_and_released_ones_serve_again(fresh_log):
    """Arenas sized for one call of 40 rows: a second call while the first's outputs live takes
    the receive path; both combine to the oracle; once the first is gone the next goes direct."""
    case = _case(num_out_tokens=40)
    one_call = call_bytes(40, case.hidden, torch.bfloat16)
    group = _group(case, arena_bytes=one_call)
    try:
        first = check_emulated(group, dataclasses.replace(case, arena_bytes=one_call))
        assert first[0].handle.data_path == "direct"
        second = check_emulated(group, dataclasses.replace(case, seed=1, arena_bytes=one_call))
        assert second[0].handle.data_path == "receive"
        assert "another" not in fresh_log.text  # one process: the engine sees every rank's arena
        # The first call's handles still combine correctly (its outputs stay in the arena).
        xs, idx, weights, _ = on_device(make_rank_inputs(case), torch.device("cpu"))
        run = dispatch_oracle(group.config, xs, idx, weights, None, 40)
        outs = [torch.randn(40, case.hidden).to(torch.bfloat16) for _ in range(3)]
        ys = group.combine(outs, [r.handle for r in first])
        want, magnitude = combine_oracle(group.config, run, outs, idx, False)
        for r in range(3):
            assert_combine_close(ys[r], want[r], magnitude[r], case.topk, f"rank {r}")
        del first, second, ys
        gc.collect()
        assert all(a.used == 0 for a in group.engine.arenas)
        third = check_emulated(group, dataclasses.replace(case, seed=2, arena_bytes=one_call))
        assert third[0].handle.data_path == "direct"
    finally:
        group.close()


def test_combine_copies_only_an_expert_out_outside_the_arena():
    case = _case()
    group = _group(case)
    try:
        xs, idx, weights, _ = on_device(make_rank_inputs(case), torch.device("cpu"))
        res = group.dispatch(xs, idx, weights)
        assert [r.handle.data_path for r in res] == ["direct"] * 3
        run = dispatch_oracle(group.config, xs, idx, weights, None, None)
        rows = [r.tokens.shape[0] for r in res]
        outs = [torch.randn(R, case.hidden).to(torch.bfloat16) for R in rows]
        want, magnitude = combine_oracle(group.config, run, outs, idx, True)
        reserves = [r.handle.source.reserve for r in res]
        for reserve in reserves:
            reserve.fill_(0x5A)
        inside = []
        for arena, out in zip(group.engine.arenas, outs):
            t = arena.empty(tuple(out.shape), out.dtype)
            inside.append(t.copy_(out))
        ys = group.combine(inside, [r.handle for r in res], apply_probs=True)
        for r in range(3):
            assert_combine_close(ys[r], want[r], magnitude[r], case.topk, f"rank {r}, expert_out in the arena")
            assert bool((reserves[r] == 0x5A).all()), f"rank {r}: an expert_out in the arena was copied"
        ys = group.combine(outs, [r.handle for r in res], apply_probs=True)
        for r in range(3):
            assert_combine_close(ys[r], want[r], magnitude[r], case.topk, f"rank {r}, expert_out outside")
            staged = reserves[r][:outs[r].numel() * 2].view(torch.bfloat16).view(outs[r].shape)
            assert torch.equal(staged, outs[r]), f"rank {r}: the copy is not in the reserve"
            # probs are the dispatch's (in the arena): not copied, the reserve's tail untouched
            assert bool((reserves[r][-rows[r] * 4:] == 0x5A).all())
    finally:
        group.close()


def test_no_arena_means_the_receive_path():
    case = _case()
    group = _group(case, arena_bytes=0)
    try:
        assert group.engine.data_path == "receive" and group.engine.arenas == []
        res = check_emulated(group, case)
        assert res[0].handle.data_path == "receive"
    finally:
        group.close()
    with pytest.raises(ValueError, match="data_path=direct needs one node whose ranks map each other's arenas"):
        _group(case, arena_bytes=0, data_path="direct")


def test_memory_plan_reports_the_arena():
    one_node = BufferConfig(512, 64, 8, 4, 4).validate()
    plan = memory_plan(one_node).as_dict()
    assert plan["arena"] == arena_bytes(one_node) > 0
    assert memory_plan(dataclasses.replace(one_node, arena_bytes=1 << 20)).as_dict()["arena"] == 1 << 20
    assert memory_plan(BufferConfig(512, 64, 8, 4, 2).validate()).as_dict()["arena"] == 0  # two nodes


def test_a_vote_against_sends_every_rank_to_the_receive_path(fresh_log):
    """One process per GPU: this process's arenas could serve, but another rank's vote says no
    (agreement.PathVote); the engine then takes the receive path, which still matches."""
    case = _case()
    group = _group(case)
    try:
        votes = []
        group.engine.vote = lambda ok: votes.append(ok) or False
        res = check_emulated(group, case)
        assert res[0].handle.data_path == "receive" and votes[0] is True
        assert "another rank's arena could not hold" in fresh_log.text
        group.engine.vote = lambda ok: ok
        assert check_emulated(group, dataclasses.replace(case, seed=1))[0].handle.data_path == "direct"
    finally:
        group.close()


T1, H1, E1, K1 = 64, 256, 8, 8  # the default arena holds one call of this shape, not two


@contextlib.contextmanager
def _one_rank_direct_buffer():
    """A HybridEPBuffer of one rank over the cuda backend on the CPU model (direct path, the
    default arena) and a routing of T1 tokens to K1 of E1 experts: (buf, group, x, idx, w)."""
    from hybrid_ep.backends.cuda.emulation import EmulatedGroup
    from hybrid_ep.bench.host import _single_rank_buffer, _world_of_one

    g = EmulatedGroup(1, H1, T1, E1, device="cpu", data_path="direct", num_sms_dispatch=1, num_sms_combine=1)
    try:
        with _world_of_one():
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(T1, H1, generator=gen).to(torch.bfloat16)
            idx = torch.argsort(torch.rand(T1, E1, generator=gen), dim=1)[:, :K1].contiguous()
            yield _single_rank_buffer(g), g, x, idx, torch.rand(T1, K1, generator=gen)
    finally:
        g.close()


def test_a_buffer_loop_stays_direct_with_the_default_arena(fresh_log):
    """HybridEPBuffer's last_call records each call without keeping its handle, so with the
    default arena (one call) every call of a loop that drops its outputs goes direct, and the
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


def test_a_training_forward_loop_stays_direct_with_the_default_arena(fresh_log):
    """hybrid_ep.dispatch + combine with inputs that ask for gradients, outputs dropped after
    each pair: the autograd graph must not keep a call's arena block past its outputs (it kept
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
            out = y.detach()  # not in the arena; y's graph holds the call's handle
            del res, y
        assert paths == ["direct"] * 4
        assert not [r for r in fresh_log.records if FALLBACK in r.getMessage()]
        g.synchronize()
        torch.testing.assert_close(out.float(), K1 * x.detach().float(), rtol=0, atol=0)
