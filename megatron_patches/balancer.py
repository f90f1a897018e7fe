"""The expert balancer inside Megatron-Core: slot-built experts, hooks, optimizer, checkpoints.

Enabled by `--hybrid-ep-balancer-interval K` (or HybridEPOptions(balancer_interval=K)) with
the hybrid_ep dispatcher. What changes, and where:

- MoELayer construction (selection.py calls `slot_experts_kwargs` / `finish_moe_layer`):
  each EP rank builds P = slots_per_rank expert modules instead of E / EP (the router still
  scores E experts), and the layer gets two persistent buffers, `hybrid_ep_slot_to_expert`
  [S] (the placement row, shared with the dispatcher's SlotTable, so checkpoints carry it)
  and `hybrid_ep_placement_shape` [num_slots, ep_size] (checked on load).
- The dispatcher maps router expert ids to slots before dispatch and reports each forward's
  routed tokens per expert to the statistics (device add, no sync).
- `attach(model, optimizer)` builds the ExpertBalancer over every balanced MoE layer of the
  model chunks, installs the first placement (or keeps the one a checkpoint restored) and
  wraps `optimizer.step`: replicas' gradients are summed before the step, and every K steps
  after it the load is reduced, a placement planned and slots migrated.
- With Megatron-LM's training loop, `install_training_hook()` (done by megatron_patches.apply)
  calls attach() at the end of `setup_model_and_optimizer`, so the flag is all a user sets.

Supported optimizers: Megatron's FP32Optimizer and mixed-precision (Float16) optimizer, also
chained; the distributed optimizer is refused with a message (see hybrid_ep.balancer.state).
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging

import torch
import torch.distributed as dist

from hybrid_ep.balancer import BalancedLayer, ExpertBalancer, MegatronOptimizerView, SlotTable, slot_parameters

from .options import HybridEPOptions

log = logging.getLogger(__name__)

_MARK = "_hybrid_ep_balancer"


def slots_per_rank(options: HybridEPOptions, num_experts: int, ep_size: int) -> int:
    """P: expert slots per EP rank (experts / EP when the option is not set)."""
    if num_experts % ep_size:
        raise ValueError(f"num_moe_experts ({num_experts}) must be a multiple of the EP size ({ep_size})")
    P = options.balancer_slots_per_rank or num_experts // ep_size
    if P * ep_size < num_experts:
        raise ValueError(
            f"hybrid_ep option balancer_slots_per_rank ({P}) x EP size ({ep_size}) = {P * ep_size} slots "
            f"is fewer than num_moe_experts ({num_experts})"
        )
    if P * ep_size - num_experts + 1 > 64 and P * ep_size > 2 * num_experts:
        log.warning("hybrid_ep balancer: %d slots for %d experts is a lot of replicas", P * ep_size, num_experts)
    return P


def slot_experts_kwargs(args: tuple, kwargs: dict, num_slots_per_rank: int) -> tuple[tuple, dict]:
    """MoELayer constructor arguments whose experts builder builds P slots instead of E / EP."""
    if "submodules" in kwargs:
        submodules = kwargs["submodules"]
    elif args:
        submodules = args[0]
    else:
        raise ValueError("the expert balancer cannot find MoELayer's submodules argument")
    builder = getattr(submodules, "experts", None)
    if builder is None or not callable(builder) or hasattr(builder, "module"):
        raise ValueError(
            "the expert balancer needs Megatron-Core >= 0.17 (experts given as a builder in "
            f"MoESubmodules), got experts={builder!r}"
        )

    @functools.wraps(builder)
    def build_slots(num_local_experts, config, *b_args, **b_kwargs):
        return builder(num_slots_per_rank, config, *b_args, **b_kwargs)

    patched = dataclasses.replace(submodules, experts=build_slots) if dataclasses.is_dataclass(submodules) \
        else copy.copy(submodules)
    if not dataclasses.is_dataclass(submodules):
        patched.experts = build_slots
    if "submodules" in kwargs:
        return args, dict(kwargs, submodules=patched)
    return (patched,) + tuple(args[1:]), kwargs


def finish_moe_layer(layer) -> None:
    """After MoELayer.__init__: slot bookkeeping, placement buffers and their load checks."""
    dispatcher = layer.token_dispatcher
    table: SlotTable = dispatcher.slot_table
    layer.num_local_experts = dispatcher.num_local_experts
    layer.local_expert_indices = list(dispatcher.local_expert_indices)
    layer.register_buffer("hybrid_ep_slot_to_expert", table.slot_to_expert_S, persistent=True)
    shape = torch.tensor([table.num_slots, dispatcher.ep_size], dtype=torch.int64,
                         device=table.slot_to_expert_S.device)
    layer.register_buffer("hybrid_ep_placement_shape", shape, persistent=True)
    layer._register_load_state_dict_pre_hook(_check_placement_shape, with_module=True)
    layer.register_load_state_dict_post_hook(_placement_loaded)
    setattr(layer, _MARK, None)


def _check_placement_shape(module, state_dict, prefix, *args, **kwargs):
    saved = state_dict.get(prefix + "hybrid_ep_placement_shape")
    if saved is None:
        raise ValueError(
            f"{prefix or 'MoE layer'}: the checkpoint has no hybrid_ep expert placement, but this run uses "
            "the expert balancer (slot-built experts); load it with the same --hybrid-ep-balancer-* "
            "settings it was saved with"
        )
    saved_slots, saved_ep = (int(v) for v in torch.as_tensor(saved).tolist())
    mine = module.hybrid_ep_placement_shape.tolist()
    if [saved_slots, saved_ep] != mine:
        raise ValueError(
            f"{prefix or 'MoE layer'}: the checkpoint's expert placement has {saved_slots} slots over EP "
            f"size {saved_ep}; this run has {mine[0]} slots over EP size {mine[1]}. Load with the same EP "
            "size and --hybrid-ep-balancer-slots-per-rank, or convert the checkpoint first"
        )


def _placement_loaded(module, incompatible_keys):
    table = module.token_dispatcher.slot_table
    table.load_(table.slot_to_expert_S.clone())  # rebuild the replica tables from the loaded row
    balancer = getattr(module, _MARK, None)
    if balancer is not None:
        balancer.refresh_from_tables()


def balanced_layers(model_chunks) -> list:
    """The MoE layers of these model chunks that were built with expert slots, in order."""
    chunks = model_chunks if isinstance(model_chunks, (list, tuple)) else [model_chunks]
    layers = []
    for chunk in chunks:
        for module in chunk.modules():
            if hasattr(module, _MARK):
                layers.append(module)
    return layers


def _writers():
    """TensorBoard / wandb writers of Megatron-LM's global state, when configured."""
    out = []
    try:
        from megatron.training.global_vars import get_tensorboard_writer, get_wandb_writer
    except ImportError:
        return out
    tb = get_tensorboard_writer()
    if tb is not None:
        out.append(lambda values, step: [tb.add_scalar(k, v, step) for k, v in values.items()])
    wandb = get_wandb_writer()
    if wandb is not None:
        out.append(lambda values, step: wandb.log(values, step=step))
    return out


