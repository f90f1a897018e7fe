"""Checks of per-call arguments, run before the call's exchange. A rank whose arguments fail
them still makes the exchange, with its refusal in it (refusals.py), so its peers raise the same
InputRefused at once instead of waiting for it.

Legend: T tokens, H hidden, B = H / 128 scale blocks, R output rows.
"""

from __future__ import annotations

import torch

from .checks import require_int
from .config import FP8_BLOCK, BufferConfig
from .fp8 import MX_BLOCK, MX_SCALE_DTYPES, is_fp8, num_scale_blocks
from .handle import DispatchHandle
from .rows import row_bytes_rule

DISPATCH_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)
COMBINE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
MAX_OUT_ROWS = 2**31 - 1  # the kernels index output rows with int32


def _names(dtypes) -> str:
    return ", ".join(str(d).replace("torch.", "") for d in dtypes)


def check_dispatch_input(x, scales, config: BufferConfig, device: torch.device) -> int:
    """Raises for x (and scales) a dispatch can not take; returns x's number of tokens."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"x must be [num_tokens, hidden_dim], got shape {tuple(x.shape)}")
    dtype = x.dtype
    if dtype not in DISPATCH_DTYPES:
        raise TypeError(f"x dtype must be one of {_names(DISPATCH_DTYPES)}, got {dtype}")
    T, H = x.shape
    if H != config.hidden_dim:
        raise ValueError(f"x hidden size {H} does not match the buffer's hidden_dim={config.hidden_dim}")
    if T > config.max_tokens_per_rank:
        raise ValueError(
            f"x has {T} tokens, more than the buffer's max_tokens_per_rank={config.max_tokens_per_rank}"
        )
    if x.device != device:
        raise ValueError(f"x is on {x.device} but this EP group communicates on {device}")
    if is_fp8(dtype):
        if H % FP8_BLOCK != 0:
            raise ValueError(f"fp8 x needs hidden_dim to be a multiple of {FP8_BLOCK}, got {H}")
        formats = (f"float32 [num_tokens, hidden_dim / {FP8_BLOCK}] (blockwise) or uint8 / float8_e8m0fnu "
                   f"[num_tokens, hidden_dim / {MX_BLOCK}] (MXFP8)")
        if scales is None:
            raise ValueError(f"fp8 x needs scales: {formats}")
        if not isinstance(scales, torch.Tensor):
            raise TypeError(f"scales must be a torch.Tensor, got {type(scales).__name__}")
        if scales.dtype != torch.float32 and scales.dtype not in MX_SCALE_DTYPES:
            raise TypeError(f"scales must be {formats}, got {scales.dtype}")
        expected = (T, num_scale_blocks(H) if scales.dtype == torch.float32 else H // MX_BLOCK)
        if tuple(scales.shape) != expected:
            raise ValueError(f"{scales.dtype} scales must have shape {list(expected)}, got {list(scales.shape)}")
        if scales.device != device:
            raise ValueError(f"scales is on {scales.device} but x is on {device}")
    elif scales is not None:
        raise ValueError(f"scales are only for float8_e4m3fn x; x is {dtype}")
    if x.element_size() > config.ring_dtype.itemsize:
        raise ValueError(f"x: {dtype} rows are wider than the buffer's rings, sized for {config.ring_dtype} "
                         "(ring_dtype): build the buffer with ring_dtype=torch.float32 to dispatch them")
    rule = row_bytes_rule(H, dtype)
    if rule:
        raise ValueError(f"x: {rule}")
    return T


def check_num_out_tokens(num_out_tokens) -> None:
    if num_out_tokens is None or (type(num_out_tokens) is int and 0 <= num_out_tokens <= MAX_OUT_ROWS):
        return  # the common cases, without require_int's abstract-class checks (a microsecond)
    require_int("num_out_tokens", num_out_tokens, 0, what="an int or None")
    if num_out_tokens > MAX_OUT_ROWS:
        raise ValueError(f"num_out_tokens must be at most {MAX_OUT_ROWS} (output rows are indexed with int32), "
                         f"got {num_out_tokens}")


def check_handle(handle, owner: int, name: str = "handle") -> DispatchHandle:
    if not isinstance(handle, DispatchHandle):
        raise TypeError(f"{name} must be the DispatchHandle of a dispatch, got {type(handle).__name__}")
    if handle.owner != owner:
        raise ValueError(f"{name} was made by another HybridEPBuffer; it is only valid on its own buffer")
    return handle


def check_reused_handle(handle: DispatchHandle, num_tokens: int, num_out_tokens) -> None:
    if handle.num_tokens != num_tokens:
        raise ValueError(
            f"handle was made for {handle.num_tokens} tokens but x has {num_tokens}; a handle is "
            f"only reusable for the same routing"
        )
    if num_out_tokens is not None and num_out_tokens != handle.num_out_tokens:
        raise ValueError(
            f"num_out_tokens={num_out_tokens} differs from the handle's {handle.num_out_tokens}; "
            f"leave it out when reusing a handle"
        )


def check_combine_input(expert_out, handle: DispatchHandle, config: BufferConfig) -> None:
    if not isinstance(expert_out, torch.Tensor):
        raise TypeError(f"expert_out must be a torch.Tensor, got {type(expert_out).__name__}")
    dtype = expert_out.dtype
    if dtype not in COMBINE_DTYPES:
        raise TypeError(f"expert_out dtype must be one of {_names(COMBINE_DTYPES)}, got {dtype}")
    expected = (handle.num_rows, config.hidden_dim)
    if expert_out.shape != expected:  # a torch.Size is a tuple
        raise ValueError(
            f"expert_out must have shape [rows of the dispatch, hidden_dim] = {list(expected)}, "
            f"got {list(expert_out.shape)}"
        )
    rule = row_bytes_rule(config.hidden_dim, dtype)
    if rule:
        raise ValueError(f"expert_out: {rule}")
    if expert_out.device != handle.probs_R.device:
        raise ValueError(f"expert_out is on {expert_out.device} but the dispatch ran on {handle.probs_R.device}")


def check_combine_wire(expert_out_dtype: torch.dtype, wire_dtype: torch.dtype | None,
                       buffer_wire_dtype: torch.dtype | None, config: BufferConfig) -> None:
    """The wire a combine's partial sums take (the call's wire_dtype, else the buffer's
    combine_wire_dtype, else expert_out's dtype) fits the rings, or is refused naming whichever
    of the three chose it."""
    wire, name = ((wire_dtype, "wire_dtype") if wire_dtype is not None else
                  (buffer_wire_dtype, "combine_wire_dtype") if buffer_wire_dtype is not None else
                  (expert_out_dtype, "expert_out"))
    check_wire_dtype_fits(wire, name, config)


def check_wire_dtype_fits(wire_dtype: torch.dtype, name: str, config: BufferConfig) -> None:
    """A combine's partial sums travel between ranks in wire_dtype, through rings sized for
    config.ring_dtype: refuse a wider one (named `name`, the argument that set it)."""
    if wire_dtype.itemsize > config.ring_dtype.itemsize:
        raise ValueError(f"{name}: {wire_dtype} partial sums are wider than the buffer's rings, sized for "
                         f"{config.ring_dtype} (ring_dtype): build the buffer with ring_dtype=torch.float32 to "
                         "combine with them")
