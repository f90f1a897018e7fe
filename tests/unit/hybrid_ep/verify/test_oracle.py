"""The oracle itself, and the reference backend, on a routing small enough to do by hand; the
combine's hop model: exact where it must be, tight enough to catch a wrong rounding."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from hybrid_ep.config import BufferConfig
from hybrid_ep.verify import (
    Case,
    assert_combine_within,
    combine_hops_oracle,
    combine_oracle,
    combine_tolerance,
    dispatch_oracle,
    make_rank_inputs,
)
from hybrid_ep.verify.compare import combine_output_range
from hybrid_ep.verify.oracle import _rank_terms
from hybrid_ep.verify.rounding import Fp32Sum, Interval, exponent_of, power_of_two, quantum, round_to

pytestmark = pytest.mark.unit

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
    # The hand example's one column repeated 4 times: a row of 4 fp32 values is the smallest
    # row (16 bytes) every backend takes.
    buf = hep.HybridEPBuffer(None, 4, 3, 2, ranks_per_node=1, backend="reference", pad_multiple=2)
    res = buf.dispatch(XS[r].repeat(1, 4), IDX[r], WEIGHTS[r])
    y = buf.combine(EXPERT_OUT[r].repeat(1, 4), res.handle, apply_probs=apply_probs)
    assert torch.equal(res.tokens, res.tokens[:, :1].repeat(1, 4)) and torch.equal(y, y[:, :1].repeat(1, 4))
    return res.tokens[:, 0].tolist(), res.probs.tolist(), y[:, :1].tolist()


def test_reference_backend_by_hand(pool_for):
    for apply_probs, want_y in ((False, WANT_Y), (True, WANT_Y_PROBS)):
        got = pool_for(2).run(_hand_example_on_rank, [(apply_probs,), (apply_probs,)])
        assert [g[0] for g in got] == WANT_ROWS
        assert [g[1] for g in got] == WANT_PROBS
        assert [g[2] for g in got] == want_y


# -- the combine hops ---------------------------------------------------------------------

BF16 = torch.bfloat16


def test_round_to_rounds_once():
    # torch casts float64 to bfloat16 through float32 and rounds twice; round_to rounds once.
    x = torch.tensor([1 + 2**-8 + 2**-30, 1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8 + 2**-30), 3.5e38], dtype=torch.float64)
    assert round_to(x, BF16).tolist() == [1 + 2**-7, 1.0, 1 + 2**-6, -(1 + 2**-7), float("inf")]
    assert x[:1].to(BF16).item() == 1.0
    gen = torch.Generator().manual_seed(0)
    y = torch.randn(20000, dtype=torch.float64, generator=gen) * torch.exp2(
        torch.randint(-140, 120, (20000,), generator=gen).double())
    f = y.float()
    assert torch.equal(round_to(y, torch.float32), f.double())
    assert torch.equal(round_to(f.double(), BF16), f.to(BF16).double())
    h = (f / 2.0**110).double()
    assert torch.equal(round_to(h, torch.float16), h.float().half().double())


_DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", _DEVICES)
def test_powers_of_two_and_exponents_are_exact_on_every_device(device):
    """CUDA's float64 pow(2, e) is off by an ulp for some e: a quantum built that way made
    round_to return 0.29687499999999994 for the bf16 value 0.296875, and every GPU combine
    check failed. The bits give exact powers and exponents on any device."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    e = torch.arange(-1022, 1024, device=device)
    want = [math.ldexp(1.0, int(k)) for k in e.tolist()]
    assert power_of_two(e).tolist() == want
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(5000, dtype=torch.float64, generator=gen) *
         torch.tensor([math.ldexp(1.0, int(k)) for k in torch.randint(-300, 300, (5000,), generator=gen)],
                      dtype=torch.float64)).to(device)
    assert exponent_of(x).tolist() == [math.frexp(v)[1] - 1 for v in x.tolist()]
    exact = x.to(BF16).double()  # bf16 values: rounding them again changes nothing
    assert torch.equal(round_to(exact, BF16), exact)
    assert torch.equal(quantum(exact, BF16).cpu(), quantum(exact.cpu(), BF16))


def test_fp32_sum_exact_or_bounded():
    # 1 + 2^-8 is exact in fp32 (a bf16 tie, kept as such); 2^30 + 1 is not: fp32 gives 2^30.
    cases = [([1.0, 2**-8], True), ([2.0**30, 1.0], False), ([0.1, 0.2, 0.3], False)]
    for terms, exact in cases:
        acc = Fp32Sum((1,), "cpu")
        for t in terms:
            acc.add(Interval.point(torch.tensor([t], dtype=torch.float64)), torch.tensor([True]))
        got = acc.result()
        fp32 = float(torch.tensor(terms, dtype=torch.float32).sum())
        assert float(got.lo) <= fp32 <= float(got.hi)
        assert (float(got.lo) == float(got.hi) == sum(terms)) == exact, (terms, got)


