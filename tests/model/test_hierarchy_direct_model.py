"""The direct path on several nodes on the CPU model: calls that wrap its RDMA rings many times.

A source stores each token straight into its final rows on its own node and once into the
staging ring of each other node it reaches; the rail peer there forwards the chunk's rows into
their final rows on its node (csrc/kernels/dispatch_direct.cuh). Combine reads each node's
routes on that node and sends one node partial per (token, other node) back
(csrc/kernels/combine_direct.cuh). The staging and node-partial rings have 2 chunk slots here, the
fewest allowed, and the calls up to 16 chunks per source, so every ring turns over many times;
each call must still match the oracle (dispatch bitwise, combine with the one rounding of each
other node's partial) and complete. The forwarded rows and node partials are counted against
the traffic model's RDMA rows.
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import torch

from harness.emulated import GroupCache, check_emulated
from harness.faults import ranks_absent
from harness.hierarchy_cases import hierarchy_case
from hybrid_ep.backends.cuda import launch as launch_plan
from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.bench import emulated
from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.verify.cases import make_rank_inputs

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

RING = 2  # chunk slots per ring: BufferConfig's smallest
_cached = GroupCache("cpu")


def group_for(case, sms: int = 2) -> EmulatedGroup:
    return _cached(case, num_sms_dispatch=sms, num_sms_combine=sms, data_path="direct", ring_chunks=RING)


WRAPS = [
    # W = 8 as 2 x 4 and 4 x 2, W = 6 as 3 x 2, W = 4 as 2 x 2; odd token counts, a rank without tokens
    hierarchy_case(2, 4, num_experts=16, topk=8, tokens=(161, 0, 97, 1, 130, 64, 33, 200)),
    hierarchy_case(4, 2, num_experts=16, topk=4, tokens=(129, 200, 0, 33, 257, 64, 5, 97)),
    hierarchy_case(3, 2, tokens=(129, 200, 0, 33, 257, 64), topk=6, apply_probs=True, dtype=torch.float32),
    hierarchy_case(2, 2, tokens=(300, 0, 97, 257), topk=4),
    # one source, every route on the other node: its rail peer forwards every chunk
    hierarchy_case(2, 2, routing="one-rank", topk=2, tokens=(512, 0, 0, 0)),
    # every token to one expert; fp8 rows and scales
    hierarchy_case(2, 2, routing="one-expert", topk=1, tokens=(300,) * 4),
    hierarchy_case(4, 2, num_experts=16, topk=8, dtype=FP8_DTYPE, tokens=(128, 0, 97, 65, 33, 1, 160, 96)),
    hierarchy_case(4, 2, num_experts=16, topk=8, dtype=FP8_DTYPE, tokens=(5, 0, 97, 65, 33, 1, 16, 9),
                   scale_format="mxfp8"),
    # a bf16 wire (the default) and an fp32 wire for bf16 and fp16 rows
    hierarchy_case(2, 2, num_experts=16, topk=8, tokens=(300, 1, 64, 97), wire_dtype=torch.float32),
    hierarchy_case(3, 2, dtype=torch.float16, apply_probs=True, tokens=(130, 257, 5, 0, 64, 33),
                   wire_dtype=torch.float32),
    # fp32 node partials into bf16 rows of 1024 columns (a vector per reducer thread)
    hierarchy_case(2, 2, 1024, num_experts=8, topk=4, tokens=(70, 1, 33, 0), wire_dtype=torch.float32),
    # dropped routes (-1), and a static size that clips routed rows (num_out_tokens)
    hierarchy_case(2, 2, num_experts=16, topk=8, drop_fraction=0.25, num_out_tokens=200, tokens=(190, 0, 130, 67)),
    hierarchy_case(3, 2, num_experts=12, topk=4, drop_fraction=0.3, tokens=(97, 0, 161, 33, 1, 64)),
    # rows over one FIFO stage, two segments each
    hierarchy_case(2, 2, 12288, dtype=torch.float32, routing="one-rank", topk=2, tokens=(97, 130, 0, 65)),
]


@pytest.mark.parametrize("case", WRAPS, ids=str)
def test_calls_that_wrap_the_rdma_rings_many_times_match_the_oracle(case):
    model.set_seed(case.world_size)
    res = check_emulated(group_for(case), dataclasses.replace(case, seed=case.world_size))
    assert {r.handle.data_path for r in res} == {"direct"}


@pytest.mark.parametrize("sms", [1, 3])
def test_more_blocks_than_ring_slots(sms):
    """A rank's blocks take its own and forwarded chunks in turn (DirectUnits, SourceSideChunks),
    so with more blocks than slots one block's chunk waits for another block's credit."""
    case = hierarchy_case(2, 2, tokens=(300, 0, 97, 257), topk=4)
    model.set_seed(sms)
    check_emulated(group_for(case, sms=sms), dataclasses.replace(case, seed=sms))


def test_back_to_back_calls_reuse_the_rings():
    """The staging and node-partial credits carry the call: over calls with other routings,
    token counts and dtypes on one buffer, a slot freed in the previous call is not taken as
    freed in this one."""
    first = hierarchy_case(2, 2, tokens=(300, 0, 97, 257), topk=4)
    group = group_for(first)
    dtypes = (torch.bfloat16, torch.float32, FP8_DTYPE, torch.float16)
    for call in range(4):
        case = dataclasses.replace(first, seed=call, dtype=dtypes[call], topk=2 + call % 3,
                                   tokens=(300, 257 - 60 * call, call, 97))
        model.set_seed(call)
        check_emulated(group, case)
    assert group_for(first) is group


def test_rdma_rows_equal_the_traffic_model():
    """One RDMA row per (token, other node) in dispatch, as the rail peers' handles keep them
    (fwd_rows); combine sends one node partial back for each of those rows, summed by the
    source once (the oracle check of the same call)."""
    case = hierarchy_case(2, 4, num_experts=16, topk=8, tokens=(161, 0, 97, 1, 130, 64, 33, 200))
    group = group_for(case)
    res = check_emulated(group, case)
    idx = [i["topk_idx"] for i in make_rank_inputs(case)]
    got, want = emulated.rdma_rows(res, idx, group.config)
    crossing = sum(int(((i // 2 // 4) != (r // 4)).any(dim=1).sum()) for r, i in enumerate(idx))
    G = case.ranks_per_node
    reached = sum(len({int(e) // 2 // G for e in row if e >= 0} - {r // G}) for r, i in enumerate(idx) for row in i)
    assert got == want == reached >= crossing > 0


def test_a_node_missing_from_the_combine_times_out_naming_it(monkeypatch):
    """A source whose other node never puts its node partials gives up within
    HYBRID_EP_TIMEOUT_S naming the rail peer there and the ring."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    group = EmulatedGroup(4, 128, 64, 8, num_sms_dispatch=2, num_sms_combine=2, device="cpu", ranks_per_node=2,
                          data_path="direct", ring_chunks=RING)
    try:
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(64, 128, generator=gen).to(torch.bfloat16) for _ in range(4)]
        idx = [torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(64)]) for _ in range(4)]
        res = group.dispatch(xs, idx, num_out_tokens=256)
        group.synchronize()
        with ranks_absent(group, {2, 3}):
            group.combine([r.tokens for r in res], [r.handle for r in res])
        with pytest.raises(RuntimeError) as err:
            group.synchronize()
        assert re.search(r"rank [01] gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for peer rank [23] on node 1 "
                         r"in combine node partials \(waiting for the rail peer on that node in the node-partial "
                         r"ring, by RDMA",
                         str(err.value)), str(err.value)
    finally:
        group.close()


