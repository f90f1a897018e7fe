"""Shared fixtures: process-group pools (started once per world size), a 1-rank group, checkpoint folders."""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.distributed as dist

from hybrid_ep.spawn import ProcessGroupPool

# Pools hold W processes each; keep only a couple alive on a 2-core machine.
_MAX_LIVE_POOLS = 2


@pytest.fixture(scope="session")
def pool_for():
    live: collections.OrderedDict[int, ProcessGroupPool] = collections.OrderedDict()

    def get(world_size: int) -> ProcessGroupPool:
        pool = live.pop(world_size, None)
        if pool is None or pool.closed:
            while len(live) >= _MAX_LIVE_POOLS:
                live.popitem(last=False)[1].close()
            pool = ProcessGroupPool(world_size, env={"HYBRID_EP_TIMEOUT_S": "60"})
        live[world_size] = pool
        return pool

    yield get
    for pool in live.values():
        pool.close()


@pytest.fixture(scope="session")
def single_rank_group(tmp_path_factory):
    """torch.distributed in this process as a world of one (gloo), for in-process checks."""
    if not dist.is_initialized():
        path = os.path.join(tmp_path_factory.mktemp("w1"), "store")
        dist.init_process_group("gloo", init_method=f"file://{path}", rank=0, world_size=1)
    yield dist.group.WORLD


@pytest.fixture(scope="module")
def new_checkpoint_dir(tmp_path_factory):
    """Makes an empty folder per call, under pytest's base temp (which keeps only its last runs)."""
    return lambda: str(tmp_path_factory.mktemp("ckpt"))


def pytest_collection_modifyitems(config, items):
    has_cuda = torch.cuda.is_available()
    many = has_cuda and torch.cuda.device_count() > 1
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "multigpu" in item.keywords and not many:
            item.add_marker(pytest.mark.skip(reason="needs more than one CUDA device"))
