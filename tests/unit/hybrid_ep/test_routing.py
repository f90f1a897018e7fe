"""The routing-metadata module on hand-built routings (values derived in the comments)."""

from __future__ import annotations

import pytest
import torch

from hybrid_ep.config import BufferConfig
from hybrid_ep.routing import normalize_routing, receive_table, send_table

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")


def _config(**kw):
    args = dict(hidden_dim=8, max_tokens_per_rank=8, num_experts=4, world_size=2, ranks_per_node=1)
    args.update(kw)
    return BufferConfig(**args).validate()


def test_send_table_hand_built():
    # W=2 (two nodes of one rank), E=4, L=2. Rank-0 tokens:
    #   t0 -> experts 1, 2 (ranks 0, 1); t1 -> expert 3 (rank 1) and a dropped slot; t2 -> 0, 1 (rank 0)
    idx = torch.tensor([[1, 2], [3, -1], [0, 1]])
    w = torch.tensor([[0.5, 0.25], [1.0, 9.0], [0.75, 0.125]])
    src = send_table(normalize_routing(3, 4, CPU, topk_idx=idx, topk_weights=w), _config())
    # Rows in (rank, token) order: (r0,t0) (r0,t2) (r1,t0) (r1,t1)
    assert src.send_token_idx_S.tolist() == [0, 2, 0, 1]
    assert src.send_counts_W.tolist() == [2, 2]
    assert src.node_counts_N.tolist() == [2, 2]  # t0 reaches both nodes, t1 node 1, t2 node 0
    assert src.route_send_row_TK.tolist() == [[0, 2], [3, -1], [1, 1]]
    assert src.row_expert_mask_SL.tolist() == [[False, True], [True, True], [True, False], [False, True]]
    # Weights of -1 slots are zeroed, not sent.
    assert src.row_probs_SL.tolist() == [[0.0, 0.5], [0.75, 0.125], [0.25, 0.0], [0.0, 1.0]]


MASK = torch.tensor([[False, True], [True, True], [True, False]])


@pytest.mark.parametrize(
    "pad,num_out,pos,tpe,rows,dropped",
    [
        # counts [2, 2]; entries (v, j) = (0,1) (1,0) (1,1) (2,0)
        (1, None, [2, 0, 3, 1], [2, 2], 4, 0),
        (4, None, [4, 0, 5, 1], [4, 4], 8, 0),  # expert 1 starts at row 4
        (4, 5, [4, 0, 1], [4, 1], 5, 1),  # row 5 does not fit in 5 rows: dropped
        (1, 6, [2, 0, 3, 1], [2, 2], 6, 0),  # two trailing rows belong to no expert
        (2, 0, [], [0, 0], 0, 4),
    ],
)
def test_receive_table_hand_built(pad, num_out, pos, tpe, rows, dropped):
    d = receive_table(MASK, pad, num_out)
    assert d.out_pos_M.tolist() == pos
    assert d.tokens_per_expert_L.tolist() == tpe
    assert d.num_rows == rows
    assert int(d.num_dropped) == dropped
    assert int(d.num_needed_rows) == {1: 4, 2: 4, 4: 8}[pad]


def test_receive_table_empty():
    d = receive_table(torch.zeros(0, 3, dtype=torch.bool), 8, None)
    assert d.num_rows == 0 and d.tokens_per_expert_L.tolist() == [0, 0, 0]


def test_routing_map_normalises_like_topk():
    routing_map = torch.tensor([[False, True, True, False], [False, False, False, True], [True, False, False, False]])
    probs = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0.7, 0.8], [0.9, 1.0, 1.1, 1.2]])
    r = normalize_routing(3, 4, CPU, routing_map=routing_map, probs=probs)
    assert r.topk_idx_TK.tolist() == [[1, 2], [3, -1], [0, -1]]
    assert torch.allclose(r.topk_weights_TK, torch.tensor([[0.2, 0.3], [0.8, 0.0], [0.9, 0.0]]))


def test_routing_map_probs_gradient_flows():
    routing_map = torch.tensor([[True, False, True]])
    probs = torch.tensor([[0.25, 0.5, 0.75]], requires_grad=True)
    r = normalize_routing(1, 3, CPU, routing_map=routing_map, probs=probs)
    (r.topk_weights_TK * torch.tensor([[2.0, 3.0]])).sum().backward()
    assert probs.grad.tolist() == [[2.0, 0.0, 3.0]]


def test_int32_topk_and_default_weights():
    r = normalize_routing(2, 4, CPU, topk_idx=torch.tensor([[0, -1], [3, 2]], dtype=torch.int32))
    assert r.topk_idx_TK.dtype == torch.int64
    assert r.topk_weights_TK.tolist() == [[1.0, 0.0], [1.0, 1.0]]
