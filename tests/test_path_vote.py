"""The per-call path vote of one process per GPU (backends/cuda/agreement.py), on CPU
processes: every rank gets the AND of every rank's answer for the same call, many calls in a
row (the two rows of words by parity), and a rank that does not vote makes its peers give up
after the timeout with a message naming it."""

from __future__ import annotations

import random

import pytest

from hybrid_ep.testing.path_vote import vote_sequence

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("world", [1, 3])
def test_every_rank_gets_the_and_of_every_call(pool_for, world):
    rng = random.Random(world)
    oks = [[rng.random() < 0.8 for _ in range(200)] for _ in range(world)]
    got = pool_for(world).run(vote_sequence, [(oks[r],) for r in range(world)])
    want = [all(oks[r][n] for r in range(world)) for n in range(200)]
    assert not all(want) or world == 1  # some calls are vetoed by one rank
    for r in range(world):
        assert got[r]["error"] is None
        assert got[r]["agreed"] == want, f"rank {r}"


def test_a_rank_that_does_not_vote_is_named_after_the_timeout(pool_for):
    oks = [True] * 5
    got = pool_for(2).run(vote_sequence, [(oks, False, 0.5), (oks, True, 0.5)])
    assert got[1] == {"agreed": [True] * 4, "error": None}
    assert got[0]["agreed"] == [True] * 4
    assert "rank 0 gave up after 0.5 s (HYBRID_EP_TIMEOUT_S) waiting for peer rank 1" in got[0]["error"]
    assert "dispatch 5" in got[0]["error"]
