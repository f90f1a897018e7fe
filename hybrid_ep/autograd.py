"""Differentiable dispatch and combine.

Backward of dispatch is combine of the row gradients (plus the probs gradients sent back to
their routes); backward of combine is dispatch of the output gradient with the same
handle. All ranks of the EP group must run backward for the same calls, in the same order.

Legend: T tokens, K routes per token, H hidden, R output rows.
"""

from __future__ import annotations

import torch

from .buffer import HybridEPBuffer
from .fp8 import is_fp8
from .handle import DispatchResult

# The Functions take the tensors that may need gradients one by one and everything else in
# one tuple (`call`): Function.apply's host time grows with its number of arguments
# (docs/architecture.md, the host path per call); backward returns one None for the tuple.


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TH, weights_TK, call):
        buffer, routing, handle, scales, num_out_tokens, num_sms, out_box = call
        rows_RH, scales_RB, handle = buffer._run_dispatch(x_TH, scales, routing, handle, num_out_tokens, num_sms)
        ctx.buffer, ctx.handle = buffer, handle
        out_box.extend([handle, scales_RB])
        # A new tensor object over the same memory: autograd sets its grad_fn on what forward
        # returns, and on the handle's own probs (which ctx keeps) that would make a reference
        # cycle, node -> ctx -> handle -> probs -> node, freed only by the garbage collector.
        probs_R = handle.probs_R.detach()
        if is_fp8(x_TH.dtype):
            ctx.mark_non_differentiable(rows_RH)
        return rows_RH, probs_R

    @staticmethod
    def backward(ctx, grad_rows_RH, grad_probs_R):
        buffer, handle = ctx.buffer, ctx.handle
        grad_x = grad_w = None
        if ctx.needs_input_grad[0] and ctx.needs_input_grad[1]:  # one exchange back where the backend can
            grad_x, grad_w = buffer._combine_and_return_row_values(grad_rows_RH.contiguous(), grad_probs_R, handle)
        elif ctx.needs_input_grad[0]:
            grad_x = buffer._run_combine(grad_rows_RH.contiguous(), handle, False, None)
        elif ctx.needs_input_grad[1]:
            grad_w = buffer._return_row_values(grad_probs_R, handle)
        return grad_x, grad_w, None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows_RH, probs_R, call):
        buffer, handle, apply_probs, num_sms, wire_dtype = call
        ctx.buffer, ctx.handle, ctx.apply_probs = buffer, handle, apply_probs
        ctx.rows_dtype = rows_RH.dtype
        # The rows are needed only to differentiate the weights; otherwise their memory may
        # be released after forward (Megatron's EP-overlap schedule frees combine's input).
        if apply_probs:
            ctx.save_for_backward(rows_RH, probs_R)
        return buffer._run_combine(rows_RH, handle, apply_probs, num_sms, wire_dtype)

    @staticmethod
    def backward(ctx, grad_y_TH):
        buffer, handle = ctx.buffer, ctx.handle
        grad_out_RH, _, _ = buffer._run_dispatch(
            grad_y_TH.contiguous(), None, None, handle, handle.num_out_tokens, None
        )
        grad_rows = grad_probs = None
        if ctx.apply_probs:
            rows_RH, probs_R = ctx.saved_tensors
            if ctx.needs_input_grad[1]:
                grad_probs = (grad_out_RH.float() * rows_RH.float()).sum(dim=1)
            if ctx.needs_input_grad[0]:
                grad_rows = (grad_out_RH.float() * probs_R.float()[:, None]).to(rows_RH.dtype)
        elif ctx.needs_input_grad[0]:
            grad_rows = grad_out_RH.to(ctx.rows_dtype)
        return grad_rows, grad_probs, None


def _records_graph(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether autograd would record a call on these inputs: where it would not, the Function
    (about 4 us of host time per apply, and the copied handle) is skipped; the outputs are the
    same tensors, without a grad_fn either way."""
    return torch.is_grad_enabled() and (a.requires_grad or (b is not None and b.requires_grad))


def _check_buffer(buffer, fn: str) -> None:
    if not isinstance(buffer, HybridEPBuffer):
        raise TypeError(f"hybrid_ep.{fn}: the first argument must be the HybridEPBuffer, got "
                        f"{type(buffer).__name__} (call hybrid_ep.{fn}(buffer, ...) or buffer.{fn}(...))")


def dispatch(
    buffer,
    x: torch.Tensor,
    topk_idx: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    *,
    scales: torch.Tensor | None = None,
    handle=None,
    num_out_tokens: int | None = None,
    routing_map: torch.Tensor | None = None,
    probs: torch.Tensor | None = None,
    num_sms: int | None = None,
) -> DispatchResult:
    """buffer.dispatch with gradients to x and to topk_weights (or Megatron's probs).

    The result's handle carries the differentiable probs, so combine(apply_probs=True) also
    sends gradients back to the routing weights. fp8 rows are not differentiable.
    """
    _check_buffer(buffer, "dispatch")
    routing, handle = buffer._check_dispatch(
        x, scales, topk_idx, topk_weights, routing_map, probs, handle, num_out_tokens, num_sms
    )
    if not _records_graph(x, None if routing is None else routing.weights_as_given_TK):
        # Nothing to differentiate: the buffer's call without the Function's bookkeeping; the
        # result is what the Function's would be (a reused handle is handed back as given).
        rows, scales_out, new = buffer._run_dispatch(x, scales, routing, handle, num_out_tokens, num_sms)
        handle = new if handle is None else handle
        return DispatchResult(rows, scales_out, handle.probs_R, handle)
    box: list = []
    if routing is not None:
        # The weights as given: the gradient of an unused route is 0 (return_row_values), so
        # no masked copy is made for autograd either.
        rows, probs_R = _Dispatch.apply(x, routing.weights_as_given_TK,
                                        (buffer, routing, None, scales, num_out_tokens, num_sms, box))
        handle = box[0]._with_probs(probs_R)
    else:
        # Same routing as before: the weights (and their graph) are the earlier ones.
        rows, _ = _Dispatch.apply(x, None, (buffer, None, handle, scales, num_out_tokens, num_sms, box))
        probs_R = handle.probs_R
    return DispatchResult(rows, box[1], probs_R, handle)  # tokens_per_expert: the handle's, when read


def combine(buffer, expert_out: torch.Tensor, handle, *, apply_probs: bool = False,
            num_sms: int | None = None, wire_dtype: torch.dtype | None = None) -> torch.Tensor:
    """buffer.combine with gradients to expert_out and, with apply_probs, to the routing weights."""
    _check_buffer(buffer, "combine")
    buffer._check_combine(expert_out, handle, apply_probs)
    # Without apply_probs the routing weights take no part: keep combine's graph off the
    # dispatch's, so a schedule may run the two backward passes separately.
    probs_R = handle.probs_R if apply_probs else None
    if not _records_graph(expert_out, probs_R):
        return buffer._run_combine(expert_out, handle, apply_probs, num_sms, wire_dtype)
    return _Combine.apply(expert_out, probs_R, (buffer, handle, apply_probs, num_sms, wire_dtype))
