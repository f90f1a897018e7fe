"""FP8 rows travel as e4m3 values plus one fp32 scale per 128 elements (DeepSeek-V3's blocks).

Legend: T rows, H hidden, B = H / 128 scale blocks.
"""

from __future__ import annotations

import torch

from .config import FP8_BLOCK

FP8_DTYPE = torch.float8_e4m3fn
_FP8_MAX = 448.0


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
