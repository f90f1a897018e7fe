"""CPU-side parts of the cuda backend: buffer layout, launch configuration, the compiled
structs, backend selection, and the layout arithmetic the kernels implement.
"""

from __future__ import annotations

import dataclasses
import importlib
import os

import pytest
import torch

from helpers import REPO, built_cuda_extension
from hybrid_ep import logs
from hybrid_ep.backends.cuda import launch
from hybrid_ep.backends.cuda.agreement import expert_out_block_bytes
from hybrid_ep.backends.cuda.arena import call_bytes
from hybrid_ep.backends.cuda.backend import memory_plan
from hybrid_ep.backends.cuda.errors import SetupError
from hybrid_ep.backends.cuda.layout import (
    AGREE_WORDS,
    MAX_TOPK,
    buffer_layouts,
    check_geometry,
    info_layout,
    rdma_layout,
    rdma_regions,
    registered_layout,
    registered_regions,
)
from hybrid_ep.backends.cuda.peer_memory import CHUNK
from hybrid_ep.config import BufferConfig
from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.routing import max_output_rows
from hybrid_ep.synthetic import drop_routes, iter_rank_routings, random_weights
from hybrid_ep.verify.oracle import dispatch_oracle

pytestmark = pytest.mark.unit

H100_SMEM_OPTIN = 227 * 1024


def _cfg(W=8, E=16, H=8192, T=4096, G=None, pad=1, min_rows=0):
    return BufferConfig(H, T, E, W, G or W, pad, min_rows).validate()


def _regions(regions) -> dict[str, int]:
    return {r.name: r.bytes for r in regions}


@pytest.mark.parametrize("cfg", [_cfg(), _cfg(W=1, E=1, H=128, T=0), _cfg(W=6, E=36, H=7168, T=17),
                                 _cfg(W=8, E=256, H=7168, T=4096), _cfg(W=64, E=256, H=7168, T=4096, G=8)])
