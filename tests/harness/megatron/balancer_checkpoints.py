"""Checkpoint round trips of a balanced Megatron MoELayer (tests): save, load fresh, go on.

`save_and_resume` runs inside balancer_runs.train_moe_layer on every rank: the balancer
folds its pending counts into the statistics (`prepare_checkpoint`, as the save hook does in
Megatron-LM), the layer and optimizer are saved in the legacy format (torch.save per rank,
the distributed optimizer's parameter state through its own save_parameter_state) or with
Megatron's dist_checkpointing (torch_dist: sharded_state_dict of layer and optimizer). In
the legacy format the distributed optimizer's shards are kept per rank as Megatron's
bucket-space parameter state (get_parameter_state_dp_reshardable): its gathered dp_zero
file cannot be loaded back on the CPU, where Megatron falls back to torch's Adam, whose
per-parameter `step` that loader does not expect. Then a
freshly built layer with scrambled weights and a new optimizer load them, and a new
balancer attaches to it. Both runs then train on; the test compares them.

`load_other_ep` loads a torch_dist checkpoint's layer into another EP size with the same
number of slots: the saved placement row is kept and the balancer re-plans from the saved
statistics at once.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import queue

import torch
import torch.distributed as dist

from megatron_patches.local.common import PLAIN_FP32_CONFIG, init_megatron
from megatron_patches.local.layer import build_moe_layer

from .balancer_common import (
    TrainRun,
    build_layer,
    expert_weights,
    fixed_output,
    make_optimizer,
    native_weights_,
    sync_params,
    train_steps,
)

# Megatron-LM's default placement of the distributed optimizer's state in torch_dist checkpoints.
_OPTIM_METADATA = {"distrib_optim_sharding_type": "dp_reshardable"}


@contextlib.contextmanager
def _write_results_in_process():
    """dist_checkpointing's file writer reports its write results through a queue served by
    a multiprocessing manager, a Python process it spawns once per rank (seconds per rank on
    a small CPU machine) and which a daemonic process (a test pool's rank) may not start. A
    synchronous save writes in this process, so an in-process queue carries the same results;
    the module's own queue is put back afterwards."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not hasattr(filesystem_async, "_results_queue"):  # another layout: let it start its manager
        with _may_start_processes():
            yield
        return
    kept = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = kept


@contextlib.contextmanager
def _may_start_processes():
    """A daemonic process (a test pool's rank) may start no process; a training process is
    not daemonic."""
    config = multiprocessing.current_process()._config
    daemon = config.get("daemon")
    config["daemon"] = False
    try:
        yield
    finally:
        config["daemon"] = daemon


def _save(run, layer, opt, directory: str) -> None:
    if run.checkpoint_format == "torch_dist":
        from megatron.core import dist_checkpointing

        model_sd = layer.sharded_state_dict()
        optim_sd = opt.sharded_state_dict(model_sd, metadata=_OPTIM_METADATA)
        with _write_results_in_process():
            dist_checkpointing.save({"model": model_sd, "optimizer": optim_sd}, directory)
        return
    if run.checkpoint_format != "legacy":
        raise ValueError(f"checkpoint_format must be 'legacy' or 'torch_dist', got {run.checkpoint_format!r}")
    torch.save({"model": layer.state_dict(), "optimizer": opt.state_dict()},
               os.path.join(directory, f"rank{dist.get_rank()}.pt"))
    if run.optimizer == "distributed":
        torch.save([o.get_parameter_state_dp_reshardable() for o in opt.chained_optimizers],
                   os.path.join(directory, f"distopt{dist.get_rank()}.pt"))
    dist.barrier()


def _load(run, layer, opt, directory: str) -> None:
    if run.checkpoint_format == "torch_dist":
        from megatron.core import dist_checkpointing

        model_sd = layer.sharded_state_dict()
        for inner in getattr(opt, "chained_optimizers", [opt]):
            if hasattr(inner, "_init_optimizer_states_with_dummy_values"):
                # torch's Adam (no Apex or TE, as on the CPU) has no `step` before its first
                # step, which the distributed optimizer's state_dict needs: one zero-gradient
                # step (it leaves the weights as they are) creates the states the load fills.
                inner._init_optimizer_states_with_dummy_values()
        optim_sd = opt.sharded_state_dict(model_sd, is_loading=True, metadata=_OPTIM_METADATA)
        loaded = dist_checkpointing.load({"model": model_sd, "optimizer": optim_sd}, directory)
        layer.load_state_dict(loaded["model"])
        with torch.no_grad():  # fp32 master shards are views of the weights
            opt.load_state_dict(loaded["optimizer"])
        return
    state = torch.load(os.path.join(directory, f"rank{dist.get_rank()}.pt"), weights_only=False)
    layer.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    if run.optimizer == "distributed":
        states = torch.load(os.path.join(directory, f"distopt{dist.get_rank()}.pt"), weights_only=False)
        for inner, param_state in zip(opt.chained_optimizers, states):
            for key, value in param_state.items():
                if isinstance(key, int):
                    for buckets in value.values():
                        for bucket in buckets:
                            for elem in bucket:
                                elem["padding"] = False
            with torch.no_grad():  # fp32 master shards are views of the weights
                inner.load_parameter_state_from_dp_reshardable(param_state)


def _fix_adam_steps(opt) -> None:
    """Megatron's DistributedOptimizer.load_state_dict on torch's Adam (no Apex or TE, as on
    the CPU) gives every parameter's state one shared `step` tensor, which torch's Adam then
    increments once per parameter per step, and its torch_dist load leaves `step` at the
    template's value; each parameter gets its own `step` again, at the checkpoint's step
    (which that load records in the param groups)."""
    for inner in getattr(opt, "chained_optimizers", [opt]):
        for group in inner.optimizer.param_groups:
            for p in group["params"]:
                state = inner.optimizer.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
                    if "step" in group:
                        state["step"].fill_(float(group["step"]))


def _scramble_(layer, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_()


def save_and_resume(case, run, layer, model, opt, bal, step: int) -> dict:
    from megatron_patches import balancer as mbalancer

    bal.prepare_checkpoint()
    sync_params(model, run)
    _save(run, layer, opt, run.checkpoint_dir)
    saved = {"placement": bal.placement_rows(), "load": bal.stats.load(), "steps": bal.steps,
             "carry": bal.stats.carry_LE.copy(), "experts": expert_weights(layer, bal),
             "output": fixed_output(layer, run)}
    fresh = build_layer(case, run)
    _scramble_(fresh, 1000 + dist.get_rank())
    model2, opt2 = make_optimizer(fresh, run)
    _load(run, fresh, opt2, run.checkpoint_dir)
    _fix_adam_steps(opt2)
    bal2 = mbalancer.attach(fresh, opt2, writers=[])
    sync_params(model2, run)
    restored = {
        "placement_equal": bool(torch.equal(saved["placement"], bal2.placement_rows())),
        "steps": (saved["steps"], bal2.steps),
        "load_equal": bool((saved["load"] == bal2.stats.load()).all()),
        "carry_equal": bool((saved["carry"] == bal2.stats.carry_LE).all()),
        "window_held": len(bal2.stats._recent),
    }
    return {"layer": fresh, "model": model2, "opt": opt2, "bal": bal2, "losses": [], "grad_norms": [],
            "restored": restored, "saved": saved}


def load_other_ep(case, run, directory: str) -> dict:
    """Load the layer of a torch_dist checkpoint into this pool's EP size (case.world_size)."""
    from megatron.core import dist_checkpointing

    from megatron_patches import balancer as mbalancer

    layer = build_layer(case, run)
    _scramble_(layer, 2000 + dist.get_rank())
    loaded = dist_checkpointing.load({"model": layer.sharded_state_dict()}, directory)
    layer.load_state_dict(loaded["model"])
    before = layer.hybrid_ep_slot_to_expert.clone()
    probe_before = fixed_output(layer, run)
    bal = mbalancer.attach(layer, None, writers=[])
    return {"events": list(bal.events), "placement_loaded": before, "placement": bal.placement_rows(),
            "load": bal.stats.load(), "steps": bal.steps, "experts": expert_weights(layer, bal),
            "probe_before": probe_before, "probe_after": fixed_output(layer, run)}


def load_elsewhere(case, run, directory: str) -> dict:
    """Load the layer of a torch_dist checkpoint into a layer built for `run` (another window,
    no balancer, ...): the load's error, or what the new balancer restored."""
    from megatron.core import dist_checkpointing
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    from megatron_patches import balancer as mbalancer

    layer = build_layer(case, run)
    try:
        loaded = dist_checkpointing.load({"model": layer.sharded_state_dict()}, directory)
        layer.load_state_dict(loaded["model"])
    except (Exception, CheckpointException) as e:  # the caller checks which error and what it says
        return {"error": f"{type(e).__name__}: {e}"}
    bal = mbalancer.attach(layer, None, writers=[]) if run.interval else None
    return {"error": None, "load": None if bal is None else bal.stats.load(),
            "held": None if bal is None else len(bal.stats._recent), "steps": None if bal is None else bal.steps}


def save_placement_only(case, run, directory: str) -> dict:
    """Train `run` (a balancer with S = E, placement only, or none) and save the layer with
    dist_checkpointing; the balancer's events, placement and statistics at the save."""
    from megatron.core import dist_checkpointing

    from megatron_patches import balancer as mbalancer

    layer = build_layer(case, run)
    native_weights_(layer, case)
    model, opt = make_optimizer(layer, run)
    bal = mbalancer.attach(layer, opt, writers=[])
    train_steps(model, opt, case, run, range(run.steps), [], [])
    if bal is not None:
        bal.prepare_checkpoint()
    with _write_results_in_process():
        dist_checkpointing.save({"model": layer.sharded_state_dict()}, directory)
    if bal is None:
        return {}
    return {"events": list(bal.events), "placement": bal.placement_rows(), "load": bal.stats.load()}


def load_unplaced(case, run) -> dict:
    """A layer's state saved before any placement was installed (its row still unset) loads
    into a fresh layer, whose balancer then installs the first placement as without one."""
    from megatron_patches import balancer as mbalancer

    saved = build_layer(case, run).state_dict()
    layer = build_layer(case, run)
    layer.load_state_dict(saved)
    unset = bool((layer.hybrid_ep_slot_to_expert < 0).all())
    bal = mbalancer.attach(layer, None, writers=[])
    try:  # into the attached layer: refused, its placement cannot come from this checkpoint
        layer.load_state_dict(saved)
        again = "loaded"
    except ValueError as err:
        again = str(err)
    return {"unset_after_load": unset, "placement": bal.placement_rows(), "after_attach": again}


def reload_after_attach(case, run) -> dict:
    """A layer trained 7 steps (a rebalance at 5, two steps of counts since) and saved (legacy
    state dict), loaded into a layer whose balancer is already attached (a reload in a
    running job): the balancer's statistics, step count and placement follow the checkpoint
    as when the checkpoint is loaded before attach."""
    from megatron_patches import balancer as mbalancer

    def state(bal):
        return {"steps": bal.steps, "load": bal.stats.load(), "carry": bal.stats.carry_LE.copy(),
                "placement": bal.placement_rows()}

    layer = build_layer(case, run)
    native_weights_(layer, case)
    model, opt = make_optimizer(layer, run)
    bal = mbalancer.attach(layer, opt, writers=[])
    train_steps(model, opt, case, run, range(7), [], [])
    bal.prepare_checkpoint()
    saved_dict = {k: v.clone() if torch.is_tensor(v) else v for k, v in layer.state_dict().items()}
    running = build_layer(case, run)
    native_weights_(running, case)
    model2, opt2 = make_optimizer(running, run)
    bal2 = mbalancer.attach(running, opt2, writers=[])
    running.load_state_dict(saved_dict)
    after = state(bal2)
    bal2.prepare_checkpoint()  # writes what it restored, not empty statistics
    return {"saved": state(bal), "after": after, "meta_after_save": running.hybrid_ep_load_meta.tolist(),
            "replan_pending": bal2.hybrid_ep_replan_pending}


def block_checkpoint(directory: str, pipeline_parallel: int, moe_layers_per_stage: int) -> dict:
    """A GPTModel of identical MoE layers (Megatron's TransformerBlock, as Megatron-LM builds
    Qwen3 and Mixtral) with the balancer on, each layer with its own placement and statistics,
    saved in torch_dist and loaded into a fresh model: what each layer held, and what it holds
    after the load. The block gives every layer the same checkpoint key; only the offsets it
    passes tell them (and the pipeline stages) apart."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    from megatron_patches import HybridEPOptions
    from megatron_patches import balancer as mbalancer

    pp = pipeline_parallel
    ep = dist.get_world_size() // pp
    init_megatron(ep, pipeline_parallel=pp)
    experts, per_rank = 4, 3  # spare slots: replicas

    def build():
        config = TransformerConfig(
            num_layers=moe_layers_per_stage * pp, hidden_size=16, num_attention_heads=2, ffn_hidden_size=32,
            moe_ffn_hidden_size=16, num_moe_experts=experts, moe_router_topk=2, moe_token_dispatcher_type="hybrid_ep",
            expert_model_parallel_size=ep, pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32 if pp > 1 else None, **PLAIN_FP32_CONFIG, masked_softmax_fusion=False,
            bias_dropout_fusion=False, persist_layer_norm=False)
        config.hybrid_ep_options = HybridEPOptions(balancer_interval=5, balancer_slots_per_rank=per_rank)
        return GPTModel(config, get_gpt_layer_local_spec(num_experts=experts, moe_grouped_gemm=False), vocab_size=64,
                        max_sequence_length=8, pre_process=ps.is_pipeline_first_stage(),
                        post_process=ps.is_pipeline_last_stage())

    def buffers(model):
        return [{name: getattr(m, name).tolist() for name in _BLOCK_BUFFERS}
                for m in model.modules() if hasattr(m, "hybrid_ep_slot_to_expert")]

    model = build()
    slots = per_rank * ep
    stage = ps.get_pipeline_model_parallel_rank()
    rows = [[(e + i + stage * moe_layers_per_stage) % experts for e in range(slots)]
            for i in range(moe_layers_per_stage)]  # another placement on every layer of every stage
    bal = mbalancer.attach(model, torch.optim.AdamW(model.parameters()), writers=[],
                           initial_placement=torch.tensor(rows))
    for i in range(moe_layers_per_stage):  # and other counts
        bal.stats.record(i, torch.arange(experts, dtype=torch.float64) + 10 * (i + stage * moe_layers_per_stage))
    bal.prepare_checkpoint()
    saved = buffers(model)
    with _write_results_in_process():
        dist_checkpointing.save(model.sharded_state_dict(), directory)
    fresh = build()
    fresh.load_state_dict(dist_checkpointing.load(fresh.sharded_state_dict(), directory), strict=False)
    return {"saved": saved, "loaded": buffers(fresh)}


_BLOCK_BUFFERS = ("hybrid_ep_slot_to_expert", "hybrid_ep_load_stats", "hybrid_ep_load_meta")


def _trained_state_dict(case, run):
    """A layer trained `run.steps` steps with the balancer: its legacy state dict, the balancer."""
    from megatron_patches import balancer as mbalancer

    layer = build_layer(case, run)
    native_weights_(layer, case)
    model, opt = make_optimizer(layer, run)
    bal = mbalancer.attach(layer, opt, writers=[])
    train_steps(model, opt, case, run, range(run.steps), [], [])
    bal.prepare_checkpoint()
    return layer.state_dict(), bal


def load_legacy_without_balancer(case, run) -> dict:
    """A layer trained with the balancer (`run`, a migration included) and saved in the legacy
    format, loaded into layers built without it (hybrid_ep with the balancer off, and
    Megatron's alltoall dispatcher) as Megatron-LM's load_checkpoint loads a model: a strict
    load, retried with strict=False on any error. Per dispatcher: the error, or None."""
    import dataclasses


    saved, bal = _trained_state_dict(case, run)
    out = {"slots_changed": sum(e["slots_changed"] for e in bal.events if e["applied"])}
    for dispatcher in ("hybrid_ep", "alltoall"):
        plain = build_layer(dataclasses.replace(case, dispatcher=dispatcher), TrainRun(run.steps))
        try:
            try:
                plain.load_state_dict(saved, strict=True)
            except Exception:  # noqa: BLE001 - Megatron-LM retries whatever failed
                plain.load_state_dict(saved, strict=False)
            out[dispatcher] = None
        except ValueError as err:
            out[dispatcher] = str(err)
    return out


def resume_at_iteration(case, run, start_iterations) -> dict:
    """A layer trained `run.steps` steps with the balancer and saved (legacy state dict), loaded
    into fresh layers attached with each start_iteration (None: a library call; Megatron-LM's
    iteration: a resume, or 0 under --finetune), each then trained `run.steps` more steps:
    per start_iteration, the step count after attach and the iterations it rebalanced at."""
    from megatron_patches import balancer as mbalancer

    saved, _ = _trained_state_dict(case, run)
    out = {}
    for start in start_iterations:
        fresh = build_layer(case, run)
        fresh.load_state_dict(saved)
        model, opt = make_optimizer(fresh, run)
        resumed = mbalancer.attach(fresh, opt, start_iteration=start, writers=[])
        steps = resumed.steps
        train_steps(model, opt, case, run, range(run.steps), [], [])
        out[start] = {"steps": steps, "rebalanced_at": [e["iteration"] for e in resumed.events]}
    return out


def stats_through_float16_module(case, fp16: bool) -> tuple[str, list]:
    """A balanced layer wrapped in Megatron's Float16Module (bf16, or fp16) as Megatron-LM's
    get_model wraps it, counts recorded and reduced, saved (legacy state dict) and loaded into
    another wrapped layer: the statistics buffer's dtype after the wrap, and the statistics
    the second balancer restored (the carry row: the counts since the last reduction)."""
    from megatron.core.transformer.module import Float16Module

    import megatron_patches
    from megatron_patches import balancer as mbalancer

    init_megatron(case.world_size)
    dtype = torch.float16 if fp16 else torch.bfloat16
    options = megatron_patches.HybridEPOptions(balancer_interval=1000, balancer_slots_per_rank=6)

    def wrapped():
        layer = build_moe_layer(case, hybrid_ep_options=options, bf16=not fp16, fp16=fp16, params_dtype=dtype)
        return Float16Module(layer.config, layer)

    model = wrapped()
    bal = mbalancer.attach(model, None, writers=[])
    bal.record(0, torch.tensor([1000003, 7, 513, 1]))
    bal.prepare_checkpoint()
    saved = model.module.state_dict()
    again = wrapped()
    again.module.load_state_dict(saved)
    restored = mbalancer.attach(again, None, writers=[])
    return str(again.module.hybrid_ep_load_stats.dtype), restored.stats.carry_LE[0].tolist()
