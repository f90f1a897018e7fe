"""The direct path through each rank's arena (opt-in: what ranks in separate processes need to
address each other's tensors), on the CPU model: outputs come from the arena,
a call the arenas can not hold takes the receive path on every rank (one log line per
process) and still matches the oracle, an expert_out outside the arena is copied into the
rank's one combine staging region (and one inside is not), its users on different streams
are ordered, a training step of several layers goes direct on every layer with the arena
sized for it, and memory_plan() reports the arena and the staging region. Without an arena,
ranks that share a process take the direct path on outputs from PyTorch's allocator, and
ranks in separate processes the receive path."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import logging

import pytest
import torch

from hybrid_ep.backends.cuda import paths as path_choice
from hybrid_ep.backends.cuda.arena import call_bytes, expected_rows, training_bytes
from hybrid_ep.backends.cuda.backend import memory_plan
from hybrid_ep.backends.cuda.staging import StreamOrder, staging_bytes
from hybrid_ep.config import BufferConfig
from hybrid_ep.testing.cases import Case, make_rank_inputs
from hybrid_ep.testing.compare import assert_combine_close
from hybrid_ep.testing.emulated import check_emulated, emulated_group_for, on_device
from hybrid_ep.testing.oracle import combine_oracle, dispatch_oracle

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

FALLBACK = "took the receive path instead of the direct path"
ARENA = 1 << 20  # holds many calls of _case's shape; its staging region every call's rows


def _case(**kw) -> Case:
    base = dict(world_size=3, ranks_per_node=3, num_experts=6, hidden=256, tokens=(20, 9, 14), topk=2,
                dtype=torch.bfloat16, backend="cuda")
    return Case(**{**base, **kw})


def _group(case: Case, **kw):
    return emulated_group_for(case, "cpu", num_sms_dispatch=2, num_sms_combine=2, **kw)


@pytest.fixture
def fresh_log(monkeypatch, caplog):
    """The once-per-process fallback line, as if no call had fallen back yet in this process."""
    monkeypatch.setattr(path_choice, "_fallbacks_logged", set())
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
            assert all(r.handle.source.topk_idx_TK is None for r in res)
        lines = [r.getMessage() for r in fresh_log.records if FALLBACK in r.getMessage()]
        assert len(lines) == 1, lines
        # the staging region is sized by the arena: the smaller of the two names the rank first
        assert "rank 0's" in lines[0] and "arena" in lines[0] and "arena_bytes" in lines[0]
        # ... and says how to size it for training
        assert "arena.training_bytes(layers_in_flight" in lines[0]
        assert group.engine.staging.uses == 0
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
    group = _group(case, arena_bytes=ARENA)
    try:
        xs, idx, weights, _ = on_device(make_rank_inputs(case), torch.device("cpu"))
        res = group.dispatch(xs, idx, weights)
        assert [r.handle.data_path for r in res] == ["direct"] * 3
        run = dispatch_oracle(group.config, xs, idx, weights, None, None)
        rows = [r.tokens.shape[0] for r in res]
        outs = [torch.randn(R, case.hidden).to(torch.bfloat16) for R in rows]
        want, magnitude = combine_oracle(group.config, run, outs, idx, True)
        staging = group.engine.staging
        for region in staging.regions:
            region.fill_(0x5A)
        inside = []
        for arena, out in zip(group.engine.arenas, outs):
            t = arena.empty(tuple(out.shape), out.dtype)
            inside.append(t.copy_(out))
        ys = group.combine(inside, [r.handle for r in res], apply_probs=True)
        for r in range(3):
            assert_combine_close(ys[r], want[r], magnitude[r], case.topk, f"rank {r}, expert_out in the arena")
            assert bool((staging.regions[r] == 0x5A).all()), f"rank {r}: an expert_out in the arena was copied"
        assert staging.uses == 0
        ys = group.combine(outs, [r.handle for r in res], apply_probs=True)
        for r in range(3):
            assert_combine_close(ys[r], want[r], magnitude[r], case.topk, f"rank {r}, expert_out outside")
            region = staging.regions[r]
            staged = region[:outs[r].numel() * 2].view(torch.bfloat16).view(outs[r].shape)
            assert torch.equal(staged, outs[r]), f"rank {r}: the copy is not in the staging region"
            # probs are the dispatch's (in the arena): not copied, the region's tail untouched
            assert bool((region[outs[r].numel() * 2:] == 0x5A).all())
        assert staging.uses == 1
    finally:
        group.close()


def _layer_inputs(case: Case, seed: int):
    return on_device(make_rank_inputs(dataclasses.replace(case, seed=seed)), torch.device("cpu"))[:3]


def _assert_combines(ys, config, run, outs, idx, case, where):
    want, magnitude = combine_oracle(config, run, outs, idx, False)
    for r in range(case.world_size):
        assert_combine_close(ys[r], want[r], magnitude[r], case.topk, f"{where}, rank {r}")


def test_a_training_step_goes_direct_on_every_layer_with_the_arena_sized_for_it(fresh_log):
    """L layers: L dispatches whose outputs stay alive (the experts save them for backward),
    L combines, then per layer in reverse backward's two calls: the dispatch of the output
    gradient (backward of combine) and the combine of the rows' gradient (backward of
    dispatch). With arena.training_bytes for L layers in flight every call goes direct and
    matches the oracle; every layer in flight holds exactly its call's rows and probs
    (call_bytes); no combine takes an arena block, each stages into the one region."""
    L = 3
    case = _case()
    H, K = case.hidden, case.topk
    rows = expected_rows(max(case.tokens), K, 2.0, case.num_experts // case.world_size)
    group = _group(case, arena_bytes=training_bytes(L, rows, H, torch.bfloat16))
    arenas, staging = group.engine.arenas, group.engine.staging
    try:
        layers = []
        for layer in range(L):
            xs, idx, w = _layer_inputs(case, layer)
            res = group.dispatch(xs, idx, w)
            assert [r.handle.data_path for r in res] == ["direct"] * 3, f"layer {layer}"
            assert max(r.tokens.shape[0] for r in res) <= rows  # the sizing rule's assumption holds
            run = dispatch_oracle(group.config, xs, idx, w, None, None)
            layers.append((idx, w, res, run))
        held = [sum(call_bytes(res[r].tokens.shape[0], H, torch.bfloat16) for _, _, res, _ in layers)
                for r in range(3)]
        assert [a.used for a in arenas] == held  # rows and probs per layer in flight, nothing more

        gen = torch.Generator().manual_seed(7)
        for layer, (idx, _, res, run) in enumerate(layers):
            outs = [(r.tokens.float() * 0.5 + torch.randn(r.tokens.shape, generator=gen)).to(torch.bfloat16)
                    for r in res]  # the experts' output: outside the arena
            ys = group.combine(outs, [r.handle for r in res])
            _assert_combines(ys, group.config, run, outs, idx, case, f"forward combine of layer {layer}")
            assert [a.used for a in arenas] == held and staging.uses == layer + 1

        for layer in reversed(range(L)):
            idx, w, res, run = layers[layer]
            grad_ys = [torch.randn(T, H, generator=gen).to(torch.bfloat16) for T in case.tokens]
            grad_in = group.redispatch(grad_ys, [r.handle for r in res])
            assert [g.handle.data_path for g in grad_in] == ["direct"] * 3, f"gradient dispatch of layer {layer}"
            grad_run = dispatch_oracle(group.config, grad_ys, idx, w, None, None)
            for r in range(3):
                assert torch.equal(grad_in[r].tokens, grad_run.ranks[r].tokens), f"layer {layer} rank {r}"
            grad_rows = [(g.tokens.float() * 2).to(torch.bfloat16) for g in grad_in]  # experts' backward
            uses = staging.uses
            gx = group.combine(grad_rows, [r.handle for r in res])
            _assert_combines(gx, group.config, run, grad_rows, idx, case, f"backward combine of layer {layer}")
            assert staging.uses == uses + 1
            grad_bytes = [call_bytes(g.tokens.shape[0], H, torch.bfloat16) for g in grad_in]
            assert [a.used for a in arenas] == [h + g for h, g in zip(held, grad_bytes)]
            del grad_in, layers[layer], res, run
            gc.collect()
            held = [sum(call_bytes(res[r].tokens.shape[0], H, torch.bfloat16) for _, _, res, _ in layers)
                    for r in range(3)]
            assert [a.used for a in arenas] == held, f"after the backward of layer {layer}"
        assert [a.used for a in arenas] == [0] * 3
        assert not [r for r in fresh_log.records if FALLBACK in r.getMessage()]
    finally:
        group.close()


def test_combines_on_another_stream_wait_for_the_last_user_of_the_staging_region():
    """The CPU model has no streams: the engine's stream getter and the order's device hooks
    are replaced by recording ones. A combine that stages on the last user's stream enqueues
    no wait; one on another stream waits for the marker recorded after the last staging
    combine's kernel, before its copy; a combine whose expert_out is in the arena does not
    touch the region and neither waits nor records. Every combine matches the oracle."""
    case = _case()
    group = _group(case, arena_bytes=ARENA)
    engine = group.engine
    staging = engine.staging
    try:
        stream, log = [1], []

        def record():
            log.append(("record", stream[0]))
            return len(log) - 1

        staging.order = StreamOrder(torch.device("cpu"), record=record,
                                    wait=lambda marker: log.append(("wait", stream[0], marker)))
        engine._stream = lambda: stream[0]
        stage = staging.stage

        def logged_stage(i, *args):
            if i == 0:
                log.append(("copy", stream[0]))
            return stage(i, *args)

        staging.stage = logged_stage
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
        inside = [group.in_arena(i, torch.randn(r.tokens.shape, generator=gen).to(torch.bfloat16))
                  for i, r in enumerate(res)]
        ys = group.combine(inside, [r.handle for r in res])
        _assert_combines(ys, group.config, run, inside, idx, case, "combine of an expert_out in the arena")
        assert log == [("copy", 1), ("record", 1), ("copy", 1), ("record", 1),
                       ("wait", 2, 3), ("copy", 2), ("record", 2),
                       ("wait", 3, 6), ("copy", 3), ("record", 3)]
        assert staging.order.last_stream == 3 and staging.uses == 4
    finally:
        group.close()


def test_a_static_size_past_the_staging_region_falls_back(fresh_log):
    """num_out_tokens above the most rows a dynamic dispatch of the buffer makes: the staging
    region could not hold its combine's expert_out, so the call takes the receive path."""
    case = _case()
    group = _group(case, arena_bytes=ARENA)
    try:
        rows = group.engine.staging.rows + 10
        res = check_emulated(group, dataclasses.replace(case, num_out_tokens=rows))
        assert [r.handle.data_path for r in res] == ["receive"] * 3
        assert "combine staging region holds" in fresh_log.text
        ok = check_emulated(group, dataclasses.replace(case, num_out_tokens=group.engine.staging.rows))
        assert ok[0].handle.data_path == "direct"
    finally:
        group.close()


