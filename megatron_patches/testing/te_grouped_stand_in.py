"""Transformer Engine's side of the fp8 rows' hand-off, stood in for machines without TE.

`te_grouped_rows` hands the experts received MXFP8 rows as TE's GroupedTensor; TE is not
installed where the tests run. This stand-in has what the hand-off touches, as TE 2.19+
defines it: a GroupedTensor holding its fields under TE's names and allowing no tensor op but
detach and alias (TE bans shape ops on it; the hand-off must pass it on untouched), an MXFP8
quantizer that keeps its usage flags, and the op fuser's path predicate as a fixed answer.

`take_grouped_rows(experts)` makes a Megatron experts module take such rows as TE's op fuser
does, numerically: fc1 computes on the rows the GroupedTensor holds (TE's requantize of MXFP8
rows is lossless: it feeds the rowwise data to the GEMM as it is), its input gradient leaves
as a plain tensor, and fc2's output gradient, arriving as a GroupedTensor, is read back the
same way. A run through it must equal, bit for bit, the run whose experts get the rows
dequantized.
"""

from __future__ import annotations

import types

import torch

from hybrid_ep.fp8 import FP8_DTYPE, MX_BLOCK, dequantize_rows

_PASS_THROUGH = (torch.ops.aten.detach.default, torch.ops.aten.alias.default)


class GroupedTensor(torch.Tensor):
    """TE's GroupedTensor as far as the hand-off sees it: the constructor's keywords, kept."""

    @staticmethod
    def __new__(cls, shape, dtype, *, num_tensors, quantizer=None, data=None, scale_inv=None, first_dims=None,
                tensor_offsets=None, with_gemm_swizzled_scales=False, requires_grad=False, **rest):
        t = torch.Tensor._make_wrapper_subclass(cls, tuple(shape), dtype=dtype, device=data.device,
                                                requires_grad=requires_grad)
        t.fields = dict(num_tensors=num_tensors, quantizer=quantizer, data=data, scale_inv=scale_inv,
                        first_dims=first_dims, tensor_offsets=tensor_offsets,
                        with_gemm_swizzled_scales=with_gemm_swizzled_scales, **rest)
        return t

    @classmethod
    def __torch_dispatch__(cls, func, types_, args=(), kwargs=None):
        if func in _PASS_THROUGH:
            (src,) = args
            return GroupedTensor(src.shape, src.dtype, **src.fields)
        raise NotImplementedError(f"the stand-in GroupedTensor allows detach and alias only, not {func}")

    def rows(self) -> torch.Tensor:
        """The values it holds, [R, H] in its dtype (what TE's group_dequantize gives)."""
        R, H = self.shape
        q = self.fields["data"].view(FP8_DTYPE).view(R, H)
        return dequantize_rows(q, self.fields["scale_inv"].view(R, H // MX_BLOCK), self.dtype)


class MXFP8Quantizer:
    def __init__(self, fp8_dtype, *, rowwise=True, columnwise=True):
        self.dtype, self.rowwise_usage, self.columnwise_usage = fp8_dtype, rowwise, columnwise
        self.optimize_for_gemm = False


def api(path_supported: bool = True, capability=(10, 0)):
    """A te_grouped_rows.te_api() answer without TE."""
    return types.SimpleNamespace(GroupedTensor=GroupedTensor, MXFP8Quantizer=MXFP8Quantizer, e4m3="kFloat8E4M3",
                                 recipe="MXFP8BlockScaling", path_supported=lambda recipe, dtype: path_supported,
                                 capability=lambda device: capability)


class _FromGrouped(torch.autograd.Function):
    """fc1's input: the rows a GroupedTensor holds; their gradient leaves as a plain tensor."""

    @staticmethod
    def forward(ctx, grouped):
        return grouped.rows()

    @staticmethod
    def backward(ctx, grad):
        return grad


class _GradFromGrouped(torch.autograd.Function):
    """fc2's output as it is; a GroupedTensor gradient arriving for it is read back as rows."""

    @staticmethod
    def forward(ctx, y, seen):
        ctx.seen = seen
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, GroupedTensor):
            ctx.seen.append(grad)
            grad = grad.rows()
        return grad, None


def read_rows(grouped: GroupedTensor) -> torch.Tensor:
    """A GroupedTensor's rows, differentiable as fc1's input is (see _FromGrouped)."""
    return _FromGrouped.apply(grouped)


def grad_read_back(y: torch.Tensor, seen: list | None = None) -> torch.Tensor:
    """y as it is; a GroupedTensor gradient arriving for it is read back as rows (in `seen`)."""
    return _GradFromGrouped.apply(y, [] if seen is None else seen)


def take_grouped_rows(experts) -> dict:
    """Wrap experts.forward to take GroupedTensor rows (see the module docstring). Returns the
    record it fills: the GroupedTensors received forward ("inputs") and backward ("grads")."""
    seen = {"inputs": [], "grads": []}
    forward = experts.forward

    def grouped_forward(hidden, tokens_per_expert, probs, *args, **kwargs):
        if not isinstance(hidden, GroupedTensor):
            raise TypeError(f"the experts expected a GroupedTensor, got {type(hidden).__name__}")
        seen["inputs"].append(hidden)
        out, bias = forward(read_rows(hidden), tokens_per_expert, probs, *args, **kwargs)
        return grad_read_back(out, seen["grads"]), bias

    experts.forward = grouped_forward
    return seen
