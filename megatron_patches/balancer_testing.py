"""Training runs of a Megatron MoELayer with and without the expert balancer (tests, docs).

`train_moe_layer` runs on every rank of a hybrid_ep.spawn.ProcessGroupPool (gloo on CPU):
a MoELayer with Megatron's SequentialMLP experts, seeded weights identical in every run,
trained on skewed inputs (a shared offset the router favours, so a few experts run hot)
toward a seeded target. The pool may be a multiple of the EP size: the ranks beyond it are
expert-data-parallel members (Megatron's parallel state: EP x EDP). `TrainRun` says how:
the optimizer is torch AdamW ("torch"), Megatron's own optimizer over Megatron's
DistributedDataParallel ("megatron") or its DistributedOptimizer ("distributed",
optionally with overlapped grad reduce and param gather), fp32 or bf16 mixed precision.
With `interval` > 0 the expert balancer rebalances every `interval` steps, with
`slots_per_rank` slots per rank (more than E / EP: replicas), planning on the sum of the
last `window` reductions.

Returned per rank: losses (mean over ranks), grad norms, Megatron-LM's params norm (as
--log-params-norm computes it, through the hook `install_training_hook` installs; Megatron
optimizers only), the migration events, the
placement after every rebalance, the output for a fixed input just before and after every
migration, and every slot's contents at the end (for the distributed optimizer: this
member's pieces of master weights and moments with their ranges), so a test can compare
runs and check replicas are identical. With a checkpoint directory, a checkpoint is saved
after step `checkpoint_step` (legacy: torch.save per rank plus the distributed optimizer's
parameter state; torch_dist: Megatron's dist_checkpointing), loaded into a freshly built
run, and both runs train on to the end.

Legend: S sequence, B batch, H hidden, F expert ffn, E experts, W EP ranks.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from .testing import LayerCase, build_moe_layer, case_tensors, init_megatron



@dataclasses.dataclass(frozen=True)
class TrainRun:
    steps: int = 20
    interval: int = 0               # 0: no balancer
    slots_per_rank: int | None = None
    optimizer: str = "torch"         # torch | megatron | distributed
    bf16: bool = False
    overlap: bool = False            # distributed: overlap_grad_reduce and overlap_param_gather
    # Megatron-LM's default: weight gradients added in fp32 straight into the fp32 main_grad
    # (needs Megatron's DDP, which gives every parameter its main_grad)
    gradient_accumulation_fusion: bool = False
    lr: float = 1e-2
    checkpoint_dir: str | None = None
    checkpoint_format: str = "legacy"  # legacy | torch_dist
    checkpoint_step: int = 10       # save after this many steps (a migration step when interval divides it)
    window: int = 1                 # reductions summed into the planning load
    tolerance: float | None = None  # the planner's (HybridEPOptions.balancer_tolerance; None: its default)
    move_budget: float | None = None  # HybridEPOptions.balancer_move_budget (None: no cap)
    frozen: str | None = None       # parameters whose name contains this get requires_grad=False

    def __post_init__(self):
        if self.gradient_accumulation_fusion and self.optimizer == "torch":
            raise ValueError("gradient_accumulation_fusion needs optimizer 'megatron' or 'distributed' "
                             "(Megatron's DDP gives each parameter the main_grad it accumulates into)")


def _ep_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()


def _data(case: LayerCase, step: int, rank: int):
    g = torch.Generator().manual_seed(case.seed * 7919 + step * 104729 + rank)
    x = torch.randn(case.seq, case.batch, case.hidden, generator=g)
    bias = torch.Generator().manual_seed(case.seed + 17)
    hot = torch.randn(case.hidden, generator=bias)
    target = torch.randn(case.seq, case.batch, case.hidden, generator=g)
    return x + 2.0 * hot, target


def _build(case: LayerCase, run: TrainRun):
    import megatron_patches

    from .buffers import BUFFERS

    init_megatron(case.world_size)
    BUFFERS.clear()  # sized from this run's first call, as a fresh job would (the pool's processes serve other tests)
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    options = megatron_patches.HybridEPOptions(
        balancer_interval=run.interval, balancer_slots_per_rank=run.slots_per_rank, balancer_window=run.window,
        balancer_tolerance=run.tolerance, balancer_move_budget=run.move_budget,
    ) if run.interval else megatron_patches.HybridEPOptions()
    layer = build_moe_layer(case, bf16=run.bf16, params_dtype=dtype, hybrid_ep_options=options,
                            gradient_accumulation_fusion=run.gradient_accumulation_fusion)
    layer._hybrid_ep_case = case
    if run.frozen:
        for name, param in layer.named_parameters():
            if run.frozen in name:
                param.requires_grad_(False)
    return layer


def _native_weights_(layer, case: LayerCase) -> None:
    """Expert r * E/W + j in local slot j (what a run without the balancer holds)."""
    L = case.num_experts // case.world_size
    rank = _ep_rank()
    router, fc1, fc2, _, _ = case_tensors(case)
    with torch.no_grad():
        layer.router.weight.copy_(router)
        for j, expert in enumerate(layer.experts.local_experts):
            e = rank * L + j if j < L else 0  # spare slots: anything; the balancer overwrites them
            expert.linear_fc1.weight.copy_(fc1[e])
            expert.linear_fc2.weight.copy_(fc2[e])


def _optimizer(layer, run: TrainRun):
    if run.optimizer == "torch":
        return layer, torch.optim.AdamW(layer.parameters(), lr=run.lr, weight_decay=0.0)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    distributed = run.optimizer == "distributed"
    overlap = distributed and run.overlap
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed, overlap_grad_reduce=overlap,
        overlap_param_gather=overlap, bucket_size=512 if distributed else None,
    )
    ddp = DistributedDataParallel(layer.config, ddp_config, layer)
    config = OptimizerConfig(optimizer="adam", lr=run.lr, weight_decay=0.0, bf16=run.bf16, fp16=False,
                             use_distributed_optimizer=distributed, clip_grad=1.0)
    return ddp, get_megatron_optimizer(config, [ddp])


def slot_contents(layer, balancer) -> list[dict]:
    """Per local slot: slot id, expert id, weights and (when the optimizer keeps them per
    parameter) master weights and Adam moments, as float64 on the CPU; under the distributed
    optimizer `pieces`: per parameter, this member's (start, end) and its pieces of master
    weights and moments."""
    from hybrid_ep.balancer.state import movable_tensors

    if balancer is None:
        return []
    P = balancer.slots_per_rank
    rows = balancer.placement_rows()[0]
    rank = _ep_rank()
    out = []
    for j, params in enumerate(balancer.layers[0].slot_params):
        slot = {"slot": rank * P + j, "expert": int(rows[rank * P + j])}
        if balancer.view.sharded:
            slot["tensors"] = [p.detach().double().cpu().clone() for p in params]
            slot["pieces"] = []
            for p in params:
                sl = balancer.view.sharded_slice(p)
                slot["pieces"].append((sl.ranges[sl.member], [x.detach().double().cpu().clone()
                                                               for x in sl.tensors[1:]]))
        else:
            slot["tensors"] = [t.detach().double().cpu().clone() for p in params
                               for t in movable_tensors(p, balancer.view)]
        out.append(slot)
    return out


def _fixed_output(layer, run: TrainRun) -> torch.Tensor:
    """The layer's output (float64) for this rank's fixed probe input."""
    x, _ = _data(layer_case(layer), 10_000, dist.get_rank())
    with torch.no_grad():
        return layer(x.to(torch.bfloat16 if run.bf16 else torch.float32))[0].double()


def layer_case(layer) -> LayerCase:
    return layer._hybrid_ep_case


def _probe_migrations(bal, layer, fixed_x, dtype, record: list) -> None:
    """Wrap bal.apply_placement: the layer's output for fixed_x just before and after."""
    original_apply = bal.apply_placement

    def apply_and_probe(*args, **kwargs):
        with torch.no_grad():
            before = layer(fixed_x.to(dtype))[0].double()
        moved = original_apply(*args, **kwargs)
        with torch.no_grad():
            after = layer(fixed_x.to(dtype))[0].double()
        record.append({"before": before, "after": after, "moved": moved})
        return moved

    bal.apply_placement = apply_and_probe


