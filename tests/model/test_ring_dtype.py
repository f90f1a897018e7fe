"""Rings sized for bf16 rows (BufferConfig.ring_dtype) on the CPU model: the kernels move bf16 and
fp8 rows and bf16 partial sums through rings whose rows are 2 bytes a value, against the oracle,
on both data paths and across nodes (the RDMA staging and node-partial rings too); a call wider
than the rings is refused by name before any kernel runs.
"""

from __future__ import annotations

import pytest
import torch

from harness.emulated import GroupCache, check_emulated
from harness.hierarchy_cases import hierarchy_case
from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.backends.cuda.layout import rdma_layout, registered_layout
from hybrid_ep.config import BufferConfig

pytestmark = pytest.mark.model

_cached = GroupCache("cpu")
H = 256


@pytest.mark.parametrize("nodes, ranks_per_node", [(1, 4), (2, 2)])
@pytest.mark.parametrize("data_path", ["receive", "direct"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
def test_bf16_rings_match_the_oracle(nodes, ranks_per_node, data_path, dtype):
    """bf16 rows (or fp8 rows, combined in bf16) with probs applied, odd and zero token counts,
    through rings of bf16 rows: each row slot is H x 2 bytes, so a row or partial written at fp32's
    stride would land in the next slot and the oracle would see it."""
    case = hierarchy_case(nodes, ranks_per_node, hidden=H, dtype=dtype, apply_probs=True)
    group = _cached(case, num_sms_dispatch=1, num_sms_combine=1, data_path=data_path, ring_dtype=torch.bfloat16)
    res = check_emulated(group, case)
    assert {r.handle.data_path for r in res} == {data_path}
    reg = registered_layout(group.config)
    assert reg.row_stride == H * 2 and reg.wire_stride == H * 2
    if nodes > 1:
        assert rdma_layout(group.config).total < rdma_layout(
            BufferConfig(H, max(case.tokens), case.num_experts, case.world_size, ranks_per_node).validate()).total


@pytest.fixture(scope="module")
def half_rings():
    group = EmulatedGroup(2, H, 16, 4, device="cpu", num_sms_dispatch=1, num_sms_combine=1, ring_dtype=torch.bfloat16)
    yield group
    group.close()


def _routing(tokens: int = 16):
    idx = torch.tensor([[t % 4, (t + 1) % 4] for t in range(tokens)], dtype=torch.int64)
    return [idx, idx.clone()], [torch.full((tokens, 2), 0.5), torch.full((tokens, 2), 0.5)]


def test_half_rings_refuse_fp32_rows_by_name(half_rings):
    idx, w = _routing()
    xs = [torch.randn(16, H), torch.randn(16, H)]
    with pytest.raises(ValueError, match=r"x: torch\.float32 rows are wider than the buffer's rings, sized for "
                                         r"torch\.bfloat16 \(ring_dtype\)"):
        half_rings.dispatch(xs, idx, w)


def test_half_rings_refuse_an_fp32_wire_by_name(half_rings):
    """After a bf16 dispatch: an fp32 wire asked per call, or an fp32 expert_out whose partials
    would travel in fp32, is refused naming the argument; the bf16 combine then runs."""
    idx, w = _routing()
    xs = [torch.randn(16, H).to(torch.bfloat16) for _ in range(2)]
    res = half_rings.dispatch(xs, idx, w)
    outs = [r.tokens for r in res]
    with pytest.raises(ValueError, match=r"wire_dtype: torch\.float32 partial sums are wider than the buffer's rings"):
        half_rings.combine(outs, [r.handle for r in res], wire_dtype=torch.float32)
    with pytest.raises(ValueError, match=r"expert_out: torch\.float32 partial sums are wider"):
        half_rings.combine([o.float() for o in outs], [r.handle for r in res])
    ys = half_rings.combine(outs, [r.handle for r in res])
    assert [y.dtype for y in ys] == [torch.bfloat16] * 2 and all(torch.isfinite(y.float()).all() for y in ys)


@pytest.mark.parametrize("bad", [torch.float8_e4m3fn, torch.int32, "bf16"])
def test_ring_dtype_takes_a_2_or_4_byte_float(bad):
    with pytest.raises(ValueError, match=r"ring_dtype must be one of torch\.float32, torch\.bfloat16, torch\.float16"):
        BufferConfig(H, 16, 4, 2, 2, ring_dtype=bad).validate()
