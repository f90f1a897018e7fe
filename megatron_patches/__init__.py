"""Megatron-Core integration of hybrid-ep (token dispatcher, flag, launcher, grouped-GEMM fix).

Importable without Megatron installed. The dispatcher and the rest arrive with the Megatron
integration; until then `apply()` says so instead of pretending to patch anything.
"""


def apply() -> None:
    raise NotImplementedError(
        "megatron_patches.apply(): the hybrid_ep token dispatcher for Megatron-Core is not part "
        "of this release yet; use hybrid_ep.HybridEPBuffer directly"
    )
