"""Dtype names used on command lines, and which dtype a combine of a dispatch returns in."""

from __future__ import annotations

import torch

from .fp8 import FP8_DTYPE

# Row payloads a dispatch accepts, by the short names the CLIs use.
DISPATCH_BY_NAME = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE, "fp32": torch.float32}
# Expert outputs are never fp8 (Megatron and DeepEP combine in bf16).
COMBINE_BY_NAME = {"bf16": torch.bfloat16, "fp32": torch.float32}


def combine_dtype_for(dispatch_dtype: torch.dtype) -> torch.dtype:
    """The dtype expert outputs come back in after a dispatch of `dispatch_dtype` rows."""
    return torch.bfloat16 if dispatch_dtype == FP8_DTYPE else dispatch_dtype