def test_without_an_arena_one_process_goes_direct_on_torch_outputs():
    """Ranks that share a process address each other's tensors as they are: the direct path's
    outputs are ordinary tensors from PyTorch's allocator, nothing lies in registered memory,
    and combine reads an expert_out where it lies (no staging)."""
    case = _case()
    group = _group(case)
    try:
        engine = group.engine
        assert engine.data_path == "direct" and engine.arenas == [] and engine.staging is None
        assert group.buffers.arena_bytes == 0
        for seed in (0, 1):
            res = check_emulated(group, dataclasses.replace(case, seed=seed))
            assert [r.handle.data_path for r in res] == ["direct"] * 3
            registered = [(t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in group.buffers.tables]
            for r in res:
                assert r.tokens._base is None and r.tokens.untyped_storage().nbytes() == r.tokens.nbytes
                assert not any(lo <= r.tokens.data_ptr() < hi for lo, hi in registered)
    finally:
        group.close()


def test_without_an_arena_ranks_in_separate_processes_take_the_receive_path():
    """One rank per process (an engine that drives one rank of the group, with a vote): no
    arena means its peers can not reach its tensors, so the buffer takes the receive path,
    and asking for the direct path is refused with the reason."""
    from hybrid_ep.backends.cuda.engine import Engine

    case = _case()
    group = _group(case)
    try:
        b = group.buffers
        engine = Engine(group.ext, group.config, [0], b.tables[:1], group.device, arenas=b, vote=lambda ok: ok)
        assert engine.data_path == "receive" and engine.arenas == [] and engine.staging is None
        with pytest.raises(ValueError, match="data_path=direct needs one node whose ranks address each other"):
            Engine(group.ext, group.config, [0], b.tables[:1], group.device, data_path="direct", arenas=b,
                   vote=lambda ok: ok)
    finally:
        group.close()


def test_memory_plan_reports_the_arena_and_the_staging_region():
    """The emulation's plan (ranks in one process): the arena and the staging region are
    registered regions, held when asked for."""
    one_node = BufferConfig(512, 64, 8, 4, 4).validate()
    plan = memory_plan(one_node, one_process_per_rank=False).as_dict()
    assert plan["arena"] == plan["combine_staging"] == 0  # opt-in: none by default
    sized_config = dataclasses.replace(one_node, arena_bytes=1 << 20)
    sized = memory_plan(sized_config, one_process_per_rank=False).as_dict()
    # the staging region holds fp32 rows of as many rows as a bf16 call in the arena: 1 MiB /
    # (512 x 2 + 4) = 1020, fewer than the 512 rows of the largest call (every token of every
    # rank to both local experts), so 512
    rows = 4 * 64 * 2
    assert sized["arena"] == 1 << 20
    assert sized["combine_staging"] == staging_bytes(sized_config) == rows * 512 * 4 + rows * 4
    small_config = dataclasses.replace(one_node, arena_bytes=100 * (512 * 2 + 4))
    assert staging_bytes(small_config) == 100 * 512 * 4 + 512  # 100 rows, probs aligned to 256 bytes
    two_nodes = memory_plan(BufferConfig(512, 64, 8, 4, 2, arena_bytes=1 << 20).validate(),
                            one_process_per_rank=False).as_dict()
    assert two_nodes["arena"] == two_nodes["combine_staging"] == 0


def test_a_vote_against_sends_every_rank_to_the_receive_path(fresh_log):
    """One process per GPU: this process's arenas could serve, but another rank's vote says no
    (agreement.PathVote); the engine then takes the receive path, which still matches."""
    case = _case()
    group = _group(case, arena_bytes=ARENA)
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


T1, H1, E1, K1 = 64, 256, 8, 8
ONE_CALL = call_bytes(T1 * K1, H1, torch.bfloat16)  # an arena of one call of this shape, not two


@contextlib.contextmanager
def _one_rank_direct_buffer():
    """A HybridEPBuffer of one rank over the cuda backend on the CPU model (direct path, an
    arena of one call) and a routing of T1 tokens to K1 of E1 experts: (buf, group, x, idx, w)."""
    from hybrid_ep.backends.cuda.emulation import EmulatedGroup
    from hybrid_ep.bench.host import _single_rank_buffer, _world_of_one

    g = EmulatedGroup(1, H1, T1, E1, device="cpu", data_path="direct", num_sms_dispatch=1, num_sms_combine=1,
                      arena_bytes=ONE_CALL)
    try:
        with _world_of_one():
            gen = torch.Generator().manual_seed(0)
            x = torch.randn(T1, H1, generator=gen).to(torch.bfloat16)
            idx = torch.argsort(torch.rand(T1, E1, generator=gen), dim=1)[:, :K1].contiguous()
            yield _single_rank_buffer(g), g, x, idx, torch.rand(T1, K1, generator=gen)
    finally:
        g.close()


def test_a_buffer_loop_stays_direct_with_an_arena_of_one_call(fresh_log):
    """HybridEPBuffer's last_call records each call without keeping its handle, so with the
    an arena of one call every call of a loop that drops its outputs goes direct, and the
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


def test_a_training_forward_loop_stays_direct_with_an_arena_of_one_call(fresh_log):
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


def test_an_emulated_group_takes_the_cases_arena():
    """A case that asks for an arena (Case.arena_bytes) gets a group with one, and one without
    a group without: the group cache keys on it."""
    from hybrid_ep.backends.cuda.arena import aligned
    from hybrid_ep.testing.emulated import GroupCache

    case = _case()
    sized = dataclasses.replace(case, arena_bytes=3 * 4096)
    cache = GroupCache("cpu", num_sms_dispatch=2, num_sms_combine=2)
    default = cache(case)
    assert default.buffers.arena_bytes == 0 and default.engine.arenas == []
    group = cache(sized)
    assert group is not default
    assert group.config.arena_bytes == 3 * 4096
    assert group.buffers.arena_bytes == staging_bytes(sized.config) + aligned(3 * 4096)
    check_emulated(group, sized)  # the call does not fit: the receive path, still the oracle's
    group.close()