def _expert_data_parallel_group():
    try:
        from megatron.core import parallel_state

        return parallel_state.get_expert_data_parallel_group()
    except Exception:  # parallel state not initialised (library use without Megatron's state)
        return None


def attach(model_chunks, optimizer, *, options: HybridEPOptions | None = None, start_iteration: int = 0,
           initial_placement=None, writers=None) -> ExpertBalancer | None:
    """Build the balancer for a model and optimizer and wrap `optimizer.step` (see module doc).

    Returns None when the model has no balanced MoE layer. The first placement is the one a
    loaded checkpoint holds, else `initial_placement` ([L, S] or a YAML path), else
    --hybrid-ep-balancer-placement, else the identity layout with replicas in spare slots.
    """
    layers = balanced_layers(model_chunks)
    if not layers:
        return None
    from .options import options_for

    options = options or options_for(layers[0].config)
    dispatchers = [layer.token_dispatcher for layer in layers]
    first = dispatchers[0]
    view = MegatronOptimizerView(optimizer) if optimizer is not None and hasattr(optimizer, "get_parameters") \
        else _torch_view(optimizer)
    balanced = [BalancedLayer(d.slot_table, slot_parameters(layer.experts, d.num_local_experts))
                for layer, d in zip(layers, dispatchers)]
    num_nodes = _num_nodes(first.ep_size, options.ranks_per_node)
    balancer = ExpertBalancer(
        balanced, num_experts=first.num_experts, slots_per_rank=first.num_local_experts,
        ep_group=first.ep_group, stats_groups=[first.ep_group, _expert_data_parallel_group()],
        num_nodes=num_nodes, interval=options.balancer_interval, window=options.balancer_window,
        decay=options.balancer_decay, min_gain=options.balancer_min_gain, optimizer_view=view,
        report_dir=options.balancer_report_dir, writers=_writers() if writers is None else writers,
        layer_numbers=[int(getattr(layer, "layer_number", i) or i) for i, layer in enumerate(layers)],
    )
    balancer.steps = int(start_iteration)
    for i, (layer, d) in enumerate(zip(layers, dispatchers)):
        setattr(layer, _MARK, balancer)
        d.load_recorder = functools.partial(balancer.record, i)
    restored = bool((balancer.placement_rows() >= 0).all())
    if not restored:
        initial = initial_placement if initial_placement is not None else options.balancer_placement
        if isinstance(initial, str):
            from hybrid_ep.balancer.placement_file import load_placement_yaml

            loaded = load_placement_yaml(initial)
            if loaded.slot_to_expert.shape != (len(layers), balancer.num_slots):
                raise ValueError(
                    f"hybrid_ep option balancer_placement {initial!r} has shape "
                    f"{tuple(loaded.slot_to_expert.shape)}, this model needs ({len(layers)}, {balancer.num_slots})"
                )
            initial = loaded.slot_to_expert
        balancer.setup(initial)
    _wrap_step(optimizer, balancer)
    return balancer


