"""The received MXFP8 rows handed to Transformer Engine's grouped GEMM as they came off the wire.

Transformer Engine's op fuser (`te.ops.GroupedLinear` and its fused grouped MLP; Megatron's
`--use-transformer-engine-op-fuser`, where `TEGroupedMLP._with_fused_impl` is set) takes, from
TE 2.19 on, a rowwise-only MXFP8 `GroupedTensor` with compact (unswizzled) E8M0 scales as fc1's
input and as fc2's output gradient, when the layer runs under TE's fp8 autocast with an MXFP8
recipe: the GEMM reads the rowwise data as it is, and `tex.group_requantize_inplace` builds what
else the GEMMs need (the columnwise copy for the weight gradient, 32 tokens per scale, and the
swizzled scales). That is the form a dispatch receives: e4m3 rows [R, H] and one E8M0 byte per
32 values [R, H/32], row-major. TE pads an MXFP8 tensor's scales to tiles of 128 rows x 4
scales; with every expert's rows a multiple of 128 (the op fuser's groups are 256 rows) and H a
multiple of 128 no tile is padded, so the received scales are TE's compact layout byte for
byte, and the GroupedTensor below is a view of the received buffers: nothing is copied.

What TE's requantize costs, R rows of H, per TE version (read in TE's cast.cpp):

- TE 2.19 (release_v2.19): three kernels, `group_dequantize` writes a bf16 copy of the rows
  (2 R x H bytes), `group_quantize` reads it back to write the columnwise copy, and the
  rowwise scales are swizzled; against dequantizing here it saves the bf16 rows' rowwise
  quantization only.
- TE main (2.20.dev, from commit 8d9325f): one kernel on compute capability 10.x with bf16
  compute, the dequantized values only in shared memory: it reads R x H fp8 values and
  R x H / 32 scales and writes the columnwise copy and the swizzled scales; no bf16 copy.

Everywhere else the experts get the rows dequantized (`megatron_patches.wire_fp8`), and never
a GroupedTensor where TE or Megatron would refuse it: `handoff_reason` decides from the config
and the experts when the dispatcher is built (the op fuser, the recipe, TE's path predicate,
and the Megatron options that pass the experts' input through an identity autograd Function,
whose `view_as` a GroupedTensor refuses); `run_time_reason` decides per dispatch from TE's fp8
autocast state, since Megatron runs some layers of an fp8 run without it
(`--first-last-layers-bf16`), where TE's GroupedLinear reshapes its input. Each fallback is
logged once (`hybrid_ep.logs`); docs/megatron.md has the byte counts.

Legend: R received rows, H hidden, E local experts (groups), M = H / 32 scales per row.
"""

from __future__ import annotations

import dataclasses
import logging
import types

import torch

from hybrid_ep.fp8 import FP8_DTYPE, MX_BLOCK
from hybrid_ep.logs import log_once

from . import wire_fp8

# Rows per group TE's grouped requantize needs (each group's scales start on a 128-row tile).
GROUP_ROWS = 128
# The first TE version whose requantize is one kernel without a bf16 copy (commit 8d9325f, TE main).
FUSED_REQUANTIZE_VERSION = (2, 20)

_log = logging.getLogger(__name__)


def te_api():
    """What the hand-off uses of Transformer Engine, or None where TE is too old or absent:
    GroupedTensor, the MXFP8 quantizer, the e4m3 DType, the MXFP8 recipe, the op fuser's
    predicate of which recipes its graph-safe grouped path (the one taking a GroupedTensor)
    runs, the fp8 autocast state, and TE's version."""
    try:
        import transformer_engine
        import transformer_engine_torch as tex
        from transformer_engine.common.recipe import MXFP8BlockScaling
        from transformer_engine.pytorch.ops.basic.grouped_linear import is_op_fuser_grouped_tensor_path_supported
        from transformer_engine.pytorch.quantization import FP8GlobalStateManager
        from transformer_engine.pytorch.tensor import GroupedTensor
        from transformer_engine.pytorch.tensor.mxfp8_tensor import MXFP8Quantizer
    except ImportError:
        return None
    if not hasattr(tex, "group_requantize_inplace"):
        return None
    return types.SimpleNamespace(GroupedTensor=GroupedTensor, MXFP8Quantizer=MXFP8Quantizer,
                                 e4m3=tex.DType.kFloat8E4M3, recipe=MXFP8BlockScaling(),
                                 path_supported=is_op_fuser_grouped_tensor_path_supported,
                                 fp8_enabled=FP8GlobalStateManager.is_fp8_enabled,
                                 fp8_recipe=FP8GlobalStateManager.get_fp8_recipe,
                                 version=str(getattr(transformer_engine, "__version__", "0")))


def _recipe(config) -> str:
    recipe = getattr(config, "fp8_recipe", None)
    return str(getattr(recipe, "value", recipe))


def _offloads_fused_mlp(experts, config) -> bool:
    return bool(getattr(experts, "offload_fused_group_mlp", False)
                or (getattr(config, "fine_grained_activation_offloading", False)
                    and "fused_group_mlp" in (getattr(config, "offload_modules", None) or ())))


