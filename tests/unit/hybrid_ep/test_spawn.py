"""The process-group pool: results per rank, errors name the rank, nothing waits forever."""

import pytest

from hybrid_ep.spawn import ProcessGroupPool

pytestmark = pytest.mark.unit


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


def _sleep(seconds):
    import time

    time.sleep(seconds)
    return "late"


def test_start_timeout_says_why_and_names_the_variable(monkeypatch):
    # Spawning a rank and importing torch takes longer than 0.01 s on any machine.
    monkeypatch.setenv("HYBRID_EP_POOL_TIMEOUT_S", "0.01")
    with pytest.raises(RuntimeError) as info:
        ProcessGroupPool(2)
    message = str(info.value)
    assert message.startswith("process group pool (start): ranks [0, 1] did not answer after")
    assert "(limit 0 s): they were still starting" in message
    assert "export HYBRID_EP_POOL_TIMEOUT_S=900" in message and "docs/troubleshooting.md" in message


def test_task_timeout_says_why_and_the_variable_raises_it(monkeypatch):
    monkeypatch.delenv("HYBRID_EP_POOL_TIMEOUT_S", raising=False)
    with ProcessGroupPool(1) as pool:
        with pytest.raises(RuntimeError, match=r"\(_sleep\): ranks \[0\] did not answer after 1 s \(limit 1 s\): "
                                               r"task _sleep had not finished(.|\n)*HYBRID_EP_POOL_TIMEOUT_S=900"):
            pool.run(_sleep, [(30,)], timeout_s=1)
    monkeypatch.setenv("HYBRID_EP_POOL_TIMEOUT_S", "20")
    with ProcessGroupPool(1) as pool:
        assert pool.timeout_s == 20.0
        assert pool.run(_sleep, [(2,)], timeout_s=1) == ["late"]  # the variable raised the task's 1 s to 20 s


@pytest.mark.parametrize("raw, words", [("ten", "must be a number of seconds, got 'ten'"),
                                        ("0", "must be > 0 seconds, got '0'")])
def test_bad_pool_timeout_is_named(monkeypatch, raw, words):
    monkeypatch.setenv("HYBRID_EP_POOL_TIMEOUT_S", raw)
    with pytest.raises(ValueError, match=f"HYBRID_EP_POOL_TIMEOUT_S {words}"):
        ProcessGroupPool(1)


def _leave_on_rank(leaving_rank):
    import torch.distributed as dist

    if dist.get_rank() == leaving_rank:
        dist.destroy_process_group()
    return "done"


def _env(name):
    import os

    return os.environ.get(name)


def test_pool_whose_rank_left_the_group_refuses_more_tasks():
    with ProcessGroupPool(2, start_method="forkserver") as pool:
        assert pool.usable
        assert pool.run(_leave_on_rank, [(1,), (1,)]) == ["done", "done"]
        assert not pool.usable  # known as soon as run() returns
        with pytest.raises(RuntimeError, match="a rank left the process group in an earlier task; the pool is closed"):
            pool.run(_rank_and_sum, [(1,), (2,)])
        assert pool.closed


def test_forked_ranks_see_the_environment_of_the_pool_start(monkeypatch):
    """Ranks forked from the fork server (started with an earlier pool) get this process's
    environment as it is when the pool starts, as spawned ranks do."""
    ProcessGroupPool(1, start_method="forkserver").close()  # the fork server runs from here on
    monkeypatch.setenv("HYBRID_EP_SPAWN_TEST", "set after the fork server started")
    with ProcessGroupPool(2, env={"HYBRID_EP_TIMEOUT_S": "7"}, start_method="forkserver") as pool:
        assert pool.run(_env, [("HYBRID_EP_SPAWN_TEST",)] * 2) == ["set after the fork server started"] * 2
        assert pool.run(_env, [("HYBRID_EP_TIMEOUT_S",)] * 2) == ["7"] * 2


def test_unknown_start_method_is_named():
    with pytest.raises(ValueError, match="start_method must be one of spawn, forkserver, got 'fork'"):
        ProcessGroupPool(1, start_method="fork")
