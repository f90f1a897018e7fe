"""When the experts take received MXFP8 rows as Transformer Engine's GroupedTensor, and the
tensor they get: each condition of the hand-off names itself when it fails, at build time
(handoff_reason) and per dispatch (run_time_reason: TE's fp8 autocast off or not MXFP8), a
fallback is logged once, and the GroupedTensor (TE stood in, reached through te_api() as TE
would be) is a view of the received rows and scales under TE's attribute names."""

from __future__ import annotations

import logging
import types

import pytest
import torch

from harness.megatron import te_stand_in
from hybrid_ep import logs
from hybrid_ep.fp8 import quantize_mxfp8
from megatron_patches import te_grouped_rows, wire_fp8

pytestmark = pytest.mark.unit


@pytest.fixture
def api():
    """te_api() with TE stood in, as on a Blackwell GPU."""
    with te_stand_in.installed(megatron=False):
        yield te_grouped_rows.te_api()


def _config(**kw):
    base = dict(fp8_recipe="mxfp8", use_transformer_engine_op_fuser=True, overlap_moe_expert_parallel_comm=False,
                params_dtype=torch.bfloat16)
    base.update(kw)
    return types.SimpleNamespace(**base)


FUSED = types.SimpleNamespace(_with_fused_impl=True)


def test_te_api_is_none_without_transformer_engine():
    assert te_grouped_rows.te_api() is None  # TE is not installed where the tests run


def test_the_hand_off_runs_where_every_condition_holds(api):
    assert te_grouped_rows.handoff_reason(FUSED, _config(), 256, api) is None


@pytest.mark.parametrize("change, words", [
    (dict(fp8_recipe="blockwise"), "requantizes a pre-quantized grouped input for MXFP8 only"),
    (dict(use_transformer_engine_op_fuser=False), "--use-transformer-engine-op-fuser"),
    (dict(experts=None), "experts not built yet"),
    (dict(experts=types.SimpleNamespace(_with_fused_impl=False)), "SimpleNamespace does not run on Transformer"),
    (dict(overlap_moe_expert_parallel_comm=True), "the EP-overlap schedule"),
    (dict(overlap_dispatch_backward_with_experts_wgrad=True), "_RecordExpertDgradCompletion), whose view_as"),
    (dict(fine_grained_activation_offloading=True, offload_modules=["fused_group_mlp"]), "offloading of fused_"),
    (dict(experts=types.SimpleNamespace(_with_fused_impl=True, offload_fused_group_mlp=True)), "offloading of fus"),
    (dict(moe_paged_stash=True), "PipelinePreScheduleFunction"),
    (dict(pad=16), "multiple of 16, not of the 128"),
    (dict(api=None), "TE 2.19 or newer"),
    (dict(params_dtype=torch.float32), "compute dtype torch.float32"),
])
def test_each_condition_names_itself(api, change, words):
    experts, pad, use_api = change.pop("experts", FUSED), change.pop("pad", 256), change.pop("api", api)
    reason = te_grouped_rows.handoff_reason(experts, _config(**change), pad, use_api)
    assert reason is not None and words in reason


def test_offloading_other_modules_keeps_the_hand_off(api):
    config = _config(fine_grained_activation_offloading=True, offload_modules=["attn_norm"])
    assert te_grouped_rows.handoff_reason(FUSED, config, 256, api) is None


def test_hopper_gets_the_rows_dequantized():
    with te_stand_in.installed(capability=(9, 0), megatron=False):
        reason = te_grouped_rows.handoff_reason(FUSED, _config(), 256, te_grouped_rows.te_api())
    assert "does not take MXFP8 here" in reason


def test_per_dispatch_the_layers_fp8_autocast_decides(api):
    assert "without Transformer Engine's fp8 autocast" in te_grouped_rows.run_time_reason(api)
    with te_stand_in.autocast(enabled=True, recipe=te_stand_in.MXFP8BlockScaling()):
        assert te_grouped_rows.run_time_reason(api) is None
        with te_stand_in.autocast(enabled=False):  # a bf16 layer inside an fp8 region
            assert "without Transformer Engine's fp8 autocast" in te_grouped_rows.run_time_reason(api)
    with te_stand_in.autocast(enabled=True, recipe=te_stand_in.Float8BlockScaling()):
        assert "runs Float8BlockScaling" in te_grouped_rows.run_time_reason(api)


def test_a_fallback_at_run_time_dequantizes_and_is_logged_once(api, caplog, monkeypatch):
    monkeypatch.setattr(logs, "_said", set())
    splits = torch.tensor([128])
    with caplog.at_level(logging.INFO, logger="megatron_patches.te_grouped_rows"):
        for _ in range(3):
            assert te_grouped_rows.rows_as(None, api, splits) is wire_fp8.dequantized
        with te_stand_in.autocast(enabled=True, recipe=te_stand_in.MXFP8BlockScaling()):
            assert isinstance(te_grouped_rows.rows_as(None, api, splits), te_grouped_rows.GroupedRows)
            assert te_grouped_rows.rows_as("experts not built yet", api, splits) is wire_fp8.dequantized
    assert [r.getMessage() for r in caplog.records] == [
        "hybrid_ep dispatcher: fp8 rows reach some layer's experts dequantized: this layer runs without Transformer "
        "Engine's fp8 autocast (a bf16 layer of an fp8 run, as --first-last-layers-bf16 makes): TE's GroupedLinear "
        "then reshapes its input, which a GroupedTensor refuses"]


