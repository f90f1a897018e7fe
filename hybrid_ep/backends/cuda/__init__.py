"""The cuda backend: hybrid_ep._C kernels over NVLink inside a node and an inter-node
transport between nodes (docs/architecture.md, "cuda backend"; csrc/README.md).

- layout.py: byte layout of the registered buffer, the RDMA region and the per-call info tensor
- launch.py: SM counts, FIFO shape, co-residency, the launch arguments of each kind of launch
- registered.py: registered buffers (CUDA IPC / fabric handles) and RDMA regions (loopback, NVSHMEM)
- nvshmem.py: NVSHMEM's one initialisation per process and its symmetric heap
- engine.py: the call sequence (count kernel, dispatch kernel, combine kernel)
- workspace.py: the per-call workspace of a dispatch and the handle's views of it
- errors.py: what a kernel recorded when it failed, as the text the host raises
- paths.py: which data path a dispatch takes, and the log line when it leaves the direct path
- backend.py: the Backend used by HybridEPBuffer, one rank per process
- emulation.py: W = N x G virtual ranks on one GPU (or on the CPU model), for tests and benchmarks

The kernels come in two builds of the same sources: hybrid_ep._C for the GPU, and
hybrid_ep._model, the CPU model of the device layer (csrc/device/model/), which runs them on
CPU tensors and checks what the hardware would punish (a development build only:
HYBRID_EP_BUILD_MODEL=1).
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
        try:
            return importlib.import_module("hybrid_ep._model")
        except ModuleNotFoundError as exc:
            if exc.name != "hybrid_ep._model":
                raise
            raise ImportError("the kernels on the CPU (hybrid_ep._model, the CPU model) are in a development build "
                              "only: HYBRID_EP_BUILD_MODEL=1 pip install --no-build-isolation -e <checkout> "
                              "(scripts/env.sh does it)") from exc
    raise ValueError(f"the cuda kernels run on a CUDA device or on the CPU model, not on {kind!r}")


__all__ = ["load_extension"]
