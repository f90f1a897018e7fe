"""fp8 on the wire for the Megatron dispatcher: the blockwise quantizer's rounding, the fp8
dispatch and the combine's fp8 backward against the oracle on gloo ranks (reference backend),
the option's refusals, and the bytes it saves by the traffic model."""

from __future__ import annotations

import types

import pytest
import torch

from harness.megatron.wire_fp8 import check_wire_case
from hybrid_ep.config import BufferConfig
from hybrid_ep.fp8 import FP8_DTYPE, dequantize_fp8, dequantize_rows, quantize_blockwise, quantize_mxfp8
from hybrid_ep.verify.cases import Case
from megatron_patches import wire_fp8
from megatron_patches.options import HybridEPOptions, add_arguments, from_args

pytestmark = pytest.mark.unit


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8_DTYPE else t.view(torch.int32)


def test_quantizer_follows_the_blockwise_rule():
    """amax -> 448 / amax in fp32, mantissa cleared; q = RNE(x * quant_scale); scale = 1 / quant_scale."""
    x = torch.zeros(3, 256)
    x[0, :128] = torch.linspace(-3.0, 3.0, 128)  # amax 3: 448 / 3 = 149.33 -> 128
    x[0, 128:] = 0.0  # an all-zero block: quant_scale 1
    x[1, :128] = 448.0  # amax 448: quant_scale 1
    x[1, 128:] = 1e-40  # quant_scale past fp32's range: the largest float, cleared to 2^127
    x[2] = torch.randn(256, generator=torch.Generator().manual_seed(1))
    q, s = quantize_blockwise(x)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (3, 2)
    assert s[0].tolist() == [1 / 128, 1.0] and s[1].tolist() == [1.0, 2.0**-127]
    amax = x[2].view(2, 128).abs().amax(dim=1)
    quant_scale = 2.0 ** torch.floor(torch.log2(448.0 / amax))
    assert torch.equal(s[2], 1 / quant_scale)
    want = (x[2].view(2, 128) * quant_scale[:, None]).to(FP8_DTYPE).view(256)
    assert torch.equal(_bits(q[2]), _bits(want))
    assert torch.equal(_bits(q[0, :128]), _bits((x[0, :128] * 128).to(FP8_DTYPE)))
    assert bool((q[0, 128:].float() == 0).all())
    # Unrounded scales (NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1): 448 / amax as it is.
    q32, s32 = quantize_blockwise(x[2:], pow2_scales=False)
    assert torch.equal(s32[0], 1 / (torch.full_like(amax, 448.0) / amax))
    assert q32.float().abs().view(2, 128).amax(dim=1).tolist() == [448.0, 448.0]


def test_power_of_two_scales_make_requantization_lossless():
    """What the experts' own 1x128 quantization makes of dequantized rows: the same values
    (TE's GEMMs compute on what was sent); with unrounded scales it is not so."""
    magnitudes = torch.logspace(-20, 20, 8).repeat_interleave(128)
    x = torch.randn(300, 1024, generator=torch.Generator().manual_seed(0)) * magnitudes
    q, s = quantize_blockwise(x)
    d = dequantize_fp8(q, s)
    assert torch.equal(dequantize_fp8(*quantize_blockwise(d)), d)
    d32 = dequantize_fp8(*quantize_blockwise(x, pow2_scales=False))
    assert not torch.equal(dequantize_fp8(*quantize_blockwise(d32, pow2_scales=False)), d32)


def test_quantizer_without_transformer_engine_is_the_torch_rule():
    quantizer = wire_fp8.BlockwiseQuantizer(use_te=False)
    assert not quantizer.uses_te and quantizer.pow2
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    q, s = quantizer(x)
    q0, s0 = quantize_blockwise(x)
    assert torch.equal(_bits(q), _bits(q0)) and torch.equal(s, s0)


def test_fp32_scales_follow_transformer_engines_switch(monkeypatch):
    monkeypatch.setenv(wire_fp8.FP32_SCALES_ENV, "1")
    assert wire_fp8.BlockwiseQuantizer(use_te=False).pow2 is False
    monkeypatch.setenv(wire_fp8.FP32_SCALES_ENV, "0")
    assert wire_fp8.BlockwiseQuantizer(use_te=False).pow2 is True


