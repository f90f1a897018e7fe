"""What Megatron's EP-overlap schedule (overlap_moe_expert_parallel_comm) needs for hybrid_ep.

The combined 1F1B schedule splits each MoE layer into nodes (pre_dispatch_computation,
moe_dispatch, mlp, moe_combine) that run the dispatcher's six phases; the dispatcher keeps
its state between phases, as the alltoall dispatcher does, so the phases need nothing new.
What the schedule decides from the dispatcher *type* is which node inputs it may free
right after their forward (`should_free_input` in megatron/core/models/common/utils.py).
For an unknown type it frees the inputs of `moe_dispatch` and `mlp`, which is right for the
alltoall dispatcher (they are copies) but not for hybrid_ep:

- moe_dispatch's input is dispatch_preprocess's output, a view of the pre-MLP layernorm
  output that the router (and the shared experts) saved for backward;
- mlp's input is token_dispatch's output, the rows the experts save for backward
  (dispatch_postprocess hands them on as they are).

So for hybrid_ep the schedule frees what it frees for Megatron's own hybridep (flex)
backend, which has the same data flow: moe_combine's input always, mlp's only when the
experts keep quantized copies (fp8 / fp4), moe_dispatch's never.
"""

from __future__ import annotations

import functools

DISPATCHER_TYPE = "hybrid_ep"
_MARK = "_hybrid_ep_patched"


def hybrid_ep_frees_input(name: str, config) -> bool:
    if name == "moe_combine":
        return True
    if name == "mlp":
        return bool(getattr(config, "fp8", None) or getattr(config, "fp4", None))
    return False


def install() -> bool:
    """Patch the schedule's free-input policy for hybrid_ep (idempotent; False when the
    installed Megatron-Core has no such policy or it is already patched)."""
    try:
        from megatron.core.models.common import utils
    except ImportError:
        return False
    original = getattr(utils, "should_free_input", None)
    if original is None:
        return False
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def should_free_input(name, is_moe, config, num_local_experts):
        if is_moe and getattr(config, "moe_token_dispatcher_type", None) == DISPATCHER_TYPE:
            return hybrid_ep_frees_input(name, config)
        return original(name, is_moe, config, num_local_experts)

    setattr(should_free_input, _MARK, True)
    utils.should_free_input = should_free_input
    return True
