"""Rows the hybrid_ep dispatcher adds per local expert: only what the built experts need.

hybrid_ep can pad each local expert's block of rows with zero rows of routing weight 0
(a multiple of `pad_multiple`, at least `min_rows_per_expert`); the experts then see the
padded counts as `tokens_per_expert`. Padding is therefore added only where the expert
module actually built needs it, so that in every other case Megatron's contracts hold
unchanged (tokens_per_expert <= capacity x EP x TP, and the router's load statistics and
aux-loss inputs, which come from the routing map, see only real tokens):

| experts built | precision | rows added per local expert |
| --- | --- | --- |
| SequentialMLP | any | none (one GEMM per expert; it pads fp8/fp4 rows per expert itself) |
| TEGroupedMLP | fp32 / bf16 / fp16 | none (no alignment needed; empty groups: the grouped-GEMM fix) |
| TEGroupedMLP | fp8 / mxfp8 / fp4 | to the quantization alignment (16 / 32 / 128) [1] |
| TEGroupedMLP on Transformer Engine's op fuser | any | 256, the op fuser's group alignment [1] |
| TEGroupedMLP on TorchGroupedLinear | any | none (torch._grouped_mm aligns inside `grouped_mm`) |

[1] the module's own padding copy is then skipped: Megatron's `skip_routed_expert_padding`
says so for the flex dispatcher's `hybridep` backend, which hybrid_ep runs as.

`--hybrid-ep-pad-multiple` (user padding) and drop-and-pad (`moe_pad_expert_input_to_capacity`)
come on top; see docs/megatron.md for what Megatron receives in each case.
"""

from __future__ import annotations


def quantized(config) -> bool:
    return bool(getattr(config, "fp8", None) or getattr(config, "fp4", None))


def quantization_alignment(config) -> int:
    """Rows per group the quantized GEMMs of `config` need (1 when not quantizing): Megatron's
    get_align_size_for_quantization (16 fp8, 32 mxfp8, 128 fp4 in Megatron-Core 0.19, 256 with TE's op fuser)."""
    if not quantized(config):
        return 1
    from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

    return int(get_align_size_for_quantization(config))


def _is_torch_grouped(experts) -> bool:
    from .grouped_gemm import TorchGroupedLinear

    return isinstance(getattr(experts, "linear_fc1", None), TorchGroupedLinear)


def pad_multiple_for(experts, config) -> tuple[int, str]:
    """(pad_multiple, why) for the experts module built by MoELayer (None: not built yet,
    decided from the config as the module Megatron would build)."""
    from megatron.core.transformer.moe import experts as experts_module

    te_grouped = getattr(experts_module, "TEGroupedMLP", ())
    if experts is None:
        grouped = bool(getattr(config, "moe_grouped_gemm", False))
        if grouped and quantized(config):
            return quantization_alignment(config), "grouped experts (from the config), quantized GEMMs"
        return 1, "no padding needed (from the config)"
    if isinstance(experts, getattr(experts_module, "SequentialMLP", ())):
        return 1, "SequentialMLP: one GEMM per expert, pads quantized rows itself"
    if isinstance(experts, te_grouped) and not _is_torch_grouped(experts):
        if getattr(experts, "_with_fused_impl", False):
            from megatron.core.transformer.moe.moe_utils import get_align_size_for_quantization

            return int(get_align_size_for_quantization(config)), "TEGroupedMLP on Transformer Engine's op fuser"
        if quantized(config):
            return quantization_alignment(config), "TEGroupedMLP with quantized GEMMs"
        return 1, "TEGroupedMLP in fp32/bf16/fp16: no row alignment needed"
    return 1, f"{type(experts).__name__}: no padding needed"
