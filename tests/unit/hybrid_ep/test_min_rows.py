"""min_rows_per_expert: every local expert's block has roundup(max(n_j, min_rows), pad) rows.

Experts that receive no token must still get min_rows zero rows with prob 0, so a grouped
GEMM after dispatch never sees an empty group. Checked on hand-built layouts, against the
oracle on 1 to 4 gloo ranks, in static-size mode (clipped at R rows) and through autograd.
"""

from __future__ import annotations

import pytest
import torch

from hybrid_ep.config import BufferConfig
from hybrid_ep.routing import receive_table
from hybrid_ep.verify import Case, check_case, combine_oracle, dispatch_oracle, make_rank_inputs
from hybrid_ep.verify.cases import dense_autograd_oracle, run_autograd_on_rank

pytestmark = pytest.mark.unit

# Received rows x local experts: counts [2, 0, 1] (expert 1 receives nothing).
MASK = torch.tensor([[True, False, False], [True, False, True]])


@pytest.mark.parametrize(
    "min_rows,pad,num_out,pos,tpe,rows",
    [
        # entries (v, j) = (0,0) (1,0) (1,2)
        (0, 1, None, [0, 1, 2], [2, 0, 1], 3),  # the layout without the option
        (1, 1, None, [0, 1, 3], [2, 1, 1], 4),  # expert 1 gets one zero row
        (3, 1, None, [0, 1, 6], [3, 3, 3], 9),  # every block grows to 3
        (3, 2, None, [0, 1, 8], [4, 4, 4], 12),  # 3 rounded up to a multiple of 2
        (8, 8, None, [0, 1, 16], [8, 8, 8], 24),
        (2, 1, 5, [0, 1, 4], [2, 2, 1], 5),  # clipped at R = 5: expert 2's real row (row 4) fits
        (2, 1, 4, [0, 1], [2, 2, 0], 4),  # R = 4: expert 2's row is dropped
        (1, 1, 6, [0, 1, 3], [2, 1, 1], 6),  # R = 6 > 4 needed: rows 4, 5 belong to no expert
    ],
)
def test_receive_table_min_rows_hand_built(min_rows, pad, num_out, pos, tpe, rows):
    d = receive_table(MASK, pad, num_out, min_rows)
    assert d.out_pos_M.tolist() == pos
    assert d.tokens_per_expert_L.tolist() == tpe
    assert d.num_rows == rows
    needed = sum(-(-max(n, min_rows) // pad) * pad for n in (2, 0, 1))
    assert int(d.num_needed_rows) == needed
    assert int(d.num_dropped) == 3 - len(pos)


def test_receive_table_min_rows_without_received_rows():
    d = receive_table(torch.zeros(0, 3, dtype=torch.bool), 4, None, 5)
    assert d.num_rows == 24 and d.tokens_per_expert_L.tolist() == [8, 8, 8]
    assert d.out_pos_M.numel() == 0


def test_oracle_min_rows_by_hand():
    # W=2, E=4 (L=2), H=1. Rank 0 tokens go to experts 0 and 2 only; rank 1 sends nothing:
    # experts 1 and 3 receive no token.
    config = BufferConfig(1, 2, 4, 2, 1, pad_multiple=2, min_rows_per_expert=3).validate()
    xs = [torch.tensor([[5.0], [6.0]]), torch.zeros(0, 1)]
    idx = [torch.tensor([[0, 2], [0, -1]]), torch.zeros(0, 2, dtype=torch.int64)]
    w = [torch.tensor([[0.5, 0.5], [1.0, 0.0]]), torch.zeros(0, 2)]
    run = dispatch_oracle(config, xs, idx, w)
    # Each block: max(n, 3) rounded up to 4 rows.
    assert run.ranks[0].tokens[:, 0].tolist() == [5.0, 6.0, 0, 0, 0, 0, 0, 0]
    assert run.ranks[0].probs.tolist() == [0.5, 1.0, 0, 0, 0, 0, 0, 0]
    assert run.ranks[1].tokens[:, 0].tolist() == [5.0, 0, 0, 0, 0, 0, 0, 0]
    assert [r.tokens_per_expert.tolist() for r in run.ranks] == [[4, 4], [4, 4]]
    outs = [torch.full((8, 1), 7.0), torch.full((8, 1), 9.0)]  # padding rows hold garbage
    ys, _ = combine_oracle(config, run, outs, idx)
    assert ys[0].tolist() == [[16.0], [7.0]]


def test_min_rows_validated():
    with pytest.raises(ValueError, match="min_rows_per_expert must be >= 0"):
        BufferConfig(8, 4, 4, 2, 1, min_rows_per_expert=-1).validate()
    with pytest.raises(TypeError, match="min_rows_per_expert must be an int"):
        BufferConfig(8, 4, 4, 2, 1, min_rows_per_expert=1.5).validate()


def test_buffer_rejects_negative_min_rows(single_rank_group):
    import hybrid_ep as hep

    with pytest.raises(ValueError, match="min_rows_per_expert"):
        hep.HybridEPBuffer(single_rank_group, 8, 4, 2, backend="reference", min_rows_per_expert=-2)
    buf = hep.HybridEPBuffer(single_rank_group, 8, 4, 2, backend="reference", min_rows_per_expert=16)
    assert buf.config.min_rows_per_expert == 16


def _real_counts(case: Case, inputs: list[dict]) -> torch.Tensor:
    """[E] routed (token, expert) entries per expert over all ranks."""
    counts = torch.zeros(case.num_experts + 1, dtype=torch.int64)
    for i in inputs:
        idx = i["topk_idx"].flatten()
        counts += torch.bincount(torch.where(idx >= 0, idx, case.num_experts), minlength=case.num_experts + 1)
    return counts[:-1]


# (W, G, tokens, topk, routing): few tokens over many experts, or all on one expert, so that
# several experts on several ranks receive no token; rank 0 of W > 1 has no token at all.
SHAPES = [
    (1, 1, (5,), 1, "uniform"),
    (2, 1, (0, 6), 1, "one-expert"),
    (3, 1, (0, 4, 2), 2, "uniform"),
    (4, 2, (0, 3, 1, 2), 1, "uniform"),
]
MIN_PAD = [(0, 8), (1, 1), (1, 4), (8, 1), (8, 8), (16, 4), (16, 16)]


def _cases():
    cases, seed = [], 300
    for k, (W, G, tokens, topk, routing) in enumerate(SHAPES):
        for m, (min_rows, pad) in enumerate(MIN_PAD):
            # Spread the options over the shapes: every shape gets 0, 1, 8 and 16.
            if (k + m) % 2 and min_rows not in (0, 16):
                continue
            dtype = (torch.float32, torch.bfloat16, torch.float8_e4m3fn)[(k + m) % 3]
            cases.append(Case(W, G, 4 * W, 128, tokens, topk, dtype, routing=routing, pad_multiple=pad,
                              min_rows_per_expert=min_rows, apply_probs=bool(m % 2), seed=seed))
            seed += 1
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_min_rows_matches_oracle(pool_for, case):
    inputs = make_rank_inputs(case)
    real = _real_counts(case, inputs)
    assert bool((real == 0).any()), "the case must have an expert without tokens"
    results = check_case(pool_for(case.world_size), case)
    L, m, pad = case.num_experts // case.world_size, case.min_rows_per_expert, case.pad_multiple
    for r, got in enumerate(results):
        tpe = got["tokens_per_expert"]
        mine = real[r * L:(r + 1) * L]
        want = ((mine.clamp(min=m) + pad - 1) // pad) * pad
        assert tpe.tolist() == want.tolist(), f"rank {r}"
        # Blocks of experts without tokens: exactly their padding rows, all zero, prob 0.
        starts = tpe.cumsum(0) - tpe
        for j in (mine == 0).nonzero()[:, 0].tolist():
            block = slice(int(starts[j]), int(starts[j] + tpe[j]))
            assert int(tpe[j]) >= m
            assert bool((got["tokens"][block].float() == 0).all()) and bool((got["probs"][block] == 0).all())


@pytest.mark.parametrize("min_rows,num_out", [(8, 20), (8, 40), (16, 100), (1, 3)])
def test_min_rows_static_size(pool_for, min_rows, num_out):
    """Clipped at R rows as without the option; rows past the last block are zero."""
    case = Case(2, 1, 8, 128, (0, 6), 1, torch.bfloat16, routing="one-expert",
                min_rows_per_expert=min_rows, num_out_tokens=num_out, seed=400 + min_rows)
    results = check_case(pool_for(2), case)
    for got in results:
        used = int(got["tokens_per_expert"].sum())
        assert got["tokens"].shape[0] == num_out and used <= num_out
        assert bool((got["tokens"][used:].float() == 0).all()) and bool((got["probs"][used:] == 0).all())
        assert got["num_needed_rows"] >= 4 * min_rows


def test_min_rows_gradients(pool_for):
    case = Case(3, 1, 12, 32, (0, 4, 3), 2, min_rows_per_expert=8, pad_multiple=4, seed=410)
    gen = torch.Generator().manual_seed(411)
    inputs = make_rank_inputs(case)
    assert bool((_real_counts(case, inputs) == 0).any())
    weights = torch.randn(case.num_experts, case.hidden, case.hidden, generator=gen) / case.hidden**0.5
    grad_ys = [torch.randn(i["x"].shape, generator=gen) for i in inputs]
    run = dispatch_oracle(case.config, [i["x"] for i in inputs], [i["topk_idx"] for i in inputs],
                          [i["topk_weights"] for i in inputs])
    want = dense_autograd_oracle(case, inputs, weights, grad_ys, run.row_of_route)
    got = pool_for(3).run(run_autograd_on_rank, [(case, inputs[r], weights, grad_ys[r], True) for r in range(3)])
    for s, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g["y"].double(), w["y"], rtol=1e-5, atol=1e-6, msg=f"rank {s} y")
        torch.testing.assert_close(g["grad_x"].double(), w["grad_x"], rtol=1e-5, atol=1e-6, msg=f"rank {s} grad x")
        want_w = torch.where(inputs[s]["topk_idx"] >= 0, w["grad_weights"], 0.0)
        torch.testing.assert_close(g["grad_weights"].double(), want_w, rtol=1e-5, atol=1e-6,
                                   msg=f"rank {s} grad routing weights")


def test_memory_plan_covers_min_rows(single_rank_group):
    import hybrid_ep as hep

    plain = hep.HybridEPBuffer(single_rank_group, 128, 4, 8, backend="reference").memory_plan()
    padded = hep.HybridEPBuffer(single_rank_group, 128, 4, 8, backend="reference",
                                min_rows_per_expert=16, pad_multiple=8).memory_plan()
    # 8 local experts, each up to 16 + 8 - 1 extra rows of 128 fp32.
    extra = padded.as_dict()["expert_rows"] - plain.as_dict()["expert_rows"]
    assert extra == 8 * (16 + 7) * 128 * 4
