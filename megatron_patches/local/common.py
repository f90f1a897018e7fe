"""What the CPU trainer, the demo, the layer benchmark and the test harnesses share.

`quiet_libraries` (Megatron's warnings off: the output is the table), `counting_batch` (the
token ids every local run trains on, with `batch_seed`, their seed), `PLAIN_FP32_CONFIG`
(TransformerConfig fields for fp32 runs on the host) and `init_megatron` (the patches, with the
CPU stand-ins asked for, and Megatron's parallel state on the current torch.distributed world).
"""

from __future__ import annotations

import torch


def quiet_libraries() -> None:
    """Megatron warns about every optional package it does not find; a local run prints its own lines."""
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    for name in ("megatron", "torch.utils.cpp_extension"):
        logging.getLogger(name).setLevel(logging.ERROR)


def batch_seed(seed: int, step: int, rank: int, micro: int = 0) -> int:
    """The generator seed of one batch: different for every step, micro-batch and rank."""
    return seed * 1_000_003 + step * 1009 + micro * 101 + rank


def counting_batch(step: int, rank: int, batch: int, seq: int, vocab: int, seed: int, micro: int = 0) -> torch.Tensor:
    """[batch, seq + 1] token ids: each sequence counts upward by a stride of 1 to 4 from a random
    start, modulo the vocabulary (a model learns it within a few dozen steps)."""
    g = torch.Generator().manual_seed(batch_seed(seed, step, rank, micro))
    start = torch.randint(0, vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 5, (batch, 1), generator=g)
    return (start + stride * torch.arange(seq + 1)) % vocab


# TransformerConfig fields shared by the demo and the tests: fp32 weights built on the host,
# no dropout, no fused kernels (they need a GPU), so results compare exactly across dispatchers.
PLAIN_FP32_CONFIG = dict(
    add_bias_linear=False,
    use_cpu_initialization=True,
    params_dtype=torch.float32,
    hidden_dropout=0.0,
    attention_dropout=0.0,
    bias_activation_fusion=False,
    gradient_accumulation_fusion=False,
)


def init_megatron(expert_parallel: int, seed: int = 1234, *, tensor_parallel: int = 1,
                  expert_tensor_parallel: int = 1, pipeline_parallel: int = 1,
                  virtual_pipeline: int | None = None) -> None:
    """Megatron's parallel state on the current torch.distributed world; re-initialised when
    an earlier call on this process asked for another layout."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    import megatron_patches

    megatron_patches.apply(cpu_compat=True)  # local runs: Megatron's CUDA-only calls on the CPU
    layout = (expert_parallel, tensor_parallel, expert_tensor_parallel, pipeline_parallel, virtual_pipeline)
    if ps.model_parallel_is_initialized() and getattr(ps, "_hybrid_ep_layout", layout) != layout:
        from ..buffers import BUFFERS

        ps.destroy_model_parallel()
        BUFFERS.clear()  # their groups are gone
        _destroy_subgroups()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tensor_parallel,
            pipeline_model_parallel_size=pipeline_parallel,
            virtual_pipeline_model_parallel_size=virtual_pipeline,
            expert_model_parallel_size=expert_parallel,
            expert_tensor_parallel_size=expert_tensor_parallel,
        )
        ps._hybrid_ep_layout = layout
    if ps.get_expert_model_parallel_world_size() != expert_parallel:
        raise RuntimeError(
            f"Megatron parallel state already has EP={ps.get_expert_model_parallel_world_size()}, "
            f"asked for {expert_parallel}"
        )
    model_parallel_cuda_manual_seed(seed)
    reset_moe_globals()


def _destroy_subgroups() -> None:
    """Destroys every process group but the world: Megatron's destroy_model_parallel drops its
    references only, and torch keeps each gloo group with its own polling thread, so a process
    that re-initialises many layouts (a test pool's ranks) would accumulate hundreds of them."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    for group in list(distributed_c10d._world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)


def reset_moe_globals() -> None:
    """Megatron keeps MoE state per process (per-layer metrics sized by the first model that
    records them, the aux-loss scale shaped by its first user); a run starts afresh."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    try:
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:  # Megatron-Core before 0.17
        return
    destroy_moe_metrics_tracker()
