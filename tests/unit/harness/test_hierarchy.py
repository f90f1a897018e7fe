"""The forward plan of the hierarchical dispatch against the traffic model and the dispatch
oracle, and the reference backend's combine hops on 2 and 3 nodes."""

from __future__ import annotations

import pytest
import torch

from harness.hierarchy import forward_plan, forwarded_rows
from hybrid_ep.config import BufferConfig
from hybrid_ep.routing import normalize_routing, receive_table, send_table
from hybrid_ep.traffic import routing_row_counts
from hybrid_ep.verify import Case, check_case, dispatch_oracle, make_rank_inputs

pytestmark = pytest.mark.unit

# (nodes, ranks per node): N in 1..4, G in {1, 2, 4}, world sizes that are not powers of two.
TOPOLOGIES = [(1, 1), (1, 4), (2, 1), (2, 2), (2, 4), (3, 1), (3, 2), (3, 4), (4, 1), (4, 2)]
ROUTINGS = [dict(routing="uniform"), dict(routing="uniform", drop_fraction=0.3), dict(routing="one-expert")]


def _case(N: int, G: int, seed: int, **kw) -> Case:
    W = N * G
    tokens = tuple((0, 33, 70, 5, 64, 31, 1, 96)[(r + seed) % 8] for r in range(W))  # 0 and non-multiples of 32
    return Case(W, G, 2 * W, 8, tokens, min(3, 2 * W), torch.bfloat16, seed=seed, **kw)


PLAN_CASES = [_case(N, G, i, **r) for i, ((N, G), r) in enumerate((t, r) for t in TOPOLOGIES for r in ROUTINGS)]


