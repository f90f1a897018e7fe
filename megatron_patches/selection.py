"""Make `moe_token_dispatcher_type="hybrid_ep"` run hybrid_ep as the flex dispatcher's backend.

Megatron-Core drives its EP communication backends (DeepEP, DeepEP's HybridEP, NCCL-EP)
through `MoEFlexTokenDispatcher` and a `_DispatchManager`, and answers for the flex type with
the `hybridep` backend wherever a dispatcher changes something outside itself: config
validation, the EP-overlap schedule (which inputs it frees, which probs it detaches), the
experts' padding and the zero-copy output buffer. So a layer of the user's `hybrid_ep` is
built as Megatron's `flex` with backend `hybridep`, and Megatron's own code takes it from
there. Two patches remain, for what has no extension point:

- `patch_config_validation`: TransformerConfig validates `hybrid_ep` as `flex` with backend
  `hybridep` and `moe_expert_rank_capacity_factor` hidden (Megatron asks for Transformer
  Engine's op fuser with it, which hybrid_ep does not need), all restored right after, so the
  parsed config still says `hybrid_ep`; options hybrid_ep refuses on the config alone
  (`manager.config_unsupported_reasons`) are refused first, and again when MoELayer is built
  (a field set after validation).
- `patch_moe_layer`: MoELayer.__init__ of a `hybrid_ep` config turns the config into `flex` for
  good (`moe_flex_dispatcher_backend` is `HYBRID_EP_BACKEND`, a str equal to "hybridep" wherever
  Megatron compares it, whose type tells it apart from a user's own choice of DeepEP's HybridEP
  and survives copy, deepcopy and dataclasses.replace of the config), and runs the original with
  the token_dispatcher module's `_HybridEPManager` bound to `HybridEPManager` (the flex
  dispatcher builds its backend by that name, with no registry; restored right after,
  whatever happens); the manager then gets the experts built (`HybridEPManager.attach`). For
  every dispatcher type the experts are built under generators of their own per (layer, EP
  rank) (megatron_patches.expert_init) and, with the expert balancer, as S / EP slots
  (megatron_patches.balancer).

Patching twice is a no-op. Both patches are listed, with the reasons, in
megatron_patches/patches.py.
"""

from __future__ import annotations

import contextlib
import functools

from . import options
from .manager import DISPATCHER_TYPE, HybridEPManager, config_unsupported_reasons, refuse

_MARK = "_hybrid_ep_patched"


class HybridEPBackendName(str):
    """Megatron's flex backend name "hybridep", as hybrid_ep's rather than DeepEP's."""


HYBRID_EP_BACKEND = HybridEPBackendName("hybridep")


def selected(config) -> bool:
    """Whether `config` runs hybrid_ep: asked for as `hybrid_ep`, or already turned into the flex
    dispatcher with hybrid_ep's backend."""
    return getattr(config, "moe_token_dispatcher_type", None) == DISPATCHER_TYPE or (
        getattr(config, "moe_token_dispatcher_type", None) == "flex"
        and isinstance(getattr(config, "moe_flex_dispatcher_backend", None), HybridEPBackendName))


def _as_flex(config) -> None:
    """`hybrid_ep` -> Megatron's `flex` with hybrid_ep's backend (in place)."""
    config.moe_token_dispatcher_type = "flex"
    config.moe_flex_dispatcher_backend = HYBRID_EP_BACKEND


@contextlib.contextmanager
def _hybridep_manager_is_hybrid_eps():
    from megatron.core.transformer.moe import token_dispatcher

    saved = token_dispatcher._HybridEPManager
    token_dispatcher._HybridEPManager = HybridEPManager
    try:
        yield
    finally:
        token_dispatcher._HybridEPManager = saved


def patch_moe_layer() -> bool:
    """Install the MoELayer hook; returns False if it was already installed."""
    from megatron.core.transformer.moe import moe_layer

    original = moe_layer.MoELayer.__init__
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        from . import balancer, expert_init

        # every dispatcher type: runs with and without spare slots, and the comparison runs
        # with Megatron's own dispatchers, start from the same expert weights
        args, kwargs = expert_init.seeded_experts_kwargs(args, kwargs)
        if not selected(config):
            original(self, config, *args, **kwargs)
            balancer.guard_unbalanced_layer(self)
            return
        refuse(config_unsupported_reasons(config))
        _as_flex(config)  # for good: Megatron's schedule, padding and frees read the type at run time
        opts = options.options_for(config)
        if opts.balancer_enabled:
            ep_size = _ep_size(kwargs.get("pg_collection"))
            P = balancer.slots_per_rank(opts, config.num_moe_experts, ep_size)
            args, kwargs = balancer.slot_experts_kwargs(args, kwargs, P)
        with _hybridep_manager_is_hybrid_eps():
            original(self, config, *args, **kwargs)
        manager = getattr(self.token_dispatcher, "_comm_manager", None)
        if not isinstance(manager, HybridEPManager):
            raise RuntimeError(
                "this Megatron-Core version builds its flex dispatcher's hybridep backend in a way the hybrid_ep "
                "patch does not recognise; see docs/megatron.md for supported versions"
            )
        manager.attach(self)
        if opts.balancer_enabled:
            balancer.finish_moe_layer(self)
        else:
            balancer.guard_unbalanced_layer(self)

    setattr(__init__, _MARK, True)
    moe_layer.MoELayer.__init__ = __init__
    return True


def patch_config_validation() -> bool:
    """Make TransformerConfig validation accept "hybrid_ep" (as the flex dispatcher with
    hybrid_ep's backend); False if already patched."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    original = TransformerConfig.__post_init__
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def __post_init__(self):
        if not selected(self):
            return original(self)
        refuse(config_unsupported_reasons(self))
        saved = {name: getattr(self, name) for name in _VALIDATED_AS}
        _as_flex(self)
        self.moe_expert_rank_capacity_factor = None
        try:
            return original(self)
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    setattr(__post_init__, _MARK, True)
    TransformerConfig.__post_init__ = __post_init__
    return True


# The fields validation sees changed for hybrid_ep, restored after it.
_VALIDATED_AS = ("moe_token_dispatcher_type", "moe_flex_dispatcher_backend", "moe_expert_rank_capacity_factor")


def _ep_size(pg_collection) -> int:
    if pg_collection is not None and getattr(pg_collection, "ep", None) is not None:
        return pg_collection.ep.size()
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()
