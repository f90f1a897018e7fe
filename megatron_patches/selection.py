"""Make `moe_token_dispatcher_type="hybrid_ep"` select HybridEPTokenDispatcher.

MoELayer.__init__ picks its dispatcher with a fixed if/elif on the type string and raises
for any other value. The patch wraps __init__: for "hybrid_ep" only, it runs the original
constructor with the type shown as "alltoall" and Megatron's alltoall class name bound to
HybridEPTokenDispatcher (both restored right after, whatever happens), so everything else
MoELayer builds (router, experts, shared experts) is untouched, except that with the expert
balancer on, the experts are built as S / EP slots (megatron_patches.balancer). Other types call the
original constructor directly. For every type the experts are drawn from generators of their
own per (layer, EP rank) (megatron_patches.expert_init), so the slot count does not change the
initial model. Patching twice is a no-op.

Megatron's TransformerConfig validation refuses dispatcher types it does not know for
`overlap_moe_expert_parallel_comm` and `moe_shared_expert_overlap`, and
`moe_expert_rank_capacity_factor` outside its flex dispatcher. `patch_config_validation`
runs the same validation for "hybrid_ep" with the type shown as "alltoall" and the rank
capacity factor hidden (both restored right after), so every other check still applies.
Megatron options hybrid_ep refuses on the config alone (`dispatcher.config_unsupported_reasons`)
are refused there, before Megatron's own checks, and again when MoELayer is built (a field set
after validation).

Both are listed, with the reasons, in megatron_patches/patches.py.
"""

from __future__ import annotations

import contextlib
import functools

from . import options
from .dispatcher import DISPATCHER_TYPE, HybridEPTokenDispatcher, config_unsupported_reasons, refuse

_MARK = "_hybrid_ep_patched"


@contextlib.contextmanager
def _alltoall_slot_holds_hybrid_ep(moe_layer_module, config):
    saved_cls = moe_layer_module.MoEAlltoAllTokenDispatcher
    saved_type = config.moe_token_dispatcher_type
    moe_layer_module.MoEAlltoAllTokenDispatcher = HybridEPTokenDispatcher
    config.moe_token_dispatcher_type = "alltoall"
    try:
        yield
    finally:
        moe_layer_module.MoEAlltoAllTokenDispatcher = saved_cls
        config.moe_token_dispatcher_type = saved_type


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
        if getattr(config, "moe_token_dispatcher_type", None) != DISPATCHER_TYPE:
            original(self, config, *args, **kwargs)
            balancer.guard_unbalanced_layer(self)
            return
        refuse(config_unsupported_reasons(config))
        opts = options.options_for(config)
        if opts.balancer_enabled:
            ep_size = _ep_size(kwargs.get("pg_collection"))
            P = balancer.slots_per_rank(opts, config.num_moe_experts, ep_size)
            args, kwargs = balancer.slot_experts_kwargs(args, kwargs, P)
        with _alltoall_slot_holds_hybrid_ep(moe_layer, config):
            original(self, config, *args, **kwargs)
        if not isinstance(self.token_dispatcher, HybridEPTokenDispatcher):
            raise RuntimeError(
                "this Megatron-Core version builds its token dispatcher in a way the hybrid_ep "
                "patch does not recognise; see docs/megatron.md for supported versions"
            )
        self.token_dispatcher.set_experts(self.experts)
        if opts.balancer_enabled:
            balancer.finish_moe_layer(self)
        else:
            balancer.guard_unbalanced_layer(self)

    setattr(__init__, _MARK, True)
    moe_layer.MoELayer.__init__ = __init__
    return True


# Fields that TransformerConfig.__post_init__ judges by Megatron's own dispatchers; for
# hybrid_ep they are shown as these values during validation and restored after.
_VALIDATED_AS = {"moe_token_dispatcher_type": "alltoall", "moe_expert_rank_capacity_factor": None}


def patch_config_validation() -> bool:
    """Make TransformerConfig validation accept "hybrid_ep"; False if already patched."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    original = TransformerConfig.__post_init__
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def __post_init__(self):
        if getattr(self, "moe_token_dispatcher_type", None) != DISPATCHER_TYPE:
            return original(self)
        refuse(config_unsupported_reasons(self))
        saved = {name: getattr(self, name) for name in _VALIDATED_AS}
        for name, shown in _VALIDATED_AS.items():
            setattr(self, name, shown)
        try:
            return original(self)
        finally:
            for name, value in saved.items():
                setattr(self, name, value)

    setattr(__post_init__, _MARK, True)
    TransformerConfig.__post_init__ = __post_init__
    return True


def _ep_size(pg_collection) -> int:
    if pg_collection is not None and getattr(pg_collection, "ep", None) is not None:
        return pg_collection.ep.size()
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_world_size()
