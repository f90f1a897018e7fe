"""The receive path's bounded rings on the CPU model, against the oracle.

A buffer holds ring_chunks chunk slots per peer for the rows it receives (and, with several
nodes, for the rows it stages for and receives from other nodes), whatever the routing; a call
that sends a rank more takes more turns of the ring, the writer waiting for the reader's credit
of each slot (csrc/kernels/dispatch_receive.cuh). The oracle matrices run on the smallest ring
(2 chunks) where they live (test_kernels_model.py::test_the_receive_path_on_two_slot_rings,
test_hierarchy_model.py::test_hierarchical_kernels_on_two_slot_rings); here run calls that wrap
it many times: every token of every rank to one expert, every token to one rank, odd and zero
token counts, fp8, dropped routes, 2-4 nodes. The model's waits are real, so a deadlock of the rings fails as a
timeout record. A missing reader is reported naming the ring, the peer and the chunk.
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
from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.backends.cuda.layout import ring_tag
from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.verify.cases import Case

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

RING = 2  # the smallest ring: every call of more than 2 chunks per (source, destination) wraps it
MODEL_SMS = 2
_cached = GroupCache("cpu")


def group_for(case: Case, sms: int = MODEL_SMS) -> EmulatedGroup:
    return _cached(case, num_sms_dispatch=sms, num_sms_combine=sms, data_path="receive", ring_chunks=RING)


def _case(W, **kw):
    base = dict(world_size=W, ranks_per_node=W, num_experts=2 * W, hidden=128, topk=2, dtype=torch.bfloat16,
                backend="cuda")
    base.update(kw)
    return Case(**base)


# Calls that wrap a 2-chunk ring many times (a ring holds 64 rows per source).
WRAPS = [
    # every token of every rank to one expert: rank 2 receives 4 x 512 rows, 8 turns of each ring
    _case(4, routing="one-expert", topk=1, tokens=(512,) * 4),
    # every route of every token to one rank's experts, odd and zero token counts
    _case(4, routing="one-rank", tokens=(321, 0, 257, 96)),
    # W = 3, top-8 of 9 experts, odd counts and a rank without tokens
    _case(3, num_experts=9, topk=8, tokens=(301, 0, 97), dtype=torch.float32),
    # fp8 rows and their scales through the rings
    _case(4, num_experts=16, topk=4, dtype=FP8_DTYPE, routing="one-rank", tokens=(200, 1, 0, 170)),
    # dropped routes (-1) and a static size that drops routed rows (num_out_tokens too small)
    _case(4, num_experts=16, topk=4, drop_fraction=0.3, num_out_tokens=300, tokens=(260, 33, 0, 199)),
    # rows over one FIFO stage, two segments each
    _case(2, hidden=12288, dtype=torch.float32, routing="one-rank", tokens=(97, 70)),
]

HIERARCHY_WRAPS = [
    hierarchy_case(2, 2, routing="one-expert", topk=1, tokens=(300,) * 4),
    hierarchy_case(2, 2, routing="one-rank", topk=2, tokens=(257, 0, 199, 64)),
    hierarchy_case(3, 2, tokens=(161, 0, 97, 1, 130, 64), topk=4),
    hierarchy_case(4, 1, routing="one-expert", topk=1, tokens=(200, 129, 0, 96)),
    hierarchy_case(4, 2, num_experts=16, topk=8, dtype=FP8_DTYPE, tokens=(128, 0, 97, 65, 33, 1, 160, 96)),
    hierarchy_case(2, 2, num_experts=16, topk=8, drop_fraction=0.25, num_out_tokens=200, tokens=(190, 0, 130, 67)),
    # rows over one FIFO stage to one rank: its forwarders' FIFOs fill while they wait for its
    # ring, so forwarded rows stay in the staging ring while the sources go on
    hierarchy_case(2, 2, 12288, dtype=torch.float32, routing="one-rank", topk=2, tokens=(97, 130, 0, 65)),
]


@pytest.mark.parametrize("case", WRAPS + HIERARCHY_WRAPS, ids=str)
def test_calls_that_wrap_the_ring_many_times_match_the_oracle(case):
    model.set_seed(3)
    check_emulated(group_for(case), case)


def test_a_call_that_wraps_the_ring_needs_no_more_memory():
    """The dispatch's rings do not grow with max_tokens_per_rank: the receive ring's regions
    and, with several nodes, the staging rings' are the same for 64 and 4096 tokens per rank."""
    from hybrid_ep.backends.cuda.layout import rdma_regions, registered_layout, registered_regions

    def config(tokens):
        return dataclasses.replace(hierarchy_case(2, 2, tokens=(tokens,) * 4).config, ring_chunks=RING)

    small, large = config(64), config(4096)
    a, b = ({r.name: r.bytes for r in registered_regions(c)} for c in (small, large))
    for region in ("recv_rows", "recv_meta"):
        assert a[region] == b[region] > 0, region
    assert registered_layout(small).recv.slots == RING  # the least a ring turns over with
    assert a["recv_rows"] == 4 * RING * 32 * 128 * 4  # W x slots x 32 rows of H fp32 values
    a, b = ({r.name: r.bytes for r in rdma_regions(c)} for c in (small, large))
    for region in ("staged_meta", "staged_rows"):
        assert a[region] == b[region] > 0, region
    assert a["staged_rows"] == 2 * 2 * RING * 32 * 128 * 4  # out and in: N x slots x 32 rows of H fp32 values


