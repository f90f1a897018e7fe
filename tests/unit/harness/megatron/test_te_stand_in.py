"""The Transformer Engine stand-in refuses what TE refuses: GroupedTensor's operations (TE's
__torch_dispatch__ at release_v2.19 and main: detach, alias, expand and expand_as to its own
shape and view(-1) pass, every shape op and every computing op raises), the constructors'
keywords (an unknown one is a TypeError, as in TE), group_requantize_inplace's checks, the op
fuser's path predicate and its check of a caller's output buffer."""

from __future__ import annotations

import pytest
import torch

from harness.megatron import te_stand_in as te
from hybrid_ep.fp8 import quantize_mxfp8

pytestmark = pytest.mark.unit

R, H = 256, 128


def _grouped(splits=(128, 128), quantizer=None, **fields) -> te.GroupedTensor:
    q, e = quantize_mxfp8(torch.randn(R, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16))
    first_dims = torch.tensor(splits)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(first_dims * H, 0)])
    values = dict(num_tensors=len(splits), data=q.view(torch.uint8).reshape(-1), scale_inv=e.reshape(-1),
                  first_dims=first_dims, tensor_offsets=offsets,
                  quantizer=quantizer or te.MXFP8Quantizer(te.DType.kFloat8E4M3, columnwise=False))
    values.update(fields)
    return te.GroupedTensor((R, H), torch.bfloat16, **values)


def test_the_operations_te_permits_keep_the_grouped_tensor():
    g = _grouped()
    for out in (g.detach(), torch.ops.aten.alias(g), g.expand(R, H), g.expand(-1, H), g.expand_as(g),
                g.expand_as(torch.empty(R, H))):
        assert isinstance(out, te.GroupedTensor) and out.shape == (R, H)
        assert out.rowwise_data is g.rowwise_data and out.first_dims is g.first_dims
    # view(-1) is the distributed optimizer's flattening: TE hands out the raw rowwise bytes
    flat = g.view(-1)
    assert not isinstance(flat, te.GroupedTensor) and flat.dtype == torch.uint8 and flat.numel() == R * H
    assert flat.data_ptr() == g.rowwise_data.data_ptr()


@pytest.mark.parametrize("op, error, words", [
    (lambda g: g.reshape(-1, H), RuntimeError, "only supports view(-1)"),
    (lambda g: g.view(R, H), RuntimeError, "only supports view(-1)"),
    (lambda g: g.view_as(g), RuntimeError, "only supports view(-1)"),  # what an identity autograd Function does
    (lambda g: g[:128], RuntimeError, "forbids shape-manipulation op: aten.slice.Tensor"),
    (lambda g: g.t(), RuntimeError, "forbids shape-manipulation op: aten.t.default"),
    (lambda g: torch.cat([g, g]), RuntimeError, "forbids shape-manipulation op: aten.cat.default"),
    (lambda g: g.unsqueeze(0), RuntimeError, "forbids shape-manipulation op"),
    (lambda g: g.to(torch.float32), NotImplementedError, "only uniform member shapes"),
    (lambda g: g + 1, NotImplementedError, "only uniform member shapes"),
    (lambda g: g.clone(), NotImplementedError, "only uniform member shapes"),
    (lambda g: g.expand(2, R, H), NotImplementedError, "only uniform member shapes"),
])
def test_the_operations_te_refuses_raise_as_in_te(op, error, words):
    with pytest.raises(error, match=words.replace("(", r"\(").replace(")", r"\)")):
        op(_grouped())


def test_te_attribute_names_hold_the_constructor_keywords():
    g = _grouped(with_gemm_swizzled_scales=False)
    assert (g.num_tensors, g.logical_shape, g.fake_dtype) == (2, (R, H), torch.bfloat16)
    assert g.first_dims.tolist() == [128, 128] and g.last_dims is None and g.columnwise_data is None
    assert g._with_gemm_swizzled_scales is False and not g.all_same_shape()
    copy = g.copy()
    assert not isinstance(copy, torch.Tensor) and copy.rowwise_data is g.rowwise_data


