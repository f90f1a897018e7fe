"""FP8 rows travel as e4m3 values plus their scales, in one of two formats:

- blockwise: one fp32 scale per 128 elements, [T, H/128] float32 (DeepSeek-V3's blocks,
  Transformer Engine's 1x128 recipe);
- MXFP8: one E8M0 scale (a power of two: the byte is its biased exponent) per 32 elements,
  [T, H/32] uint8 or float8_e8m0fnu (Transformer Engine's mxfp8 recipe, its compact
  rowwise layout before the GEMM's swizzle).

Both take H/32 bytes per row, so the kernels move either as the same bytes: an MXFP8 row's
scales are viewed as H/128 fp32 words on the way in (wire_scales) and viewed back on the
way out (scales_from_wire); nothing reads their values on the way.

Legend: T rows, H hidden, B = H / 128 scale blocks, M = H / 32 MXFP8 scale blocks.
"""

from __future__ import annotations

import torch

from .config import FP8_BLOCK

FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0
MX_BLOCK = 32  # elements per MXFP8 scale
MX_SCALE_DTYPES = (torch.uint8, torch.float8_e8m0fnu)  # E8M0 biased exponents, as bytes or as the dtype


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype == FP8_DTYPE


def num_scale_blocks(hidden_dim: int) -> int:
    return hidden_dim // FP8_BLOCK


