"""The reference backend over NCCL (CUDA tensors): same oracle, same cases as on gloo."""

from __future__ import annotations

import contextlib

import pytest
import torch

from helpers import static_reference_round_trip
from hybrid_ep.spawn import ProcessGroupPool
from hybrid_ep.verify import Case, check_case

pytestmark = pytest.mark.gpu

FP8 = torch.float8_e4m3fn


def _cases(world_size):
    G = world_size
    tokens = tuple((5 * r + 3) % 9 for r in range(world_size))
    return [
        Case(world_size, G, 2 * world_size, 256, tokens, 2, torch.bfloat16, drop_fraction=0.2, seed=1),
        Case(world_size, G, 2 * world_size, 256, tokens, 2, FP8, pad_multiple=16, seed=2),
        Case(world_size, G, 2 * world_size, 256, tokens, 1, torch.float32, num_out_tokens=4, seed=3),
    ]


@pytest.mark.gpu
def test_one_gpu_matches_oracle():
    with ProcessGroupPool(1, backend="nccl") as pool:
        for case in _cases(1):
            check_case(pool, case)


@pytest.mark.multigpu
def test_two_gpus_match_oracle():
    with ProcessGroupPool(2, backend="nccl") as pool:
        for case in _cases(2):
            check_case(pool, case)


def _static_round_trip_without_host_sync():
    """The static round trip under torch.cuda.set_sync_debug_mode("error"): any host
    synchronisation raises (tests/unit/harness/test_host_sync.py finds them all on the CPU)."""

    @contextlib.contextmanager
    def sync_is_an_error():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()

    return static_reference_round_trip(sync_is_an_error)


@pytest.mark.gpu
def test_static_size_makes_no_host_sync():
    with ProcessGroupPool(1, backend="nccl") as pool:
        assert pool.run(_static_round_trip_without_host_sync) == [("reference", 40, 0, True)]


def _reuse_other_handles():
    """Ranks reuse handles of different dispatches with the same counts: on NCCL nothing is read on
    the host for a call with a handle, so the header check runs at the next dispatch with a
    routing (its count read), on every rank alike."""
    import torch.distributed as dist

    import hybrid_ep as hep

    rank, W = dist.get_rank(), dist.get_world_size()
    buf = hep.HybridEPBuffer(None, 128, 2 * W, 2 * W, ranks_per_node=W, backend="reference")
    dev = buf.device
    t = torch.arange(2 * W)
    a, b = (t % W * 2)[:, None].to(dev), ((t + 1) % W * 2)[:, None].to(dev)  # the same counts, other rows
    x = torch.randn(2 * W, 128, device=dev)
    ra, rb = buf.dispatch(x, a), buf.dispatch(x, b)
    buf.dispatch(x, handle=(ra if rank == 0 else rb).handle)
    try:
        buf.dispatch(x, a)
        message = "no error"
    except ValueError as err:
        message = str(err)
    res = buf.dispatch(x, a)
    return message, torch.equal(buf.combine(res.tokens, res.handle), x)


@pytest.mark.multigpu
def test_reused_handles_that_disagree_raise_at_the_next_routing():
    with ProcessGroupPool(2, backend="nccl") as pool:
        out = pool.run(_reuse_other_handles)
    assert out[0] == out[1]
    message, group_works = out[0]
    assert "the EP ranks disagree on the handle (rank 0: dispatch #1, rank 1: dispatch #2)" in message, message
    assert group_works
