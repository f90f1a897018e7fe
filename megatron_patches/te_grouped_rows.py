"""The received MXFP8 rows handed to Transformer Engine's grouped GEMM as they came off the wire.

Transformer Engine's op fuser (`te.ops.GroupedLinear` and its fused grouped MLP; Megatron's
`--use-transformer-engine-op-fuser`, where `TEGroupedMLP._with_fused_impl` is set) takes, from
TE 2.19 on, a rowwise-only MXFP8 `GroupedTensor` with compact (unswizzled) E8M0 scales as fc1's
input and as fc2's output gradient: the GEMM reads the rowwise data as it is, and
`tex.group_requantize_inplace` builds only what else the GEMMs need (the columnwise copy for the
weight gradient, 32 tokens per scale, and the swizzled scales) without a bf16 copy of the rows.
That is the form a dispatch receives: e4m3 rows [R, H] and one E8M0 byte per 32 values
[R, H/32], row-major. TE pads an MXFP8 tensor's scales to tiles of 128 rows x 4 scales; with
every expert's rows a multiple of 128 (the op fuser's groups are 256 rows) and H a multiple of
128 no tile is padded, so the received scales are TE's compact layout byte for byte, and the
GroupedTensor below is a view of the received buffers: nothing is copied.

Everywhere else the experts get the rows dequantized (`megatron_patches.wire_fp8`);
`handoff_reason` says why, and what that costs is in docs/megatron.md.

Legend: R received rows, H hidden, E local experts (groups), M = H / 32 scales per row.
"""

from __future__ import annotations

import dataclasses
import logging
import types

import torch

from hybrid_ep.fp8 import FP8_DTYPE, MX_BLOCK
from hybrid_ep.logs import log_once

# Rows per group TE's grouped requantize needs (each group's scales start on a 128-row tile).
GROUP_ROWS = 128

_log = logging.getLogger(__name__)


def te_api():
    """What the hand-off uses of Transformer Engine, or None where TE is too old or absent:
    GroupedTensor, the MXFP8 quantizer, the e4m3 DType, the MXFP8 recipe and the op fuser's
    predicate of which recipes its graph-safe grouped path (the one taking a GroupedTensor) runs."""
    try:
        import transformer_engine_torch as tex
        from transformer_engine.common.recipe import MXFP8BlockScaling
        from transformer_engine.pytorch.ops.basic.grouped_linear import is_op_fuser_grouped_tensor_path_supported
        from transformer_engine.pytorch.tensor import GroupedTensor
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    except ImportError:
        return None
    if not hasattr(tex, "group_requantize_inplace"):
        return None
    return types.SimpleNamespace(GroupedTensor=GroupedTensor, MXFP8Quantizer=MXFP8Quantizer,
                                 e4m3=tex.DType.kFloat8E4M3, recipe=MXFP8BlockScaling(),
                                 path_supported=is_op_fuser_grouped_tensor_path_supported,
                                 capability=torch.cuda.get_device_capability)


def _recipe(config) -> str:
    recipe = getattr(config, "fp8_recipe", None)
    return str(getattr(recipe, "value", recipe))


def handoff_reason(experts, config, pad_multiple: int, device: torch.device | None, api) -> str | None:
    """None where the experts' grouped GEMM takes the received fp8 rows as they are, else why
    they get them dequantized. api: te_api() (None: no TE that takes them; tests pass a stand-in)."""
    if _recipe(config) != "mxfp8":
        return ("--fp8-recipe blockwise: Transformer Engine requantizes a pre-quantized grouped input for "
                "MXFP8 only (its weight gradient needs blocks of 128 tokens, which rows quantized along "
                "the hidden dimension cannot supply)")
    if not getattr(config, "use_transformer_engine_op_fuser", False):
        return ("Transformer Engine's GroupedLinear module quantizes a plain input itself; "
                "--use-transformer-engine-op-fuser runs the experts on TE's op fuser, which takes quantized rows")
    if experts is None:
        return "experts not built yet"
    if not getattr(experts, "_with_fused_impl", False):
        return (f"{type(experts).__name__} does not run on Transformer Engine's op fuser "
                "(Megatron's _is_fused_impl_supported said no)")
    if getattr(config, "overlap_moe_expert_parallel_comm", False):
        return ("the EP-overlap schedule detaches the experts' input as a plain tensor and frees its storage "
                "after fc1; a GroupedTensor owns none")
    if pad_multiple % GROUP_ROWS:
        return (f"rows per expert are a multiple of {pad_multiple}, not of the {GROUP_ROWS} TE's grouped "
                "requantize needs")
    if api is None:
        return "Transformer Engine without GroupedTensor input to its grouped GEMM (TE 2.19 or newer has it)"
    if device is None or device.type != "cuda":
        return "rows not on a GPU"
    if not api.path_supported(api.recipe, getattr(config, "params_dtype", torch.bfloat16)):
        major, minor = api.capability(device)
        return (f"Transformer Engine's graph-safe grouped GEMM takes MXFP8 on compute capability 10.x-11.0 only "
                f"(this GPU: {major}.{minor}, or cuBLASLt too old)")
    return None


@dataclasses.dataclass(frozen=True)
class GroupedRows:
    """Wraps received MXFP8 rows and their E8M0 scales as TE's GroupedTensor of E groups."""

    splits_E: torch.Tensor  # rows per local expert (a host or device tensor)
    api: object

    def __call__(self, rows_RH: torch.Tensor, scales_RM: torch.Tensor, dtype: torch.dtype):
        R, H = rows_RH.shape
        if rows_RH.dtype != FP8_DTYPE or scales_RM.shape != (R, H // MX_BLOCK) or scales_RM.element_size() != 1:
            raise ValueError(f"GroupedRows takes e4m3 rows [R, H] and E8M0 scales [R, H/{MX_BLOCK}], got "
                             f"{rows_RH.dtype} {list(rows_RH.shape)} and {scales_RM.dtype} {list(scales_RM.shape)}")
        if R % GROUP_ROWS or H % GROUP_ROWS:
            raise ValueError(f"GroupedRows needs rows and hidden size in multiples of {GROUP_ROWS}, got [{R}, {H}]")
        first_dims = self.splits_E.to(device=rows_RH.device, dtype=torch.int64)
        offsets = torch.zeros(first_dims.numel() + 1, dtype=torch.int64, device=rows_RH.device)
        torch.cumsum(first_dims * H, dim=0, out=offsets[1:])
        quantizer = self.api.MXFP8Quantizer(self.api.e4m3, rowwise=True, columnwise=False)
        quantizer.optimize_for_gemm = False  # compact scales: what TE's requantize starts from
        return self.api.GroupedTensor(
            shape=(R, H), dtype=dtype, num_tensors=first_dims.numel(), quantizer=quantizer,
            data=rows_RH.view(torch.uint8).reshape(-1), columnwise_data=None,
            scale_inv=scales_RM.view(torch.uint8).reshape(-1), columnwise_scale_inv=None,
            amax=None, columnwise_amax=None, scale=None,
            first_dims=first_dims, last_dims=None, tensor_offsets=offsets,
            with_gemm_swizzled_scales=False,
        )


def announcement(reason: str | None) -> str:
    """The startup line saying how the experts take fp8 rows."""
    how = ("as Transformer Engine's MXFP8 GroupedTensor, not dequantized" if reason is None
           else f"dequantized: {reason}")
    return f"hybrid_ep dispatcher: fp8 rows reach the experts {how}"


def announce(reason: str | None) -> None:
    """Log announcement(reason) once per process (every MoE layer decides alike)."""
    log_once(_log, logging.INFO, announcement(reason))
