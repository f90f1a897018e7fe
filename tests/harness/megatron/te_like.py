"""A grouped linear that allocates its output as Transformer Engine's GroupedLinear does.

TE's `_GroupedLinear.forward` (an autograd Function) allocates its output in Python,
`out = torch.empty([sum(m_splits), weights[0].size(0)], dtype=activation_dtype, device=...)`,
and its grouped GEMM writes every group's rows into it; megatron_patches.expert_out relies on
that. `PythonAllocatedGroupedLinear` is TorchGroupedLinear (same constructor, parameters and
zero-safe contract) with that forward, so the CPU tests run the in-place path through a
TEGroupedMLP without Transformer Engine. Legend: R rows, K input features, N output features.
"""

from __future__ import annotations

import torch

from megatron_patches.grouped_gemm import TorchGroupedLinear


class _GroupedLinear(torch.autograd.Function):
    """out[rows of group g] = x[rows of g] @ w_g^T, into one torch.empty([R, N]) (as TE)."""

    @staticmethod
    def forward(ctx, x_RK, counts, *weights):
        if sum(counts) != x_RK.shape[0]:
            raise ValueError(f"m_splits sum to {sum(counts)} for {x_RK.shape[0]} rows")
        ctx.counts = counts
        ctx.save_for_backward(x_RK, *weights)
        out = torch.empty([sum(counts), weights[0].size(0)], dtype=x_RK.dtype, device=x_RK.device)
        start = 0
        for n, w in zip(counts, weights):
            torch.matmul(x_RK[start:start + n], w.t().to(x_RK.dtype), out=out[start:start + n])
            start += n
        return out

    @staticmethod
    def backward(ctx, grad_RN):
        x_RK, *weights = ctx.saved_tensors
        grad_x = torch.empty_like(x_RK)
        grad_ws = []
        start = 0
        for n, w in zip(ctx.counts, weights):
            g = grad_RN[start:start + n]
            grad_x[start:start + n] = g @ w.to(g.dtype)
            grad_ws.append((g.t() @ x_RK[start:start + n]).to(w.dtype))
            start += n
        return (grad_x, None, *grad_ws)


class PythonAllocatedGroupedLinear(TorchGroupedLinear):
    """TorchGroupedLinear whose output is one torch.empty([rows, N]) written per group by a
    custom autograd Function, as Transformer Engine's GroupedLinear makes it (no bias)."""

    OUTPUT_FROM_TORCH_EMPTY = True

    def forward(self, x_RK: torch.Tensor, m_splits):
        if self.use_bias:
            raise ValueError("PythonAllocatedGroupedLinear has no bias")
        counts = [int(c) for c in (m_splits.tolist() if isinstance(m_splits, torch.Tensor) else m_splits)]
        return _GroupedLinear.apply(x_RK, counts, *self._weights()), None


def te_like_grouped_mlp_submodules():
    """TEGroupedMLP's submodules with both linears PythonAllocatedGroupedLinear."""
    from megatron.core.transformer.moe import experts

    submodules_cls = getattr(experts, "GroupedMLPSubmodules", None)
    if submodules_cls is None:
        from megatron.core.transformer.mlp import MLPSubmodules as submodules_cls
    return submodules_cls(linear_fc1=PythonAllocatedGroupedLinear, linear_fc2=PythonAllocatedGroupedLinear)


# LayerCase.experts for TEGroupedMLP on these linears (megatron_patches.local.layer)
EXPERTS = f"{__name__}:te_like_grouped_mlp_submodules"
