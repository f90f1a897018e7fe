"""fp8 on the wire for the hybrid_ep dispatcher: which runs can carry it, the quantizer, and
the differentiable dispatch and combine around fp8 exchanges.

Rows are quantized once, on the rank that makes them, by the run's recipe: Transformer
Engine's 1x128 blockwise rule (--fp8-recipe blockwise: fp32 scales) or its MXFP8 rule
(--fp8-recipe mxfp8: 1x32 E8M0 scales); with TE importable and the rows on a GPU by TE's own
quantizer, otherwise by `hybrid_ep.fp8.quantize_blockwise` / `quantize_mxfp8`, which round the
same way. The receiving rank hands them to the experts as TE's grouped GEMM takes them
(`te_grouped_rows`, MXFP8 on TE's op fuser) or dequantized. Both recipes' power-of-two
scales make dequantizing lossless for the experts' own quantization: a dequantized block
quantizes again to the same values, so TE's GEMMs compute on exactly what was sent.

Gradients pass straight through the quantization: the dispatch's backward sums the row
gradients in their own dtype (hybrid_ep's combine); the combine's backward sends the output
gradient to the expert rows as fp8 (combine_grad_fp8).

Legend: T tokens, H hidden, B = H / 128 (blockwise) or H / 32 (MXFP8) scale blocks, R dispatched rows.
"""

from __future__ import annotations

import os

import torch

import hybrid_ep as hep
from hybrid_ep.fp8 import FP8_DTYPE, MX_BLOCK, dequantize_rows, quantize_blockwise, quantize_mxfp8

DISPATCH_FLAG = "--hybrid-ep-dispatch-fp8"
COMBINE_GRAD_FLAG = "--hybrid-ep-combine-grad-fp8"
# TE's Float8BlockScaling recipe reads this when built: "1" turns its power-of-two scales off.
FP32_SCALES_ENV = "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"


def _recipe(config) -> str:
    recipe = getattr(config, "fp8_recipe", None)
    return str(getattr(recipe, "value", recipe))


def unsupported_reasons(config, options) -> list[str]:
    """What stops this run from sending rows in fp8, each naming the option and what to change."""
    flags = [flag for flag, on in ((DISPATCH_FLAG, options.dispatch_fp8),
                                   (COMBINE_GRAD_FLAG, options.combine_grad_fp8)) if on]
    reasons = []
    recipe = _recipe(config)
    for flag in flags:
        if recipe not in QUANTIZERS:
            reasons.append(
                f"{flag} needs --fp8-recipe blockwise (1x128 fp32 scales) or mxfp8 (1x32 E8M0 scales), the fp8 "
                f"rows hybrid_ep carries, got fp8_recipe={recipe!r}; set one of them or drop {flag}"
            )
        hidden = getattr(config, "hidden_size", None)
        if hidden is not None and hidden % 128 != 0:
            reasons.append(f"{flag} needs hidden_size a multiple of 128 (a row's scales travel in 4-byte words of "
                           f"128 values), got {hidden}")
    if options.combine_grad_fp8 and getattr(config, "fp8", None) == "hybrid":
        reasons.append(
            f"{COMBINE_GRAD_FLAG} with --fp8-format hybrid: Transformer Engine then quantizes gradients "
            f"to E5M2, and hybrid_ep carries E4M3 only; use --fp8-format e4m3 or drop {COMBINE_GRAD_FLAG}"
        )
    return reasons


def pow2_scales() -> bool:
    """Whether the blockwise recipe rounds its scales to powers of two (TE's default)."""
    return os.environ.get(FP32_SCALES_ENV, "0") != "1"


def _te_quantizer(pow2: bool):
    """TE's rowwise 1x128 quantizer, or None where TE is not importable."""
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.float8_blockwise_tensor import Float8BlockQuantizer
    except ImportError:
        return None
    return Float8BlockQuantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False, amax_epsilon=0.0,
                                force_pow_2_scales=pow2, block_scaling_dim=1)


