"""Expert weights drawn from a generator of their own per (MoE layer, EP rank).

Megatron draws every MoE layer's experts from one random stream per rank (the global CPU
generator under --use-cpu-initialization, else the RNG tracker's expert-parallel state), so a
layer that builds more experts shifts the draws of every layer after it. With the expert
balancer's spare slots a rank builds P slots instead of E / EP, and a run with spare slots
would start from other expert weights than one without (Megatron-LM's pretrain_gpt.py: losses
7.7e-4 apart at the first iteration). Here each MoE layer builds its experts under generators
seeded by (the rank's seed, global layer number, EP rank) and leaves every generator as it
found it: slot j draws after slots 0..j-1, so the first E / EP slots, and everything built
after the experts, are the same with and without spare slots, for every dispatcher type.

The rank's seed is `torch.initial_seed()`, the seed Megatron-LM's initialisation (and the CPU
trainer) gave torch.manual_seed. The CPU generator's seed leaves out the expert tensor
parallel rank, because --use-cpu-initialization draws the whole weight on every ETP rank and
keeps its slice; the tracker's and the CUDA generator's seeds include it, because there each
ETP rank draws its own slice (as Megatron's own expert-parallel seed does).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import dataclasses
import functools

import numpy as np

_MARK = "_hybrid_ep_layer_context"
# The TransformerLayer whose __init__ is running: its MoE layer takes the global layer number.
_building_layer: contextvars.ContextVar = contextvars.ContextVar("hybrid_ep_building_layer", default=None)


def derived_seed(*parts: int) -> int:
    """A 63-bit seed mixed from integers (numpy's SeedSequence: nearby inputs, unrelated seeds)."""
    return int(np.random.SeedSequence([int(p) % 2 ** 64 for p in parts]).generate_state(1, np.uint64)[0] >> 1)


def _expert_tracker_state(seed: int):
    """(tracker, its states, the expert-parallel state's name, that state re-seeded by `seed`), or
    None when Megatron's RNG tracker is not set up or does not keep an expert-parallel state."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = getattr(mrandom, "_CUDA_RNG_STATE_TRACKER", None)  # never create one here
    name = mrandom.get_expert_parallel_rng_tracker_name()
    if tracker is None or not hasattr(tracker, "get_states"):
        return None
    states = tracker.get_states()
    if name not in states:
        return None
    fresh = copy.copy(tracker)  # same kind of state (CUDA, graph-safe, CPU stand-in), own dicts
    fresh.reset()
    fresh.add(name, seed)
    new_state = fresh.get_states().get(name)
    return None if new_state is None else (tracker, states, name, new_state)


@contextlib.contextmanager
def expert_generators(cpu_seed: int, device_seed: int):
    """Inside: the CPU generator seeded by cpu_seed; the current CUDA device's generator and
    the RNG tracker's expert-parallel state by device_seed. After: all as they were."""
    import torch

    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    tracked = _expert_tracker_state(device_seed)
    with torch.random.fork_rng(devices=devices):
        torch.random.default_generator.manual_seed(cpu_seed)
        for device in devices:
            torch.cuda.default_generators[device].manual_seed(device_seed)
        if tracked is not None:
            tracker, states, name, new_state = tracked
            tracker.set_states(dict(states, **{name: new_state}))
        try:
            yield
        finally:
            if tracked is not None:
                tracker.set_states(states)


def _expert_ranks(pg_collection) -> tuple[int, int]:
    """(EP rank, expert tensor parallel rank) of this process, as MoELayer finds them."""
    ep = getattr(pg_collection, "ep", None) if pg_collection is not None else None
    etp = getattr(pg_collection, "expt_tp", None) if pg_collection is not None else None
    if ep is not None and etp is not None:
        return ep.rank(), etp.rank()
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank(), parallel_state.get_expert_tensor_parallel_rank()


def layer_number_of(kwargs: dict) -> int | None:
    """The global layer number of the MoE layer being built: its own layer_number argument, else
    the enclosing TransformerLayer's (Megatron sets it on the MoE layer only after building it)."""
    if kwargs.get("layer_number") is not None:
        return int(kwargs["layer_number"])
    layer = _building_layer.get()
    return getattr(layer, "layer_number", None)


def replace_experts_builder(args: tuple, kwargs: dict, wrap) -> tuple[tuple, dict]:
    """MoELayer constructor arguments whose MoESubmodules.experts builder is wrap(builder)."""
    if "submodules" in kwargs:
        submodules = kwargs["submodules"]
    elif args:
        submodules = args[0]
    else:
        raise ValueError("cannot find MoELayer's submodules argument")
    builder = getattr(submodules, "experts", None)
    if builder is None or not callable(builder) or hasattr(builder, "module"):
        raise ValueError(
            f"megatron_patches needs the experts given as a builder in MoESubmodules, got experts={builder!r}"
        )
    if dataclasses.is_dataclass(submodules):
        patched = dataclasses.replace(submodules, experts=wrap(builder))
    else:
        patched = copy.copy(submodules)
        patched.experts = wrap(builder)
    if "submodules" in kwargs:
        return args, dict(kwargs, submodules=patched)
    return (patched,) + tuple(args[1:]), kwargs


def seeded_experts_kwargs(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """MoELayer constructor arguments whose experts are built under expert_generators for this
    layer and rank; unchanged when the layer number is not known."""
    import torch

    layer_number = layer_number_of(kwargs)
    if layer_number is None:
        return args, kwargs
    ep_rank, etp_rank = _expert_ranks(kwargs.get("pg_collection"))
    base = torch.initial_seed()

    def wrap(builder):
        @functools.wraps(builder)
        def build(*b_args, **b_kwargs):
            with expert_generators(derived_seed(base, layer_number, ep_rank),
                                   derived_seed(base, layer_number, ep_rank, etp_rank)):
                return builder(*b_args, **b_kwargs)

        return build

    return replace_experts_builder(args, kwargs, wrap)


def install_layer_context() -> bool:
    """Let MoE layers see the TransformerLayer that builds them; False if already installed."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    original = TransformerLayer.__init__
    if getattr(original, _MARK, False):
        return False

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        token = _building_layer.set(self)
        try:
            original(self, *args, **kwargs)
        finally:
            _building_layer.reset(token)

    setattr(__init__, _MARK, True)
    TransformerLayer.__init__ = __init__
    return True
