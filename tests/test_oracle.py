"""The oracle itself, and the reference backend, on a routing small enough to do by hand."""

from __future__ import annotations

import torch

from hybrid_ep.config import BufferConfig
from hybrid_ep.testing import combine_oracle, dispatch_oracle

# W=2 ranks (two nodes of one), E=2 (expert 0 on rank 0, expert 1 on rank 1), H=1.
CONFIG = BufferConfig(1, 3, 2, 2, 1, pad_multiple=2)
XS = [torch.tensor([[10.0], [11.0], [12.0]]), torch.tensor([[20.0], [21.0]])]
IDX = [torch.tensor([[0, 1], [1, -1], [0, -1]]), torch.tensor([[1, 0], [-1, -1]])]
WEIGHTS = [torch.tensor([[0.5, 0.25], [1.0, 0.0], [0.75, 0.0]]), torch.tensor([[0.125, 0.875], [0.0, 0.0]])]
# Expert 0 receives (s0,t0) (s0,t2) (s1,t0); expert 1 receives (s0,t0) (s0,t1) (s1,t0); pad to 4.
WANT_ROWS = [[10.0, 12.0, 20.0, 0.0], [10.0, 11.0, 20.0, 0.0]]
WANT_PROBS = [[0.5, 0.75, 0.875, 0.0], [0.25, 1.0, 0.125, 0.0]]
# Experts double their rows; the padding row carries garbage (99) that combine must ignore.
EXPERT_OUT = [torch.tensor([[20.0], [24.0], [40.0], [99.0]]), torch.tensor([[20.0], [22.0], [40.0], [99.0]])]
WANT_Y = [[[40.0], [22.0], [24.0]], [[80.0], [0.0]]]
WANT_Y_PROBS = [[[15.0], [22.0], [18.0]], [[40.0], [0.0]]]  # 0.5*20+0.25*20, 1*22, 0.75*24; 0.875*40+0.125*40


def test_oracle_by_hand():
    run = dispatch_oracle(CONFIG, XS, IDX, WEIGHTS)
    assert [r.tokens[:, 0].tolist() for r in run.ranks] == WANT_ROWS
    assert [r.probs.tolist() for r in run.ranks] == WANT_PROBS
    assert [r.tokens_per_expert.tolist() for r in run.ranks] == [[4], [4]]
    ys, _ = combine_oracle(CONFIG, run, EXPERT_OUT, IDX)
    assert [y.tolist() for y in ys] == WANT_Y
    ys, _ = combine_oracle(CONFIG, run, EXPERT_OUT, IDX, apply_probs=True)
    assert [y.tolist() for y in ys] == WANT_Y_PROBS


def test_oracle_static_size_by_hand():
    run = dispatch_oracle(CONFIG, XS, IDX, WEIGHTS, num_out_tokens=2)
    # Only the first two rows of each rank fit: (s1,t0) is dropped on both ranks.
    assert [r.tokens[:, 0].tolist() for r in run.ranks] == [[10.0, 12.0], [10.0, 11.0]]
    assert [r.num_dropped for r in run.ranks] == [1, 1]
    assert [r.tokens_per_expert.tolist() for r in run.ranks] == [[2], [2]]
    ys, _ = combine_oracle(CONFIG, run, [o[:2] for o in EXPERT_OUT], IDX)
    assert [y.tolist() for y in ys] == [[[40.0], [22.0], [24.0]], [[0.0], [0.0]]]


def _hand_example_on_rank(apply_probs):
    import torch.distributed as dist

    import hybrid_ep as hep

    r = dist.get_rank()
    buf = hep.HybridEPBuffer(None, 1, 3, 2, ranks_per_node=1, backend="reference", pad_multiple=2)
    res = buf.dispatch(XS[r], IDX[r], WEIGHTS[r])
    y = buf.combine(EXPERT_OUT[r], res.handle, apply_probs=apply_probs)
    return res.tokens[:, 0].tolist(), res.probs.tolist(), y.tolist()


def test_reference_backend_by_hand(pool_for):
    for apply_probs, want_y in ((False, WANT_Y), (True, WANT_Y_PROBS)):
        got = pool_for(2).run(_hand_example_on_rank, [(apply_probs,), (apply_probs,)])
        assert [g[0] for g in got] == WANT_ROWS
        assert [g[1] for g in got] == WANT_PROBS
        assert [g[2] for g in got] == want_y