def test_registered_regions_are_aligned_contiguous_and_sized(cfg):
    reg, regions = registered_layout(cfg), registered_regions(cfg)
    W, G, N, L, T, H = (cfg.world_size, cfg.ranks_per_node, cfg.num_nodes, cfg.experts_per_rank,
                        cfg.max_tokens_per_rank, cfg.hidden_dim)
    assert regions[0].offset == 0 and all(r.offset % 128 == 0 for r in regions)
    for r, nxt in zip(regions, regions[1:]):
        assert r.offset + r.bytes == nxt.offset
    assert regions[-1].offset + regions[-1].bytes == reg.total
    sizes = _regions(regions)
    # the receive rings: a ring per source, each writer's ring_chunks shared among its N sources
    assert reg.recv.rings == W and reg.recv.slots == max(2, cfg.ring_chunks // N)
    ring_rows = W * reg.recv.slots * 32
    assert sizes["recv_rows"] == ring_rows * reg.row_stride and reg.row_stride >= H * 4
    assert sizes["recv_meta"] == 16 * ring_rows * reg.meta_entries and reg.meta_entries == min(L, MAX_TOPK)
    assert sizes["recv_scales"] == ring_rows * reg.scale_stride
    assert reg.scale_stride == (((H // 128) * 4 + 15) // 16 * 16 if H % 128 == 0 else 0)
    # the partial rings: one per expert host of the node, ring_chunks slots or the largest source's chunks
    comb = min(cfg.ring_chunks, max(1, -(-T // 32)))
    assert (reg.partial.rings, reg.partial.slots) == (G, comb)
    assert sizes["partial_rows"] == G * comb * 32 * ((H * 4 + 15) // 16 * 16)
    assert sizes["forward_rows"] == (N * G * reg.forward.slots * 32 * reg.wire_stride if N > 1 else 0)
    assert sizes["flags+counts"] >= 8 * (N * G * reg.recv.slots + 2 * G * comb) + 4 * W * (W + N + L)
    heap = memory_plan(cfg).as_dict().get("nvshmem_heap", 0)  # several nodes: the RDMA region's
    assert memory_plan(cfg).registered_bytes == reg.total + heap  # peer memory starts empty


def test_memory_plan_lines_are_the_registered_regions():
    """memory_plan()'s registered lines are the regions csrc builds (name, bytes, purpose), in order."""
    for cfg in (_cfg(), _cfg(W=8, E=256, H=7168, T=4096, G=4)):
        regions = registered_regions(cfg)
        lines = memory_plan(cfg).buffers[:len(regions)]
        assert [(b.name, b.nbytes, b.purpose) for b in lines] == [(r.name, r.bytes, r.purpose) for r in regions]
        assert sum(b.nbytes for b in lines) == registered_layout(cfg).total


@pytest.mark.parametrize(("world_size", "held"), [(64, 0.7e9), (8, 0.12e9)])
def test_a_deepseek_v3_like_layer_holds_rings_sized_by_their_writers(world_size, held):
    """E 256, top-8, H 7168, 4096 tokens per rank (a bf16 model's layer): EP 64 as 8 nodes of 8
    holds at most 0.7 GB per GPU, EP 8 at most 0.12 GB. Each ring region is sized by the peers
    that write it (node peers over NVLink, rail peers over RDMA), not by the EP size."""
    cfg = BufferConfig(7168, 4096, 256, world_size, 8).validate()
    plan = memory_plan(cfg)
    assert plan.held_bytes <= held, str(plan)
    reg, row, lines = registered_layout(cfg), 7168 * 4, plan.as_dict()
    # NVLink: the partial rings one per expert host of the node (G), ring_chunks slots each
    assert lines["partial_rows"] == 8 * 8 * 32 * row
    if world_size == 8:
        assert lines["recv_rows"] == 8 * 8 * 32 * row  # a ring per source, all of this node
    else:  # a writer's 8 slots shared among its 8 sources, but no fewer than 2 each
        assert reg.recv.slots == reg.forward.slots == 2
        assert lines["recv_rows"] == 64 * 2 * 32 * row and lines["forward_rows"] == 8 * 8 * 2 * 32 * row
        assert _regions(rdma_regions(cfg))["staged_rows"] == 2 * 8 * 8 * 32 * row  # RDMA: N rings, out and in


DSV3_ROW = 7168 * 4  # a DeepSeek-V3 row between ranks, sized for fp32


def _dsv3(world_size: int, ranks_per_node: int, ring_chunks: int = 8) -> BufferConfig:
    """DeepSeek-V3's layer (H 7168, 4096 tokens per rank, top-8) with 288 experts, which every
    group below divides."""
    return BufferConfig(7168, 4096, 288, world_size, ranks_per_node, ring_chunks=ring_chunks).validate()


@pytest.mark.parametrize("ring", [2, 4, 8, 16])
@pytest.mark.parametrize("G", [1, 2, 4, 8])
def test_up_to_eight_writers_each_keep_ring_chunks_slots(G, ring):
    """A host of 8 GPUs or fewer: every writer keeps its ring_chunks slots in each ring family
    (the depth the kernels run at there), whatever the nodes."""
    for N in (1, 2):
        reg = registered_layout(BufferConfig(7168, 4096, 8 * G * N, G * N, G, ring_chunks=ring).validate())
        assert reg.partial.slots == ring and reg.recv.slots == max(2, ring // N)
        if N > 1:
            assert reg.forward.slots == max(2, ring // (N - 1))


@pytest.mark.parametrize(("G", "slots"), [(9, 7), (12, 5), (16, 4), (32, 2), (36, 2), (72, 2)])
def test_past_eight_writers_each_holds_its_share_of_eight_writers_slots(G, slots):
    """A reader with G > 8 writers (a GB200 NVLink domain) gives each its share of
    ring_chunks x 8 slots, never fewer than 2 (the least a ring between ranks turns over with):
    the bytes a reader holds stop growing with the domain until that floor."""
    cfg = _dsv3(G, G)
    reg, lines = registered_layout(cfg), memory_plan(cfg).as_dict()
    assert (reg.recv.rings, reg.recv.slots) == (G, slots) and (reg.partial.rings, reg.partial.slots) == (G, slots)
    assert lines["recv_rows"] == lines["partial_rows"] == G * slots * 32 * DSV3_ROW
    assert lines["recv_rows"] <= 8 * 8 * 32 * DSV3_ROW or slots == 2


# held bytes per GPU at DeepSeek-V3's shape (E 288, bf16): the registered regions and, across
# domains, the NVSHMEM heap; each the sum of the regions asserted in the test
DSV3_HELD = {(8, 8): 118_445_440, (36, 36): 133_022_976, (72, 72): 265_768_192, (288, 72): 1_349_992_320}


@pytest.mark.parametrize(("W", "G"), list(DSV3_HELD))
def test_memory_plan_at_deepseek_v3s_shape_per_nvlink_domain(W, G):
    """memory_plan() at 8, 36, 72 ranks in one NVLink domain and 288 as 4 domains of 72. One
    domain of 36 or 72 holds at most 0.71 GB per GPU (DeepEP's figure at EP 64; it held 0.53 and
    1.06 GB with a full depth per writer); 4 domains of 72 hold 1.35 GB (1.75 before): there the
    receive and forward rings keep 2 slots per (writer, source), 288 of each."""
    cfg = _dsv3(W, G)
    plan, reg, N = memory_plan(cfg), registered_layout(cfg), W // G
    lines = plan.as_dict()
    slots = 8 if G <= 8 else 2
    assert lines["recv_rows"] == W * max(2, slots // N) * 32 * DSV3_ROW
    assert lines["partial_rows"] == G * slots * 32 * DSV3_ROW
    assert lines["forward_rows"] == (W * 2 * 32 * DSV3_ROW if N > 1 else 0)
    assert (reg.forward.slots if N > 1 else 2) == 2
    if N > 1:  # RDMA: N <= 8 rail peers keep their ring_chunks slots, out and in
        rd = _regions(rdma_regions(cfg))
        assert rd["staged_rows"] == rd["node_part_rows"] == 2 * N * 8 * 32 * DSV3_ROW
    assert plan.held_bytes == DSV3_HELD[(W, G)], str(plan)
    if N == 1:
        assert plan.held_bytes <= 0.71e9


def test_outputs_are_not_held_and_peer_memory_starts_empty():
    """One process per rank: peer memory holds nothing until a call needs it (peer_memory_bytes
    pre-sizes it, rounded up to a chunk); what a call can make it grow by is the per-call part:
    its output, an expert-out block and the rounding of a growth."""
    plan = memory_plan(_cfg())
    sizes = plan.as_dict()
    assert sizes["peer_memory"] == 0 and "arena" not in sizes
    out = next(b for b in plan.buffers if b.name == "dispatch_out")
    worst = 8 * 4096 * 2  # every route of every rank
    # bf16 rows by default: the rows, their fp32 probs, alignment
    assert not out.registered and out.nbytes == call_bytes(worst, 8192, torch.bfloat16)
    assert worst * (8192 * 2 + 4) <= out.nbytes < worst * (8192 * 2 + 4) + 1024
    assert sizes["expert_out_block"] == worst * 8192 * 2 and sizes["peer_rounding"] == CHUNK  # bf16 expert_out rows
    assert plan.workspace_bytes == out.nbytes + worst * 8192 * 2 + CHUNK
    assert plan.held_bytes == plan.registered_bytes == sum(plan.held_by_region().values())
    presized = memory_plan(BufferConfig(8192, 4096, 16, 8, 8, peer_memory_bytes=CHUNK + 1).validate())
    assert presized.as_dict()["peer_memory"] == 2 * CHUNK
    assert memory_plan(_cfg(), peer_held=3 * CHUNK).as_dict()["peer_memory"] == 3 * CHUNK


@pytest.mark.parametrize("dtype, value_bytes", [(torch.float32, 4), (torch.bfloat16, 2), (FP8_DTYPE, 2)])
def test_the_expert_out_block_is_sized_for_the_expert_output_of_the_rows_dispatched(dtype, value_bytes):
    """The expert-out block holds the dispatch's expert output: fp32 rows after fp32, bf16 after
    bf16 and fp8 (the experts compute in bf16); the output block, the rows as dispatched."""
    sizes = memory_plan(_cfg(), dtype=dtype).as_dict()
    worst = 8 * 4096 * 2
    assert sizes["expert_out_block"] == expert_out_block_bytes(worst, 8192, dtype) == worst * 8192 * value_bytes
    assert sizes["dispatch_out"] >= worst * 8192 * dtype.itemsize


def test_the_expert_out_block_at_deepseek_v3s_shape_is_half_the_fp32_one():
    """At the DeepSeek-V3-like shape (hidden 7168, 4096 tokens per rank, 256 experts on 8
    ranks, top-8), training's bf16 expert-out block is at most half of an fp32 block with room
    for its probs: in memory_plan() (the worst case: every route of every rank) and for a
    balanced call (4096 x 8 rows: 0.47 GB, not 0.94)."""
    cfg = BufferConfig(7168, 4096, 256, 8, 8).validate()
    worst = max_output_rows(cfg, min(cfg.experts_per_rank, MAX_TOPK))  # the plan's worst case
    bf16 = memory_plan(cfg).as_dict()["expert_out_block"]
    assert bf16 == worst * 7168 * 2 and bf16 <= (worst * 7168 * 4 + worst * 4) / 2
    balanced = 4096 * 8
    assert expert_out_block_bytes(balanced, 7168) == balanced * 7168 * 2 == 469_762_048
    figure = f"{expert_out_block_bytes(balanced, 7168) / 1e9:.2f} GB"  # what the user pages say
    for page in ("README.md", "docs/megatron.md"):
        with open(os.path.join(REPO, page)) as f:
            text = " ".join(f.read().split())
        assert any(f"{figure} for {a}4096 tokens x top-8" in text for a in ("a call of ", "")), page


@pytest.mark.parametrize("ring", [2, 8])
def test_combine_rings_are_their_slots_whatever_max_tokens(ring):
    """Several nodes: every combine ring (partials, forwarded partials, node partials out and in)
    holds its slots x 32 fp32 rows per writer, with a signal and a credit word per slot; 4096 or
    65536 tokens per rank take the same bytes."""
    sizes = []
    for T in (4096, 65536):
        cfg = BufferConfig(7168, T, 256, 64, 8, ring_chunks=ring).validate()
        reg, rdma = registered_layout(cfg), rdma_layout(cfg)
        row, G, N = 7168 * 4, 8, 8
        regs, rd = _regions(registered_regions(cfg)), _regions(rdma_regions(cfg))
        assert regs["partial_rows"] == G * ring * 32 * row
        assert regs["forward_rows"] == N * G * max(2, ring // (N - 1)) * 32 * row
        assert rd["node_part_rows"] == 2 * N * ring * 32 * row
        assert (rdma.node_part.rings, rdma.node_part.slots) == (N, ring)
        sizes.append((regs["partial_rows"], regs["forward_rows"], rd["node_part_rows"], reg.partial.slots,
                      reg.forward.slots))
    assert sizes[0] == sizes[1]


def test_info_offsets_are_contiguous():
    cfg = _cfg(W=6, E=36, G=6)
    il = info_layout(cfg)
    fields = dataclasses.asdict(il)
    total = fields.pop("total")
    W, N, L = 6, 1, 6
    sizes = {"tokens_per_expert": L, "expert_start": L, "expert_rows": L, "src_prefix": W * L, "recv_count": W,
             "src_tokens": W,
             "recv_offset": W, "send_count": W, "needed": 1, "bad_route": 3, "agreement": W * (1 + AGREE_WORDS),
             "dropped": 1, "num_recv": 1, "count_matrix": W * W, "node_counts": W * N}
    assert sum(sizes.values()) == total
    for name, start in fields.items():
        assert start + sizes[name] <= total
    assert sorted(fields.values()) == sorted(set(fields.values()))
    assert il.bad_route == il.needed + 1  # a dynamic-size dispatch reads both in one slice
    assert il.agreement == il.bad_route + 3  # and every rank's agreement words in the same


@pytest.mark.parametrize("kwargs,match", [
    (dict(W=2, E=4, G=1), "inter-node transport"),
    (dict(W=2, E=2048), "num_experts must be <= 1024"),
    (dict(W=1, E=1, H=6), "hidden_dim must be a multiple of 4"),
])
def test_geometry_limits_name_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        check_geometry(_cfg(**kwargs))


def test_fifo_shapes():
    bf16 = launch.fifo_shape(8192 * 2, H100_SMEM_OPTIN)  # one 16 KiB row per stage
    assert (bf16.stage_bytes, bf16.stages, bf16.rows_per_stage) == (16384, 8, 1)
    fp32_big = launch.fifo_shape(16384 * 4, H100_SMEM_OPTIN)  # 64 KiB rows: two segments each
    assert (fp32_big.stage_bytes, fp32_big.stages, fp32_big.rows_per_stage) == (launch.MAX_STAGE_BYTES, 6, 1)
    tiny = launch.fifo_shape(128 * 2, H100_SMEM_OPTIN)  # small rows batched, a chunk's worth at most
    assert (tiny.stage_bytes, tiny.rows_per_stage) == (32 * 256, 32) and tiny.stages == 8
    mid = launch.fifo_shape(2048 * 2, H100_SMEM_OPTIN)  # four 4 KiB rows fill the 16 KiB target
    assert (mid.stage_bytes, mid.rows_per_stage) == (16384, 4)
    ds = launch.fifo_shape(7168 * 2, H100_SMEM_OPTIN)  # DeepSeek-V3's bf16 row: one per stage
    assert (ds.stage_bytes, ds.rows_per_stage) == (14336, 1)
    assert launch.fifo_shape(128, H100_SMEM_OPTIN, chunk_tokens=8).rows_per_stage == 8
    for shape in (bf16, fp32_big, tiny, mid, ds):
        assert shape.smem_bytes <= H100_SMEM_OPTIN - launch.STATIC_SMEM_RESERVE
    # Dispatch's two FIFOs (send, expand) share the budget: fewer stages each, both fit.
    two = launch.fifo_shape(8192 * 2, H100_SMEM_OPTIN, pipelines=launch.DISPATCH_PIPELINES)
    assert (two.stage_bytes, two.stages) == (16384, 6)
    assert launch.DISPATCH_PIPELINES * two.smem_bytes <= H100_SMEM_OPTIN - launch.STATIC_SMEM_RESERVE
    with pytest.raises(ValueError, match="multiple of 16"):
        launch.fifo_shape(24, H100_SMEM_OPTIN)
    with pytest.raises(ValueError, match="fewer than 2 FIFO stages"):
        launch.fifo_shape(32768, 48 * 1024)


def test_store_queue_keeps_most_stages_for_the_loads():
    # The seed shape's dispatch FIFOs (6 stages of one 16 KiB row) hold one stage for the
    # stores, where a fixed queue of 4 left the loads 1-2 stages.
    dispatch = launch.fifo_shape(8192 * 2, H100_SMEM_OPTIN, pipelines=launch.DISPATCH_PIPELINES)
    assert dispatch.stages == 6
    assert launch.store_groups(dispatch.stages) == 1
    assert [launch.store_groups(n) for n in (2, 3, 7, 8, 12, 16)] == [1, 1, 1, 2, 3, 4]
    # An override (HYBRID_EP_STORE_GROUPS) is kept below the ring's size and wait_group's 7.
    assert [launch.store_groups(n, 0) for n in (2, 16)] == [0, 0]
    assert [launch.store_groups(n, 7) for n in (2, 6, 16)] == [1, 5, 7]
    with pytest.raises(ValueError, match="stages must be >= 2"):
        launch.store_groups(1)
    # Combine's partials have a ring of their own that no load refills: all but one in flight.
    assert [launch.combine_store_groups(n) for n in (2, 3, 16)] == [1, 2, 7]
    assert [launch.combine_store_groups(n, 0) for n in (2, 16)] == [0, 0]
    with pytest.raises(ValueError, match="out_stages must be >= 2"):
        launch.combine_store_groups(1)


def test_combine_rings_hold_whole_rows_in_segments_a_group_can_hold():
    # The seed shape: one bf16 row of 16 KiB per stage, 3 output stages, 5 stages per side.
    seed = launch.combine_shape(8192, 2, 2, H100_SMEM_OPTIN)
    assert (seed.seg_cols, seed.host_stages, seed.out_stages, seed.src_stages) == (8192, 5, 3, 5)
    assert seed.smem_bytes <= H100_SMEM_OPTIN - launch.STATIC_SMEM_RESERVE
    # DeepSeek-V3's 7168 columns fit one segment; an fp32 wire halves the columns per stage.
    assert launch.combine_shape(7168, 2, 2, H100_SMEM_OPTIN).seg_cols == 7168
    fp32_wire = launch.combine_shape(8192, 2, 4, H100_SMEM_OPTIN)
    assert (fp32_wire.seg_cols, fp32_wire.host_stage_bytes, fp32_wire.src_stage_bytes) == (4096, 8192, 16384)
    # Wider rows are cut into segments of a multiple of 8 columns, never beyond the registers.
    wide = launch.combine_shape(16388, 2, 2, H100_SMEM_OPTIN)
    assert wide.seg_cols == launch.COMBINE_MAX_SEG_COLS
    # Small rows: deep rings, capped at the kernels' 16 stages.
    small = launch.combine_shape(256, 2, 2, H100_SMEM_OPTIN)
    assert (small.seg_cols, small.host_stages, small.out_stages, small.src_stages) == (256, 16, 16, 16)
    with pytest.raises(ValueError, match="multiple of 4 columns"):
        launch.combine_shape(6, 2, 2, H100_SMEM_OPTIN)
    with pytest.raises(ValueError, match="fewer than 2 combine stages"):
        launch.combine_shape(8192, 4, 4, 48 * 1024)


@pytest.mark.parametrize("raw, want", [(None, None), ("", None), ("0", 0), ("4", 4), ("7", 7)])
def test_store_groups_override_reads_its_variable(raw, want):
    env = {} if raw is None else {launch.STORE_GROUPS_ENV: raw}
    assert launch.store_groups_override(env) == want


@pytest.mark.parametrize("raw", ["8", "-1", "two", "1.5"])
def test_store_groups_override_out_of_range_names_the_variable(raw):
    with pytest.raises(ValueError, match=f"HYBRID_EP_STORE_GROUPS must be an integer from 0 to 7, got '{raw}'"):
        launch.store_groups_override({launch.STORE_GROUPS_ENV: raw})


@pytest.mark.parametrize("raw, want", [(None, None), ("", None), ("2", 2), ("16", 16)])
def test_direct_combine_stages_override_reads_its_variable(raw, want):
    env = {} if raw is None else {launch.DIRECT_COMBINE_STAGES_ENV: raw}
    assert launch.direct_combine_stages_override(env) == want


@pytest.mark.parametrize("raw", ["1", "17", "six"])
def test_direct_combine_stages_override_out_of_range_names_the_variable(raw):
    with pytest.raises(ValueError,
                       match=f"HYBRID_EP_DIRECT_COMBINE_STAGES must be an integer from 2 to 16, got '{raw}'"):
        launch.direct_combine_stages_override({launch.DIRECT_COMBINE_STAGES_ENV: raw})


@pytest.mark.parametrize("new", [None, "3"])
def test_direct_combine_stages_old_name_raises_naming_the_new_one(new):
    """HYBRID_EP_PULL_STAGES, the knob's old name, is refused, alone or beside the new name, by an
    error that names HYBRID_EP_DIRECT_COMBINE_STAGES: a sweep still setting it would otherwise
    measure the default."""
    env = {"HYBRID_EP_PULL_STAGES": "3"} | ({} if new is None else {launch.DIRECT_COMBINE_STAGES_ENV: new})
    assert launch.OLD_DIRECT_COMBINE_STAGES_ENV == "HYBRID_EP_PULL_STAGES"
    with pytest.raises(ValueError, match="HYBRID_EP_PULL_STAGES was renamed HYBRID_EP_DIRECT_COMBINE_STAGES: set "
                                         "HYBRID_EP_DIRECT_COMBINE_STAGES instead"):
        launch.direct_combine_stages_override(env)
    assert launch.direct_combine_stages_override({"HYBRID_EP_PULL_STAGES": ""}) is None  # empty: unset


@pytest.mark.parametrize("raw, want", [(None, None), ("", None), ("observe", "observe"), ("elect", "elect"),
                                       ("converged", "converged"), ("named", "named")])
def test_reducer_wait_override_reads_its_variable(raw, want):
    env = {} if raw is None else {launch.REDUCER_WAIT_ENV: raw}
    assert launch.reducer_wait_override(env) == want


def test_reducer_wait_override_names_the_variable_and_its_choices():
    with pytest.raises(ValueError,
                       match="HYBRID_EP_REDUCER_WAIT must be one of observe, elect, converged, named, got 'lane'"):
        launch.reducer_wait_override({launch.REDUCER_WAIT_ENV: "lane"})
    assert sorted(launch.REDUCER_WAITS.values()) == [0, 1, 2, 3]  # params.h's codes, distinct


@pytest.mark.parametrize("raw, want", [(None, None), ("", None), ("route", "route"), ("token", "token")])
def test_combine_stage_override_reads_its_variable(raw, want):
    env = {} if raw is None else {launch.COMBINE_STAGE_ENV: raw}
    assert launch.combine_stage_override(env) == want


def test_combine_stage_override_names_the_variable_and_its_choices():
    with pytest.raises(ValueError, match="HYBRID_EP_COMBINE_STAGE must be one of route, token, got 'segment'"):
        launch.combine_stage_override({launch.COMBINE_STAGE_ENV: "segment"})
    assert sorted(launch.COMBINE_STAGES.values()) == [0, 1]  # params.h's codes, distinct


@pytest.mark.parametrize("raw, want", [(None, None), ("", None), ("0", 0), ("1", 1)])
def test_store_runs_override_reads_its_variable(raw, want):
    env = {} if raw is None else {launch.STORE_RUNS_ENV: raw}
    assert launch.store_runs_override(env) == want


@pytest.mark.parametrize("raw", ["2", "yes"])
def test_store_runs_override_names_the_variable(raw):
    with pytest.raises(ValueError, match=f"HYBRID_EP_STORE_RUNS must be an integer from 0 to 1, got {raw!r}"):
        launch.store_runs_override({launch.STORE_RUNS_ENV: raw})


def test_token_stages_are_32_kib_three_a_pipeline_on_an_h200():
    """A token stage holds top-8 bf16 parts of 2048 columns: 32 KiB, three a pipeline in 227 KiB of
    shared memory; the route stages' segment width is kept for the launchers' check."""
    shape = launch.token_stage_shape(8192, 2, 227 * 1024)
    assert (shape.stage_bytes, shape.stages, shape.seg_cols) == (32768, 3, 8192)
    assert launch.token_stage_shape(7168, 2, 227 * 1024, max_stages=2).stages == 2
    with pytest.raises(ValueError, match="fewer than 2 direct-combine token stages"):
        launch.token_stage_shape(8192, 2, 100 * 1024)


@pytest.mark.parametrize("raw, want", [(None, None), ("", None), ("4", 4), ("8", 8)])
def test_reducer_warps_override_reads_its_variable(raw, want):
    env = {} if raw is None else {launch.REDUCER_WARPS_ENV: raw}
    assert launch.reducer_warps_override(env) == want


@pytest.mark.parametrize("raw", ["6", "16", "eight"])
def test_reducer_warps_override_names_the_variable_and_its_choices(raw):
    with pytest.raises(ValueError, match=f"HYBRID_EP_REDUCER_WARPS must be one of 4, 8, got {raw!r}"):
        launch.reducer_warps_override({launch.REDUCER_WARPS_ENV: raw})


def test_row_bytes_and_coresidency_errors():
    assert launch.check_row_bytes("x", 7168, "float8_e4m3fn") == 7168
    with pytest.raises(ValueError, match=r"x: .*multiple of 8 for bfloat16"):
        launch.check_row_bytes("x", 7164, "bfloat16")
    launch.check_coresident("num_sms", 16, 8, 132, 1)
    with pytest.raises(ValueError, match=r"num_sms=17 x 8 rank\(s\) in one launch needs 136"):
        launch.check_coresident("num_sms", 17, 8, 132, 1)
    with pytest.raises(ValueError, match="num_sms must be >= 1"):
        launch.check_coresident("num_sms", 0, 1, 132, 1)


@pytest.mark.parametrize("module", ["hybrid_ep._model", "hybrid_ep._C"])
def test_compiled_structs_match_the_python_plan(module):
    """Both modules bind the same structs (csrc/bindings/common.h): the CPU model's, built in
    every install, and the GPU extension's where it is built."""
    from hybrid_ep.backends.cuda.engine import check_extension

    ext = built_cuda_extension() if module == "hybrid_ep._C" else importlib.import_module(module)
    check_extension(ext)
    args = ext.LaunchArgs()
    args.geo.reg.recv_rows = 12345
    assert args.geo.reg.recv_rows == 12345
    r = ext.RankArgs()
    r.rank, r.num_out_rows = 3, -1
    args.set_rank(15, r)
    assert args.get_rank(15).rank == 3 and args.get_rank(15).num_out_rows == -1
    with pytest.raises(IndexError):
        args.set_rank(ext.MAX_LAUNCH_RANKS, r)
    geo = ext.Geometry()
    geo.reg = buffer_layouts(_cfg(), ext).reg
    assert geo.reg.total == registered_layout(_cfg()).total and geo.reg.recv.slots == 8
    several = BufferConfig(128, 64, 8, 4, 2).validate()
    geo.rdma = buffer_layouts(several, ext).rdma
    assert geo.rdma.total == rdma_layout(several).total > 0


def test_backend_selection_without_a_gpu(single_rank_group):
    from hybrid_ep.backends import create_backend, cuda_unavailable_reason

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU machine's behaviour")
    assert "no CUDA device" in cuda_unavailable_reason(single_rank_group) or "not installed" in \
        cuda_unavailable_reason(single_rank_group)
    cfg = _cfg(W=1, E=2, H=128, T=8)
    assert create_backend("auto", cfg, single_rank_group, 0, 1).name == "reference"
    with pytest.raises(RuntimeError, match="backend='cuda' is not available"):
        create_backend("cuda", cfg, single_rank_group, 0, 1)


# -- the counts' arithmetic of csrc/kernels/count.cu and dispatch_receive.cu ----------------


def _kernel_positions(cfg, topk_idx):
    """What the count and dispatch kernels compute, written with the kernels' own formulas:
    ordinal of (t, e) among a rank's tokens, per-source prefixes of expert counts, padded
    starts, then pos = start_j + src_prefix[s][j] + ordinal for each kept entry."""
    W, L, E, pad, mn = cfg.world_size, cfg.experts_per_rank, cfg.num_experts, cfg.pad_multiple, cfg.min_rows_per_expert
    ordinal, counts = [], torch.zeros(W, E, dtype=torch.int64)
    for s, idx in enumerate(topk_idx):
        seen = torch.zeros(E, dtype=torch.int64)
        ords = torch.full(idx.shape, -1, dtype=torch.int64)
        for t in range(idx.shape[0]):
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e >= 0:
                    ords[t, k] = seen[e]
                    seen[e] += 1
        ordinal.append(ords)
        counts[s] = seen
    layouts = []
    for d in range(W):
        per_src = counts[:, d * L:(d + 1) * L]  # [W sources, L]
        n = per_src.sum(0)
        rows = ((torch.maximum(n, torch.tensor(mn)) + pad - 1) // pad) * pad
        start = torch.cumsum(rows, 0) - rows
        src_prefix = torch.cumsum(per_src, 0) - per_src
        layouts.append((start, src_prefix, rows))
    return ordinal, layouts


@pytest.mark.parametrize("W,E,K,tokens,pad,mn,drop", [
    (4, 16, 8, (17, 0, 1, 40), 1, 0, 0.0),
    (3, 9, 2, (5, 9, 0), 16, 0, 0.3),
    (8, 64, 8, (33,) * 8, 8, 8, 0.1),
    (2, 2, 1, (3, 0), 1, 4, 0.0),
])
def test_kernel_layout_arithmetic_matches_the_oracle(W, E, K, tokens, pad, mn, drop):
    cfg = BufferConfig(16, max(tokens), E, W, W, pad, mn).validate()
    gen = torch.Generator().manual_seed(W * 100 + E)
    idx = [drop_routes(i, drop, gen) if drop else i for i in iter_rank_routings("uniform", tokens, E, K, seed=W)]
    ws = [random_weights(i, gen) for i in idx]
    xs = [torch.randn(t, 16, generator=gen) for t in tokens]
    run = dispatch_oracle(cfg, xs, idx, ws)
    ordinal, layouts = _kernel_positions(cfg, idx)
    L = cfg.experts_per_rank
    for s in range(W):
        for t in range(tokens[s]):
            for k in range(K):
                e = int(idx[s][t, k])
                if e < 0:
                    assert int(run.row_of_route[s][t, k]) == -1
                    continue
                d, j = divmod(e, L)
                start, src_prefix, _ = layouts[d]
                pos = int(start[j] + src_prefix[s, j] + ordinal[s][t, k])
                assert pos == int(run.row_of_route[s][t, k]), (s, t, k)
    for d in range(W):
        start, _, rows = layouts[d]
        assert torch.equal(rows, run.ranks[d].tokens_per_expert)
        assert int(rows.sum()) == run.ranks[d].num_needed_rows


class _FabricExt:
    """Stands in for hybrid_ep._C's fabric probe."""

    def __init__(self, answer: str):
        self.answer, self.probes = answer, 0

    def fabric_probe(self, device: int) -> str:
        self.probes += 1
        return self.answer


def test_fabric_handles_only_after_a_successful_probe(single_rank_group, monkeypatch, caplog):
    from hybrid_ep.backends.cuda import registered

    refused = "cuMemCreate (fabric) failed (CUresult 800): no IMEX channel is open to this process"
    monkeypatch.setattr(logs, "_said", set())
    caplog.set_level("INFO", logger="hybrid_ep")
    monkeypatch.delenv("HYBRID_EP_HANDLE", raising=False)
    ext = _FabricExt(refused)
    assert registered._handle_kind(ext, single_rank_group, 0) == registered.IPC
    assert registered._handle_kind(ext, single_rank_group, 0) == registered.IPC
    assert ext.probes == 2
    choices = [r.getMessage() for r in caplog.records if "registered buffers use" in r.getMessage()]
    assert choices == [f"hybrid_ep: registered buffers use CUDA IPC handles (fabric handles unavailable on rank 0: "
                       f"{refused})"], "the choice is logged once"
    assert registered._handle_kind(_FabricExt(""), single_rank_group, 0) == registered.FABRIC

    monkeypatch.setenv("HYBRID_EP_HANDLE", "fabric")
    with pytest.raises(RuntimeError, match="HYBRID_EP_HANDLE=fabric, but fabric handles do not work on rank 0: "
                                           "cuMemCreate"):
        registered._handle_kind(_FabricExt(refused), single_rank_group, 0)
    monkeypatch.setenv("HYBRID_EP_HANDLE", "ipc")
    never = _FabricExt("")
    assert registered._handle_kind(never, single_rank_group, 0) == registered.IPC and never.probes == 0
    monkeypatch.setenv("HYBRID_EP_HANDLE", "nvlink")
    with pytest.raises(SetupError, match="rank 0 failed probing fabric handles \\(HYBRID_EP_HANDLE\\): ValueError: "
                                         "HYBRID_EP_HANDLE must be auto, ipc or fabric"):
        registered._handle_kind(never, single_rank_group, 0)


def test_a_node_across_hosts_without_fabric_handles_is_refused_by_name(monkeypatch):
    """CUDA IPC cannot leave a host: a node (NVLink domain) of ranks on two hosts whose fabric
    probe fails on some rank is refused, naming the ranks, the refusal and the way out; a node
    within one host falls back to IPC as before."""
    from hybrid_ep.backends.cuda import registered

    refused = "cuMemCreate (fabric) failed (CUresult 800): no IMEX channel is open to this process"
    hosts = [("a", None), ("a", None), ("b", None), ("b", None)]
    monkeypatch.delenv("HYBRID_EP_HANDLE", raising=False)
    monkeypatch.setattr(registered.dist, "get_world_size", lambda group=None: 4)
    monkeypatch.setattr(registered.dist, "get_rank", lambda group=None: 0)

    def gather(out, mine, group=None):  # every rank's outcome of the probe step (SetupStep): none failed
        out[:] = [(None, ("auto", refused if r == 3 else "", hosts[r])) for r in range(4)]

    monkeypatch.setattr(registered.dist, "all_gather_object", gather)
    with pytest.raises(RuntimeError, match=r"EP ranks 0..3 \(ranks_per_node=4\) share an NVLink domain across 2 "
                                           r"hosts, which only fabric handles cross, but they do not work on rank 3: "
                                           r"cuMemCreate"):
        registered._handle_kind(_FabricExt(""), None, 0, 4)
    assert registered._handle_kind(_FabricExt(""), None, 0, 2) == registered.IPC  # ranks 0 and 1: one host


class _HandleExt:
    """Stands in for hybrid_ep._C's registered-memory calls: a handle names its owner, and
    opening one records whose it was."""

    def __init__(self, rank: int):
        self.rank, self.opened = rank, []

    def fabric_probe(self, device) -> str:
        return "no fabric on this machine"

    def allocate_registered(self, nbytes, kind, device):
        return 1000 + self.rank, nbytes, f"handle of rank {self.rank}"

    def open_peer(self, handle, size, kind, device):
        owner = int(handle.rsplit(" ", 1)[1])
        self.opened.append(owner)
        return 2000 + owner

    def close_peer(self, ptr, size, kind):
        pass

    def free_registered(self, ptr, size, kind):
        pass


def _exchange_on_rank(ranks_per_node: int):
    import torch.distributed as dist

    from hybrid_ep.backends.cuda.registered import RegisteredBuffers

    ext = _HandleExt(dist.get_rank())
    config = BufferConfig(128, 8, 4, 4, ranks_per_node).validate()
    buffers = RegisteredBuffers.exchanged(ext, config, dist.group.WORLD, dist.get_rank(), torch.device("cpu"))
    table = buffers.tables[0].tolist()
    buffers._opened, buffers._owned = [], []  # nothing real to free
    return ext.opened, table


def test_registered_handles_are_opened_only_inside_the_node(pool_for):
    """A handle from another machine cannot be opened: ranks of other nodes stay 0 in the
    table (the RDMA transport reaches them), those of the own node are mapped."""
    opened, tables = zip(*pool_for(4).run(_exchange_on_rank, [(2,)] * 4))
    assert list(opened) == [[1], [0], [3], [2]]
    assert list(tables) == [[1000, 2001, 0, 0], [2000, 1001, 0, 0], [0, 0, 1002, 2003], [0, 0, 2002, 1003]]
    opened, tables = zip(*pool_for(4).run(_exchange_on_rank, [(4,)] * 4))
    assert list(opened) == [[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]]
    assert tables[2] == [2000, 2001, 1002, 2003]


def test_cuda_backend_by_name_needs_a_device(single_rank_group):
    """Without a CUDA device, asking for cuda by name gives the reason, and it is not the
    transport: processes sharing one GPU use gloo."""
    from hybrid_ep.backends import cuda_unavailable_reason

    if torch.cuda.is_available():
        pytest.skip("this checks the CPU machine's behaviour")
    reason = cuda_unavailable_reason(single_rank_group, explicit=True)
    assert reason is not None and "NCCL" not in reason


@pytest.mark.gpu
def test_cuda_backend_by_name_runs_over_a_gloo_group(single_rank_group):
    """`auto` keeps CPU-looking (gloo) groups on the reference backend; asked for by name,
    cuda needs only the extension and a device (processes sharing one GPU use gloo)."""
    from hybrid_ep.backends import cuda_unavailable_reason

    try:
        import hybrid_ep._C  # noqa: F401
    except ImportError:
        pytest.skip("hybrid_ep._C is not built")
    assert cuda_unavailable_reason(single_rank_group, explicit=True) is None
    assert cuda_unavailable_reason(single_rank_group) == "the EP group is not an NCCL group"


def test_data_path_direct_where_ranks_address_each_other(monkeypatch):
    # One node whose ranks address each other's tensors and agree per call goes direct;
    # several nodes, or separate processes without an arena, take the receive path. The
    # variable and the argument pick one, checked.
    assert launch.data_path(True, environ={}) == "direct"
    assert launch.data_path(False, environ={}) == "receive"
    assert launch.data_path(True, environ={launch.DATA_PATH_ENV: "receive"}) == "receive"
    assert launch.data_path(True, "receive", environ={launch.DATA_PATH_ENV: "direct"}) == "receive"
    with pytest.raises(ValueError, match="HYBRID_EP_DATA_PATH=direct needs one node whose ranks address each other"):
        launch.data_path(False, environ={launch.DATA_PATH_ENV: "direct"})
    with pytest.raises(ValueError, match="HYBRID_EP_DATA_PATH must be one of direct, receive, got 'push'"):
        launch.data_path(True, environ={launch.DATA_PATH_ENV: "push"})
    with pytest.raises(ValueError, match="data_path must be one of"):
        launch.data_path(True, "pull", environ={})


def test_direct_store_queue_covers_the_stores_latency_and_leaves_the_loads_most_stages():
    # Little's law with the H200's C_store (63.17 B/ns) and L_store_read (317.4 ns): about 20 KB
    # in flight over the two store threads, one group of a 16 KiB stage each; 12 stages of a
    # 16 KiB row at the seed shape (13 fit; the store threads take the items in turn, so the
    # count is even), so the stores hold 4 (2 x (1 + the one being stored)).
    direct = launch.direct_fifo_shape(8192 * 2, H100_SMEM_OPTIN)
    assert (direct.stages, direct.stage_bytes) == (12, 16384)
    assert launch.direct_store_groups(12, 16384) == 1
    assert launch.direct_store_groups(13, 16384) == 1
    assert [launch.direct_store_groups(13, b) for b in (32768, 8192, 4096, 2048, 512)] == [1, 2, 3, 5, 6]
    # the threads' groups and the stages being stored leave the loads at least one stage
    assert [launch.direct_store_groups(n, 512) for n in (2, 3, 4, 5, 16)] == [0, 1, 1, 2, 7]
    assert [launch.direct_store_groups(13, 16384, g) for g in (0, 2, 7)] == [0, 2, 6]
    with pytest.raises(ValueError, match="stages must be >= 2"):
        launch.direct_store_groups(1, 16384)
    with pytest.raises(ValueError, match="stage_bytes must be positive"):
        launch.direct_store_groups(13, 0)


@pytest.mark.parametrize("smem", [H100_SMEM_OPTIN, 100 * 1024])
def test_the_direct_dispatch_fifo_has_a_stage_count_its_store_threads_share_evenly(smem):
    """The direct dispatch's store threads take alternate stages: an even count gives every
    stage one consumer (csrc/kernels/dispatch_direct.cuh's launcher refuses another count), fifo_shape's
    stage size and rows otherwise."""
    assert launch.DIRECT_STORE_THREADS == 2
    for row_bytes in (256, 4096, 8192, 14336, 16384, 24576, 32768, 65536):
        plain = launch.fifo_shape(row_bytes, smem, max_stages=launch.MAX_STAGES)
        direct = launch.direct_fifo_shape(row_bytes, smem)
        assert direct.stages % launch.DIRECT_STORE_THREADS == 0 and direct.stages >= 2, (row_bytes, direct)
        assert plain.stages - launch.DIRECT_STORE_THREADS < direct.stages <= plain.stages
        assert (direct.stage_bytes, direct.rows_per_stage) == (plain.stage_bytes, plain.rows_per_stage)


def test_direct_combine_rings_split_the_shared_memory_between_two_pipelines():
    seed = launch.direct_combine_shape(8192, 2, H100_SMEM_OPTIN)
    assert (seed.seg_cols, seed.stages, seed.stage_bytes) == (8192, 6, 16384)
    assert seed.smem_bytes <= H100_SMEM_OPTIN - launch.STATIC_SMEM_RESERVE
    assert launch.direct_combine_shape(8192, 4, H100_SMEM_OPTIN).seg_cols == 4096  # fp32: 16 KiB stages
    assert launch.direct_combine_shape(256, 2, H100_SMEM_OPTIN).stages == launch.MAX_STAGES
    with pytest.raises(ValueError, match="multiple of 4 columns"):
        launch.direct_combine_shape(6, 2, H100_SMEM_OPTIN)
    with pytest.raises(ValueError, match="fewer than 2 direct-combine stages"):
        launch.direct_combine_shape(8192, 2, 48 * 1024)
