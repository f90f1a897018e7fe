"""Rows of any dtype (fp8 included) as raw bytes, so one code path moves every dtype, and the
one rule on their size that every backend enforces."""

from __future__ import annotations

import functools

import torch

# Every backend takes only rows whose size is a multiple of this many bytes. The cuda kernels
# move rows with 16-byte bulk copies; the reference backend could move any row, but refusing
# the same shapes means code that runs on the CPU also runs on a GPU.
ROW_ALIGN_BYTES = 16
# The widest element (fp32) needs the fewest values per 16 bytes: a hidden size that is not
# a multiple of this fits no dtype.
MIN_HIDDEN_MULTIPLE = ROW_ALIGN_BYTES // 4


@functools.lru_cache(maxsize=256)
def row_bytes_rule(hidden: int, dtype: torch.dtype) -> str | None:
    """None when a row of `hidden` values of dtype is a multiple of 16 bytes, else the rule it
    breaks. Remembered per (hidden, dtype): every dispatch and combine asks."""
    size = dtype.itemsize
    if hidden * size % ROW_ALIGN_BYTES == 0:
        return None
    name = str(dtype).replace("torch.", "")
    return (f"a row of {hidden} {name} values is {hidden * size} bytes; every backend needs rows of a multiple of "
            f"{ROW_ALIGN_BYTES} bytes, so the hidden size must be a multiple of {ROW_ALIGN_BYTES // size} for {name}")


def check_hidden_dim(hidden_dim: int) -> None:
    """At buffer creation: refuse a hidden size that no dtype could move."""
    if hidden_dim % MIN_HIDDEN_MULTIPLE:
        raise ValueError(
            f"hidden_dim must be a multiple of {MIN_HIDDEN_MULTIPLE}, got {hidden_dim}: every backend moves rows "
            f"in multiples of {ROW_ALIGN_BYTES} bytes ({ROW_ALIGN_BYTES // 4} fp32, {ROW_ALIGN_BYTES // 2} bf16 / "
            f"fp16 or {ROW_ALIGN_BYTES} fp8 values)")


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
