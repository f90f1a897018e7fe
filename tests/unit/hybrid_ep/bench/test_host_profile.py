"""The bench's host profile: which functions a call pair's host time goes to."""

import pytest

from hybrid_ep.bench.host_profile import profile_pairs

pytestmark = pytest.mark.unit


def _slow_leaf():
    total = 0
    for i in range(20000):  # the time is the function's own, not a built-in's
        total += i * i
    return total


def _fast_leaf():
    return 1


def _pair():
    _slow_leaf()
    _fast_leaf()
    _fast_leaf()


def test_the_slowest_function_comes_first_with_its_calls_per_pair():
    top = profile_pairs(_pair, pairs=4, top=50)
    names = [row["function"] for row in top]
    slow = next(row for row in top if row["function"].endswith("(_slow_leaf)"))
    fast = next(row for row in top if row["function"].endswith("(_fast_leaf)"))
    assert names[0] == slow["function"]  # its loop's own time dominates
    assert fast["calls_per_pair"] == 2 and slow["own_us_per_pair"] > fast["own_us_per_pair"]
    pair = next(row for row in top if row["function"].endswith("(_pair)"))
    assert pair["calls_per_pair"] == 1 and pair["cumulative_us_per_pair"] >= slow["own_us_per_pair"]
    assert ":" in fast["function"] and "test_host_profile.py" in fast["function"]


def test_the_list_is_cut_at_top_and_pairs_must_be_positive():
    assert len(profile_pairs(_pair, pairs=2, top=3)) == 3
    with pytest.raises(ValueError, match="pairs"):
        profile_pairs(_pair, pairs=0)
