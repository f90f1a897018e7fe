"""When the experts take received MXFP8 rows as Transformer Engine's GroupedTensor, and the
tensor they get: each condition of the hand-off names itself when it fails, and the
GroupedTensor (TE stood in) is a view of the received rows and scales in TE's fields."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from hybrid_ep import logs
from hybrid_ep.fp8 import quantize_mxfp8
from megatron_patches import te_grouped_rows
from megatron_patches.testing import te_grouped_stand_in

pytestmark = pytest.mark.unit

CUDA = torch.device("cuda", 0)  # only a value here: nothing runs on it


def _config(**kw):
    base = dict(fp8_recipe="mxfp8", use_transformer_engine_op_fuser=True, overlap_moe_expert_parallel_comm=False,
                params_dtype=torch.bfloat16)
    base.update(kw)
    return types.SimpleNamespace(**base)


FUSED = types.SimpleNamespace(_with_fused_impl=True)


def _reason(experts=FUSED, pad=256, device=CUDA, api=te_grouped_stand_in.api(), **config):
    return te_grouped_rows.handoff_reason(experts, _config(**config), pad, device, api)


def test_the_hand_off_runs_where_every_condition_holds():
    assert _reason() is None


@pytest.mark.parametrize("change, words", [
    (dict(fp8_recipe="blockwise"), "requantizes a pre-quantized grouped input for MXFP8 only"),
    (dict(use_transformer_engine_op_fuser=False), "--use-transformer-engine-op-fuser"),
    (dict(experts=None), "experts not built yet"),
    (dict(experts=types.SimpleNamespace(_with_fused_impl=False)), "SimpleNamespace does not run on Transformer"),
    (dict(overlap_moe_expert_parallel_comm=True), "the EP-overlap schedule"),
    (dict(pad=16), "multiple of 16, not of the 128"),
    (dict(api=None), "TE 2.19 or newer"),
    (dict(device=torch.device("cpu")), "rows not on a GPU"),
    (dict(device=None), "rows not on a GPU"),
    (dict(api=te_grouped_stand_in.api(path_supported=False, capability=(9, 0))), "(this GPU: 9.0"),
])
def test_each_condition_names_itself(change, words):
    reason = _reason(**change)
    assert reason is not None and words in reason


def test_the_grouped_tensor_is_a_view_of_the_received_rows():
    H, splits = 256, torch.tensor([128, 0, 256])
    x = torch.randn(384, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, e = quantize_mxfp8(x)
    t = te_grouped_rows.GroupedRows(splits, te_grouped_stand_in.api())(q, e, torch.bfloat16)
    f = t.fields
    assert isinstance(t, te_grouped_stand_in.GroupedTensor) and t.shape == (384, H) and t.dtype == torch.bfloat16
    assert f["data"].data_ptr() == q.data_ptr() and f["scale_inv"].data_ptr() == e.data_ptr()
    assert f["data"].dtype == torch.uint8 and f["data"].shape == (384 * H,)
    assert f["scale_inv"].dtype == torch.uint8 and f["scale_inv"].shape == (384 * H // 32,)
    assert f["num_tensors"] == 3 and f["first_dims"].tolist() == [128, 0, 256]
    assert f["first_dims"].dtype == torch.int64 and f["tensor_offsets"].tolist() == [0, 128 * H, 128 * H, 384 * H]
    assert f["with_gemm_swizzled_scales"] is False and f["quantizer"].optimize_for_gemm is False
    q_ = f["quantizer"]
    assert (q_.dtype, q_.rowwise_usage, q_.columnwise_usage) == ("kFloat8E4M3", True, False)
    assert torch.equal(t.rows(), (q.float().view(384, H // 32, 32)
                                  * torch.exp2(e.float() - 127)[:, :, None]).view(384, H).to(torch.bfloat16))
    with pytest.raises(NotImplementedError, match="detach and alias only"):
        t[:128]  # TE bans shape ops on it; the hand-off passes it on untouched


def test_rows_it_cannot_wrap_are_refused_by_their_sizes():
    make = te_grouped_rows.GroupedRows(torch.tensor([64]), te_grouped_stand_in.api())
    q, e = quantize_mxfp8(torch.ones(64, 256))
    with pytest.raises(ValueError, match=r"multiples of 128, got \[64, 256\]"):
        make(q, e, torch.bfloat16)
    with pytest.raises(ValueError, match=r"E8M0 scales \[R, H/32\], got .*torch.float32 \[64, 2\]"):
        make(q, torch.ones(64, 2), torch.bfloat16)


def test_the_startup_line_is_said_once(caplog, monkeypatch):
    monkeypatch.setattr(logs, "_said", set())
    with caplog.at_level(logging.INFO, logger="megatron_patches.te_grouped_rows"):
        for _ in range(3):
            te_grouped_rows.announce("experts not built yet")
            te_grouped_rows.announce(None)
    assert [r.getMessage() for r in caplog.records] == [
        "hybrid_ep dispatcher: fp8 rows reach the experts dequantized: experts not built yet",
        "hybrid_ep dispatcher: fp8 rows reach the experts as Transformer Engine's MXFP8 GroupedTensor, "
        "not dequantized",
    ]