# 2 nodes x 2 ranks, one expert per rank. Token 0 of rank 0 goes to rank 1 (its node) and to
# ranks 2 and 3 (node 1): outputs 2^-8, 1 and 2^-8. Node 1's partial 1 + 2^-8 is a bf16 tie and
# rounds to 1; then 1 + 2^-8 rounds to 1 again. Rounded once, 1 + 2^-7 is exact.
TIE_IDX = [torch.tensor([[1, 2, 3]])] + [torch.zeros(0, 3, dtype=torch.int64)] * 3
TIE_OUT = [torch.zeros(0, 1, dtype=BF16)] + [torch.tensor([[v]], dtype=BF16) for v in (2**-8, 1.0, 2**-8)]


def _tie_bounds(ranks_per_node, wire_dtype=None):
    cfg = BufferConfig(1, 1, 4, 4, ranks_per_node).validate()
    run = dispatch_oracle(cfg, [torch.ones(i.shape[0], 1) for i in TIE_IDX], TIE_IDX)
    return combine_hops_oracle(cfg, run, TIE_OUT, TIE_IDX, wire_dtype=wire_dtype)[0]


def test_two_roundings_differ_from_one():
    two_nodes = _tie_bounds(2)
    # The source's fp32 sum is 1 + 2^-8 exactly (one value, whatever the order), cast to 1.
    assert two_nodes.lo.item() == two_nodes.hi.item() == two_nodes.value.item() == 1 + 2**-8
    assert [t.item() for t in combine_output_range(two_nodes, BF16)] == [1.0, 1.0]
    assert two_nodes.hops.tolist() == [2]
    for flat in (_tie_bounds(4), _tie_bounds(1), _tie_bounds(2, torch.float32)):
        assert flat.lo.item() == flat.hi.item() == 1 + 2**-7
        assert [t.item() for t in combine_output_range(flat, BF16)] == [1 + 2**-7] * 2
    with pytest.raises(AssertionError, match="differs from the hop model"):
        assert_combine_within(torch.tensor([[1 + 2**-7]], dtype=BF16), two_nodes)
    assert_combine_within(torch.tensor([[1.0]], dtype=BF16), two_nodes)


def _random_run(ranks_per_node, apply_probs=False, integers=False, seed=0):
    case = Case(4, ranks_per_node, 8, 64, (48, 0, 37, 48), 4, BF16, apply_probs=apply_probs, seed=seed)
    inputs = make_rank_inputs(case)
    idx = [i["topk_idx"] for i in inputs]
    run = dispatch_oracle(case.config, [i["x"] for i in inputs], idx, [i["topk_weights"] for i in inputs])
    gen = torch.Generator().manual_seed(seed + 1)
    outs = [(torch.randint(-8, 9, r.tokens.shape, generator=gen).float() if integers
             else torch.randn(r.tokens.shape, generator=gen)).to(BF16) for r in run.ranks]
    return case.config, run, outs, idx


def test_representable_values_are_exact():
    cfg, run, outs, idx = _random_run(2, integers=True)
    want, _ = combine_oracle(cfg, run, outs, idx)
    for b, w in zip(combine_hops_oracle(cfg, run, outs, idx), want):
        assert torch.equal(b.lo, w) and torch.equal(b.hi, w) and torch.equal(b.value, w)
        lo, hi = combine_output_range(b, BF16)
        assert torch.equal(lo, hi)


@pytest.mark.parametrize("apply_probs", [False, True])
def test_one_node_is_the_single_hop_model(apply_probs):
    """One node: every rank's partial rounded once, then summed. One rank per node: a node
    partial is one rank's partial, so its second rounding changes nothing."""
    cfg, run, outs, idx = _random_run(4, apply_probs)
    one_node = combine_hops_oracle(cfg, run, outs, idx, apply_probs)
    for s, b in enumerate(one_node):
        single_hop = torch.zeros_like(b.value)
        for d in range(4):
            partial = torch.zeros_like(b.value)
            for sel, rows in _rank_terms(run, s, d, idx[s], outs[d].double(), 2, apply_probs):
                partial[sel] += rows
            single_hop += round_to(partial, BF16)
        assert torch.equal(b.value, single_hop)
    one_rank_nodes = combine_hops_oracle(dataclasses.replace(cfg, ranks_per_node=1), run, outs, idx, apply_probs)
    for a, b in zip(one_node, one_rank_nodes):
        assert torch.equal(a.lo, b.lo) and torch.equal(a.hi, b.hi) and torch.equal(a.value, b.value)