def _num_nodes(ep_size: int, ranks_per_node: int | None) -> int:
    """NVLink domains the EP group spans (the planner packs experts onto them first)."""
    import os

    per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", ep_size))
    per_node = max(1, min(per_node, ep_size))
    return ep_size // per_node if ep_size % per_node == 0 else 1


def _torch_view(optimizer):
    from hybrid_ep.balancer import OptimizerView, TorchOptimizerView

    return TorchOptimizerView(optimizer) if optimizer is not None else OptimizerView()


def _wrap_step(optimizer, balancer: ExpertBalancer) -> None:
    if optimizer is None:
        return
    original = optimizer.step
    if getattr(original, _MARK, False):
        raise RuntimeError("an expert balancer is already attached to this optimizer")

    @functools.wraps(original)
    def step(*args, **kwargs):
        balancer.before_optimizer_step()
        result = original(*args, **kwargs)
        balancer.after_optimizer_step()
        return result

    setattr(step, _MARK, True)
    optimizer.step = step
    optimizer.hybrid_ep_balancer = balancer


def install_training_hook() -> bool:
    """Attach the balancer at the end of Megatron-LM's setup_model_and_optimizer."""
    try:
        from megatron.training import training
    except ImportError:
        return False
    original = training.setup_model_and_optimizer
    if getattr(original, _MARK, False):
        return True

    @functools.wraps(original)
    def setup_model_and_optimizer(*args, **kwargs):
        model, optimizer, scheduler = original(*args, **kwargs)
        from megatron.training import get_args

        attach(model, optimizer, start_iteration=int(getattr(get_args(), "iteration", 0) or 0))
        return model, optimizer, scheduler

    setattr(setup_model_and_optimizer, _MARK, True)
    training.setup_model_and_optimizer = setup_model_and_optimizer
    return True
