"""The process-group pool: results per rank, errors name the rank, nothing waits forever."""

import pytest

from hybrid_ep.spawn import ProcessGroupPool


def _rank_and_sum(value):
    import torch
    import torch.distributed as dist

    t = torch.tensor([value])
    dist.all_reduce(t)
    return dist.get_rank(), int(t)


def _fail_on_rank(bad_rank):
    import torch.distributed as dist

    if dist.get_rank() == bad_rank:
        raise KeyError("broken on purpose")
    return "fine"


def test_pool_runs_collectives(pool_for):
    assert pool_for(3).run(_rank_and_sum, [(1,), (2,), (3,)]) == [(0, 6), (1, 6), (2, 6)]


def test_pool_reports_failing_rank():
    with ProcessGroupPool(2) as pool:
        with pytest.raises(RuntimeError, match=r"ranks \[1\] raised(.|\n)*KeyError: 'broken on purpose'"):
            pool.run(_fail_on_rank, [(1,), (1,)])
        assert pool.closed
