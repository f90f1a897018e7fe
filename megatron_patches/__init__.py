"""Megatron-Core integration of hybrid-ep: the flex dispatcher's backend, flags, launcher, grouped-GEMM fix.

    import megatron_patches
    megatron_patches.apply()     # then moe_token_dispatcher_type="hybrid_ep" works

Importable without Megatron installed; `apply()` and the dispatcher need megatron-core.
Every Megatron function apply() replaces, and why no extension point serves, is listed once in
`patches.PATCHES` (docs/megatron.md#patches is its table). The --hybrid-ep-* flags reach
Megatron-LM's parser through its extension point, `extra_args_provider` (the launcher
`python -m megatron_patches.pretrain_gpt` passes it; scripts of their own pass it themselves).
The CPU stand-ins of `local.cpu_compat` are installed only when asked for
(`apply(cpu_compat=True)` or HYBRID_EP_CPU_COMPAT=1: the local demo, trainer and tests).
"""

from __future__ import annotations

from .options import HybridEPOptions, extra_args_provider

_applied = None


def apply(*, cpu_compat: bool | None = None) -> dict:
    """Patch Megatron once (idempotent); returns what each installer of patches.PATCHES did.

    cpu_compat: also install `local.cpu_compat`'s CPU stand-ins (they act only where no GPU
    is visible). None: as HYBRID_EP_CPU_COMPAT says (1 on, 0 or unset off).
    """
    global _applied
    from . import patches, versions
    from .local import cpu_compat as compat

    versions.check_megatron_core()  # older releases fail in obscure places: refuse them by name
    if compat.requested(cpu_compat):
        compat.enable()
    if _applied is None:
        patches.warn_on_drift()
        _applied = patches.install()
    return dict(_applied, cpu_compat=compat.enabled())


def __getattr__(name):
    # Lazy: the manager module imports Megatron-Core.
    if name == "HybridEPManager":
        from .manager import HybridEPManager

        return HybridEPManager
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HybridEPManager", "HybridEPOptions", "apply", "extra_args_provider"]