def record_placements(bal) -> list:
    """Wrap bal.rebalance: (iteration, placement rows [L, S]) after every rebalance."""
    record = []
    original_rebalance = bal.rebalance

    def rebalance_and_record(iteration):
        event = original_rebalance(iteration)
        record.append((int(iteration), bal.placement_rows()))
        return event

    bal.rebalance = rebalance_and_record
    return record


def _params_norm(model, run: TrainRun) -> float:
    """Megatron-LM's params norm of the model, as its training loop logs it (under this run's
    own Megatron-LM args, set for the call only: the pool's processes serve other runs)."""
    import types

    from megatron.training import global_vars, training

    from . import balancer as mbalancer

    mbalancer.install_training_hook()
    saved = global_vars._GLOBAL_ARGS
    global_vars._GLOBAL_ARGS = types.SimpleNamespace(bf16=run.bf16, use_megatron_fsdp=False)
    try:
        return float(training.calc_params_l2_norm(model))
    finally:
        global_vars._GLOBAL_ARGS = saved


def _train_steps(model, opt, case, run, steps, losses, grad_norms, params_norms=None) -> None:
    rank = dist.get_rank()
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    for step in steps:
        x, target = _data(case, step, rank)
        if run.optimizer != "torch":
            model.zero_grad_buffer()
        opt.zero_grad()
        out, _ = model(x.to(dtype))
        loss = ((out.float() - target) ** 2).mean()
        loss.backward()
        if run.optimizer != "torch":
            model.finish_grad_sync()
        stepped = opt.step()
        if run.optimizer != "torch":
            grad_norms.append(float(stepped[1]))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
        if params_norms is not None and run.optimizer != "torch":
            params_norms.append(_params_norm(model, run))


