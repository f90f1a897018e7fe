"""The kernels on the CPU model as ranks in separate processes run them: every virtual rank has
its own growable peer memory and maps its node peers' at addresses of its own, so the direct
kernels translate every published offset through a table that differs per rank; every call's
path is agreed on the count kernel's count exchange. Against the oracle, one node and two."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_ep.backends.cuda import chunk_channel
from hybrid_ep.testing.cases import Case
from hybrid_ep.testing.emulated import check_emulated, emulated_group_for

pytestmark = pytest.mark.model


def _group(case: Case, **kw):
    return emulated_group_for(case, "cpu", separate_processes=True, num_sms_dispatch=1, num_sms_combine=1, **kw)


def _bases_differ(group) -> None:
    """Every rank sees each node peer's memory at another address than the owner and than the
    other ranks of the node."""
    G, W = group.config.ranks_per_node, group.world_size
    tables = [t.tolist() for t in group.engine.bases_tables]
    for d in range(W):
        seen = [tables[r][d] for r in range(W) if r // G == d // G]
        assert len(set(seen)) == len(seen) and all(seen), (d, seen)


@pytest.mark.parametrize("W,G", [(3, 3), (4, 2)])  # in this order the odd FIFO of 13 stages read rows unloaded
def test_rising_sizes_go_direct_from_the_call_after_each_growth(W, G):
    case = Case(world_size=W, ranks_per_node=G, num_experts=2 * W, hidden=2048, tokens=(7, 0, 9, 5)[:W], topk=2,
                backend="cuda")
    group = _group(dataclasses.replace(case, tokens=(160,) * W))  # fp32 rows of 8 KiB: 2 MiB hold ~128 rows
    try:
        _bases_differ(group)
        paths, extents = [], []
        big = (100, 160, 120, 150)[:W]
        for n, tokens in enumerate([case.tokens, case.tokens, big, big]):
            res = check_emulated(group, dataclasses.replace(case, tokens=tokens, seed=n // 2))  # each size twice
            paths.append(res[0].handle.data_path)
            extents.append([m.extent for m in group.peer.own])
        assert paths == ["receive", "direct", "receive", "direct"]
        assert all(e > 0 for e in extents[0]) and any(b > a for a, b in zip(extents[1], extents[2]))
        # (check_emulated's re-dispatch keeps a second output alive: it may grow again for it)
    finally:
        group.close()


def test_a_static_size_goes_direct_on_the_ledger_without_reading():
    case = Case(world_size=3, ranks_per_node=3, num_experts=6, hidden=128, tokens=(9, 4, 0), topk=2,
                num_out_tokens=24, backend="cuda")
    group = _group(case)
    try:
        paths = [check_emulated(group, dataclasses.replace(case, seed=n))[0].handle.data_path for n in range(4)]
        # The first call reads (the ledger is empty) and grows; the second reads and goes direct;
        # from then on the ledger holds the calls (reads counted per call that read).
        assert paths == ["receive", "direct", "direct", "direct"]
        assert group.peer.reads < 2 * 4  # each check makes a dispatch and a re-dispatch
    finally:
        group.close()


def test_calls_the_ledger_holds_map_nothing_and_the_next_read_maps_the_growth():
    """A held call sets no agreement words (no rank reads them) and maps nothing: after a growth,
    node peers map the new chunks at the next call that reads, and that call goes direct into
    them. Static sizes on one node of 3, the oracle after every call."""
    W, H, T, K, E = 3, 2048, 8, 2, 6
    small, big = W * T * K, 300  # fp32 rows of 8 KiB: 300 rows and their expert-out block need 3 chunks
    group = emulated_group_for(Case(world_size=W, ranks_per_node=W, num_experts=E, hidden=H, tokens=(T,) * W,
                                    topk=K, backend="cuda"), "cpu", separate_processes=True, num_sms_dispatch=1,
                               num_sms_combine=1)
    set_words = []
    host = group.engine.host

    class Host:  # counts the agreement words set per call
        def __getattr__(self, name):
            if name == "set_agree":
                set_words.append(1)
            return getattr(host, name)

    group.engine.host = Host()
    try:
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(T, H, generator=gen) for _ in range(W)]
        idx = [torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous() for _ in range(W)]
        ws = [torch.rand(T, K, generator=gen) for _ in range(W)]
        seen = []
        for rows in (small, small, big, small, big):
            set_words.clear()
            reads = group.peer.reads
            res = group.dispatch(xs, idx, ws, num_out_tokens=rows)
            ys = group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
            group.synchronize()
            for y, x, w in zip(ys, xs, ws):
                torch.testing.assert_close(y, (w[:, :, None] * x[:, None, :]).sum(1), rtol=1e-5, atol=1e-5)
            mapped = [v.mapped(p) for v in group.peer.views for p in v.bases]
            seen.append((res[0].handle.data_path, group.peer.reads - reads, len(set_words),
                         min(mapped) == max(m.extent for m in group.peer.own)))
            del res, ys
        assert seen == [("receive", 1, W, False),  # no ledger yet: reads, grows (peers map at the next read)
                        ("direct", 1, W, True),  # reads: every peer mapped, direct
                        ("receive", 1, W, False),  # the ledger does not hold it: reads, grows
                        ("direct", 0, 0, False),  # held within the last read's limits: no words, nothing mapped
                        ("direct", 1, W, True)]  # reads: peers map the growth, direct into it
    finally:
        group.engine.host = host
        group.close()


def test_a_failed_import_costs_one_call_and_the_oracle_still_matches(monkeypatch):
    small = Case(world_size=3, ranks_per_node=3, num_experts=6, hidden=2048, tokens=(9, 4, 7), topk=2, backend="cuda")
    big = dataclasses.replace(small, tokens=(100, 160, 120))  # more than the first chunk holds
    group = _group(big)
    try:
        xs = lambda c: [torch.randn(t, 2048, generator=torch.Generator().manual_seed(t)) for t in c.tokens]  # noqa: E731
        idx = lambda c: [torch.argsort(torch.rand(t, 6, generator=torch.Generator().manual_seed(t + 1)),  # noqa: E731
                                       dim=1)[:, :2].contiguous() for t in c.tokens]
        paths = [group.dispatch(xs(small), idx(small))[0].handle.data_path for _ in range(2)]
        paths.append(group.dispatch(xs(big), idx(big))[0].handle.data_path)  # grows
        monkeypatch.setattr("hybrid_ep.backends.cuda.peer_memory.fetch_chunk", lambda *a, **k: "refused (test)")
        paths.append(group.dispatch(xs(big), idx(big))[0].handle.data_path)  # no rank can import: receive
        assert all(v.failed_imports > 0 for v in group.peer.views)
        monkeypatch.setattr("hybrid_ep.backends.cuda.peer_memory.fetch_chunk", chunk_channel.fetch_chunk)
        paths.append(group.dispatch(xs(big), idx(big))[0].handle.data_path)  # imports, goes direct
        assert paths == ["receive", "direct", "receive", "receive", "direct"]
        check_emulated(group, big)  # and the buffer still matches the oracle
    finally:
        group.close()


def test_an_expert_out_in_the_expert_out_block_is_read_in_place():
    case = Case(world_size=2, ranks_per_node=2, num_experts=4, hidden=128, tokens=(8, 6), topk=2, backend="cuda")
    group = _group(case)
    try:
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(t, 128, generator=gen) for t in case.tokens]
        idx = [torch.argsort(torch.rand(t, 4, generator=gen), dim=1)[:, :2].contiguous() for t in case.tokens]
        for _ in range(2):
            res = group.dispatch(xs, idx)
        assert res[0].handle.data_path == "direct"
        outs = [group.in_peer_memory(i, r.tokens.float() * 2) for i, r in enumerate(res)]
        assert all(group.peer.own[i].arena.contains(o) for i, o in enumerate(outs))
        before = group.engine.expert_out_copies
        ys = group.combine(outs, [r.handle for r in res])
        assert group.engine.expert_out_copies == before  # read in place: nothing copied
        ys_copied = group.combine([o.clone() for o in outs], [r.handle for r in res])
        assert group.engine.expert_out_copies == before + 1  # from outside peer memory: one copy
        for a, b in zip(ys, ys_copied):
            torch.testing.assert_close(a, b)
        for y, x, i in zip(ys, xs, idx):
            torch.testing.assert_close(y, 2 * x * (i >= 0).sum(1, keepdim=True).float())
    finally:
        group.close()


def test_captured_pairs_go_direct_after_a_warm_up_and_keep_their_blocks(monkeypatch):
    """CUDA graphs, with the capture faked where the backend asks (capture.capturing): after
    warm-up calls outside a capture, static-size dispatch + combine pairs captured go direct on
    the ledger, read nothing back and grow nothing; a captured call the ledger cannot hold
    takes the receive path, still growing nothing; the blocks taken inside the capture stay
    taken (every replay writes them), and a later release_unused retires no memory under them."""
    from hybrid_ep.backends.cuda import capture

    case = Case(world_size=3, ranks_per_node=3, num_experts=6, hidden=128, tokens=(9, 4, 7), topk=2,
                num_out_tokens=24, backend="cuda")
    group = _group(case)
    try:
        warm = [check_emulated(group, dataclasses.replace(case, seed=n))[0].handle.data_path for n in range(2)]
        assert warm == ["receive", "direct"]
        own = group.peer.own
        extents, reads = [m.extent for m in own], group.peer.reads
        assert all(m.arena.kept == 0 for m in own)
        monkeypatch.setattr(capture, "capturing", lambda device: True)
        captured = [check_emulated(group, dataclasses.replace(case, seed=n)) for n in range(2, 5)]
        assert [res[0].handle.data_path for res in captured] == ["direct"] * 3
        assert group.peer.reads == reads and [m.extent for m in own] == extents  # no read, no growth
        assert all(m.arena.kept > 0 for m in own)
        kept = [m.arena.kept for m in own]
        big = dataclasses.replace(case, num_out_tokens=8192, seed=5)  # 4 MiB of rows: more than the ledger holds
        assert check_emulated(group, big)[0].handle.data_path == "receive"
        assert group.peer.reads == reads and [m.extent for m in own] == extents
        monkeypatch.setattr(capture, "capturing", lambda device: False)
        blocks = [(r.tokens.data_ptr(), r.tokens.numel() * r.tokens.element_size()) for res in captured for r in res]
        del captured
        assert [check_emulated(group, big)[0].handle.data_path for _ in range(2)] == ["receive", "direct"]
        grown = [m.extent for m in own]
        assert all(g > e for g, e in zip(grown, extents))  # outside the capture the big call grew
        group.peer.trim_requested = True
        check_emulated(group, dataclasses.replace(case, seed=6))  # the trimming call
        check_emulated(group, dataclasses.replace(case, seed=7))  # peers unmapped: the tail goes
        assert all(m.extent < g for m, g in zip(own, grown))  # a free tail was retired
        assert [m.arena.kept for m in own] == kept
        for i, m in enumerate(own):
            for ptr, nbytes in blocks[i::3]:
                assert m.base <= ptr and ptr + nbytes <= m.base + m.extent, (i, ptr, nbytes, m.extent)
    finally:
        group.close()


def _bf16_calls(group, case, seed=0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(t, case.hidden, generator=gen).bfloat16() for t in case.tokens]
    idx = [torch.argsort(torch.rand(t, case.num_experts, generator=gen), dim=1)[:, :2].contiguous()
           for t in case.tokens]
    return xs, idx


def test_a_bf16_call_copies_its_expert_out_into_a_bf16_block():
    """After bf16 dispatches the expert-out block holds bf16 rows (half an fp32 block): a
    combine of an expert_out from outside peer memory copies exactly its bytes there, and an
    fp32 expert_out, which the block was not sized for, is refused naming the dtype."""
    case = Case(world_size=2, ranks_per_node=2, num_experts=4, hidden=128, tokens=(8, 6), topk=2, backend="cuda")
    group = _group(case)
    try:
        xs, idx = _bf16_calls(group, case)
        for _ in range(2):
            res = group.dispatch(xs, idx)
        assert res[0].handle.data_path == "direct"
        rows = [r.tokens.shape[0] for r in res]
        blocks = group.engine.outputs.expert_out_blocks
        assert [b.numel() for b in blocks] == [-(-R * 128 * 2 // 128) * 128 for R in rows]  # bf16, 128-byte aligned
        before = group.engine.expert_out_copied_bytes
        ys = group.combine([r.tokens * 2 for r in res], [r.handle for r in res])
        assert group.engine.expert_out_copied_bytes - before == sum(R * 128 * 2 for R in rows)
        for y, x, i in zip(ys, xs, idx):
            assert y.dtype == torch.bfloat16
            torch.testing.assert_close(y.float(), 2 * x.float() * (i >= 0).sum(1, keepdim=True).float())
        with pytest.raises(ValueError, match=r"expert_out on rank 0 is torch.float32 \[128 columns\], outside peer "
                                             r"memory.*2-byte values"):
            group.combine([r.tokens.float() for r in res], [r.handle for r in res])
    finally:
        group.close()


def test_an_expert_out_view_of_a_replaced_block_is_refused():
    """A view of the expert-out block taken before a larger dispatch replaced the block would be
    read from freed peer memory: its combine is refused; a view taken after it is read in place."""
    case = Case(world_size=2, ranks_per_node=2, num_experts=4, hidden=128, tokens=(8, 6), topk=2, backend="cuda")
    big = dataclasses.replace(case, tokens=(40, 30))
    group = _group(big)
    try:
        xs, idx = _bf16_calls(group, case)
        for _ in range(2):
            res = group.dispatch(xs, idx)
        views = [group.engine.expert_out_view(i, r.tokens.shape, torch.bfloat16, like=r.tokens)
                 for i, r in enumerate(res)]
        xs_big, idx_big = _bf16_calls(group, big, seed=1)
        for _ in range(2):
            res_big = group.dispatch(xs_big, idx_big)  # larger: a new expert-out block
        assert res_big[0].handle.data_path == "direct"
        with pytest.raises(ValueError, match="an expert_out_view of an expert-out block that a later dispatch "
                                             "replaced"):
            group.combine(views, [r.handle for r in res])
        before = group.engine.expert_out_copies
        fresh = [group.engine.expert_out_view(i, r.tokens.shape, torch.bfloat16, like=r.tokens)
                 for i, r in enumerate(res_big)]
        ys = group.combine(fresh, [r.handle for r in res_big])
        assert group.engine.expert_out_copies == before
        for y, x, i in zip(ys, xs_big, idx_big):
            torch.testing.assert_close(y.float(), x.float() * (i >= 0).sum(1, keepdim=True).float())
    finally:
        group.close()
