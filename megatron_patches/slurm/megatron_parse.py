"""Parse a Megatron-LM argument list the way pretrain_gpt.py does, without a cluster.

`parse(argv, world_size)` runs megatron.training's parse_args (with
megatron_patches.extra_args_provider, so `hybrid_ep` and the --hybrid-ep-* flags are known) +
validate_args + core_transformer_config_from_args after megatron_patches.apply() and returns
(args, TransformerConfig). Nothing is allocated: a TransformerConfig is a dataclass of sizes,
so the 671B recipe parses on a laptop.

validate_args reads the world size from $WORLD_SIZE (and the rank from $RANK) when the
arguments are parsed; the recipe's world size and environment are set for the duration of
the call.

On a machine without the GPU stack (this project's CI, the CPU local mode), two stand-ins,
only for the duration of the call and only where the stack is missing:

- no CUDA device: validate_args asks the device's compute capability (whether grouped GEMM
  is supported; whether CUDA_DEVICE_MAX_CONNECTIONS matters for TP/CP, pre-Blackwell); it
  is answered with the capability of the recipe's GPU type (what the cluster will answer)
  instead of raising "no NVIDIA driver";
- no Transformer Engine: TransformerConfig refuses the default fused RoPE ("install TE");
  `--no-rope-fusion` is appended, which changes only which RoPE kernel runs.

Both are reported in `notes` so callers can say what was substituted.
"""

from __future__ import annotations

import contextlib
import os
import sys


@contextlib.contextmanager
def _as_process(argv: list[str], world_size: int, rank: int, env: dict):
    env = {**{k: str(v) for k, v in env.items()}, "WORLD_SIZE": str(world_size), "RANK": str(rank)}
    saved_argv, saved_env = sys.argv, {k: os.environ.get(k) for k in env}
    sys.argv = ["pretrain_gpt.py", *argv]
    os.environ.update(env)
    try:
        yield
    finally:
        sys.argv = saved_argv
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


# Compute capability by GPU type (answers validate_args' grouped-GEMM question without a GPU).
CAPABILITY = {"A100": (8, 0), "H100": (9, 0), "H200": (9, 0), "B200": (10, 0), "GB200": (10, 0),
              "B300": (10, 3), "GB300": (10, 3)}


def has_transformer_engine() -> bool:
    import importlib.util

    return importlib.util.find_spec("transformer_engine") is not None


@contextlib.contextmanager
def _capability(answer):
    import torch

    if answer is None or torch.cuda.is_available():
        yield
        return
    import types

    saved = torch.cuda.get_device_capability, torch.cuda.get_device_properties
    props = types.SimpleNamespace(major=answer[0], minor=answer[1], name="stand-in", total_memory=0,
                                  multi_processor_count=0)
    torch.cuda.get_device_capability = lambda device=None: answer
    torch.cuda.get_device_properties = lambda device=None: props
    try:
        yield
    finally:
        torch.cuda.get_device_capability, torch.cuda.get_device_properties = saved


def parse(argv: list[str], world_size: int, rank: int = 0, gpu_type: str = "H100", env: dict | None = None,
          notes: list | None = None):
    """(Megatron args namespace, TransformerConfig) of a pretrain_gpt.py argument list.

    env: the job's environment variables (a recipe's `env`), set for the call, since
    validate_args checks some of them (CUDA_DEVICE_MAX_CONNECTIONS with TP or CP).
    """
    import torch

    import megatron_patches

    megatron_patches.apply()
    from megatron.training import arguments

    notes = notes if notes is not None else []
    argv = list(argv)
    if not has_transformer_engine() and "--no-rope-fusion" not in argv:
        argv.append("--no-rope-fusion")
        notes.append("Transformer Engine not installed: --no-rope-fusion appended")
    answer = None
    if not torch.cuda.is_available():
        answer = CAPABILITY.get(gpu_type, (9, 0))
        notes.append(f"no CUDA device: compute capability answered as {answer} ({gpu_type})")
    with _as_process(argv, world_size, rank, env or {}), _capability(answer):
        args = arguments.parse_args(megatron_patches.extra_args_provider)
        arguments.validate_args(args)
        config = arguments.core_transformer_config_from_args(args)
    return args, config