@pytest.mark.parametrize("case", PLAN_CASES, ids=[str(c) for c in PLAN_CASES])
def test_plan_matches_traffic_model(case):
    cfg = case.config
    idx = [i["topk_idx"] for i in make_rank_inputs(case)]
    plan = forward_plan(idx, cfg)
    counts = routing_row_counts(idx, cfg)
    N, G = cfg.num_nodes, cfg.ranks_per_node
    staged = torch.stack([f.staged_rows.sum() for f in plan.forwarders]).to(torch.int64)
    assert torch.equal(staged, counts.combine_rdma), "rows staged at each forwarder != RDMA rows it receives"
    sent = torch.stack([(s >= 0).sum() for s in plan.node_slot])
    assert torch.equal(sent, counts.dispatch_rdma), "staged rows of each source != its RDMA rows"
    assert torch.equal(forwarded_rows(plan, cfg), counts.dispatch_nvlink - counts.flat_dispatch_nvlink)
    for f in plan.forwarders:
        for sn in range(N):
            s = sn * G + f.rank % G
            used = f.staged_token[sn] >= 0
            if sn == cfg.node_of(f.rank):
                assert not bool(used.any()) and int(f.staged_rows[sn].sum()) == 0
                continue
            # Each chunk's staged tokens fill its first slots, in token order, from that chunk.
            per_chunk = used.view(plan.num_chunks, plan.chunk_tokens)
            assert torch.equal(per_chunk.sum(dim=1, dtype=torch.int32), f.staged_rows[sn])
            want_used = torch.arange(plan.chunk_tokens)[None, :] < f.staged_rows[sn][:, None]
            assert torch.equal(per_chunk, want_used)
            tokens = f.staged_token[sn][used].to(torch.int64)
            slots = used.nonzero()[:, 0]
            assert torch.equal(tokens // plan.chunk_tokens, slots // plan.chunk_tokens)
            assert bool((tokens[1:] > tokens[:-1]).all())
            assert torch.equal(plan.node_slot[s][tokens, cfg.node_of(f.rank)].to(torch.int64), slots)
            # Forwarded to exactly the ranks of f's node the token is routed to, into its slot there.
            node_ranks = slice(cfg.node_of(f.rank) * G, (cfg.node_of(f.rank) + 1) * G)
            assert torch.equal(f.fwd_slots[sn][used].to(torch.int64), plan.send_ord[s][tokens, node_ranks])
            assert bool((f.fwd_slots[sn][~used] == -1).all())


def _simulate_dispatch(cfg: BufferConfig, plan, xs, idx) -> list[torch.Tensor]:
    """Expert-major rows of every rank when rows from another node arrive only through the
    plan's staging and forwarding, and rows from the own node directly."""
    W, G, L = cfg.world_size, cfg.ranks_per_node, cfg.experts_per_rank
    tables = [send_table(normalize_routing(i.shape[0], cfg.num_experts, i.device, topk_idx=i), cfg) for i in idx]
    # recv[d][s][slot] = token of s in d's receive slot, filled once each.
    recv = [[torch.full((int(tables[s].send_counts_W[d]),), -1, dtype=torch.int64) for s in range(W)]
            for d in range(W)]

    def put(d, s, slot, token):
        assert int(recv[d][s][slot]) == -1, f"receive slot {slot} of source {s} at rank {d} written twice"
        recv[d][s][slot] = token

    for s in range(W):
        for d in range(W):
            if cfg.node_of(d) == cfg.node_of(s):
                for t in (plan.send_ord[s][:, d] >= 0).nonzero()[:, 0].tolist():
                    put(d, s, int(plan.send_ord[s][t, d]), t)
    for f in plan.forwarders:
        for sn in range(cfg.num_nodes):
            s = sn * G + f.rank % G
            for q in (f.staged_token[sn] >= 0).nonzero()[:, 0].tolist():
                for g in range(G):
                    slot = int(f.fwd_slots[sn][q, g])
                    if slot >= 0:
                        put(cfg.node_of(f.rank) * G + g, s, slot, int(f.staged_token[sn][q]))
    outs = []
    for d in range(W):
        assert all(bool((r >= 0).all()) for r in recv[d]), f"rank {d}: a receive slot was never written"
        first = [tables[s].send_counts_W.cumsum(0)[d] - tables[s].send_counts_W[d] for s in range(W)]
        rows = torch.cat([xs[s][recv[d][s]] for s in range(W)])
        mask = torch.cat([tables[s].row_expert_mask_SL[first[s] + torch.arange(recv[d][s].numel())]
                          for s in range(W)]) if W else torch.zeros(0, L, dtype=torch.bool)
        dest = receive_table(mask, cfg.pad_multiple, None, cfg.min_rows_per_expert)
        out = torch.zeros(dest.num_rows, cfg.hidden_dim, dtype=rows.dtype)
        out[dest.out_pos_M] = rows[dest.out_src_M]
        outs.append(out)
    return outs


@pytest.mark.parametrize("case", PLAN_CASES[::2], ids=[str(c) for c in PLAN_CASES[::2]])
def test_plan_delivers_the_oracle_dispatch(case):
    cfg = case.config
    inputs = make_rank_inputs(case)
    xs, idx = [i["x"] for i in inputs], [i["topk_idx"] for i in inputs]
    run = dispatch_oracle(cfg, xs, idx, [i["topk_weights"] for i in inputs])
    for d, got in enumerate(_simulate_dispatch(cfg, forward_plan(idx, cfg), xs, idx)):
        assert torch.equal(got.view(torch.int16), run.ranks[d].tokens.view(torch.int16)), f"rank {d}"


def test_plan_by_hand():
    # 2 nodes x 2 ranks, one expert per rank; chunks of 2 tokens. Source 0 (node 0, rail 0):
    # t0 -> ranks 2 and 3, t1 -> rank 1 (own node), t2 -> rank 3. Its forwarder on node 1 is rank 2.
    cfg = BufferConfig(8, 3, 4, 4, 2).validate()
    idx = [torch.tensor([[2, 3], [1, -1], [3, -1]])] + [torch.zeros(0, 2, dtype=torch.int64)] * 3
    plan = forward_plan(idx, cfg, chunk_tokens=2)
    assert plan.num_chunks == 2
    assert plan.node_slot[0].tolist() == [[-1, 0], [-1, -1], [-1, 2]]
    f = plan.forwarders[2]
    assert f.staged_rows.tolist() == [[1, 1], [0, 0]]
    assert f.staged_token[0].tolist() == [0, -1, 2, -1]
    assert f.fwd_slots[0].tolist() == [[0, 0], [-1, -1], [-1, 1], [-1, -1]]
    assert forwarded_rows(plan, cfg).tolist() == [0, 0, 2, 0]  # t0 and t2 to rank 3; t0 kept on rank 2
    assert all(int(p.staged_rows.sum()) == 0 for p in plan.forwarders if p.rank != 2)


def test_plan_rejects_bad_arguments():
    cfg = BufferConfig(8, 4, 4, 4, 2).validate()
    idx = [torch.zeros(2, 1, dtype=torch.int64)] * 4
    with pytest.raises(ValueError, match="chunk_tokens must be >= 1"):
        forward_plan(idx, cfg, chunk_tokens=0)
    with pytest.raises(TypeError, match="chunk_tokens must be an int"):
        forward_plan(idx, cfg, chunk_tokens=32.0)
    with pytest.raises(ValueError, match="expected world_size=4"):
        forward_plan(idx[:3], cfg)
    with pytest.raises(ValueError, match=r"topk_idx_per_rank\[1\] has 5 tokens.*max_tokens_per_rank=4"):
        forward_plan([idx[0], torch.zeros(5, 1, dtype=torch.int64)] + idx[2:], cfg)
    with pytest.raises(ValueError, match="topk_idx values must be in"):
        forward_plan([torch.full((2, 1), 4)] + idx[1:], cfg)


# -- the reference backend's combine hops ---------------------------------------------------

# Rank r's expert output; token 0 of rank 0 goes to ranks 1, 2, 3, token 1 (W=6) to ranks 1,
# 4, 5. On nodes of 2 ranks, each token's remote node partial 1 + 2^-8 is a bf16 tie that
# rounds to 1, and so does 1 + 2^-8 at the source; on one node the sum is 1 + 2^-7, exact.
TIE_OUTPUT = {1: 2**-8, 2: 1.0, 3: 2**-8, 4: 1.0, 5: 2**-8}


def _tie_routes(world_size: int) -> torch.Tensor:
    return torch.tensor([[1, 2, 3], [1, 4, 5]][: 1 if world_size == 4 else 2])


def _tie_on_rank(ranks_per_node: int):
    import torch.distributed as dist

    import hybrid_ep as hep

    r, W = dist.get_rank(), dist.get_world_size()
    idx = _tie_routes(W) if r == 0 else torch.zeros(0, 3, dtype=torch.int64)
    buf = hep.HybridEPBuffer(None, 8, 2, W, ranks_per_node=ranks_per_node, backend="reference")
    res = buf.dispatch(torch.ones(idx.shape[0], 8, dtype=torch.bfloat16), idx)
    out = torch.full(res.tokens.shape, TIE_OUTPUT.get(r, 0.0), dtype=torch.bfloat16)
    return buf.combine(out, res.handle).float().tolist()


@pytest.mark.parametrize("world_size", [4, 6])
def test_reference_rounds_once_per_hop(pool_for, world_size):
    """2 and 3 nodes of 2 ranks: the remote node's partial is rounded again; one node: once."""
    from hybrid_ep.verify import combine_hops_oracle
    from hybrid_ep.verify.compare import combine_output_range

    idx = [_tie_routes(world_size)] + [torch.zeros(0, 3, dtype=torch.int64)] * (world_size - 1)
    for G, want in ((2, 1.0), (world_size, 1 + 2**-7)):
        got = pool_for(world_size).run(_tie_on_rank, [(G,)] * world_size)
        assert got[0] == [[want] * 8] * idx[0].shape[0]
        cfg = BufferConfig(8, 2, world_size, world_size, G).validate()
        run = dispatch_oracle(cfg, [torch.ones(i.shape[0], 8) for i in idx], idx)
        outs = [torch.full(r.tokens.shape, TIE_OUTPUT.get(d, 0.0), dtype=torch.bfloat16)
                for d, r in enumerate(run.ranks)]
        lo, hi = combine_output_range(combine_hops_oracle(cfg, run, outs, idx)[0], torch.bfloat16)
        assert lo.tolist() == hi.tolist() == got[0]


def test_reference_three_nodes_matches_the_hop_model(pool_for):
    check_case(pool_for(6), Case(6, 2, 12, 64, (40, 0, 33, 64, 17, 50), 4, torch.bfloat16, apply_probs=True,
                                 drop_fraction=0.1, seed=21))
