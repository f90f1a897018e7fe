"""Shared fixtures (process-group pools started once per world size, a 1-rank group, checkpoint
folders), the test tiers, and the skips of tests that need a GPU."""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.distributed as dist

from hybrid_ep.spawn import ProcessGroupPool

# Pools hold W processes each; keep only a couple alive on a 2-core machine.
_MAX_LIVE_POOLS = 2

# Every test file names its tier (`pytestmark = pytest.mark.<tier>`), so `pytest -m <tier>` runs
# one kind of test; CONTRIBUTING.md says when to run which.
TIERS = {
    "unit": "the library and its tools in Python: oracle, reference backend on gloo ranks, balancer, "
            "traffic model, benchmark and launcher CLIs",
    "model": "the CUDA kernels on the CPU model of the device layer (hybrid_ep._model), against the oracle",
    "megatron": "Megatron-Core integration on CPU gloo ranks (skipped without megatron-core)",
    "sanitizer": "the native modules' tests on AddressSanitizer + UBSan and ThreadSanitizer builds",
}
# Markers beside the tier: a test file made only of GPU tests carries `gpu` in place of a tier.
OTHER_MARKERS = {
    "gpu": "needs a CUDA device (skipped without one)",
    "multigpu": "needs more than one CUDA device (skipped otherwise)",
    "slow": "runs for tens of seconds (training loops, sanitized builds); -m 'not slow' leaves it out",
}


def pytest_configure(config):
    for name, what in {**TIERS, **OTHER_MARKERS}.items():
        config.addinivalue_line("markers", f"{name}: {what}")


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


def _tier_errors(items) -> list[str]:
    """Files with a test in no tier or in two (GPU-only files may carry `gpu` alone)."""
    bad = {}
    for item in items:
        marks = {m.name for m in item.iter_markers()}
        tiers = [t for t in TIERS if t in marks]
        if len(tiers) > 1 or (not tiers and "gpu" not in marks):
            bad.setdefault(item.path.name, tiers)
    return [f"{name}: {' and '.join(tiers) or 'no tier'}" for name, tiers in sorted(bad.items())]


def pytest_collection_modifyitems(config, items):
    errors = _tier_errors(items)
    if errors:
        raise pytest.UsageError("every test file needs one tier marker, `pytestmark = pytest.mark.<tier>` with "
                                f"<tier> one of {', '.join(TIERS)} (tests/conftest.py): " + "; ".join(errors))
    has_cuda = torch.cuda.is_available()
    many = has_cuda and torch.cuda.device_count() > 1
    for item in items:
        if "gpu" in item.keywords and not has_cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if "multigpu" in item.keywords and not many:
            item.add_marker(pytest.mark.skip(reason="needs more than one CUDA device"))
