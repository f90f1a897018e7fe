"""Per-128 fp8 quantisation used for fp8 dispatch inputs."""

import pytest
import torch

from hybrid_ep.fp8 import dequantize_fp8, quantize_fp8

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
