"""Every store plan of the direct dispatch (HYBRID_EP_DIRECT_STORES) on the CPU model, against
the oracle.

The plans are candidate designs of the dispatch's store path, one kernel instantiation each
(csrc/kernels/dispatch_direct.cuh, StoreCrew): they differ only in which threads issue a stage's
bulk stores, so each must give the default's rows bit for bit, on one node and across nodes
(where the store warps also stage rows for the RDMA warp and take the staging credits). The
default plan runs every case of tests/test_kernels_model.py and
tests/test_hierarchy_direct_model.py; here the other plans run a spread of those cases (the
whole matrix in the full tier).
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from hybrid_ep.backends.cuda import launch
from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.testing.emulated import check_emulated, emulated_group_for
from hybrid_ep.testing.hierarchy_cases import hierarchy_case
from test_hierarchy_direct_model import RING, WRAPS
from test_kernels_model import CASES, _case

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

PLANS = sorted(set(launch.STORE_PLANS) - {launch.DEFAULT_STORE_PLAN})  # the default runs everywhere else

# One node: zero and odd token counts, fp8 (scales stored one by one, and whole 16-byte units),
# rows of two segments, small rows batched several to a stage, one hot expert, a static size that
# drops routes (a full node of 8 in the full tier).
ONE_NODE = [
    _case(3, tokens=(17, 1, 0)),
    _case(4, num_experts=32, dtype=FP8_DTYPE, tokens=(64, 17, 1, 0), topk=8),
    _case(4, num_experts=16, hidden=512, dtype=FP8_DTYPE, tokens=(64, 17, 1, 0), topk=8),
    _case(2, hidden=12288, dtype=torch.float32, tokens=(3, 2)),
    _case(3, hidden=128, tokens=(64, 17, 33), topk=2),
    _case(4, routing="one-expert", tokens=(33,) * 4),
    _case(4, num_experts=16, num_out_tokens=37, dtype=FP8_DTYPE, topk=8, tokens=(64, 17, 1, 0)),
]
# Across nodes, on 2-slot staging rings: every route off-node, and fp8 rows and scales.
ACROSS = [
    hierarchy_case(2, 2, routing="one-rank", topk=2, tokens=(512, 0, 0, 0)),
    hierarchy_case(2, 2, num_experts=8, topk=4, dtype=FP8_DTYPE, tokens=(97, 0, 130, 33)),
]
FULL_ONE_NODE = [c for c in CASES if c not in ONE_NODE]
FULL_ACROSS = [c for c in WRAPS if c not in ACROSS]  # W = 8 as 2 x 4 and 4 x 2 among them


def _check(monkeypatch, plan: str, case, seed: int, **group_kw) -> None:
    monkeypatch.setenv(launch.STORE_PLAN_ENV, plan)  # read when the group's buffers are made
    group = emulated_group_for(case, "cpu", data_path="direct", **group_kw)
    try:
        model.set_seed(seed)
        res = check_emulated(group, dataclasses.replace(case, seed=seed))
        assert {r.handle.data_path for r in res} == {"direct"}
        (direct,) = [a for key, a in group.engine._launch_cache.items() if key[0] == "dispatch_direct"]
        assert direct.store_plan == launch.STORE_PLANS[plan]  # the plan that ran
    finally:
        group.close()


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", ONE_NODE, ids=str)
def test_every_store_plan_matches_the_oracle_on_one_node(monkeypatch, plan, case):
    _check(monkeypatch, plan, case, seed=1, num_sms_dispatch=2, num_sms_combine=2)


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", ACROSS, ids=str)
def test_every_store_plan_matches_the_oracle_across_nodes(monkeypatch, plan, case):
    _check(monkeypatch, plan, case, seed=case.world_size, num_sms_dispatch=2, num_sms_combine=2, ring_chunks=RING)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", FULL_ONE_NODE, ids=str)
def test_every_store_plan_matches_the_whole_one_node_matrix(monkeypatch, plan, case):
    _check(monkeypatch, plan, case, seed=0, num_sms_dispatch=2, num_sms_combine=2)


@pytest.mark.slow
@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("case", FULL_ACROSS, ids=str)
def test_every_store_plan_matches_the_whole_across_nodes_matrix(monkeypatch, plan, case):
    _check(monkeypatch, plan, case, seed=case.world_size, num_sms_dispatch=2, num_sms_combine=2, ring_chunks=RING)


@pytest.mark.parametrize("groups", [pytest.param("0", marks=pytest.mark.slow), "7"])
@pytest.mark.parametrize("plan", PLANS)
def test_a_store_plan_releases_a_stage_only_after_its_stores_read_it(monkeypatch, plan, groups):
    """Every plan with no store group left reading (a stage released right after its own stores
    read it) and with the deepest queue the ring allows (7, cut to (stages - 1) / 2): the
    releases the loads wait for come from each plan's leader, after every member's reads. Rows
    of two segments, and small rows batched several to a stage with 8 routes each."""
    monkeypatch.setenv(launch.STORE_GROUPS_ENV, groups)
    for case in (_case(2, hidden=12288, dtype=torch.float32, tokens=(9, 4)),
                 _case(4, num_experts=16, hidden=1024, topk=8, tokens=(97, 64, 1, 33))):
        _check(monkeypatch, plan, case, seed=int(groups), num_sms_dispatch=1, num_sms_combine=1)


def test_an_unknown_store_plan_is_refused_by_name(monkeypatch):
    monkeypatch.setenv(launch.STORE_PLAN_ENV, "widest")
    with pytest.raises(ValueError, match=r"HYBRID_EP_DIRECT_STORES must be one of \['alternate', 'lanes', 'single'\]"):
        launch.store_plan()
