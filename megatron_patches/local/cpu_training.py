"""Megatron-LM's training loop (megatron.training: `pretrain()`) on a machine without a GPU.

`cpu_compat` covers Megatron-Core's modules; megatron.training assumes a GPU in a few more:

- `initialize_megatron` asserts `torch.cuda.is_available()`, and initialises the model-parallel
  state and the model-parallel RNG only when `torch.cuda.device_count() > 0`, after
  `torch.cuda.set_device(local_rank)`;
- `get_model` moves each model chunk with `module.cuda(current_device)`, and pretrain_gpt.py's
  batches go to the GPU with `tensor.cuda(non_blocking=True)`;
- `set_jit_fusion_options` warms the fused bias-GeLU and bias-dropout-add up on `device="cuda"`
  inputs (compiling them for the GPU; on the host they would compile for the CPU, and the
  warm-up's random inputs would draw from the host generator the model's initialisation uses):
  the warm-up is skipped;
- the loop, its logging and the rerun state machine make `device='cuda'` scalars, empty the
  CUDA cache, read CUDA memory statistics and save and restore the CUDA generator's state;
- not a GPU matter, but met on the same runs: `initialize_megatron` builds the dataset helpers
  with `make` in megatron/core/datasets, where the megatron-core wheel ships them built and
  without the Makefile (the run exits); with the wheel's built helpers importable, the build
  step is skipped.

`enable()` gives those modules a `torch` whose `cuda` says one device exists and places work
on the CPU (set_device and empty_cache do nothing, memory statistics read 0) and whose
factories asked for 'cuda' build on the CPU, and makes `Tensor.cuda` return the CPU tensor
itself. It is part of `cpu_compat.enable()`: asked for (HYBRID_EP_CPU_COMPAT=1 or
`apply(cpu_compat=True)`), and only where no GPU is visible.
"""

from __future__ import annotations

import functools
import importlib

import torch

# The megatron.training (and Megatron-Core) modules whose `torch` is replaced.
MODULES = (
    "megatron.training.initialize",
    "megatron.training.training",
    "megatron.training.utils.common_utils",
    "megatron.core.rerun_state_machine",
)


class _CudaOnTheHost:
    """`torch.cuda` as megatron.training sees it: one device, which is the host."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    @staticmethod
    def is_available():
        return True

    @staticmethod
    def device_count():
        return 1

    @staticmethod
    def set_device(device):
        return None

    @staticmethod
    def empty_cache():
        return None

    @staticmethod
    def memory_allocated(device=None):
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def get_rng_state(device="cuda"):
        return torch.get_rng_state()  # the host generator stands for the GPU's (as cpu_compat's RNG tracker)

    @staticmethod
    def set_rng_state(state, device="cuda"):
        torch.set_rng_state(state)


def _host_cuda_tensor(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    """Tensor.cuda without a GPU: the tensor stays where it is (on the host)."""
    return self


def _does_nothing_instead_of(original):
    """A function that does nothing in place of `original` (which patches.check() still finds)."""

    @functools.wraps(original)
    def nothing(*args, **kwargs):
        return None

    return nothing


def _use_built_dataset_helpers() -> None:
    import os

    from megatron.core.datasets import utils

    folder = os.path.dirname(os.path.abspath(utils.__file__))
    if os.path.exists(os.path.join(folder, "Makefile")):
        return  # a Megatron-LM checkout: its own build runs
    try:
        importlib.import_module("megatron.core.datasets.helpers_cpp")
    except ImportError:
        return  # nothing built: Megatron's build step runs and says why it fails
    utils.compile_helpers = _does_nothing_instead_of(utils.compile_helpers)


def _skip_jit_warmup() -> None:
    from megatron.training import initialize

    initialize._warmup_jit_function = _does_nothing_instead_of(initialize._warmup_jit_function)


def enable(cpu_factory_torch: type) -> None:
    """Install the stand-ins above (idempotent); cpu_compat.enable() calls it where no GPU is
    visible, with its `torch` whose factories asked for 'cuda' build on the CPU."""

    class _TrainingTorch(cpu_factory_torch):
        def __init__(self, real):
            super().__init__(real)
            self.cuda = _CudaOnTheHost(real.cuda)
            self._hybrid_ep_host_cuda = True

    for name in MODULES:
        module = importlib.import_module(name)
        if not hasattr(module.torch, "_hybrid_ep_host_cuda"):
            module.torch = _TrainingTorch(module.torch)
    torch.Tensor.cuda = _host_cuda_tensor
    _skip_jit_warmup()
    _use_built_dataset_helpers()