def handoff_reason(experts, config, pad_multiple: int, api) -> str | None:
    """None where the experts' grouped GEMM can take the received fp8 rows as they are (in a
    layer under TE's MXFP8 autocast: `run_time_reason`), else why they get them dequantized.
    api: te_api() (None: no TE that takes them; tests pass a stand-in)."""
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
    if getattr(config, "overlap_dispatch_backward_with_experts_wgrad", False):
        return ("--overlap-dispatch-backward-with-experts-wgrad: Megatron passes the experts' input through an "
                "identity autograd Function (_RecordExpertDgradCompletion), whose view_as a GroupedTensor refuses")
    if _offloads_fused_mlp(experts, config):
        return ("fine-grained activation offloading of fused_group_mlp: Megatron's offload start (an identity "
                "autograd Function) views the experts' input, which a GroupedTensor refuses")
    if getattr(config, "moe_paged_stash", False):
        return ("--moe-paged-stash: Megatron's stash passes the experts' input through an identity autograd "
                "Function (PipelinePreScheduleFunction), whose view_as a GroupedTensor refuses")
    if pad_multiple % GROUP_ROWS:
        return (f"rows per expert are a multiple of {pad_multiple}, not of the {GROUP_ROWS} TE's grouped "
                "requantize needs")
    if api is None:
        return "Transformer Engine without GroupedTensor input to its grouped GEMM (TE 2.19 or newer has it)"
    dtype = getattr(config, "params_dtype", torch.bfloat16)
    if not api.path_supported(api.recipe, dtype):
        return (f"Transformer Engine's graph-safe grouped GEMM does not take MXFP8 here (is_op_fuser_grouped_tensor_"
                f"path_supported: compute capability 10.x-11.0 with bf16 or fp16 compute and cuBLASLt 13.3 or newer; "
                f"compute dtype {dtype})")
    return None


def run_time_reason(api) -> str | None:
    """At a dispatch whose config passed handoff_reason: None where this layer runs under TE's fp8
    autocast with an MXFP8 recipe, else why its experts get the rows dequantized."""
    if not api.fp8_enabled():
        return ("this layer runs without Transformer Engine's fp8 autocast (a bf16 layer of an fp8 run, as "
                "--first-last-layers-bf16 makes): TE's GroupedLinear then reshapes its input, which a "
                "GroupedTensor refuses")
    recipe = api.fp8_recipe()
    if not recipe.mxfp8():
        return (f"this layer's fp8 autocast runs {type(recipe).__name__}: Transformer Engine requantizes a "
                "pre-quantized grouped input for MXFP8 only")
    return None


@dataclasses.dataclass(frozen=True)
class GroupedRows:
    """Wraps received MXFP8 rows and their E8M0 scales as TE's GroupedTensor of E groups.

    splits_E: rows per local expert, on the rows' device (a host tensor is copied there without
    blocking; nothing is read back, so a CUDA graph can capture it)."""

    splits_E: torch.Tensor
    api: object

    def __call__(self, rows_RH: torch.Tensor, scales_RM: torch.Tensor, dtype: torch.dtype):
        R, H = rows_RH.shape
        if rows_RH.dtype != FP8_DTYPE or scales_RM.shape != (R, H // MX_BLOCK) or scales_RM.element_size() != 1:
            raise ValueError(f"GroupedRows takes e4m3 rows [R, H] and E8M0 scales [R, H/{MX_BLOCK}], got "
                             f"{rows_RH.dtype} {list(rows_RH.shape)} and {scales_RM.dtype} {list(scales_RM.shape)}")
        if R % GROUP_ROWS or H % GROUP_ROWS:
            raise ValueError(f"GroupedRows needs rows and hidden size in multiples of {GROUP_ROWS}, got [{R}, {H}]")
        first_dims = self.splits_E.to(device=rows_RH.device, dtype=torch.int64, non_blocking=True)
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


def rows_as(static_reason: str | None, api, splits_E: torch.Tensor):
    """How one dispatch's experts take its received fp8 rows (split as splits_E per local expert,
    on the rows' device): GroupedRows where static_reason (handoff_reason's) is None and this
    layer runs under TE's MXFP8 autocast, else `wire_fp8.dequantized`, the reason logged once."""
    if static_reason is not None:
        return wire_fp8.dequantized
    reason = run_time_reason(api)
    if reason is None:
        return GroupedRows(splits_E, api)
    log_once(_log, logging.INFO, f"hybrid_ep dispatcher: fp8 rows reach some layer's experts dequantized: {reason}")
    return wire_fp8.dequantized


def requantize_cost(api) -> str:
    """What TE's requantize of the handed-on rows costs at the installed TE (module docstring)."""
    release = tuple(int(p) for p in api.version.split(".")[:2] if p.isdigit())
    if release >= FUSED_REQUANTIZE_VERSION:
        return f"Transformer Engine {api.version} requantizes them in one kernel, without a bf16 copy"
    return (f"Transformer Engine {api.version} requantizes them through a bf16 copy (2 bytes per value; one kernel "
            f"without it from TE {'.'.join(map(str, FUSED_REQUANTIZE_VERSION))} on)")


def announcement(reason: str | None, api=None) -> str:
    """The startup line saying how the experts take fp8 rows."""
    if reason is not None:
        how = f"dequantized: {reason}"
    else:
        how = ("as Transformer Engine's MXFP8 GroupedTensor in layers under TE's MXFP8 autocast, not dequantized"
               + (f" ({requantize_cost(api)})" if api is not None else ""))
    return f"hybrid_ep dispatcher: fp8 rows reach the experts {how}"


def announce(reason: str | None, api=None) -> None:
    """Log announcement(reason) once per process (every MoE layer decides alike)."""
    log_once(_log, logging.INFO, announcement(reason, api))
