"""Posted puts on the CPU model (hybrid_ep._model.set_posted_puts): the timing model's account
of a cluster, where a NIC moves the bytes between nodes that the emulation's loopback transport
copies with a warp's lanes. Each put lands at once, written by its issuing thread, and is priced
by the nic_* constants (csrc/device/model/timing.h). Both data paths must still match the oracle
with it on, and the bytes priced on the NICs must be the bytes the kernels put.
"""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from harness.emulated import GroupCache, check_emulated
from harness.hierarchy_cases import hierarchy_case
from hybrid_ep.bench import emulated
from hybrid_ep.verify.cases import make_rank_inputs
from tools.timing import constants

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

_cached = GroupCache("cpu")

CASES = [
    hierarchy_case(2, 2, tokens=(300, 0, 97, 257), topk=4),
    hierarchy_case(3, 2, num_experts=12, topk=4, drop_fraction=0.3, tokens=(97, 0, 161, 33, 1, 64)),
    hierarchy_case(2, 2, routing="one-rank", topk=2, tokens=(200, 0, 0, 0)),
]


@pytest.fixture
def posted():
    model.set_posted_puts(True)
    model.set_timing([constants.load_table(constants.H200).costs()])
    try:
        yield
    finally:
        model.set_timing(None)
        model.set_posted_puts(False)


@pytest.mark.parametrize("data_path", ["direct", "receive"])
@pytest.mark.parametrize("case", CASES, ids=str)
def test_posted_puts_match_the_oracle(posted, case, data_path):
    model.set_seed(case.world_size)
    group = _cached(case, num_sms_dispatch=2, num_sms_combine=2, data_path=data_path, ring_chunks=2)
    res = check_emulated(group, dataclasses.replace(case, seed=case.world_size))
    assert {r.handle.data_path for r in res} == {data_path}
    assert any(r["nic_bytes"] > 0 for r in model.timing_reports())


def test_the_combine_puts_one_node_partial_per_rdma_row_on_the_nics(posted):
    """The direct combine's only bytes between nodes are its node partials, a wire row each
    (bf16 here): what the NICs carried is the traffic model's RDMA rows x the row's bytes. The
    dispatch carries its rows and their routing, so at least the rows' bytes."""
    case = hierarchy_case(2, 2, num_experts=16, topk=8, tokens=(300, 1, 64, 97))
    group = _cached(case, num_sms_dispatch=2, num_sms_combine=2, data_path="direct", ring_chunks=2)
    inputs = make_rank_inputs(case)
    xs, idxs = [i["x"] for i in inputs], [i["topk_idx"] for i in inputs]
    model.timing_reports()
    res = group.dispatch(xs, idxs, [i["topk_weights"] for i in inputs])
    group.synchronize()
    dispatched = sum(r["nic_bytes"] for r in model.timing_reports())
    group.combine([r.tokens.to(torch.bfloat16) for r in res], [r.handle for r in res])
    group.synchronize()
    combined = sum(r["nic_bytes"] for r in model.timing_reports())
    rdma, rdma_model = emulated.rdma_rows(res, idxs, group.config)
    assert rdma == rdma_model > 0
    row_bytes = case.hidden * 2
    assert combined == rdma * row_bytes
    assert dispatched > rdma * row_bytes
