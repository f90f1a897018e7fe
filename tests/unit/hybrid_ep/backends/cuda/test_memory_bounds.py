"""What the cuda backend holds per GPU for a buffer's life, from memory_plan(): bounded by
design (rings of a fixed number of chunks per peer, outputs from PyTorch's allocator), at the
shapes users run and at the benchmark's seed shape."""

from __future__ import annotations

import pytest
import torch

from hybrid_ep.backends.cuda.backend import memory_plan
from hybrid_ep.config import BufferConfig

pytestmark = pytest.mark.unit

GB = 1e9


def _plan(world_size: int, ranks_per_node: int, *, hidden=7168, tokens=4096, experts=256, ring_dtype=torch.float32):
    return memory_plan(BufferConfig(hidden, tokens, experts, world_size, ranks_per_node,
                                    ring_dtype=ring_dtype).validate())


def test_deepseek_v3_layer_on_one_node_of_eight_holds_under_1_gb():
    """E=256, top-8, H=7168, 4096 tokens per rank, EP=8 on one node. The held part does not depend
    on the dtype of a call (rows are sized for the buffer's ring_dtype, fp32 by default), so bf16
    and fp8 calls hold the same."""
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


# What a rank's rings hold, by region (registered buffer and RDMA region): rows sized by ring_dtype.
ROW_REGIONS = ("recv_rows", "partial_rows", "forward_rows")


@pytest.mark.parametrize("world_size, ranks_per_node, experts", [(8, 8, 256), (64, 8, 256), (288, 72, 288)])
def test_bf16_rings_hold_half_the_row_regions(world_size, ranks_per_node, experts):
    """ring_dtype=bf16 sizes every row of the rings for 2 bytes a value: each row region is half of
    fp32's (H = 7168: rows stay whole 16-byte lines), and the NVSHMEM heap of the RDMA rings
    shrinks by half its row regions, nothing else."""
    wide, half = (_plan(world_size, ranks_per_node, experts=experts, ring_dtype=d).as_dict()
                  for d in (torch.float32, torch.bfloat16))
    for line in ROW_REGIONS:
        if line in wide:
            assert half[line] * 2 == wide[line], line
    assert half["recv_scales"] == wide["recv_scales"] and half["recv_meta"] == wide["recv_meta"]
    if world_size > ranks_per_node:
        assert half["nvshmem_heap"] < wide["nvshmem_heap"]


@pytest.mark.parametrize("world_size, ranks_per_node", [(72, 72), (288, 72)])
def test_nvlink_domains_of_72_hold_under_0_71_gb_with_bf16_rings(world_size, ranks_per_node):
    """DeepSeek-V3's shape (H 7168, 4096 tokens per rank, 288 experts) on GB200 NVL72: EP 72 in one
    NVLink domain and EP 288 as 4 domains of 72, rings sized for the bf16 rows training moves,
    hold at most 0.71 GB per GPU (DeepEP's figure at EP 64); with fp32 rows the 4 domains do not."""
    plan = _plan(world_size, ranks_per_node, experts=288, ring_dtype=torch.bfloat16)
    assert plan.held_bytes <= 0.71 * GB, plan
    if world_size > ranks_per_node:
        assert _plan(world_size, ranks_per_node, experts=288).held_bytes > 0.71 * GB
