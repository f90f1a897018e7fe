"""What the balancer harnesses share: the run's settings, the layer, its optimizer, its training steps.

balancer_runs (training runs with and without the expert balancer) and balancer_checkpoints
(save, load fresh, go on) both build a layer with `build_layer`, load the seeded weights of
a run without the balancer with `native_weights_`, wrap it with `make_optimizer` and train it
with `train_steps` on `step_data`; `fixed_output` and `expert_weights` are what they compare.
Legend: S sequence, B batch, H hidden, E experts, W EP ranks, L = E / W.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megatron_patches.local.common import init_megatron
from megatron_patches.local.layer import LayerCase, build_moe_layer, case_tensors


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
    rdma_weight: float | None = None  # HybridEPOptions.balancer_rdma_weight (None: the node-agnostic plan)
    ranks_per_node: int | None = None  # HybridEPOptions.ranks_per_node (None: from the launch)
    frozen: str | None = None       # parameters whose name contains this get requires_grad=False

    def __post_init__(self):
        if self.gradient_accumulation_fusion and self.optimizer == "torch":
            raise ValueError("gradient_accumulation_fusion needs optimizer 'megatron' or 'distributed' "
                             "(Megatron's DDP gives each parameter the main_grad it accumulates into)")


def ep_rank() -> int:
    """This rank's index in Megatron's expert-parallel group."""
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()


def step_data(case: LayerCase, step: int, rank: int):
    """(input, target) [S, B, H] of one step and rank: inputs share an offset the router favours (hot experts)."""
    g = torch.Generator().manual_seed(case.seed * 7919 + step * 104729 + rank)
    x = torch.randn(case.seq, case.batch, case.hidden, generator=g)
    bias = torch.Generator().manual_seed(case.seed + 17)
    hot = torch.randn(case.hidden, generator=bias)
    target = torch.randn(case.seq, case.batch, case.hidden, generator=g)
    return x + 2.0 * hot, target


def build_layer(case: LayerCase, run: TrainRun):
    """The run's MoELayer (with the balancer's options when run.interval > 0), on a fresh buffer cache."""
    import megatron_patches
    from megatron_patches.buffers import BUFFERS

    init_megatron(case.world_size)
    BUFFERS.clear()  # sized from this run's first call, as a fresh job would (the pool's processes serve other tests)
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    options = megatron_patches.HybridEPOptions(
        balancer_interval=run.interval, balancer_slots_per_rank=run.slots_per_rank, balancer_window=run.window,
        balancer_tolerance=run.tolerance, balancer_move_budget=run.move_budget, balancer_rdma_weight=run.rdma_weight,
        ranks_per_node=run.ranks_per_node,
    ) if run.interval else megatron_patches.HybridEPOptions(ranks_per_node=run.ranks_per_node)
    layer = build_moe_layer(case, bf16=run.bf16, params_dtype=dtype, hybrid_ep_options=options,
                            gradient_accumulation_fusion=run.gradient_accumulation_fusion)
    layer._hybrid_ep_case = case
    if run.frozen:
        for name, param in layer.named_parameters():
            if run.frozen in name:
                param.requires_grad_(False)
    return layer


def native_weights_(layer, case: LayerCase) -> None:
    """Expert r * E/W + j in local slot j (what a run without the balancer holds)."""
    L = case.num_experts // case.world_size
    rank = ep_rank()
    router, fc1, fc2, _, _ = case_tensors(case)
    with torch.no_grad():
        layer.router.weight.copy_(router)
        for j, expert in enumerate(layer.experts.local_experts):
            e = rank * L + j if j < L else 0  # spare slots: anything; the balancer overwrites them
            expert.linear_fc1.weight.copy_(fc1[e])
            expert.linear_fc2.weight.copy_(fc2[e])


def make_optimizer(layer, run: TrainRun):
    """(model, optimizer): the layer and torch AdamW, or Megatron's DDP and optimizer (run.optimizer)."""
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


def fixed_output(layer, run: TrainRun) -> torch.Tensor:
    """The layer's output (float64) for this rank's fixed probe input."""
    x, _ = step_data(layer_case(layer), 10_000, dist.get_rank())
    with torch.no_grad():
        return layer(x.to(torch.bfloat16 if run.bf16 else torch.float32))[0].double()


def layer_case(layer) -> LayerCase:
    """The LayerCase build_layer made the layer from."""
    return layer._hybrid_ep_case


def params_norm(model, run: TrainRun) -> float:
    """Megatron-LM's params norm of the model, as its training loop logs it (under this run's
    own Megatron-LM args, set for the call only: the pool's processes serve other runs)."""
    import types

    from megatron.training import global_vars, training

    from megatron_patches import balancer as mbalancer

    mbalancer.install_training_hook()
    saved = global_vars._GLOBAL_ARGS
    global_vars._GLOBAL_ARGS = types.SimpleNamespace(bf16=run.bf16, use_megatron_fsdp=False)
    try:
        return float(training.calc_params_l2_norm(model))
    finally:
        global_vars._GLOBAL_ARGS = saved


def train_steps(model, opt, case, run, steps, losses, grad_norms, params_norms=None) -> None:
    """Train the given steps; appends the mean loss over ranks (and the Megatron optimizers' norms)."""
    rank = dist.get_rank()
    dtype = torch.bfloat16 if run.bf16 else torch.float32
    for step in steps:
        x, target = step_data(case, step, rank)
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
            params_norms.append(params_norm(model, run))


def sync_params(model, run: TrainRun) -> None:
    """Whole weights on every member (an overlapped param gather waits for the next forward)."""
    if run.optimizer == "distributed":
        with torch.no_grad():
            model.start_param_sync(force_sync=True)


def expert_weights(layer, bal) -> dict:
    """expert id -> (fc1, fc2) of the first local slot holding it (float64)."""
    P = len(layer.experts.local_experts)
    rank = ep_rank()
    L = layer.config.num_moe_experts // layer.config.expert_model_parallel_size
    out = {}
    for j, expert in enumerate(layer.experts.local_experts):
        e = int(bal.placement_rows()[0, rank * P + j]) if bal is not None else rank * L + j
        out.setdefault(e, (expert.linear_fc1.weight.detach().double().clone(),
                           expert.linear_fc2.weight.detach().double().clone()))
    return out