def _check_rows(name: str, t) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != 2:
        shape = list(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a 2-D tensor [tokens, hidden], got {shape}")


def quantize_fp8(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block quantisation: x ~= q * scale, with the block's absmax mapped to 448."""
    _check_rows("x", x_TH)
    T, H = x_TH.shape
    if H % FP8_BLOCK != 0:
        raise ValueError(f"x hidden size {H} must be a multiple of {FP8_BLOCK} for fp8")
    blocks = x_TH.float().view(T, H // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-12)
    scales_TB = amax / _FP8_MAX
    q = (blocks / scales_TB[:, :, None]).clamp(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE)
    return q.view(T, H), scales_TB


def dequantize_fp8(q_TH: torch.Tensor, scales_TB: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    _check_rows("q", q_TH)
    if not isinstance(scales_TB, torch.Tensor):
        raise ValueError(f"scales must be a tensor [tokens, hidden / {FP8_BLOCK}], got {type(scales_TB).__name__}")
    T, H = q_TH.shape
    if H % FP8_BLOCK != 0:
        raise ValueError(f"q hidden size {H} must be a multiple of {FP8_BLOCK} for fp8")
    if tuple(scales_TB.shape) != (T, H // FP8_BLOCK):
        raise ValueError(f"scales must be [tokens, hidden / {FP8_BLOCK}] = [{T}, {H // FP8_BLOCK}], "
                         f"got {list(scales_TB.shape)}")
    blocks = q_TH.float().view(T, H // FP8_BLOCK, FP8_BLOCK) * scales_TB.float()[:, :, None]
    return blocks.view(T, H).to(dtype)


def quantize_blockwise(x_TH: torch.Tensor, pow2_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block quantisation by Transformer Engine's 1x128 blockwise rule, bit for bit.

    In fp32: quant_scale = 448 / amax (rounded to nearest), its mantissa cleared with
    pow2_scales (the recipe's default: a power of two, so a dequantised block quantises
    again to the same bits); amax 0 or inf gives 1, a quant_scale past fp32's range the
    largest float. q = x * quant_scale, rounded to nearest-even and saturated to +-448; the
    scale sent with the row is 1 / quant_scale (q * scale ~= x).
    """
    _check_rows("x", x_TH)
    T, H = x_TH.shape
    if H % FP8_BLOCK != 0:
        raise ValueError(f"x hidden size {H} must be a multiple of {FP8_BLOCK} for fp8")
    blocks = x_TH.float().view(T, H // FP8_BLOCK, FP8_BLOCK)
    amax = blocks.abs().amax(dim=2)
    quant_scale = torch.full_like(amax, _FP8_MAX) / amax
    quant_scale = torch.where(torch.isinf(quant_scale), torch.finfo(torch.float32).max, quant_scale)
    quant_scale = torch.where((amax == 0) | torch.isinf(amax) | torch.isnan(amax), 1.0, quant_scale)
    if pow2_scales:
        bits = quant_scale.view(torch.int32) & torch.tensor(-8388608, dtype=torch.int32)  # 0xFF800000
        quant_scale = bits.view(torch.float32)
    q = (blocks * quant_scale[:, :, None]).clamp(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE)
    return q.view(T, H), 1.0 / quant_scale


def quantize_mxfp8(x_TH: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-32-element quantisation by Transformer Engine's MXFP8 rule, bit for bit: the block's
    scale exponent is float_to_e8m0(amax * (1 / 448)) (the fp32 product's biased exponent, one
    up where its mantissa is not zero, except a subnormal of at most half the smallest normal;
    0 for amax 0, 0xFE for inf, 0xFF for nan), q = x * 2^(127 - e) (1 for e = 0), rounded to
    nearest-even and saturated to +-448. Returns (q [T, H] e4m3, scales [T, H/32] uint8: e)."""
    _check_rows("x", x_TH)
    T, H = x_TH.shape
    if H % FP8_BLOCK != 0:  # H/32 scale bytes travel as H/128 fp32 words
        raise ValueError(f"x hidden size {H} must be a multiple of {FP8_BLOCK} for fp8")
    blocks = x_TH.float().view(T, H // MX_BLOCK, MX_BLOCK)
    v = blocks.abs().amax(dim=2) * torch.tensor(1.0 / _FP8_MAX, dtype=torch.float32)
    bits = v.view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + up.to(torch.int32)
    e = torch.where(v == 0, 0, e)
    e = torch.where(torch.isinf(v), 0xFE, torch.where(torch.isnan(v), 0xFF, e))
    inverse = torch.where(e == 0, 1.0, ((254 - e).clamp(min=0) << 23).view(torch.float32))
    q = (blocks * inverse[:, :, None]).clamp(-_FP8_MAX, _FP8_MAX).to(FP8_DTYPE)
    return q.view(T, H), e.to(torch.uint8)


def dequantize_mxfp8(q_TH: torch.Tensor, scales_TM: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """x ~= q * 2^(e - 127) per 32 elements (e = 0 gives 0, as Transformer Engine reads it)."""
    _check_rows("q", q_TH)
    T, H = q_TH.shape
    if not isinstance(scales_TM, torch.Tensor) or tuple(scales_TM.shape) != (T, H // MX_BLOCK):
        shape = list(scales_TM.shape) if isinstance(scales_TM, torch.Tensor) else type(scales_TM).__name__
        raise ValueError(f"scales must be [tokens, hidden / {MX_BLOCK}] = [{T}, {H // MX_BLOCK}], got {shape}")
    e = scales_TM.view(torch.uint8).to(torch.int32)
    scale = (e << 23).view(torch.float32)
    return (q_TH.float().view(T, H // MX_BLOCK, MX_BLOCK) * scale[:, :, None]).view(T, H).to(dtype)


def dequantize_rows(q_TH: torch.Tensor, scales: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """fp8 rows dequantized by the format of their scales (blockwise or MXFP8)."""
    return dequantize_mxfp8(q_TH, scales, dtype) if is_mx_scales(scales) else dequantize_fp8(q_TH, scales, dtype)


def is_mx_scales(scales: torch.Tensor | None) -> bool:
    """Whether fp8 rows' scales are MXFP8's (E8M0 bytes) rather than blockwise fp32."""
    return scales is not None and scales.dtype in MX_SCALE_DTYPES


def wire_scales(scales: torch.Tensor | None) -> torch.Tensor | None:
    """The scales as the kernels move them: blockwise ones as they are, MXFP8's [T, H/32] bytes
    as [T, H/128] fp32 words (the same bytes; copied first where the view can not start on a
    4-byte boundary)."""
    if scales is None or not is_mx_scales(scales):
        return scales
    t = scales.contiguous().view(torch.uint8)
    if t.data_ptr() % 4:
        t = t.clone()
    return t.view(torch.float32)


def scales_from_wire(scales: torch.Tensor | None, like: torch.Tensor | None) -> torch.Tensor | None:
    """Dispatched scales in the format of `like` (the scales given): [R, H/128] fp32 words back
    to MXFP8's [R, H/32] bytes of like's dtype; a padding row's are 0 either way."""
    if scales is None or like is None or not is_mx_scales(like):
        return scales
    return scales.view(torch.uint8).view(like.dtype)
