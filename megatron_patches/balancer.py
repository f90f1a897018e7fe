"""The expert balancer inside Megatron-Core: slot-built experts, hooks, optimizer, checkpoints.

Enabled by `--hybrid-ep-balancer-interval K` (or HybridEPOptions(balancer_interval=K)) with
the hybrid_ep dispatcher. What changes, and where:

- MoELayer construction (selection.py calls `slot_experts_kwargs` / `finish_moe_layer`):
  each EP rank builds P = slots_per_rank expert modules instead of E / EP (the router still
  scores E experts), and the layer gets persistent buffers, so legacy and torch_dist
  checkpoints carry them: `hybrid_ep_slot_to_expert` [S] (the placement row, shared with
  the dispatcher's SlotTable), `hybrid_ep_placement_shape` [num_slots, ep_size] (checked on
  load), and the layer's load statistics `hybrid_ep_load_stats` [window + 2, E] with
  `hybrid_ep_load_meta` [4] (the statistics are float64 kept as int64 bits, which
  Float16Module's cast leaves alone; see ExpertBalancer.prepare_checkpoint, which the installed
  save hook runs on every rank before Megatron-LM saves). A checkpoint saved with another
  EP size but the same number of slots loads: the saved placement row is kept (slot s now
  lives on rank s // P) and the balancer re-plans from the saved statistics at once.
- The dispatcher maps router expert ids to slots before dispatch and reports each forward's
  routed tokens per expert to the statistics (device add, no sync).
- `attach(model, optimizer)` builds the ExpertBalancer over every balanced MoE layer of the
  model chunks, installs the first placement (or keeps the one a checkpoint restored) and
  wraps `optimizer.step`: replicas' gradients are summed before the step, and every K steps
  after it the load is reduced, a placement planned and slots migrated.
- With Megatron-LM's training loop, `install_training_hook()` (done by megatron_patches.apply)
  calls attach() at the end of `setup_model_and_optimizer`, so the flag is all a user sets.

Supported optimizers: Megatron's FP32Optimizer, mixed-precision (Float16) optimizer and
DistributedOptimizer, also chained (see hybrid_ep.balancer.state). Under the distributed
optimizer a slot's pieces move between the expert-data-parallel members that own them.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from hybrid_ep.balancer import BalancedLayer, ExpertBalancer, MegatronOptimizerView, SlotTable, slot_parameters
from hybrid_ep.balancer.balancer import stats_values
from hybrid_ep.balancer.state import is_replica
from hybrid_ep.topology import group_ranks_per_node

from .expert_init import replace_experts_builder
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

    def wrap(builder):
        @functools.wraps(builder)
        def build_slots(num_local_experts, config, *b_args, **b_kwargs):
            return builder(num_slots_per_rank, config, *b_args, **b_kwargs)

        return build_slots

    return replace_experts_builder(args, kwargs, wrap)


def finish_moe_layer(layer) -> None:
    """After MoELayer.__init__: slot bookkeeping, placement buffers and their load checks."""
    dispatcher = layer.token_dispatcher._comm_manager
    table: SlotTable = dispatcher.slot_table
    layer.num_local_experts = dispatcher.num_local_experts
    layer.local_expert_indices = list(dispatcher.local_expert_indices)
    layer.register_buffer("hybrid_ep_slot_to_expert", table.slot_to_expert_S, persistent=True)
    shape = torch.tensor([table.num_slots, dispatcher.ep_size], dtype=torch.int64,
                         device=table.slot_to_expert_S.device)
    layer.register_buffer("hybrid_ep_placement_shape", shape, persistent=True)
    # dist_checkpointing loads into the buffers themselves before load_state_dict runs the
    # check, so the layer's own shape is also kept off the buffer.
    layer._hybrid_ep_shape = (table.num_slots, dispatcher.ep_size)
    from .options import options_for

    window = options_for(layer.config).balancer_window
    device = table.slot_to_expert_S.device
    # float64 statistics kept as int64 bits (stats_values): Float16Module casts float buffers
    layer.register_buffer("hybrid_ep_load_stats", torch.zeros(window + 2, table.num_experts, dtype=torch.int64,
                                                               device=device), persistent=True)
    layer.register_buffer("hybrid_ep_load_meta", torch.zeros(4, dtype=torch.int64, device=device), persistent=True)
    layer._register_load_state_dict_pre_hook(_check_placement_shape, with_module=True)
    layer.register_load_state_dict_post_hook(_placement_loaded)
    layer.sharded_state_dict = _slot_sharded_state_dict(layer.sharded_state_dict)
    setattr(layer, _MARK, None)


def guard_unbalanced_layer(layer) -> None:
    """A MoE layer built without the balancer refuses a checkpoint saved with it. Its experts
    are stored by slot; Megatron-LM's loader retries a failed strict load with strict=False,
    which drops the placement keys and loads slot j as expert j without a word. A hook that
    raises stops it under either."""
    layer._register_load_state_dict_pre_hook(_refuse_slot_checkpoint, with_module=True)


def _refuse_slot_checkpoint(module, state_dict, prefix, *args, **kwargs):
    saved = state_dict.get(prefix + "hybrid_ep_placement_shape")
    if saved is None:
        return
    slots, ep = (int(v) for v in torch.as_tensor(saved).tolist())
    raise ValueError(
        f"{prefix or 'MoE layer'}: this checkpoint was saved with the hybrid_ep expert balancer: its experts "
        f"are stored by slot under a placement ({slots} slots over EP size {ep}), and a run without the "
        "balancer would load them as the wrong experts. Load it with the balancer on "
        "(--hybrid-ep-balancer-interval > 0) and EP size x --hybrid-ep-balancer-slots-per-rank = "
        f"{slots} (docs/balancer.md, checkpoints)"
    )


# Global checkpoint keys of slot-built experts: their weights are indexed by slot, not by
# expert, so they must not share keys with the expert-indexed weights of a run without the
# balancer (at S = E the shapes agree, and such a run would load slot s as expert s).
_SLOT_EXPERTS = "hybrid_ep_slot_experts."
_BALANCER_BUFFERS = ("hybrid_ep_slot_to_expert", "hybrid_ep_placement_shape", "hybrid_ep_load_stats",
                     "hybrid_ep_load_meta")


def _slot_sharded_state_dict(original):
    """The layer's torch_dist (sharded) state dict, two changes on top of Megatron's:
    - expert entries get global keys under `hybrid_ep_slot_experts.` (local keys unchanged),
      so a run without the balancer fails on missing keys instead of loading slot-ordered
      weights as experts, and a run with it cannot load expert-ordered ones;
    - the placement and statistics buffers are saved as objects, not sharded tensors: a
      sharded tensor's shape is checked by dist_checkpointing before the layer's own load
      hook runs, which then could neither resize statistics saved with another window nor
      name the slot counts in its error. An object takes its global offset from
      sharded_offsets, as Megatron's own extra state does: a TransformerBlock of identical
      layers gives every layer the same key and tells them apart only there (the layer axis,
      pipeline stages included), so a fixed offset saved the same shard once per layer and
      dist_checkpointing refused the whole save."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject
    from megatron.core.transformer.utils import _get_extra_state_offsets

    @functools.wraps(original)
    def sharded_state_dict(prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        out = original(prefix, sharded_offsets, metadata)
        experts = prefix + "experts."
        for local_key, entry in out.items():
            if local_key.startswith(experts) and hasattr(entry, "key") and entry.key.startswith(experts):
                entry.key = prefix + _SLOT_EXPERTS + entry.key[len(experts):]
            elif local_key[len(prefix):] in _BALANCER_BUFFERS and hasattr(entry, "data"):
                # a host copy: an object is pickled with its device, and loaded there on every
                # rank (no map_location); the load hooks copy it into the device buffers
                out[local_key] = ShardedObject(entry.key, entry.data.detach().cpu().clone(),
                                               *_get_extra_state_offsets(sharded_offsets), replica_id=entry.replica_id)
        return out

    return sharded_state_dict


def _check_placement_shape(module, state_dict, prefix, *args, **kwargs):
    saved = state_dict.get(prefix + "hybrid_ep_placement_shape")
    if saved is None:
        raise ValueError(
            f"{prefix or 'MoE layer'}: the checkpoint has no hybrid_ep expert placement, but this run uses "
            "the expert balancer (slot-built experts); load it with the same --hybrid-ep-balancer-* "
            "settings it was saved with"
        )
    saved_slots, saved_ep = (int(v) for v in torch.as_tensor(saved).tolist())
    mine = list(module._hybrid_ep_shape)
    if saved_slots != mine[0]:
        raise ValueError(
            f"{prefix or 'MoE layer'}: the checkpoint's expert placement has {saved_slots} slots over EP "
            f"size {saved_ep}; this run has {mine[0]} slots over EP size {mine[1]}. Keep EP size x "
            "--hybrid-ep-balancer-slots-per-rank equal to the saved number of slots"
        )
    if saved_ep != mine[1]:  # same slots on another EP size: keep the row, re-plan once loaded
        state_dict[prefix + "hybrid_ep_placement_shape"] = torch.tensor(mine, dtype=torch.int64)
        module._hybrid_ep_replan = True
        log.info("%s: checkpoint saved with EP size %d, loading into EP size %d: the expert balancer "
                 "re-plans from the saved statistics", prefix or "MoE layer", saved_ep, mine[1])
    stats_key = prefix + "hybrid_ep_load_stats"
    saved_stats = state_dict.get(stats_key)
    if saved_stats is not None and torch.as_tensor(saved_stats).is_floating_point():
        # saved as float64 by earlier versions (or cast by Float16Module): into the int64 bits
        state_dict[stats_key] = torch.as_tensor(saved_stats).to(torch.float64).view(torch.int64)
    if saved_stats is None:  # saved before statistics were checkpointed: start counting afresh
        state_dict[stats_key] = torch.zeros_like(module.hybrid_ep_load_stats)
        state_dict[prefix + "hybrid_ep_load_meta"] = torch.zeros_like(module.hybrid_ep_load_meta)
    elif tuple(saved_stats.shape) != tuple(module.hybrid_ep_load_stats.shape):
        _resize_saved_stats(state_dict, prefix, module)


def _resize_saved_stats(state_dict, prefix, module) -> None:
    """Statistics saved with another --hybrid-ep-balancer-window: keep the newest reductions."""
    from hybrid_ep.balancer import LoadStatistics

    saved = stats_values(torch.as_tensor(state_dict[prefix + "hybrid_ep_load_stats"])).cpu().numpy()
    held, has_ema, steps, valid = torch.as_tensor(state_dict[prefix + "hybrid_ep_load_meta"]).tolist()
    window = module.hybrid_ep_load_stats.shape[0] - 2
    stats = LoadStatistics(1, module.hybrid_ep_load_stats.shape[1], window=window)
    stats.unpack([saved], held, bool(has_ema))
    packed, held, has_ema = stats.pack(0)
    state_dict[prefix + "hybrid_ep_load_stats"] = torch.from_numpy(packed).view(torch.int64)
    state_dict[prefix + "hybrid_ep_load_meta"] = torch.tensor([held, int(has_ema), steps, valid])


def _placement_loaded(module, incompatible_keys):
    table = module.token_dispatcher._comm_manager.slot_table
    row = table.slot_to_expert_S.clone()
    balancer = getattr(module, _MARK, None)
    if bool((row < 0).all()):  # saved before a placement was installed: attach installs one
        if balancer is not None:
            raise ValueError("this checkpoint was saved before the expert balancer installed a placement; "
                             "load it before the balancer is attached (attach then installs the first one)")
        return
    table.load_(row)  # rebuild the replica tables from the loaded row
    if balancer is None:  # not attached yet: attach restores the statistics
        return
    # loaded into a running balancer (a reload after attach): once every layer it balances is
    # loaded, the statistics and step count follow the checkpoint; a re-plan for another EP
    # size, a collective that moves slots, waits for the end of the next optimizer step
    balancer.refresh_from_tables()
    module._hybrid_ep_loaded = True
    layers = balancer.hybrid_ep_layers
    if all(getattr(layer, "_hybrid_ep_loaded", False) for layer in layers):
        for layer in layers:
            layer._hybrid_ep_loaded = False
        balancer.hybrid_ep_replan_pending = _restore(balancer, layers)


def _restore(balancer: ExpertBalancer, layers) -> bool:
    """Statistics and steps from a loaded checkpoint; whether it came from another EP size
    (then the balancer re-plans once)."""
    if not balancer.restore_saved():
        return False
    replan = any(getattr(layer, "_hybrid_ep_replan", False) for layer in layers)
    for layer in layers:
        layer._hybrid_ep_replan = False
    return replan


def _resume(balancer: ExpertBalancer, layers, start_iteration: int | None) -> None:
    """_restore, and the re-plan at once. Called on every rank (a re-plan migrates, a collective).
    A given start_iteration (Megatron-LM's iteration) wins over the saved step count: they
    agree on a resume, and --finetune starts Megatron at 0, where the balancer's schedule,
    report folders and logged steps must start too."""
    replan = _restore(balancer, layers)
    if start_iteration is not None and balancer.steps != start_iteration:
        log.info("hybrid_ep balancer: checkpoint saved at step %d, training starts at iteration %d; the "
                 "rebalancing schedule follows the iteration", balancer.steps, start_iteration)
        balancer.steps = int(start_iteration or 0)
    if replan:
        balancer.replan()


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


def _stage_reporter(report_dir: str | None) -> tuple[bool | None, str | None]:
    """Who writes the report files and log lines, and where: with pipeline parallelism each
    stage's balancer covers its own MoE layers, so each stage reports, from its first rank
    (EP, expert-TP and expert-DP rank 0), into a folder of its own. (None, report_dir) outside
    Megatron's parallel state: the ExpertBalancer's default (global rank 0)."""
    try:
        from megatron.core import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return None, report_dir
        stages, stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
        first = (ps.get_expert_model_parallel_rank() == 0 and ps.get_expert_tensor_parallel_rank() == 0
                 and ps.get_expert_data_parallel_rank() == 0)
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        return None, report_dir
    if stages > 1 and report_dir:
        report_dir = os.path.join(report_dir, f"pipeline_stage_{stage}")
    return first, report_dir


def _expert_data_parallel_group():
    try:
        from megatron.core import parallel_state

        return parallel_state.get_expert_data_parallel_group()
    except Exception:  # parallel state not initialised (library use without Megatron's state)
        return None


def attach(model_chunks, optimizer, *, options: HybridEPOptions | None = None, start_iteration: int | None = None,
           initial_placement=None, writers=None) -> ExpertBalancer | None:
    """Build the balancer for a model and optimizer and wrap `optimizer.step` (see module doc).

    start_iteration: the training loop's iteration (Megatron-LM's training hook passes it);
    None: 0, or the step count a loaded checkpoint holds.

    Returns None when the model has no balanced MoE layer. The first placement is the one a
    loaded checkpoint holds, else `initial_placement` ([L, S] or a YAML path), else
    --hybrid-ep-balancer-placement, else the identity placement with replicas in spare slots.
    """
    layers = balanced_layers(model_chunks)
    if not layers:
        return None
    from .options import options_for

    options = options or options_for(layers[0].config)
    dispatchers = [layer.token_dispatcher._comm_manager for layer in layers]  # HybridEPManager
    first = dispatchers[0]
    view = MegatronOptimizerView(optimizer) if optimizer is not None and hasattr(optimizer, "get_parameters") \
        else _torch_view(optimizer)
    balanced = [BalancedLayer(d.slot_table, slot_parameters(layer.experts, d.num_local_experts),
                              saved_stats=layer.hybrid_ep_load_stats, saved_meta=layer.hybrid_ep_load_meta)
                for layer, d in zip(layers, dispatchers)]
    if isinstance(view, MegatronOptimizerView):
        view.use_for([p for b in balanced for params in b.slot_params for p in params])
    num_nodes = _num_nodes(first.ep_group, first.ep_size, options.ranks_per_node)
    is_reporter, report_dir = _stage_reporter(options.balancer_report_dir)
    balancer = ExpertBalancer(
        balanced, num_experts=first.num_experts, slots_per_rank=first.num_local_experts,
        ep_group=first.ep_group, stats_groups=[first.ep_group, _expert_data_parallel_group()],
        num_nodes=num_nodes, interval=options.balancer_interval, window=options.balancer_window,
        decay=options.balancer_decay, min_gain=options.balancer_min_gain, tolerance=options.balancer_tolerance,
        move_budget=options.balancer_move_budget, rdma_weight=getattr(options, "balancer_rdma_weight", None),
        optimizer_view=view,
        report_dir=report_dir, is_reporter=is_reporter, writers=_writers() if writers is None else writers,
        layer_numbers=[int(getattr(layer, "layer_number", None) or i + 1) for i, layer in enumerate(layers)],
    )
    balancer.steps = int(start_iteration or 0)
    balancer.hybrid_ep_layers = layers  # the MoE layers, for a checkpoint loaded after attach
    balancer.hybrid_ep_replan_pending = False
    balancer.hybrid_ep_iteration = None  # the training loop's iteration before each step, when known
    for i, (layer, d) in enumerate(zip(layers, dispatchers)):
        setattr(layer, _MARK, balancer)
        d.load_recorder = functools.partial(balancer.record, i)
    restored = bool((balancer.placement_rows() >= 0).all())
    if not restored:
        initial = initial_placement if initial_placement is not None else options.balancer_placement
        if isinstance(initial, str):
            from hybrid_ep.balancer.placement_file import load_placement_yaml

            initial = _placement_for_model(load_placement_yaml(initial), initial, balancer, first.ep_size)
        balancer.setup(initial)
    else:
        _resume(balancer, layers, start_iteration)
    _wrap_step(optimizer, balancer)
    return balancer


def _placement_for_model(loaded, path: str, balancer: ExpertBalancer, ep_size: int) -> torch.Tensor:
    """[L, S] rows of the file for this model's MoE layers, by their layer numbers (Megatron's
    global `layer.layer_number`, as balancer.layer_numbers holds them), so one file planned for
    the whole model serves every pipeline stage. A file without layer_numbers (older versions,
    by hand) must have as many layers as the model and is matched in order. Refused unless it
    was planned for this model's experts and EP size too: a plan for another EP size has the
    same shape when the slot totals agree, and would load as a placement balanced for ranks
    this model does not have."""
    want = {"num_experts": balancer.num_experts, "ep_size": ep_size, "num_slots": balancer.num_slots}
    have = {"num_experts": loaded.num_experts, "ep_size": loaded.num_ranks, "num_slots": loaded.num_slots}
    wrong = [f"{key} {have[key]} (the model has {want[key]})" for key in want if have[key] != want[key]]
    numbers = list(balancer.layer_numbers)
    stage = _pipeline_stage()
    model = "the model" if stage is None else f"pipeline stage {stage}"
    if loaded.layer_numbers is None:
        if loaded.num_layers != len(numbers):
            wrong.append(f"layers {loaded.num_layers} and no layer_numbers ({model} has {len(numbers)}: "
                         f"MoE layers {numbers})")
    else:
        missing = loaded.missing_layers(numbers)
        if missing:
            wrong.append(f"layer_numbers {list(loaded.layer_numbers)} ({model} has MoE layers {numbers}; "
                         f"none for {missing})")
    if wrong:
        every_stage = "" if stage is None else " (--stats takes every pipeline stage's statistics.npz)"
        raise ValueError(
            f"hybrid_ep option balancer_placement {path!r} was planned for another model: {', '.join(wrong)}. "
            f"Plan one for this model: python -m hybrid_ep.balancer plan --stats ... --ep-size {ep_size} "
            f"--num-slots {balancer.num_slots}{every_stage}"
        )
    return loaded.rows_for(numbers)


def _pipeline_stage() -> int | None:
    """This rank's pipeline stage with pipeline parallelism; None without it (or outside
    Megatron's parallel state)."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized() and ps.get_pipeline_model_parallel_world_size() > 1:
            return int(ps.get_pipeline_model_parallel_rank())
    except (ImportError, AssertionError, AttributeError, RuntimeError):
        pass
    return None


def _num_nodes(ep_group, ep_size: int, ranks_per_node: int | None) -> int:
    """Nodes the EP group spans (the planner packs experts onto them first): the buffer's
    own ranks_per_node (hybrid_ep/topology.py; the balancer needs expert TP 1, so the
    buffer's group is the EP group), 1 where it does not divide the group."""
    per_node = group_ranks_per_node(ep_group, ranks_per_node)
    return ep_size // per_node if isinstance(per_node, int) and 1 <= per_node <= ep_size and ep_size % per_node == 0 \
        else 1


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
        iteration = balancer.hybrid_ep_iteration() if balancer.hybrid_ep_iteration is not None else None
        if iteration is not None:  # iterations the loop skipped without a step (--iterations-to-skip)
            balancer.steps = int(iteration)
        balancer.before_optimizer_step()
        result = original(*args, **kwargs)
        balancer.after_optimizer_step()
        if balancer.hybrid_ep_replan_pending:  # a checkpoint of another EP size loaded after attach
            balancer.hybrid_ep_replan_pending = False
            balancer.replan()
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

        balancer = attach(model, optimizer, start_iteration=int(getattr(get_args(), "iteration", 0) or 0))
        if balancer is not None:
            balancer.hybrid_ep_iteration = _megatron_iteration
        return model, optimizer, scheduler

    setattr(setup_model_and_optimizer, _MARK, True)
    training.setup_model_and_optimizer = setup_model_and_optimizer
    _install_save_hook(training)
    _install_params_norm_hook(training)
    return True


class _WithoutReplicas:
    """A model chunk whose parameters leave out the balancer's replica copies."""

    def __init__(self, chunk):
        self._chunk = chunk

    def parameters(self, *args, **kwargs):
        return (p for p in self._chunk.parameters(*args, **kwargs) if not is_replica(p))

    def named_parameters(self, *args, **kwargs):
        return ((n, p) for n, p in self._chunk.named_parameters(*args, **kwargs) if not is_replica(p))

    def __getattr__(self, name):
        return getattr(self._chunk, name)


def _install_params_norm_hook(training) -> None:
    """Megatron-LM's params norm (--log-params-norm) over the model without replica copies:
    each expert counts once, as in a run without the balancer, and the optimizer's `shared`
    mark on an FP32Optimizer's replica parameters does not trip its assert."""
    original = getattr(training, "calc_params_l2_norm", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def calc_params_l2_norm(model, *args, **kwargs):
        chunks = model if isinstance(model, list) else [model]
        return original([_WithoutReplicas(c) for c in chunks], *args, **kwargs)

    setattr(calc_params_l2_norm, _MARK, True)
    training.calc_params_l2_norm = calc_params_l2_norm


def _megatron_iteration() -> int | None:
    """Megatron-LM's iteration in the step being taken (args.curr_iteration; it counts the
    iterations --iterations-to-skip passes over without an optimizer step, so the balancer's
    schedule and report steps follow it rather than its own count of steps)."""
    from megatron.training import get_args

    value = getattr(get_args(), "curr_iteration", None)
    return None if value is None else int(value)


def _install_save_hook(training) -> None:
    """Megatron-LM's save_checkpoint, preceded on every rank by the balancer's prepare_checkpoint."""
    original = getattr(training, "save_checkpoint", None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def save_checkpoint(iteration, model, optimizer, *args, **kwargs):
        balancer = getattr(optimizer, "hybrid_ep_balancer", None)
        if balancer is not None:
            balancer.prepare_checkpoint()
        return original(iteration, model, optimizer, *args, **kwargs)

    setattr(save_checkpoint, _MARK, True)
    training.save_checkpoint = save_checkpoint
