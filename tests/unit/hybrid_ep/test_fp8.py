"""fp8 quantisation of dispatch inputs: per-128 fp32 scales, and MXFP8's per-32 E8M0 scales."""

import math
import struct

import pytest
import torch

from hybrid_ep.fp8 import dequantize_fp8, dequantize_mxfp8, quantize_fp8, quantize_mxfp8, scales_from_wire, wire_scales

pytestmark = pytest.mark.unit


def test_round_trip_within_e4m3_precision():
    scale = torch.tensor([1e-3, 10.0]).repeat_interleave(128)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)) * scale
    q, s = quantize_fp8(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 2) and s.dtype == torch.float32
    back = dequantize_fp8(q, s)
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of the block's values (plus subnormals).
    assert bool(((back - x).abs() <= x.abs() * 2**-4 + s.repeat_interleave(128, dim=1) * 2**-9).all())
    # The block absmax maps to 448 exactly.
    assert torch.allclose(q.float().abs().view(5, 2, 128).amax(dim=2), torch.full((5, 2), 448.0))


def test_zero_rows():
    q, s = quantize_fp8(torch.zeros(0, 128))
    assert q.shape == (0, 128) and s.shape == (0, 1)


def _e8m0(amax: float) -> int:
    """Transformer Engine's float_to_e8m0(amax * (1 / 448)), one value at a time from its fp32
    bits (struct), apart from the vectorised code under test."""
    v = struct.unpack("<f", struct.pack("<f", amax))[0] * struct.unpack("<f", struct.pack("<f", 1.0 / 448))[0]
    v = struct.unpack("<f", struct.pack("<f", v))[0]  # the product rounded to fp32
    if math.isnan(v):
        return 0xFF
    if math.isinf(v):
        return 0xFE
    if v == 0:
        return 0
    bits = struct.unpack("<I", struct.pack("<f", v))[0]
    exponent, mantissa = (bits >> 23) & 0xFF, bits & 0x7FFFFF
    if mantissa > 0 and exponent != 0xFE and not (exponent == 0 and mantissa <= 0x400000):
        exponent += 1
    return exponent


def test_mxfp8_scales_are_transformer_engines_e8m0_exponents():
    """Per 32 elements: amaxes across fp32's range, exact powers of two (no round-up), zero,
    subnormal products (the half-normal rule), bit for bit with the scalar rule; every block's
    largest value lands in [224, 448] (one binade) unless the block is zero or subnormal."""
    amaxes = [0.0, 1.0, 448.0, 449.0, 896.0, 3.0, 1e-3, 2.0**-130, 2.0**-120 * 448, 1e30, 1.5 * 2.0**-126 * 448,
              0.5 * 2.0**-126 * 448]
    x = torch.zeros(1, 32 * len(amaxes))
    for i, a in enumerate(amaxes):
        x[0, 32 * i] = a
        x[0, 32 * i + 1] = -a / 3
    assert x.shape == (1, 384)  # 12 blocks: H a multiple of 128
    q, e = quantize_mxfp8(x)
    assert q.dtype == torch.float8_e4m3fn and e.dtype == torch.uint8 and e.shape == (1, 12)
    assert e[0].tolist() == [_e8m0(float(x[0, 32 * i].abs())) for i in range(12)]
    block_max = q.float().abs().view(12, 32).amax(dim=1)
    real = e[0] > 0
    assert bool((block_max <= 448).all()) and bool((block_max[real & (x.view(12, 32).abs().amax(1) > 2.0**-100)]
                                                     >= 224).all())


def test_mxfp8_round_trip_within_e4m3_precision():
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(1)) * torch.logspace(-4, 4, 256)
    q, e = quantize_mxfp8(x)
    back = dequantize_mxfp8(q, e)
    scale = (e.to(torch.int32) << 23).view(torch.float32).repeat_interleave(32, dim=1)
    assert bool(((back - x).abs() <= x.abs() * 2**-4 + scale * 2**-9).all())
    assert torch.equal(dequantize_mxfp8(q, e.view(torch.float8_e8m0fnu)), back)  # either scale dtype


def test_mxfp8_scales_travel_as_the_bytes_of_blockwise_ones():
    """A row's H/32 E8M0 bytes are H/128 fp32 words on the wire and the same bytes back, in the
    dtype they came in; a view that does not start on a 4-byte boundary is copied first."""
    _, e = quantize_mxfp8(torch.randn(5, 512, generator=torch.Generator().manual_seed(2)))
    wire = wire_scales(e)
    assert wire.dtype == torch.float32 and wire.shape == (5, 4)
    assert torch.equal(scales_from_wire(wire, e), e)
    as_e8m0 = e.view(torch.float8_e8m0fnu)
    back = scales_from_wire(wire_scales(as_e8m0), as_e8m0)
    assert back.dtype == torch.float8_e8m0fnu and torch.equal(back.view(torch.uint8), e)
    odd = torch.cat([torch.zeros(1, dtype=torch.uint8), e.reshape(-1)])[1:].view(5, 16)  # offset 1 byte
    assert torch.equal(scales_from_wire(wire_scales(odd), odd), e)
    blockwise = torch.rand(5, 4)
    assert wire_scales(blockwise) is blockwise and scales_from_wire(blockwise, blockwise) is blockwise