WIRE_CASES = [
    # 1 node of 4; odd token counts, a rank without tokens
    Case(4, 4, 8, 256, (17, 0, 5, 33), 3, torch.bfloat16, seed=1),
    # 2 nodes x 2: rows cross RDMA; dropped routes, padding to 8 rows per expert
    Case(4, 2, 8, 384, (9, 23, 0, 1), 2, torch.bfloat16, drop_fraction=0.2, pad_multiple=8, seed=2),
    # static size (drop-and-pad / rank capacity): overflow dropped, trailing zero rows
    Case(4, 2, 8, 256, (31, 7, 1, 0), 4, torch.bfloat16, num_out_tokens=40, seed=3),
    Case(4, 2, 8, 128, (3, 0, 2, 5), 2, torch.bfloat16, num_out_tokens=64, seed=4),
    # MXFP8's 1x32 E8M0 scales, one node and 2 nodes x 2, odd and zero token counts
    Case(4, 4, 8, 256, (17, 0, 5, 33), 3, torch.bfloat16, seed=5, scale_format="mxfp8"),
    Case(4, 2, 8, 384, (9, 23, 0, 1), 2, torch.bfloat16, drop_fraction=0.2, pad_multiple=8, seed=6,
         scale_format="mxfp8"),
]


@pytest.mark.parametrize("case", WIRE_CASES, ids=str)
def test_fp8_dispatch_and_combine_backward_match_the_oracle(pool_for, case):
    results = check_wire_case(pool_for(case.world_size), case)
    assert any(int(r["num_dropped"]) > 0 for r in results) == (case.num_out_tokens == 40)
    assert sum(r["tokens"].shape[0] for r in results) > 0


GROUPED_CASES = [
    # MXFP8 rows handed on as TE's GroupedTensor: groups of 128 rows, 1 node of 4 and 2 nodes x 2
    Case(4, 4, 8, 256, (17, 0, 5, 33), 3, torch.bfloat16, pad_multiple=128, seed=8, scale_format="mxfp8"),
    Case(4, 2, 8, 384, (9, 23, 0, 1), 2, torch.bfloat16, drop_fraction=0.2, pad_multiple=128, seed=9,
         scale_format="mxfp8"),
]


@pytest.mark.parametrize("case", GROUPED_CASES, ids=str)
def test_rows_handed_on_as_grouped_tensor_match_the_oracle(pool_for, case):
    """The same checks with the rows and the combine's fp8 backward handed on as TE's
    GroupedTensor (stood in), read back as rows: bit for bit the dequantized oracle's."""
    results = check_wire_case(pool_for(case.world_size), case, grouped=True)
    assert all(r["tokens"].shape[0] % 128 == 0 for r in results)


def _config(**kw):
    base = dict(fp8_recipe="blockwise", fp8=None, hidden_size=256)
    base.update(kw)
    return types.SimpleNamespace(**base)


def test_the_options_parse_and_default_off():
    import argparse

    parser = add_arguments(argparse.ArgumentParser())
    assert from_args(parser.parse_args([])) == HybridEPOptions()
    opts = from_args(parser.parse_args(["--hybrid-ep-dispatch-fp8", "--hybrid-ep-combine-grad-fp8"]))
    assert opts.dispatch_fp8 and opts.combine_grad_fp8
    with pytest.raises(ValueError, match="hybrid_ep option dispatch_fp8 must be a bool, got 1"):
        HybridEPOptions(dispatch_fp8=1).validate()


