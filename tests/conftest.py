"""Shared fixtures (process-group pools started once per world size, a 1-rank group, checkpoint
folders), the test tiers, the skips of tests that need a GPU, and which tests share a worker
when pytest-xdist runs the suite on several (scripts/test.sh)."""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.distributed as dist

from hybrid_ep.spawn import ProcessGroupPool, preload_for_forkserver

# Pools hold W processes each; keep only a couple alive on a 2-core machine.
_MAX_LIVE_POOLS = 2
# What the pools' ranks import, imported once in the fork server they are forked from: a rank
# starts in about a second instead of importing torch (and Megatron-Core) again, seconds of CPU
# each. A module that does not import (no megatron-core) is skipped.
_RANK_PRELOAD = ["torch", "hybrid_ep", "hybrid_ep.spawn", "hybrid_ep.testing", "megatron.core",
                 "megatron.core.transformer.moe.moe_layer", "megatron.core.optimizer", "megatron.core.distributed"]

# Every test file names its tier (`pytestmark = pytest.mark.<tier>`), so `pytest -m <tier>` runs
# one kind of test; CONTRIBUTING.md says when to run which.
TIERS = {
    "unit": "the library and its tools in Python: oracle, reference backend on gloo ranks, balancer, "
            "traffic model, benchmark and launcher CLIs",
    "model": "the CUDA kernels on the CPU model of the device layer (hybrid_ep._model), against the oracle",
    "megatron": "Megatron-Core integration on CPU gloo ranks (skipped without megatron-core)",
    "faults": "faults injected between ranks (slow, stalled, dead or bad peers, processes outside the job): "
              "every rank's error within the timeout, by name, nothing leaked",
    "sanitizer": "the native modules' tests on AddressSanitizer + UBSan and ThreadSanitizer builds",
}
# Markers beside the tier: a test file made only of GPU tests carries `gpu` in place of a tier.
OTHER_MARKERS = {
    "gpu": "needs a CUDA device (skipped without one)",
    "multigpu": "needs more than one CUDA device (skipped otherwise)",
    "slow": "runs for tens of seconds (training loops, sanitized builds); -m 'not slow' leaves it out",
}


def pytest_configure(config):
    # auto never follows a calibration of the machine the tests run on (hybrid-ep-bench --calibrate
    # writes to ~/.cache by default); the tests of the evidence file name their own
    os.environ["HYBRID_EP_AUTO_EVIDENCE"] = os.path.join(os.devnull, "no-auto-evidence.json")
    for name, what in {**TIERS, **OTHER_MARKERS}.items():
        config.addinivalue_line("markers", f"{name}: {what}")
    # set below (pytest-xdist registers it too; without pytest-xdist it is a plain mark)
    config.addinivalue_line("markers", "xdist_group(name): tests that pytest-xdist runs on one worker")


@pytest.fixture(scope="session")
def pool_for():
    """pool_for(W): a pool of W gloo ranks, shared by the tests of this worker. A pool that a
    test closed, or left unusable (a rank that left the group), is replaced by a new one; a
    test that leaves the group unusable another way (a timed-out collective) closes it, e.g.
    `with pool_for(2) as pool:`."""
    live: collections.OrderedDict[int, ProcessGroupPool] = collections.OrderedDict()
    preload_for_forkserver(_RANK_PRELOAD)

    def get(world_size: int) -> ProcessGroupPool:
        pool = live.pop(world_size, None)
        if pool is not None and not pool.usable:
            pool.close()
            pool = None
        if pool is None:
            while len(live) >= _MAX_LIVE_POOLS:
                live.popitem(last=False)[1].close()
            pool = ProcessGroupPool(world_size, env={"HYBRID_EP_TIMEOUT_S": "60"}, start_method="forkserver")
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


def _shares_state_of_its_file(item) -> bool:
    """Whether the test uses what its file's other tests reuse: a module-scoped fixture of its
    file (a build, a training run), also one it names in a parameter and gets with
    request.getfixturevalue, or the session's process-group pools (pool_for), whose world
    sizes a file's tests mostly share."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return False

    def of_this_file(defs) -> bool:
        fixture = defs[-1]
        return fixture.scope == "module" and getattr(fixture.func, "__module__", None) == item.module.__name__

    for name, defs in info.name2fixturedefs.items():
        if name == "pool_for" or of_this_file(defs):
            return True
    params = getattr(getattr(item, "callspec", None), "params", {})
    manager = item.session._fixturemanager
    for value in params.values():
        if isinstance(value, str) and value.isidentifier():
            defs = manager.getfixturedefs(value, item)
            if defs and of_this_file(defs):
                return True
    return False


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's own hook reads the xdist_group marks
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
        # With --dist loadgroup (scripts/test.sh), tests of one xdist_group run on one worker: a
        # file's module-scoped fixtures are then made once and its pools started by one worker.
        # Every other test goes to whichever worker is free.
        if isinstance(item, pytest.Function) and _shares_state_of_its_file(item):
            item.add_marker(pytest.mark.xdist_group(item.path.name))
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: the long work first
        _slow_work_first(items)


@pytest.hookimpl(trylast=True, specname="pytest_collection_modifyitems")  # after pytest-xdist's hook
def pytest_collection_modifyitems_xdist_group_ids(config, items):
    """pytest-xdist's --dist loadgroup reads a test's group from its node id ("...@group"),
    which its worker hook writes into `item._nodeid`; pytest 9 keeps the id in `item._id`, so
    the groups were lost and every test was scheduled alone (a file's module-scoped fixtures
    and pools were made again on each worker, and again after tests of other files). Writes
    the suffix where pytest-xdist could not."""
    if not getattr(config.option, "loadgroup", False):
        return
    from _pytest.nodeid import NodeId

    for item in items:
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid.rpartition("]")[2] and hasattr(item, "_id"):
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


def _slow_work_first(items) -> None:
    """Moves the slow tests, and the tests that share their worker, to the front (each keeping
    its order): the workers start them first and the short tests fill in around them, so no
    worker is left with a long test at the end while the others are idle (with pytest-xdist's
    --no-loadscopereorder, which keeps this order)."""
    def groups(item):
        return {str(m.args[0]) for m in item.iter_markers("xdist_group")}

    slow_groups = set().union(*(groups(i) for i in items if i.get_closest_marker("slow")))
    items.sort(key=lambda i: not (i.get_closest_marker("slow") or groups(i) & slow_groups))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test of the model tier names the CPU model's seed and weakenings as they were when it
    failed (the tests set the seed; a weakening draws from it), so the failure can be run again."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and "model" in item.keywords:
        try:
            import hybrid_ep._model as model
        except ImportError:
            return
        report.sections.append(("CPU model", f"seed {model.seed()}, weakenings {model.weakenings()}"))
