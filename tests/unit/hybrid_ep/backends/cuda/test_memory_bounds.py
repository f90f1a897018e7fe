"""What the cuda backend holds per GPU for a buffer's life, from memory_plan(): bounded by
design (rings of a fixed number of chunks per peer, outputs from PyTorch's allocator), at the
shapes users run and at the benchmark's seed shape."""

from __future__ import annotations

import pytest

from hybrid_ep.backends.cuda.backend import memory_plan
from hybrid_ep.config import BufferConfig

pytestmark = pytest.mark.unit

GB = 1e9


def _plan(world_size: int, ranks_per_node: int, *, hidden=7168, tokens=4096, experts=256):
    return memory_plan(BufferConfig(hidden, tokens, experts, world_size, ranks_per_node).validate())


def test_deepseek_v3_layer_on_one_node_of_eight_holds_under_1_gb():
    """E=256, top-8, H=7168, 4096 tokens per rank, EP=8 on one node. The plan does not depend on
    the dtype of a call (rows are sized for fp32), so bf16 and fp8 calls hold the same."""
    plan = _plan(8, 8)
    assert plan.held_bytes <= 1 * GB, plan


def test_deepseek_v3_layer_on_eight_nodes_of_eight_holds_under_4_gb():
    plan = _plan(64, 8)
    assert plan.held_bytes <= 4 * GB, plan
    assert plan.as_dict()["nvshmem_heap"] > 0  # the RDMA rings are counted


def test_the_seed_shape_holds_under_1_gb():
    """The benchmark's shape: H=8192, 4096 tokens per rank, 16 experts, EP=8."""
    plan = _plan(8, 8, hidden=8192, experts=16)
    assert plan.held_bytes <= 1 * GB, plan


@pytest.mark.parametrize("world_size, ranks_per_node", [(8, 8), (16, 4)])
def test_more_tokens_per_rank_cost_rings_no_more_memory(world_size, ranks_per_node):
    """Sixteen times the tokens per rank: only the per-chunk signal words grow (16 bytes per
    chunk of 32 tokens and peer), never a row region."""
    small, large = (_plan(world_size, ranks_per_node, tokens=t) for t in (4096, 65536))
    rows = {"recv_rows", "partial_rows", "forward_rows", "recv_meta", "recv_scales"}
    for line in rows:
        assert large.as_dict()[line] == small.as_dict()[line], line
    assert large.held_bytes - small.held_bytes < 64 * 2**20