def test_back_to_back_calls_wrap_the_ring_with_other_shapes():
    """Credits carry the call in their high word: a slot freed in the previous call does not
    count as freed in this one, over calls with other routings, token counts and dtypes."""
    first = _case(3, tokens=(200, 0, 0))
    group = group_for(first)
    dtypes = (torch.bfloat16, torch.float32, FP8_DTYPE, torch.float16)
    for call in range(6):
        case = _case(3, seed=call, dtype=dtypes[call % 4], topk=1 + call % 2, tokens=(200, (67 * call) % 201, call),
                     routing="one-rank" if call % 2 else "uniform")
        model.set_seed(call)
        check_emulated(group, case)
    assert group_for(first) is group


def _dispatch_to_an_absent_rank(ranks_per_node: int) -> str:
    """Rank 0 sends its 256 tokens (8 chunks) to rank 1's experts through 2-chunk rings; rank 1
    has no tokens and runs its count kernel but not its dispatch kernel. Returns the error the
    group raised."""
    group = EmulatedGroup(2, 128, 256, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu", data_path="receive",
                          ranks_per_node=ranks_per_node, ring_chunks=RING)
    try:
        xs = [torch.randn(256, 128).to(torch.bfloat16), torch.zeros(0, 128, dtype=torch.bfloat16)]
        idx = [torch.tensor([[2, 3]] * 256), torch.zeros(0, 2, dtype=torch.int64)]
        with ranks_absent(group, after_count={1}):
            group.dispatch(xs, idx, num_out_tokens=512)
        with pytest.raises(RuntimeError) as err:
            group.synchronize()
        return str(err.value)
    finally:
        group.close()


@pytest.mark.parametrize("seed", [0, 1])
def test_a_reader_that_never_frees_its_ring_is_named(monkeypatch, seed):
    """One node: rank 0's writers fill the two slots of rank 1's ring for rank 0 and wait for
    rank 1 to free chunk 0's slot (its credit in call 1, ring_tag(1, 0)): the record names the ring,
    rank 1 and that chunk. Rank 0's expansion waits too, for its own chunk 2, which its stalled
    writers never signal; a wait on a rank's own signal has twice the bound, so the ring's wait
    reports first whatever the schedule."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    model.set_seed(seed)
    message = _dispatch_to_an_absent_rank(ranks_per_node=2)
    assert re.search(r"rank 0 gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for peer rank 1 in the dispatch's "
                     r"receive ring \(waiting for the peer to read a chunk and free its slot.*"
                     rf"\(call 1, expected {ring_tag(1, 0)}, saw 0\)", message), message


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_rail_peer_that_never_forwards_is_named(monkeypatch, seed):
    """Two nodes of one rank: rank 0 stages its 8 chunks for node 1 through a 2-chunk staging
    ring and waits for rank 1 to forward a chunk and free its slot: the record names the
    staging, rank 1, its node and the chunk. Its RDMA warps wait side by side, each for the
    slot of its own chunk c >= 2 (the credit of chunk c - 2), so which chunk's wait ends first
    depends on the schedule: any of chunks 0-5 with nothing seen."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    model.set_seed(seed)
    message = _dispatch_to_an_absent_rank(ranks_per_node=1)
    found = re.search(r"rank 0 gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for peer rank 1 on node 1 in the "
                      r"dispatch's staging for that node \(waiting for the rail peer to forward a chunk and free its "
                      r"slot.*\(call 1, expected (\d+), saw 0\)", message)
    assert found, message
    assert int(found.group(1)) in {ring_tag(1, c) for c in range(8 - RING)}, message