def test_runs_it_cannot_serve_are_refused_naming_the_option():
    both = HybridEPOptions(dispatch_fp8=True, combine_grad_fp8=True)
    assert wire_fp8.unsupported_reasons(_config(), both) == []
    assert wire_fp8.unsupported_reasons(_config(fp8_recipe="delayed"), HybridEPOptions()) == []
    assert wire_fp8.unsupported_reasons(_config(fp8_recipe="mxfp8"), both) == []
    delayed = wire_fp8.unsupported_reasons(_config(fp8_recipe="delayed"), HybridEPOptions(combine_grad_fp8=True))
    assert delayed == ["--hybrid-ep-combine-grad-fp8 needs --fp8-recipe blockwise (1x128 fp32 scales) or mxfp8 "
                       "(1x32 E8M0 scales), the fp8 rows hybrid_ep carries, got fp8_recipe='delayed'; set one of "
                       "them or drop --hybrid-ep-combine-grad-fp8"]
    odd = wire_fp8.unsupported_reasons(_config(hidden_size=200), HybridEPOptions(dispatch_fp8=True))
    assert odd == ["--hybrid-ep-dispatch-fp8 needs hidden_size a multiple of 128 (a row's scales travel in 4-byte "
                   "words of 128 values), got 200"]
    hybrid = wire_fp8.unsupported_reasons(_config(fp8="hybrid"), both)
    assert len(hybrid) == 1 and hybrid[0].startswith("--hybrid-ep-combine-grad-fp8 with --fp8-format hybrid")


def test_each_recipe_gets_its_quantizer():
    """--fp8-recipe picks the rule: blockwise's fp32 [T, H/128] scales, mxfp8's E8M0 [T, H/32]
    bytes; without Transformer Engine (here) each is the torch rule of hybrid_ep.fp8."""
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    blockwise = wire_fp8.quantizer_for(_config(), use_te=False)
    mx = wire_fp8.quantizer_for(_config(fp8_recipe="mxfp8"), use_te=False)
    q, s = blockwise(x)
    assert s.dtype == torch.float32 and s.shape == (5, 2) and torch.equal(s, quantize_blockwise(x)[1])
    q, e = mx(x)
    want_q, want_e = quantize_mxfp8(x)
    assert e.dtype == torch.uint8 and e.shape == (5, 8) and torch.equal(e, want_e)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # power-of-two scales: the experts' own MXFP8 quantization of the dequantized rows gives them back
    d = dequantize_rows(q, e, torch.bfloat16)
    assert torch.equal(dequantize_rows(*quantize_mxfp8(d), torch.bfloat16), d)


def test_fp8_bytes_by_the_traffic_model():
    """A step's bytes over NVLink and RDMA by the traffic model, the same routing in fp8 and in
    bf16 (2 nodes x 4, H 7168, top-8). The dispatch with its scales: (H + 4 H / 128) / 2 H =
    0.515625 of bf16. A whole step (forward dispatch and combine, their backward passes) with
    both options on: two dispatch-shaped exchanges in fp8, two combine-shaped ones in bf16."""
    from hybrid_ep.synthetic import iter_rank_routings
    from hybrid_ep.traffic import combine_row_bytes, dispatch_row_bytes, rank_traffic, routing_row_counts

    H, W, G, E, K, T = 7168, 8, 4, 64, 8, 512
    cfg = BufferConfig(H, T, E, W, G).validate()
    counts = routing_row_counts(list(iter_rank_routings("uniform", (T,) * W, E, K, 0)), cfg)

    def wire_bytes(op: str, row_bytes: int) -> int:
        per_rank = [rank_traffic(op, r, counts, row_bytes) for r in range(W)]
        return sum(t.nvlink_bytes + t.rdma_bytes for t in per_rank)

    bf16, fp8 = (wire_bytes("dispatch", dispatch_row_bytes(H, dt)) for dt in (torch.bfloat16, FP8_DTYPE))
    assert bf16 > 0 and fp8 / bf16 == 0.515625
    combine = wire_bytes("combine", combine_row_bytes(H, torch.bfloat16))
    step_bf16 = 2 * bf16 + 2 * combine
    step_fp8 = 2 * fp8 + 2 * combine
    assert step_fp8 / step_bf16 == pytest.approx((2 * 0.515625 + 2 * combine / bf16) / (2 + 2 * combine / bf16))
    assert combine == bf16 and step_fp8 / step_bf16 == pytest.approx(0.7578125)