def test_the_grouped_tensor_is_a_view_of_the_received_rows(api):
    H, splits = 256, torch.tensor([128, 0, 256])
    x = torch.randn(384, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    q, e = quantize_mxfp8(x)
    t = te_grouped_rows.GroupedRows(splits, api)(q, e, torch.bfloat16)
    assert isinstance(t, te_stand_in.GroupedTensor) and t.shape == (384, H) and t.dtype == torch.bfloat16
    assert t.rowwise_data.data_ptr() == q.data_ptr() and t.scale_inv.data_ptr() == e.data_ptr()
    assert t.rowwise_data.dtype == torch.uint8 and t.rowwise_data.shape == (384 * H,)
    assert t.scale_inv.dtype == torch.uint8 and t.scale_inv.shape == (384 * H // 32,)
    assert t.num_tensors == 3 and t.first_dims.tolist() == [128, 0, 256] and t.logical_shape == (384, H)
    assert t.first_dims.dtype == torch.int64 and t.tensor_offsets.tolist() == [0, 128 * H, 128 * H, 384 * H]
    assert t._with_gemm_swizzled_scales is False and t.quantizer.optimize_for_gemm is False
    assert t.columnwise_data is None and t.columnwise_scale_inv is None
    q_ = t.quantizer
    assert (q_.dtype, q_.rowwise_usage, q_.columnwise_usage) == (te_stand_in.DType.kFloat8E4M3, True, False)
    assert torch.equal(t.rows(), (q.float().view(384, H // 32, 32)
                                  * torch.exp2(e.float() - 127)[:, :, None]).view(384, H).to(torch.bfloat16))
    # TE's requantize takes it as the op's MXFP8 e4m3 input, and the hand-off passed it on untouched
    te_stand_in.group_requantize_inplace(t.copy(), te_stand_in.MXFP8Quantizer(te_stand_in.DType.kFloat8E4M3), 3,
                                         t.first_dims, te_stand_in.DType.kBFloat16)


def test_rows_it_cannot_wrap_are_refused_by_their_sizes(api):
    make = te_grouped_rows.GroupedRows(torch.tensor([64]), api)
    q, e = quantize_mxfp8(torch.ones(64, 256))
    with pytest.raises(ValueError, match=r"multiples of 128, got \[64, 256\]"):
        make(q, e, torch.bfloat16)
    with pytest.raises(ValueError, match=r"E8M0 scales \[R, H/32\], got .*torch.float32 \[64, 2\]"):
        make(q, torch.ones(64, 2), torch.bfloat16)


@pytest.mark.parametrize("version, words", [
    ("2.19.0", "requantizes them through a bf16 copy"),
    ("2.20.0.dev0+d0067d0", "in one kernel, without a bf16 copy"),
])
def test_the_cost_said_is_the_installed_tes(api, version, words):
    assert words in te_grouped_rows.requantize_cost(types.SimpleNamespace(version=version))


def test_the_startup_line_is_said_once(api, caplog, monkeypatch):
    monkeypatch.setattr(logs, "_said", set())
    with caplog.at_level(logging.INFO, logger="megatron_patches.te_grouped_rows"):
        for _ in range(3):
            te_grouped_rows.announce("experts not built yet")
            te_grouped_rows.announce(None, api)
    assert [r.getMessage() for r in caplog.records] == [
        "hybrid_ep dispatcher: fp8 rows reach the experts dequantized: experts not built yet",
        "hybrid_ep dispatcher: fp8 rows reach the experts as Transformer Engine's MXFP8 GroupedTensor in layers "
        "under TE's MXFP8 autocast, not dequantized (Transformer Engine 2.19.0 requantizes them through a bf16 copy "
        "(2 bytes per value; one kernel without it from TE 2.20 on))",
    ]


@pytest.mark.gpu
def test_the_counts_reach_te_without_a_host_copy_so_a_cuda_graph_captures_it(api):
    """The hand-off under CUDA graph capture: counts on the host are copied without blocking,
    counts on the device are not copied; nothing is read back."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    q, e = quantize_mxfp8(torch.ones(256, 256, device="cuda"))
    splits = torch.tensor([128, 128], device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        t = te_grouped_rows.GroupedRows(splits, api)(q, e, torch.bfloat16)
    graph.replay()
    torch.cuda.synchronize()
    assert t.first_dims.device == q.device and t.tensor_offsets.tolist() == [0, 128 * 256, 256 * 256]
