"""The combine's bounded rings on the CPU model: calls that send many times what a ring holds.

The receive path's combine moves partial sums through rings of BufferConfig.ring_chunks chunk
slots per peer (csrc/kernels/combine_receive.cuh): an expert host writes chunk c of a source into slot
c % ring (of the source's ring, or of its rail peer's forwarding ring), a forwarder the node
partials of chunk c into slot c % ring of the node-partial ring, and each, from the second turn
on, first waits until the reader of that ring has read chunk c - ring there (its credit). Here
the rings have 2 slots, the fewest allowed, and the calls 8 to 16 chunks per source, so every
ring turns over many times; each call must still match the oracle (every rounding of the
hierarchy reproduced) and complete: a wait that never ends ends the launch with a timeout
record, which the check raises. Several SM counts per rank, so that a rank has more blocks than
its rings have slots.
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import torch

from harness.emulated import GroupCache, check_emulated, on_device
from harness.faults import ranks_absent
from harness.hierarchy_cases import hierarchy_case
from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.backends.cuda.layout import registered_layout, registered_regions, ring_tag
from hybrid_ep.verify.cases import Case, make_rank_inputs

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

RING = 2  # chunk slots per ring: BufferConfig's smallest
_cached = GroupCache("cpu")


def group_for(case: Case, sms: int = 2) -> EmulatedGroup:
    return _cached(case, num_sms_dispatch=2, num_sms_combine=sms, data_path="receive", ring_chunks=RING)


def _case(W, **kw):
    base = dict(world_size=W, ranks_per_node=W, num_experts=2 * W, hidden=128, tokens=(17,) * W, topk=2,
                dtype=torch.bfloat16, backend="cuda")
    base.update(kw)
    return Case(**base)


ONE_NODE = [
    # one source and eight hosts of its routes, each with a few rows per chunk: the hosts run ahead
    # and wait for the source's credits, so a credit sent early lets a host overwrite what the
    # source is still reading
    _case(8, num_experts=16, topk=2, tokens=(512,) + (0,) * 7),
    # 16 chunks per source, 8 turns of every ring: every token to one expert, every route to one rank
    _case(8, routing="one-expert", topk=1, tokens=(512,) * 8),
    _case(8, routing="one-rank", topk=2, tokens=(512,) * 8),
    # W = 3, odd token counts, a rank without tokens
    _case(3, tokens=(257, 0, 101), topk=3),
    # fp32 rows with apply_probs; a bf16 wire (the default) and an fp32 wire for bf16 rows
    _case(4, dtype=torch.float32, apply_probs=True, topk=4, tokens=(200, 33, 0, 129)),
    _case(4, num_experts=16, topk=8, tokens=(300, 1, 64, 97)),
    _case(4, num_experts=16, topk=8, tokens=(300, 1, 64, 97), wire_dtype=torch.float32),
    _case(3, dtype=torch.float16, apply_probs=True, tokens=(130, 257, 5), wire_dtype=torch.float32),
    # dropped routes (-1), and a static size that drops rows (num_out_tokens)
    _case(4, num_experts=16, drop_fraction=0.3, topk=8, tokens=(260, 17, 0, 99)),
    _case(4, num_experts=16, num_out_tokens=150, topk=8, tokens=(260, 17, 0, 99)),
]


@pytest.mark.parametrize("case", ONE_NODE, ids=str)
def test_one_node_calls_many_times_a_ring_match_the_oracle(case):
    model.set_seed(3)
    check_emulated(group_for(case), dataclasses.replace(case, seed=3))


SEVERAL_NODES = [
    hierarchy_case(2, 2, topk=1, tokens=(512, 0, 0, 0)),  # one source, hosts on both nodes ahead of it
    hierarchy_case(2, 2, tokens=(300, 0, 97, 257), topk=4),
    hierarchy_case(3, 2, tokens=(129, 200, 0, 33, 257, 64), topk=6, apply_probs=True, dtype=torch.float32),
    hierarchy_case(4, 1, tokens=(200, 0, 64, 129), topk=4, wire_dtype=torch.float32),
    hierarchy_case(2, 4, routing="one-expert", topk=1, tokens=(256,) * 8),
    hierarchy_case(2, 2, routing="one-rank", topk=2, tokens=(512,) * 4),
    hierarchy_case(3, 1, drop_fraction=0.3, topk=3, tokens=(300, 100, 5)),
    hierarchy_case(2, 2, num_out_tokens=120, topk=4, num_experts=16, tokens=(260, 17, 0, 99)),
]


@pytest.mark.parametrize("case", SEVERAL_NODES, ids=str)
def test_several_nodes_calls_many_times_a_ring_match_the_oracle(case):
    model.set_seed(case.world_size)
    check_emulated(group_for(case), dataclasses.replace(case, seed=case.world_size))


@pytest.mark.parametrize("sms", [1, 3, pytest.param(5, marks=pytest.mark.slow)])  # slow: the full tier
def test_more_blocks_than_ring_slots(sms):
    """A rank's blocks take its chunks in turn, so with more blocks than slots one block's chunk
    waits for another block's (or rank's) credit; the forwarder's own chunks come less than a
    turn of the ring after the forwarded ones (SourceSideChunks' lag)."""
    for case in (_case(4, num_experts=16, topk=8, tokens=(300, 1, 64, 97)),
                 hierarchy_case(2, 2, tokens=(300, 0, 97, 257), topk=4)):
        model.set_seed(sms)
        check_emulated(group_for(case, sms=sms), dataclasses.replace(case, seed=sms))


def test_back_to_back_calls_reuse_the_rings():
    """Each call starts its rings' slots where the last left them: the signal and credit words
    carry the call and the chunk, so no word is reset between calls."""
    first = hierarchy_case(2, 2, tokens=(300, 0, 97, 257), topk=4)
    group = group_for(first)
    for call in range(4):
        case = dataclasses.replace(first, seed=call, tokens=(300, 257 - 60 * call, call, 97), topk=2 + call % 3)
        model.set_seed(call)
        check_emulated(group, case)
    assert group_for(first) is group


def test_the_partial_ring_is_its_slots_whatever_max_tokens():
    """Memory for partials: ring x 32 fp32 rows per expert host, not max_tokens rows."""
    group = group_for(ONE_NODE[0])
    reg, cfg = registered_layout(group.config), group.config
    partial_rows = {r.name: r.bytes for r in registered_regions(cfg)}["partial_rows"]
    assert reg.partial.slots == RING and reg.partial.rings == cfg.ranks_per_node
    assert partial_rows == cfg.ranks_per_node * RING * 32 * cfg.hidden_dim * 4
    assert partial_rows * 8 == cfg.world_size * cfg.max_tokens_per_rank * cfg.hidden_dim * 4


def test_a_source_that_never_reads_its_partials_is_named_by_its_expert_host(monkeypatch):
    """Rank 1's 256 tokens (8 chunks) all go to rank 0's experts, and rank 1 is missing from the
    combine: rank 0 stores chunks 0 and 1 into rank 1's ring, then waits for rank 1 to free the
    slot of chunk 0, and gives up naming rank 1 and the ring (no other wait is open: rank 0 has
    no tokens of its own)."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    group = EmulatedGroup(2, 128, 256, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu", data_path="receive",
                          ring_chunks=RING)
    try:
        case = _case(2, num_experts=4, tokens=(0, 256))
        xs, _, weights, _ = on_device(make_rank_inputs(case), "cpu")
        idx = [torch.zeros(0, 2, dtype=torch.int64), torch.tensor([[0, 1]] * 256)]
        res = group.dispatch(xs, idx, weights)
        group.synchronize()
        with ranks_absent(group, {1}):
            group.combine([r.tokens for r in res], [r.handle for r in res])
        with pytest.raises(RuntimeError, match=r"rank 0 gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for peer "
                                               r"rank 1 in the combine's partial-sum ring .*\(call 1, expected "
                                               rf"{ring_tag(1, 0)}, saw 0\)"):
            group.synchronize()
    finally:
        group.close()


def _combine_with_absent(world: int, per_node: int, max_tokens: int, idx: list[torch.Tensor], absent: set[int]) -> str:
    """Dispatch `idx` (bf16 rows of 128) on a receive-path group with two-slot rings, then a
    combine with the ranks `absent` missing; returns the error the group raised."""
    group = EmulatedGroup(world, 128, max_tokens, 2 * world, num_sms_dispatch=1, num_sms_combine=1, device="cpu",
                          ranks_per_node=per_node, data_path="receive", ring_chunks=RING)
    try:
        xs = [torch.randn(i.shape[0], 128).to(torch.bfloat16) for i in idx]
        res = group.dispatch(xs, idx)
        group.synchronize()
        with ranks_absent(group, absent):
            group.combine([r.tokens for r in res], [r.handle for r in res])
        with pytest.raises(RuntimeError) as err:
            group.synchronize()
        return str(err.value)
    finally:
        group.close()


# Schedules of the model (its seed) on which a wait of a rank on its own ring timed out first
# and the record named the rank itself, before that wait had twice the bound (peer_ring.cuh).
ABSENT_SEEDS = [0, 2, 3]


@pytest.mark.parametrize("seed", ABSENT_SEEDS)
def test_a_forwarder_that_never_reads_is_named_by_the_expert_host(monkeypatch, seed):
    """Two nodes of two ranks: rank 0's 256 tokens all go to rank 3's experts (node 1), whose
    partials of them go to rank 0's rail peer there, rank 2. With ranks 0-2 missing from the
    combine, rank 3 fills rank 2's forwarding ring and gives up waiting for rank 2 to free the
    slot of chunk 0. (Nothing else waits: rank 3 has no tokens, and rank 1, which has to signal
    every chunk of rank 0 too, rows or none, is missing.)"""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    model.set_seed(seed)
    empty = torch.zeros(0, 2, dtype=torch.int64)
    message = _combine_with_absent(4, 2, 256, [torch.tensor([[6, 7]] * 256), empty, empty, empty], {0, 1, 2})
    assert re.search(r"rank 3 gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for peer rank 2 on node 1 in the "
                     rf"combine's forwarding ring .*\(call 1, expected {ring_tag(1, 0)}, saw 0\)", message), message


@pytest.mark.parametrize("seed", ABSENT_SEEDS)
def test_a_source_that_never_reads_its_node_partials_is_named_by_its_forwarder(monkeypatch, seed):
    """Two nodes of one rank: rank 0's 256 tokens all go to rank 1's experts; rank 1 forwards
    their node partials back. With rank 0 missing from the combine, rank 1 puts chunks 0 and 1
    and gives up waiting for rank 0 to free the node-partial slot of chunk 0, by RDMA. Rank 1's
    expert side, which waits for its own forwarder to free a forwarding-ring slot meanwhile,
    does not report first (on seeds 2 and 3 it did, naming rank 1 itself)."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    model.set_seed(seed)
    message = _combine_with_absent(2, 1, 256, [torch.tensor([[2, 3]] * 256), torch.zeros(0, 2, dtype=torch.int64)],
                                   {0})
    assert re.search(r"rank 1 gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for peer rank 0 on node 0 in the "
                     rf"combine's node-partial ring .*\(call 1, expected {ring_tag(1, 0)}, saw 0\)", message), message
