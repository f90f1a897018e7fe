"""Training runs of a Megatron MoELayer with and without the expert balancer (tests, docs).

`train_moe_layer` runs on every rank of a hybrid_ep.spawn.ProcessGroupPool (gloo on CPU):
a MoELayer with Megatron's SequentialMLP experts, seeded weights identical in every run,
trained on skewed inputs (a shared offset the router favours, so a few experts run hot)
toward a seeded target. The optimizer is torch AdamW ("torch") or Megatron's own optimizer
over Megatron's DistributedDataParallel ("megatron", fp32 or bf16 mixed precision). With
`interval` > 0 the expert balancer rebalances every `interval` steps, with
`slots_per_rank` slots per rank (more than E / EP: replicas).

Returned per rank: losses (mean over ranks), the migration events, the output for a fixed
input just before and after every migration, and every slot's contents at the end, so a
test can compare runs and check replicas are identical.

Legend: S sequence, B batch, H hidden, F expert ffn, E experts, W EP ranks.
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist

from .testing import LayerCase, build_moe_layer, case_tensors, init_megatron


def _data(case: LayerCase, step: int, rank: int):
    g = torch.Generator().manual_seed(case.seed * 7919 + step * 104729 + rank)
    x = torch.randn(case.seq, case.batch, case.hidden, generator=g)
    bias = torch.Generator().manual_seed(case.seed + 17)
    hot = torch.randn(case.hidden, generator=bias)
    target = torch.randn(case.seq, case.batch, case.hidden, generator=g)
    return x + 2.0 * hot, target


def _build(case: LayerCase, *, interval: int, slots_per_rank: int | None, bf16: bool):
    import megatron_patches

    init_megatron(case.world_size)
    dtype = torch.bfloat16 if bf16 else torch.float32
    options = megatron_patches.HybridEPOptions(
        balancer_interval=interval, balancer_slots_per_rank=slots_per_rank,
    ) if interval else megatron_patches.HybridEPOptions()
    return build_moe_layer(case, bf16=bf16, params_dtype=dtype, hybrid_ep_options=options)


def _native_weights_(layer, case: LayerCase, rank: int) -> None:
    """Expert r * E/W + j in local slot j (what a run without the balancer holds)."""
    L = case.num_experts // case.world_size
    router, fc1, fc2, _, _ = case_tensors(case)
    with torch.no_grad():
        layer.router.weight.copy_(router)
        for j, expert in enumerate(layer.experts.local_experts):
            e = rank * L + j if j < L else 0  # spare slots: anything; the balancer overwrites them
            expert.linear_fc1.weight.copy_(fc1[e])
            expert.linear_fc2.weight.copy_(fc2[e])


def _optimizer(layer, kind: str, bf16: bool, lr: float):
    if kind == "torch":
        return layer, torch.optim.AdamW(layer.parameters(), lr=lr, weight_decay=0.0)
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp = DistributedDataParallel(
        layer.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True, use_distributed_optimizer=False), layer,
    )
    config = OptimizerConfig(optimizer="adam", lr=lr, weight_decay=0.0, bf16=bf16, fp16=False,
                             use_distributed_optimizer=False, clip_grad=1.0)
    return ddp, get_megatron_optimizer(config, [ddp])


def slot_contents(layer, balancer) -> list[dict]:
    """Per local slot: expert id, weights, and (when the optimizer has them) master weights
    and Adam moments, all as float64 on the CPU."""
    from hybrid_ep.balancer.state import movable_tensors

    rows = balancer.placement_rows()[0] if balancer is not None else None
    rank = dist.get_rank()
    out = []
    for j, params in enumerate(balancer.layers[0].slot_params if balancer else []):
        tensors = [t.detach().double().cpu().clone() for p in params for t in movable_tensors(p, balancer.view)]
        out.append({"slot": rank * len(balancer.layers[0].slot_params) + j,
                    "expert": int(rows[rank * len(balancer.layers[0].slot_params) + j]), "tensors": tensors})
    return out


def train_moe_layer(case: LayerCase, steps: int = 20, interval: int = 0, slots_per_rank: int | None = None,
                    optimizer: str = "torch", bf16: bool = False, lr: float = 1e-2,
                    checkpoint_dir: str | None = None) -> dict:
    from . import balancer as mbalancer

    rank = dist.get_rank()
    layer = _build(case, interval=interval, slots_per_rank=slots_per_rank, bf16=bf16)
    _native_weights_(layer, case, rank)
    model, opt = _optimizer(layer, optimizer, bf16, lr)
    bal = mbalancer.attach(layer, opt, writers=[]) if interval else None
    fixed_x, _ = _data(case, 10_000, rank)
    dtype = torch.bfloat16 if bf16 else torch.float32
    around_migration = []
    if bal is not None:
        original_apply = bal.apply_placement

        def apply_and_probe(*args, **kwargs):
            with torch.no_grad():
                before = layer(fixed_x.to(dtype))[0].double()
            moved = original_apply(*args, **kwargs)
            with torch.no_grad():
                after = layer(fixed_x.to(dtype))[0].double()
            around_migration.append({"before": before, "after": after, "moved": moved})
            return moved

        bal.apply_placement = apply_and_probe
    losses, grad_norms = [], []
    for step in range(steps):
        x, target = _data(case, step, rank)
        if optimizer == "megatron":
            model.zero_grad_buffer()
        opt.zero_grad()
        out, _ = model(x.to(dtype))
        loss = ((out.float() - target) ** 2).mean()
        loss.backward()
        if optimizer == "megatron":
            model.finish_grad_sync()
        stepped = opt.step()
        if optimizer == "megatron":
            grad_norms.append(float(stepped[1]))
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(float(mean) / dist.get_world_size())
    result = {
        "losses": losses,
        "grad_norms": grad_norms,
        "events": [] if bal is None else list(bal.events),
        "around_migration": around_migration,
        "slots": slot_contents(layer, bal) if bal is not None else [],
        "placement": None if bal is None else bal.placement_rows(),
        "experts": _expert_weights(layer, bal),
    }
    if checkpoint_dir is not None:
        result["checkpoint"] = _checkpoint_round_trip(case, layer, opt, bal, checkpoint_dir, interval,
                                                      slots_per_rank, optimizer, bf16, lr)
    return result


def _expert_weights(layer, bal) -> dict:
    """expert id -> (fc1, fc2) of the first local slot holding it (float64)."""
    P = len(layer.experts.local_experts)
    rank = dist.get_rank()
    L = layer.config.num_moe_experts // dist.get_world_size()
    out = {}
    for j, expert in enumerate(layer.experts.local_experts):
        e = int(bal.placement_rows()[0, rank * P + j]) if bal is not None else rank * L + j
        out.setdefault(e, (expert.linear_fc1.weight.detach().double().clone(),
                           expert.linear_fc2.weight.detach().double().clone()))
    return out


def _checkpoint_round_trip(case, layer, opt, bal, directory, interval, slots_per_rank, optimizer, bf16, lr):
    """Save model + optimizer state, load them into a freshly built run, compare; also try
    loading into a run with a different number of slots."""
    from . import balancer as mbalancer

    rank = dist.get_rank()
    path = os.path.join(directory, f"rank{rank}.pt")
    torch.save({"model": layer.state_dict(), "optimizer": opt.state_dict()}, path)
    saved_slots = slot_contents(layer, bal)
    saved_placement = bal.placement_rows()

    fresh = _build(case, interval=interval, slots_per_rank=slots_per_rank, bf16=bf16)
    torch.manual_seed(1000 + rank)
    with torch.no_grad():
        for p in fresh.parameters():
            p.normal_()
    model2, opt2 = _optimizer(fresh, optimizer, bf16, lr)
    state = torch.load(path, weights_only=False)
    fresh.load_state_dict(state["model"])
    # (Megatron's optimizer state_dict also carries the fp32 master copies of a mixed-precision run.)
    opt2.load_state_dict(state["optimizer"])
    bal2 = mbalancer.attach(fresh, opt2, writers=[])
    loaded_slots = slot_contents(fresh, bal2)
    max_diff = 0.0
    for a, b in zip(saved_slots, loaded_slots):
        assert a["expert"] == b["expert"] and len(a["tensors"]) == len(b["tensors"])
        for x, y in zip(a["tensors"], b["tensors"]):
            max_diff = max(max_diff, float((x - y).abs().max()) if x.numel() else 0.0)
    other = _build(case, interval=interval, slots_per_rank=(slots_per_rank or 0) + 1, bf16=bf16)
    try:
        other.load_state_dict(state["model"])
        mismatch_error = None
    except Exception as err:  # the test checks the message
        mismatch_error = f"{type(err).__name__}: {err}"
    return {
        "placement_equal": bool(torch.equal(saved_placement, bal2.placement_rows())),
        "max_abs_diff": max_diff,
        "num_tensors": sum(len(s["tensors"]) for s in saved_slots),
        "mismatch_error": mismatch_error,
    }


def temporary_directory() -> str:
    return tempfile.mkdtemp(prefix="hybrid_ep_balancer_ckpt_")