@pytest.mark.parametrize("nodes,per_node", [(2, 2), pytest.param(4, 2, marks=pytest.mark.slow)])  # slow: the full tier
def test_the_combine_pipelines_share_own_and_forwarded_chunks(nodes, per_node):
    """A block's own and forwarded chunks cost differently; each kind goes to the two pipelines
    in turn (combine_direct.cuh, UnitPipelines), so at one block per rank their reducers are
    about equally busy in the timing model (taken alternately regardless of kind, one pipeline
    had every forwarded chunk on 2 nodes, and the busier reducers 1.16x / 1.46x the other's time
    on 2 / 4 nodes at the seed shape)."""
    from tools.timing import constants, driver, predict

    shape = predict.Shape(world_size=nodes * per_node, nodes=nodes, hidden=1024, tokens=256, topk=4, experts=16)
    job = predict.job(shape, shape.tokens, [1], [constants.load_table(constants.H200).costs()], payload=False,
                      posted_puts=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYBRID_EP_DATA_PATH", "direct")
        result = driver.run_job(job)
    (launch,) = [x for x in result["runs"][0]["combine"]["launches"] if x["kernel"] == "combine_direct"]
    busy = {r["warp"]: r["busy_ns"] for r in launch["roles"]}
    # each pipeline a load warp, then its reducers (HYBRID_EP_REDUCER_WARPS, default 4), then the put warp
    reducers = launch_plan.reducer_warps_override() or launch_plan.REDUCER_WARPS_NARROW
    first, second = (sum(busy[p * (reducers + 1) + 1 + w] for w in range(reducers)) for p in (0, 1))
    assert len(busy) == 2 * (reducers + 1) + 1
    assert max(first, second) / min(first, second) < 1.08


_WIDE_LAG = hierarchy_case(2, 4, num_experts=16, topk=8, tokens=(600, 0, 97, 1, 330, 64, 33, 513))
_NARROW_LAG = hierarchy_case(2, 2, num_experts=8, topk=4, tokens=(600, 0, 330, 513))
# every lag on the 4-rank case; the 8-rank case (20-30 s a point on the model) at 2 SMs in CI's
# tier, at 1 and 3 in the full tier
LAGGED = [pytest.param(_WIDE_LAG, sms, id=f"{_WIDE_LAG}-{sms}", marks=() if sms == 2 else pytest.mark.slow)
          for sms in (1, 2, 3)] + [pytest.param(_NARROW_LAG, sms, id=f"{_NARROW_LAG}-{sms}") for sms in (1, 2, 3)]


@pytest.mark.parametrize("case, sms", LAGGED)
def test_own_chunks_lag_two_block_steps_on_the_default_ring(case, sms):
    """At the default ring (8 slots) an own chunk comes two block steps after the forwarded
    chunks of its index (DirectCombine::own_lag: 2, 4 and 6 here, where the 2-slot rings above
    allow 1); the calls must still match the oracle and complete."""
    model.set_seed(sms)
    group = _cached(case, num_sms_dispatch=sms, num_sms_combine=sms, data_path="direct")
    assert group.config.ring_chunks == 8
    check_emulated(group, dataclasses.replace(case, seed=sms))
