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

import torch
import torch.distributed as dist

from megatron_patches.local.common import init_megatron
from megatron_patches.local.layer import LayerCase, build_moe_layer

from .balancer_checkpoints import save_and_resume
from .balancer_common import (
    TrainRun,
    build_layer,
    ep_rank,
    expert_weights,
    fixed_output,
    make_optimizer,
    native_weights_,
    step_data,
    sync_params,
    train_steps,
)


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
    rank = ep_rank()
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


def train_moe_layer(case: LayerCase, run: TrainRun) -> dict:
    from megatron_patches import balancer as mbalancer

    layer = build_layer(case, run)
    native_weights_(layer, case)
    model, opt = make_optimizer(layer, run)
    bal = mbalancer.attach(layer, opt, writers=[]) if run.interval else None
    fixed_x, _ = step_data(case, 10_000, dist.get_rank())
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    around_migration = []
    placements = []
    if bal is not None:
        _probe_migrations(bal, layer, fixed_x, dtype, around_migration)
        placements = record_placements(bal)
    losses, grad_norms, params_norms = [], [], []
    split = run.checkpoint_step if run.checkpoint_dir else run.steps
    train_steps(model, opt, case, run, range(split), losses, grad_norms, params_norms)
    resumed = None
    if run.checkpoint_dir is not None:
        resumed = save_and_resume(case, run, layer, model, opt, bal, split)
    train_steps(model, opt, case, run, range(split, run.steps), losses, grad_norms, params_norms)
    if resumed is not None:
        resumed_placements = record_placements(resumed["bal"])
        train_steps(resumed["model"], resumed["opt"], case, run, range(split, run.steps),
                     resumed["losses"], resumed["grad_norms"])
        sync_params(resumed["model"], run)
        resumed = {"losses": resumed["losses"], "grad_norms": resumed["grad_norms"],
                   "events": list(resumed["bal"].events), "slots": slot_contents(resumed["layer"], resumed["bal"]),
                   "restored": resumed["restored"], "saved": resumed["saved"], "placements": resumed_placements}
    sync_params(model, run)
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
        "rdma_weight": None if bal is None else bal.rdma_weight,
        "routing_nodes": None if bal is None else bal.routing_nodes,
        "placements": placements,
        "experts": expert_weights(layer, bal),
        "ep_rank": ep_rank(),
        "resumed": resumed,
    }


def migrate_with_gather_in_flight(case: LayerCase, run: TrainRun) -> dict:
    """Two migrations under the distributed optimizer with overlapped param gather: the first
    starts while a param all-gather is in flight (as after Megatron's optimizer step with
    --overlap-param-gather-with-optimizer-step), the second with none. Per migration: the
    layer's output for a fixed input before and after, the expert bucket groups with a
    gather in flight, and how many all-gathers each group ran."""
    from megatron_patches import balancer as mbalancer

    layer = build_layer(case, run)
    native_weights_(layer, case)
    model, opt = make_optimizer(layer, run)
    bal = mbalancer.attach(layer, opt, writers=[])
    train_steps(model, opt, case, run, range(3), [], [])
    sync_params(model, run)
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
        before = fixed_output(layer, run)
        sync_params(model, run)
        with torch.no_grad():
            if in_flight:
                model.start_param_sync()  # async
            handles = sum(g.param_gather_handle is not None for g in groups)
            for g in groups:
                gathers[id(g)] = 0
            bal.apply_placement(new)
        counts = sorted(gathers.values())
        out.append({"before": before, "after": fixed_output(layer, run), "in_flight": handles, "gathers": counts})
    return {"migrations": out, "groups": len(groups)}


def attach_placement_file(case: LayerCase, slots_per_rank: int, path: str):
    """attach() with --hybrid-ep-balancer-placement set to path: the placement rows it set up,
    or the ValueError's message."""
    import megatron_patches
    from megatron_patches import balancer as mbalancer

    init_megatron(case.world_size)
    options = megatron_patches.HybridEPOptions(balancer_interval=5, balancer_slots_per_rank=slots_per_rank,
                                               balancer_placement=path)
    layer = build_moe_layer(case, hybrid_ep_options=options)
    try:
        bal = mbalancer.attach(layer, torch.optim.AdamW(layer.parameters()), writers=[])
    except ValueError as err:
        return str(err)
    return bal.placement_rows()
