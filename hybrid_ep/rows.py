"""Rows of any dtype (fp8 included) as raw bytes, so one code path moves every dtype."""

from __future__ import annotations

import torch


def _dense(t: torch.Tensor) -> torch.Tensor:
    """t with row-major strides. is_contiguous() ignores the stride of size-1 dimensions,
    but a dtype view checks them, so compare the strides themselves."""
    expected, step = [], 1
    for size in reversed(t.shape):
        expected.append(step)
        step *= size
    if tuple(reversed(expected)) == t.stride():
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device).copy_(t)


def as_byte_rows(t: torch.Tensor) -> torch.Tensor:
    """[rows, cols] of any dtype as [rows, cols * element size] uint8 (a view when possible)."""
    if t.dim() != 2:
        raise ValueError(f"expected a 2-D tensor, got shape {tuple(t.shape)}")
    return _dense(t.detach()).view(torch.uint8)


def from_byte_rows(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of as_byte_rows: [rows, nbytes] uint8 as [rows, nbytes / element size] dtype."""
    return _dense(b).view(dtype)