class BlockwiseQuantizer:
    """x [T, H] -> (e4m3 [T, H], fp32 scales [T, B]) by the blockwise recipe; x ~= q * scales."""

    def __init__(self, pow2: bool | None = None, use_te: bool = True):
        self.pow2 = pow2_scales() if pow2 is None else pow2
        self._te = _te_quantizer(self.pow2) if use_te else None

    @property
    def uses_te(self) -> bool:
        return self._te is not None

    def __call__(self, x_TH):
        if self._te is None or not x_TH.is_cuda or x_TH.shape[0] == 0:
            return quantize_blockwise(x_TH, self.pow2)
        T, H = x_TH.shape
        qt = self._te(x_TH.contiguous())
        q_TH = qt._rowwise_data.view(FP8_DTYPE)
        # The quantizer is built for GEMMs (not for all-gather): its rowwise scales come in TE's
        # GEMM-ready form, transposed, the token dimension padded to a multiple of 4.
        scale_inv = qt._rowwise_scale_inv
        if tuple(scale_inv.shape) != (H // 128, (T + 3) // 4 * 4):
            raise RuntimeError(f"Transformer Engine's 1x128 rowwise scales for [{T}, {H}] rows came as "
                               f"{list(scale_inv.shape)}, not the GEMM-ready [{H // 128}, {(T + 3) // 4 * 4}]")
        return q_TH, scale_inv[:, :T].t().contiguous().to(torch.float32)


def _te_mx_quantizer():
    """TE's rowwise MXFP8 quantizer, or None where TE is not importable."""
    try:
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    except ImportError:
        return None
    return MXFP8Quantizer(tex.DType.kFloat8E4M3, rowwise=True, columnwise=False)


class MXFP8Quantizer:
    """x [T, H] -> (e4m3 [T, H], E8M0 scales [T, H/32] uint8) by the MXFP8 recipe; x ~= q * 2^(e - 127)."""

    def __init__(self, use_te: bool = True):
        self._te = _te_mx_quantizer() if use_te else None

    @property
    def uses_te(self) -> bool:
        return self._te is not None

    def __call__(self, x_TH):
        if self._te is None or not x_TH.is_cuda or x_TH.shape[0] == 0:
            return quantize_mxfp8(x_TH)
        T, H = x_TH.shape
        qt = self._te(x_TH.contiguous())
        q_TH = qt._rowwise_data.view(FP8_DTYPE)
        # TE pads its rowwise E8M0 scales to [128 rows, 4 columns] tiles (unswizzled: the GEMM
        # swizzles them itself); the rows' own are the top-left [T, H/32].
        scale_inv = qt._rowwise_scale_inv
        M = H // MX_BLOCK
        if scale_inv.dim() != 2 or scale_inv.shape[0] < T or scale_inv.shape[1] < M:
            raise RuntimeError(f"Transformer Engine's MXFP8 rowwise scales for [{T}, {H}] rows came as "
                               f"{list(scale_inv.shape)}, not at least [{T}, {M}]")
        return q_TH, scale_inv[:T, :M].contiguous().view(torch.uint8)


# The quantizer of each --fp8-recipe whose rows hybrid_ep carries
QUANTIZERS = {"blockwise": BlockwiseQuantizer, "mxfp8": MXFP8Quantizer}


def quantizer_for(config, use_te: bool = True):
    """The run's quantizer (unsupported_reasons refuses other recipes first)."""
    return QUANTIZERS[_recipe(config)](use_te=use_te)


def dequantized(rows_RH, scales_RB, dtype):
    """The experts' rows where they cannot take fp8: the received rows dequantized to dtype."""
    return dequantize_rows(rows_RH, scales_RB, dtype)


class _ReceivedRows(torch.autograd.Function):
    """Forward: the received fp8 rows as the experts take them (`as_rows`: dequantized, or
    te_grouped_rows.GroupedRows). Backward: the dispatch's own, the row gradients summed back
    to their tokens (hybrid_ep's combine)."""

    @staticmethod
    def forward(ctx, x_TH, rows_RH, scales_RB, call, as_rows):
        ctx.buffer, ctx.handle = call
        return as_rows(rows_RH, scales_RB, x_TH.dtype)

    @staticmethod
    def backward(ctx, grad_rows_RH):
        return ctx.buffer.combine(grad_rows_RH.contiguous(), ctx.handle), None, None, None, None


class _CombineFp8Grad(torch.autograd.Function):
    """Forward: hybrid_ep's combine. Backward: the output gradient quantized per token and
    dispatched as fp8 with the same handle, handed to the expert rows as `as_rows` makes them."""

    @staticmethod
    def forward(ctx, rows_RH, call):
        buffer, handle, quantizer, num_sms, as_rows = call
        ctx.buffer, ctx.handle, ctx.quantizer, ctx.as_rows = buffer, handle, quantizer, as_rows
        ctx.dtype = rows_RH.dtype
        return buffer.combine(rows_RH, handle, num_sms=num_sms)

    @staticmethod
    def backward(ctx, grad_y_TH):
        q_TH, scales_TB = ctx.quantizer(grad_y_TH.contiguous())
        res = ctx.buffer.dispatch(q_TH, scales=scales_TB, handle=ctx.handle)
        return ctx.as_rows(res.tokens, res.scales, ctx.dtype), None


def send(buffer, x_TH, quantizer, *, num_out_tokens=None, num_sms=None, **routing):
    """hybrid_ep.dispatch of x's rows quantized by `quantizer`: the result as received
    (result.tokens / result.scales the fp8 rows and scales; the routing weights keep their
    gradients through result.probs, hybrid_ep's autograd). `received_rows` hands them on."""
    q_TH, scales_TB = quantizer(x_TH.detach())
    return hep.dispatch(buffer, q_TH, scales=scales_TB, num_out_tokens=num_out_tokens, num_sms=num_sms, **routing)


def received_rows(buffer, x_TH, res, as_rows=dequantized):
    """The rows of `send`'s result as the experts take them, differentiable towards x."""
    if torch.is_grad_enabled() and x_TH.requires_grad:
        return _ReceivedRows.apply(x_TH, res.tokens, res.scales, (buffer, res.handle), as_rows)
    return as_rows(res.tokens, res.scales, x_TH.dtype)


def dispatch(buffer, x_TH, quantizer, *, num_out_tokens=None, num_sms=None, **routing):
    """hybrid_ep.dispatch with the rows sent as fp8: (result, rows [R, H] dequantized to x's dtype)."""
    res = send(buffer, x_TH, quantizer, num_out_tokens=num_out_tokens, num_sms=num_sms, **routing)
    return res, received_rows(buffer, x_TH, res)


def combine(buffer, rows_RH, handle, quantizer, *, num_sms=None, as_rows=dequantized):
    """hybrid_ep.combine (apply_probs off) whose backward sends the output gradient as fp8."""
    if torch.is_grad_enabled() and rows_RH.requires_grad:
        return _CombineFp8Grad.apply(rows_RH, (buffer, handle, quantizer, num_sms, as_rows))
    return buffer.combine(rows_RH, handle, num_sms=num_sms)


class _QuantizeRows(torch.autograd.Function):
    """Forward: rows quantized and dequantized; backward: the gradient as it is."""

    @staticmethod
    def forward(ctx, rows_RH, quantizer):
        return dequantize_rows(*quantizer(rows_RH.contiguous()), rows_RH.dtype)

    @staticmethod
    def backward(ctx, grad_RH):
        return grad_RH, None


class _QuantizeGrad(torch.autograd.Function):
    """Forward: the rows as they are; backward: their gradient quantized and dequantized."""

    @staticmethod
    def forward(ctx, rows_RH, quantizer):
        ctx.quantizer = quantizer
        return rows_RH.clone()

    @staticmethod
    def backward(ctx, grad_RH):
        return dequantize_rows(*ctx.quantizer(grad_RH.contiguous()), grad_RH.dtype), None


def quantize_expert_rows(experts, quantizer) -> None:
    """Make a Megatron experts module quantize its input rows and its output's gradient with
    `quantizer`, dequantized: what fp8 on the wire does to them, for a dispatcher that sends
    its rows unquantized (the reference the fp8 dispatcher is compared with)."""

    def quantize_input(module, args):
        return (_QuantizeRows.apply(args[0], quantizer), *args[1:])

    def quantize_output_grad(module, args, output):
        return (_QuantizeGrad.apply(output[0], quantizer), *output[1:])

    experts.register_forward_pre_hook(quantize_input)
    experts.register_forward_hook(quantize_output_grad)