def _sync_params(model, run: TrainRun) -> None:
    """Whole weights on every member (an overlapped param gather waits for the next forward)."""
    if run.optimizer == "distributed":
        with torch.no_grad():
            model.start_param_sync(force_sync=True)


def train_moe_layer(case: LayerCase, run: TrainRun) -> dict:
    from . import balancer as mbalancer

    layer = _build(case, run)
    _native_weights_(layer, case)
    model, opt = _optimizer(layer, run)
    bal = mbalancer.attach(layer, opt, writers=[]) if run.interval else None
    fixed_x, _ = _data(case, 10_000, dist.get_rank())
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    around_migration = []
    placements = []
    if bal is not None:
        _probe_migrations(bal, layer, fixed_x, dtype, around_migration)
        placements = record_placements(bal)
    losses, grad_norms, params_norms = [], [], []
    split = run.checkpoint_step if run.checkpoint_dir else run.steps
    _train_steps(model, opt, case, run, range(split), losses, grad_norms, params_norms)
    resumed = None
    if run.checkpoint_dir is not None:
        from .balancer_checkpoint_testing import save_and_resume

        resumed = save_and_resume(case, run, layer, model, opt, bal, split)
    _train_steps(model, opt, case, run, range(split, run.steps), losses, grad_norms, params_norms)
    if resumed is not None:
        resumed_placements = record_placements(resumed["bal"])
        _train_steps(resumed["model"], resumed["opt"], case, run, range(split, run.steps),
                     resumed["losses"], resumed["grad_norms"])
        _sync_params(resumed["model"], run)
        resumed = {"losses": resumed["losses"], "grad_norms": resumed["grad_norms"],
                   "events": list(resumed["bal"].events), "slots": slot_contents(resumed["layer"], resumed["bal"]),
                   "restored": resumed["restored"], "saved": resumed["saved"], "placements": resumed_placements}
    _sync_params(model, run)
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "params_norms": params_norms,
        "events": [] if bal is None else list(bal.events),
        "around_migration": around_migration,
        "slots": slot_contents(layer, bal),
        "placement": None if bal is None else bal.placement_rows(),
        "tolerance": None if bal is None else bal.tolerance,
        "move_budget": None if bal is None else bal.move_budget,
        "placements": placements,
        "experts": _expert_weights(layer, bal),
        "ep_rank": _ep_rank(),
        "resumed": resumed,
    }


