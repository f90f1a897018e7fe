"""Megatron-Core integration of hybrid-ep: token dispatcher, flag, launcher, grouped-GEMM fix.

    import megatron_patches
    megatron_patches.apply()     # then moe_token_dispatcher_type="hybrid_ep" works

Importable without Megatron installed; `apply()` and the dispatcher need megatron-core.
What apply() changes (docs/megatron.md): MoELayer selects HybridEPTokenDispatcher for the
type "hybrid_ep" (other types untouched) and tells it which experts it built; every MoE
layer draws its experts from generators of its own per (layer, EP rank), so spare balancer
slots do not change the initial model (`expert_init`);
TransformerConfig validation accepts "hybrid_ep" wherever it accepts alltoall/flex
(`overlap_moe_expert_parallel_comm`, `moe_shared_expert_overlap`,
`moe_expert_rank_capacity_factor`); the EP-overlap schedule frees node inputs for hybrid_ep
as for Megatron's hybridep backend; TEGroupedMLP skips its quantization padding when
hybrid_ep already aligned the rows; Megatron-LM's argument parser (when installed)
accepts `--moe-token-dispatcher-type hybrid_ep` and the --hybrid-ep-* knobs; the
grouped-GEMM zero-token fix is installed when present; Megatron-LM's
setup_model_and_optimizer attaches the expert balancer when --hybrid-ep-balancer-interval is
set; on a machine without a GPU the CPU stand-ins of `local.cpu_compat` are enabled (never on
a GPU machine).
"""

from __future__ import annotations

import importlib

from .options import HybridEPOptions

_applied = None


def _install_grouped_gemm_fix() -> bool:
    try:
        module = importlib.import_module(f"{__name__}.grouped_gemm")
    except ModuleNotFoundError as err:
        if err.name != f"{__name__}.grouped_gemm":
            raise
        return False
    module.install()
    return True


def _install_balancer_hook() -> bool:
    from . import balancer

    return balancer.install_training_hook()


def apply(*, cpu_fallback: bool = True) -> dict:
    """Patch Megatron once (idempotent); returns what is active.

    cpu_fallback: enable `local.cpu_compat` when no GPU is visible (it never acts on a GPU).
    """
    global _applied
    from . import expert_init, expert_rows, overlap, selection, versions
    from .local import cpu_compat

    versions.check_megatron_core()  # older releases fail in obscure places: refuse them by name
    if cpu_fallback:
        cpu_compat.enable()
    if _applied is None:
        selection.patch_moe_layer()
        selection.patch_config_validation()
        expert_init.install_layer_context()
        _applied = {
            "moe_layer": True,
            "config_validation": True,
            "expert_padding": expert_rows.install(),
            "ep_overlap_schedule": overlap.install(),
            "arguments": selection.patch_megatron_arguments(),
            "grouped_gemm": _install_grouped_gemm_fix(),
            "balancer_hook": _install_balancer_hook(),
        }
    return dict(_applied, cpu_compat=cpu_compat.enabled())


def __getattr__(name):
    # Lazy: the dispatcher module imports Megatron-Core.
    if name == "HybridEPTokenDispatcher":
        from .dispatcher import HybridEPTokenDispatcher

        return HybridEPTokenDispatcher
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HybridEPOptions", "HybridEPTokenDispatcher", "apply"]
