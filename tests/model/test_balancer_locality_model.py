"""The replica choice by locality through the cuda kernels on the CPU model: slot ids from
hybrid_ep.balancer.route_topk_to_slots dispatched on emulated ranks of two nodes. A route to
an expert with a copy on the token's own node never crosses to the other node (the kernels'
own count of tokens per (source, node) says so), the rows land on the local copies, and the
dispatch equals the oracle; the spreading rule over every copy sends a share across."""

from __future__ import annotations

import importlib

import pytest
import torch

from harness.emulated import emulated_group_for
from hybrid_ep.balancer import SlotTable, route_topk_to_slots
from hybrid_ep.verify.cases import Case
from hybrid_ep.verify.compare import assert_dispatch_matches
from hybrid_ep.verify.oracle import dispatch_oracle

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

# 2 nodes of 2 ranks, 2 slots per rank (node 0: slots 0-3); expert 0 (home node 0) has copies
# in slots 0, 2 (node 0) and 5 (node 1); 1, 2 and 3 one or two copies each
ROW = [0, 1, 0, 2, 3, 0, 2, 3]
W, G, E, T, H = 4, 2, 4, 24, 64


def _dispatch(num_nodes: int):
    table = SlotTable(E, len(ROW)).set_shape(W, num_nodes).load_(torch.tensor(ROW))
    g = torch.Generator().manual_seed(1)
    idx = [torch.stack([torch.zeros(T, dtype=torch.int64), 1 + torch.randint(0, 3, (T,), generator=g)], dim=1)
           for _ in range(W)]  # every token routes to expert 0 and one other expert
    slots = [route_topk_to_slots(i, table, rank=r) for r, i in enumerate(idx)]
    case = Case(world_size=W, ranks_per_node=G, num_experts=len(ROW), hidden=H, tokens=(T,) * W, topk=2)
    group = emulated_group_for(case, "cpu", num_sms_dispatch=2, num_sms_combine=2)
    try:
        xs = [torch.randn(T, H, generator=g) for _ in range(W)]
        weights = [torch.rand(T, 2, generator=g) for _ in range(W)]
        model.set_seed(W)
        res = group.dispatch(xs, slots, weights)
        group.synchronize()
        run = dispatch_oracle(group.config, xs, slots, weights)
        for r in range(W):
            got = {"tokens": res[r].tokens, "scales": res[r].scales, "probs": res[r].probs,
                   "tokens_per_expert": res[r].tokens_per_expert, "num_dropped": int(res[r].handle.num_dropped)}
            assert_dispatch_matches(got, run.ranks[r], f"rank {r}")
        return slots, [r.handle.node_counts_WN.cpu() for r in res], [r.tokens_per_expert.cpu() for r in res]
    finally:
        group.close()


def test_routes_to_a_replicated_expert_stay_on_the_own_node_through_the_kernels():
    slots, node_counts, per_expert = _dispatch(num_nodes=2)
    for r in range(W):
        own = r // G
        assert all(int(s) // 4 == own for s in slots[r][:, 0]), f"rank {r} sent expert 0 off its node"
    # node 1's tokens reach node 0 only for expert 1 (one copy there); node 0's reach node 1 for 3
    for r in range(W):
        counts = node_counts[r][r]  # every rank's table holds all sources; row r: its own tokens per node
        crossing = int(((slots[r] // 4) != r // G).any(dim=1).sum())
        assert int(counts[1 - r // G]) == crossing
    # expert 0's rows: node 0's tokens on slots 0 and 2 (ranks 0, 1), node 1's on slot 5 (rank 2)
    assert int(per_expert[0][0]) + int(per_expert[1][0]) == 2 * T and int(per_expert[2][1]) == 2 * T


def test_spreading_rule_sends_a_share_of_them_across():
    slots, _, _ = _dispatch(num_nodes=1)
    across = sum(int(((s[:, 0] // 4) != r // G).sum()) for r, s in enumerate(slots))
    assert across > 0.2 * W * T  # about a third of expert 0's routes take the copy on the other node
