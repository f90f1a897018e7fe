"""Reference backend against the dense oracle, across world sizes, node counts and options."""

from __future__ import annotations

import itertools

import pytest
import torch

from hybrid_ep.traffic import combine_row_bytes, count_tables, dispatch_row_bytes, rank_traffic, row_counts
from hybrid_ep.verify import Case, check_case

pytestmark = pytest.mark.unit

FP8 = torch.float8_e4m3fn
DTYPES = (torch.float32, torch.bfloat16, FP8)

# (world size, ranks per node): 1 to 3 nodes, world sizes that are not powers of two.
TOPOLOGIES = [(1, 1), (2, 1), (2, 2), (3, 1), (3, 3), (4, 2), (4, 4), (6, 2), (6, 3), (8, 4)]


def _cases():
    cases = []
    counter = itertools.count()
    for W, G in TOPOLOGIES:
        E = 2 * W
        tokens = tuple((7 * r + 3) % 11 for r in range(W))  # differ per rank, 0 on some
        if W > 1:
            tokens = (0,) + tokens[1:]
        max_k = min(8, E)
        variants = [
            dict(topk=1, dtype=torch.float32),
            dict(topk=2, dtype=torch.bfloat16, drop_fraction=0.3, apply_probs=True),
            dict(topk=min(4, E), dtype=torch.bfloat16, wire_dtype=torch.float32),
            dict(topk=max_k, dtype=FP8, pad_multiple=8),
            dict(topk=min(3, E), dtype=torch.bfloat16, routing="one-expert", pad_multiple=64),
            dict(topk=min(4, E), dtype=torch.float32, num_out_tokens=3, drop_fraction=0.1),
            dict(topk=min(5, E), dtype=FP8, num_out_tokens=500, pad_multiple=8, routing_map=True),
            dict(topk=min(3, E), dtype=FP8, num_out_tokens=5, pad_multiple=8, scale_format="mxfp8"),
            dict(topk=max_k, dtype=torch.float32, routing="zipf", routing_map=True, apply_probs=True),
        ]
        for v in variants:
            cases.append(Case(W, G, E, 128, tokens, seed=next(counter), **v))
    return cases


CASES = _cases()


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_matches_oracle(pool_for, case):
    check_case(pool_for(case.world_size), case)


def test_every_call_on_one_buffer_is_checked(pool_for):
    """check_case(calls=3): each rank runs the case three times on one buffer; every call is held
    against the oracle and its data path reported."""
    results = check_case(pool_for(3), Case(3, 3, 6, 128, (5, 0, 7), 2, torch.bfloat16, seed=31), calls=3)
    assert [len(r["call_paths"]) for r in results] == [3] * 3
    assert {p for r in results for p in r["call_paths"]} == {results[0]["data_path"]}


@pytest.mark.parametrize("topk", range(1, 9))
def test_every_topk(pool_for, topk):
    case = Case(4, 2, 8, 256, (9, 4, 0, 13), topk, torch.bfloat16, seed=100 + topk)
    check_case(pool_for(4), case)


@pytest.mark.parametrize("pad", [1, 8, 64])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).replace("torch.", ""))
def test_pad_multiple(pool_for, pad, dtype):
    case = Case(3, 1, 6, 128, (10, 0, 5), 3, dtype, pad_multiple=pad, drop_fraction=0.2, seed=7)
    results = check_case(pool_for(3), case)
    for r in results:
        tpe = r["tokens_per_expert"]
        assert bool((tpe % pad == 0).all()), tpe


def test_static_size_smaller_counts_overflow(pool_for):
    case = Case(4, 2, 8, 128, (20, 20, 20, 20), 4, torch.bfloat16, num_out_tokens=16, seed=11)
    results = check_case(pool_for(4), case)
    dropped = [r["num_dropped"] for r in results]
    assert all(d > 0 for d in dropped), dropped
    for r in results:
        assert r["tokens"].shape[0] == 16
        assert r["num_needed_rows"] > 16
        assert int(r["tokens_per_expert"].sum()) == 16


def test_static_size_larger_pads_with_zero_rows(pool_for):
    case = Case(4, 2, 8, 128, (5, 0, 3, 2), 2, torch.float32, num_out_tokens=64, seed=12)
    results = check_case(pool_for(4), case)
    for r in results:
        used = int(r["tokens_per_expert"].sum())
        assert r["num_dropped"] == 0 and used == r["num_needed_rows"] < 64
        assert bool((r["tokens"][used:] == 0).all()) and bool((r["probs"][used:] == 0).all())


def test_static_size_zero_rows(pool_for):
    results = check_case(pool_for(2), Case(2, 1, 4, 128, (3, 4), 2, torch.float32, num_out_tokens=0, seed=13))
    assert sum(r["num_dropped"] for r in results) == 14  # every routed slot is dropped


def test_all_ranks_without_tokens(pool_for):
    results = check_case(pool_for(4), Case(4, 2, 8, 128, (0, 0, 0, 0), 2, torch.bfloat16, pad_multiple=8))
    for r in results:
        assert r["tokens"].shape[0] == 0 and r["y"].shape == (0, 128)


def test_all_tokens_on_one_expert_k1(pool_for):
    case = Case(6, 3, 12, 128, (8, 1, 0, 4, 9, 2), 1, torch.float32, routing="one-expert", seed=14)
    results = check_case(pool_for(6), case)
    hot_rank = (12 // 2) // 2
    assert results[hot_rank]["tokens"].shape[0] == sum(case.tokens)
    assert all(results[r]["tokens"].shape[0] == 0 for r in range(6) if r != hot_rank)


def test_large_hidden_and_tokens(pool_for):
    check_case(pool_for(4), Case(4, 2, 16, 1024, (300, 257, 1, 0), 8, torch.bfloat16, pad_multiple=16, seed=15))


def test_last_traffic_matches_model(pool_for):
    case = Case(4, 2, 8, 256, (9, 4, 0, 13), 3, FP8, seed=16)
    results = check_case(pool_for(4), case)
    from hybrid_ep.verify import make_rank_inputs

    inputs = make_rank_inputs(case)
    counts = row_counts(*count_tables([i["topk_idx"] for i in inputs], case.config), 2)
    for rank, r in enumerate(results):
        dispatch, combine = r["traffic"]
        assert dispatch == rank_traffic("dispatch", rank, counts, dispatch_row_bytes(256, FP8))
        assert combine == rank_traffic("combine", rank, counts, combine_row_bytes(256, torch.bfloat16))
        assert dispatch.row_bytes == 256 + 2 * 4 and combine.row_bytes == 512
    assert sum(r["traffic"][0].rdma_bytes for r in results) > 0