@pytest.mark.parametrize("build", [
    lambda: _grouped(fields_te_does_not_have=1),
    lambda: te.MXFP8Quantizer(te.DType.kFloat8E4M3, rowwise_only=True),
    lambda: te.GroupedLinear(2, H, H, bias=False, out_buffer=None),
    lambda: te.ScaledSwiGLU(None, limit=1.0),
    lambda: te.GroupedLinearModule(2, H, H, bias=False, output=None),
])
def test_unknown_keywords_are_refused(build):
    with pytest.raises(TypeError, match="unexpected keyword argument"):
        build()


def test_requantize_checks_the_input_as_te_does():
    op_quantizer = te.MXFP8Quantizer(te.DType.kFloat8E4M3)
    assert te.group_requantize_inplace(_grouped(), op_quantizer, 2, None, te.DType.kBFloat16) is None
    e5m2 = te.MXFP8Quantizer(te.DType.kFloat8E5M2)
    with pytest.raises(RuntimeError, match="disagree on the FP8 dtype"):  # --fp8-format hybrid's gradients
        te.group_requantize_inplace(_grouped(), e5m2, 2, None, te.DType.kBFloat16)

    class OtherQuantizer(te.MXFP8Quantizer):
        pass

    with pytest.raises(RuntimeError, match="disagree on quantization format"):
        te.group_requantize_inplace(_grouped(), OtherQuantizer(te.DType.kFloat8E4M3), 2, None, te.DType.kBFloat16)
    g = _grouped()
    g.quantizer = None
    with pytest.raises(RuntimeError, match="no quantizer"):
        te.group_requantize_inplace(g, op_quantizer, 2, None, te.DType.kBFloat16)
    with pytest.raises(RuntimeError, match="already has columnwise data"):
        te.group_requantize_inplace(_grouped(columnwise_data=torch.zeros(R * H, dtype=torch.uint8)), op_quantizer,
                                    2, None, te.DType.kBFloat16)


def test_the_path_predicate_is_tes():
    mxfp8 = te.MXFP8BlockScaling()
    for capability, dtype, want in [((10, 0), torch.bfloat16, True), ((11, 0), torch.float16, True),
                                    ((10, 0), torch.float32, False), ((9, 0), torch.bfloat16, False),
                                    ((12, 0), torch.bfloat16, False)]:
        te._DEVICE["capability"] = capability
        try:
            assert te.is_op_fuser_grouped_tensor_path_supported(mxfp8, dtype) is want, (capability, dtype)
        finally:
            te._DEVICE["capability"] = (10, 0)


def test_an_output_buffer_is_checked_as_te_checks_it():
    ok = torch.empty(R, H)
    assert te.validate_or_alloc_output(ok, (R, H), torch.float32, ok.device) is ok
    for buffer, words in [(torch.empty(R, H + 1), "shape"), (torch.empty(R, H, dtype=torch.bfloat16), "dtype"),
                          (torch.empty(H, R).t(), "contiguous"), (torch.empty(R, H, requires_grad=True), "gradient")]:
        with pytest.raises(ValueError, match=words):
            te.validate_or_alloc_output(buffer, (R, H), torch.float32, ok.device)


def test_the_op_takes_a_grouped_tensor_only_with_quantized_compute_on_the_graph_safe_path():
    fc1 = te.GroupedLinear(2, H, 64, bias=False, dtype=torch.bfloat16)
    recipe = te.MXFP8BlockScaling()
    rows = fc1.take_input(_grouped(), True, recipe, torch.bfloat16)
    assert torch.equal(rows, _grouped().rows())
    with pytest.raises(RuntimeError, match="only supports view"):  # no autocast: maybe_dequantize(x).reshape
        fc1.take_input(_grouped(), False, None, torch.bfloat16)
    te._DEVICE["capability"] = (9, 0)
    try:
        with pytest.raises(NotImplementedError, match="only supported on the graph-safe grouped-tensor path"):
            fc1.take_input(_grouped(), True, recipe, torch.bfloat16)
    finally:
        te._DEVICE["capability"] = (10, 0)