def migrate_with_gather_in_flight(case: LayerCase, run: TrainRun) -> dict:
    """Two migrations under the distributed optimizer with overlapped param gather: the first
    starts while a param all-gather is in flight (as after Megatron's optimizer step with
    --overlap-param-gather-with-optimizer-step), the second with none. Per migration: the
    layer's output for a fixed input before and after, the expert bucket groups with a
    gather in flight, and how many all-gathers each group ran."""
    from . import balancer as mbalancer

    layer = _build(case, run)
    _native_weights_(layer, case)
    model, opt = _optimizer(layer, run)
    bal = mbalancer.attach(layer, opt, writers=[])
    _train_steps(model, opt, case, run, range(3), [], [])
    _sync_params(model, run)
    groups = model.expert_parallel_bucket_groups
    gathers = {id(g): 0 for g in groups}
    for g in groups:
        original = g.start_param_sync

        def counted(force_sync=False, _g=g, _original=original):
            gathers[id(_g)] += _g.param_gather_handle is None  # with a handle it only waits for it
            return _original(force_sync=force_sync)

        g.start_param_sync = counted
    rows = bal.placement_rows()
    P = bal.slots_per_rank
    swapped = rows.clone()
    swapped[0, :2], swapped[0, P:P + 2] = rows[0, P:P + 2], rows[0, :2]  # EP ranks 0 and 1 swap two slots
    out = []
    for new, in_flight in ((swapped, True), (rows, False)):
        before = _fixed_output(layer, run)
        _sync_params(model, run)
        with torch.no_grad():
            if in_flight:
                model.start_param_sync()  # async
            handles = sum(g.param_gather_handle is not None for g in groups)
            for g in groups:
                gathers[id(g)] = 0
            bal.apply_placement(new)
        counts = sorted(gathers.values())
        out.append({"before": before, "after": _fixed_output(layer, run), "in_flight": handles, "gathers": counts})
    return {"migrations": out, "groups": len(groups)}


def attach_placement_file(case: LayerCase, slots_per_rank: int, path: str):
    """attach() with --hybrid-ep-balancer-placement set to path: the placement rows it set up,
    or the ValueError's message."""
    import megatron_patches

    from . import balancer as mbalancer

    init_megatron(case.world_size)
    options = megatron_patches.HybridEPOptions(balancer_interval=5, balancer_slots_per_rank=slots_per_rank,
                                               balancer_placement=path)
    layer = build_moe_layer(case, hybrid_ep_options=options)
    try:
        bal = mbalancer.attach(layer, torch.optim.AdamW(layer.parameters()), writers=[])
    except ValueError as err:
        return str(err)
    return bal.placement_rows()


def _expert_weights(layer, bal) -> dict:
    """expert id -> (fc1, fc2) of the first local slot holding it (float64)."""
    P = len(layer.experts.local_experts)
    rank = _ep_rank()
    L = layer.config.num_moe_experts // layer.config.expert_model_parallel_size
    out = {}
    for j, expert in enumerate(layer.experts.local_experts):
        e = int(bal.placement_rows()[0, rank * P + j]) if bal is not None else rank * L + j
        out.setdefault(e, (expert.linear_fc1.weight.detach().double().clone(),
                           expert.linear_fc2.weight.detach().double().clone()))
    return out