def _truncate_bf16(x32: torch.Tensor) -> torch.Tensor:
    return (x32.view(torch.int32) & -65536).view(torch.float32)


def _simulated_combine(cfg, run, outs, idx, mistake=None, reverse=False):
    """The hierarchical combine in fp32 arithmetic, as a backend computes it (bf16 wire),
    with an optional mistake in the rounding of a hop."""
    G, L = cfg.ranks_per_node, cfg.experts_per_rank
    wire = {"no rank rounding": lambda x: x}.get(mistake, lambda x: x.to(BF16).float())
    node_round = {"one rounding": lambda x: x, "truncated node partial": _truncate_bf16}.get(
        mistake, lambda x: x.to(BF16).float())
    ys = []
    for s, ix in enumerate(idx):
        parts = []  # (node, partial) per rank
        for d in range(cfg.world_size):
            terms = [(sel, rows.float()) for sel, rows in _rank_terms(run, s, d, ix, outs[d].double(), L, False)]
            partial = torch.zeros(ix.shape[0], cfg.hidden_dim)
            for sel, rows in reversed(terms) if reverse else terms:
                partial[sel] += rows
            parts.append((d // G, wire(partial)))
        y = torch.zeros(ix.shape[0], cfg.hidden_dim)
        for n in (reversed(range(cfg.num_nodes)) if reverse else range(cfg.num_nodes)):
            node = sum((p for m, p in parts if m == n), torch.zeros_like(y))
            y += node if n == s // G else node_round(node)
        ys.append(y.to(BF16))
    return ys


def test_hop_model_is_tight():
    """The fp32 arithmetic of the hops passes in any summation order; each wrong rounding of
    a hop is caught."""
    cfg, run, outs, idx = _random_run(2, seed=3)
    bounds = combine_hops_oracle(cfg, run, outs, idx)
    for reverse in (False, True):
        for y, b in zip(_simulated_combine(cfg, run, outs, idx, reverse=reverse), bounds):
            assert_combine_within(y, b)
    for mistake in ("one rounding", "truncated node partial", "no rank rounding"):
        with pytest.raises(AssertionError, match="differs from the hop model"):
            for s, (y, b) in enumerate(zip(_simulated_combine(cfg, run, outs, idx, mistake), bounds)):
                assert_combine_within(y, b, f"{mistake}, rank {s}")


@pytest.mark.parametrize("apply_probs", [False, True])
def test_hop_model_within_the_two_hop_bound(apply_probs):
    """Sound against the exact float64 sum: the hop model's range stays inside the bound with
    two roundings per contribution, and mostly admits one output value."""
    cfg, run, outs, idx = _random_run(2, apply_probs, seed=5)
    want, magnitude = combine_oracle(cfg, run, outs, idx, apply_probs)
    open_elements = total = 0
    for b, w, m in zip(combine_hops_oracle(cfg, run, outs, idx, apply_probs), want, magnitude):
        tol = combine_tolerance(w, m, BF16, 4, hops=2)
        lo, hi = combine_output_range(b, BF16)
        assert bool(((lo - w).abs() <= tol).all()) and bool(((hi - w).abs() <= tol).all())
        open_elements += int((lo != hi).sum())
        total += lo.numel()
    assert open_elements <= total // 1000, (open_elements, total)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_combine_tolerance_allows_correct_rounding_of_subnormals(dtype):
    """A sum whose correctly rounded result is a subnormal of the output dtype: fp16's
    spacing there is 2**-24, far above the 2**-136 that clamping at fp32's exponent gave."""
    tiny = torch.finfo(dtype).smallest_normal
    spacing = tiny * torch.finfo(dtype).eps  # spacing of the subnormals
    want = torch.full((1, 4), 1.5 * spacing, dtype=torch.float64)  # exactly between two subnormals
    got = want.to(dtype)  # rounds to even: 2 x spacing
    err = (got.double() - want).abs()
    assert float(err.max()) == pytest.approx(0.5 * spacing)
    tol = combine_tolerance(want, want.abs(), dtype, 1)
    assert bool((err <= tol).all())
    assert bool((tol < 4 * spacing).all())  # still a bound that can fail: not wider than a few spacings
