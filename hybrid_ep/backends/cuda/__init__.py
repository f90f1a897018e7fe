"""The cuda backend: hybrid_ep._C kernels over NVLink (DESIGN.md sections 1 and 5).

- layout.py: byte layout of the registered buffer and the per-call info tensor
- launch.py: SM counts, FIFO shape, co-residency
- registered.py: allocation and exchange of registered buffers (CUDA IPC / fabric handles)
- engine.py: the call sequence (layout kernel, dispatch kernel, combine kernel)
- backend.py: the Backend used by HybridEPBuffer, one rank per process
- emulation.py: W virtual ranks on one GPU (or on the CPU model), for tests and benchmarks

The kernels come in two builds of the same sources: hybrid_ep._C for the GPU, and
hybrid_ep._model, the CPU model of the device layer (csrc/device/model/), which runs them on
CPU tensors and checks what the hardware would punish.
"""

from __future__ import annotations

import importlib

import torch


def load_extension(device: torch.device | str = "cuda"):
    """hybrid_ep._C for a CUDA device, hybrid_ep._model for the CPU; ImportError with the reason."""
    kind = torch.device(device).type
    if kind == "cuda":
        return importlib.import_module("hybrid_ep._C")
    if kind == "cpu":
        return importlib.import_module("hybrid_ep._model")
    raise ValueError(f"the cuda kernels run on a CUDA device or on the CPU model, not on {kind!r}")


__all__ = ["load_extension"]
