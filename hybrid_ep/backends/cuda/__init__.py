"""The cuda backend: hybrid_ep._C kernels over NVLink (DESIGN.md sections 1 and 5).

- layout.py: byte layout of the registered buffer and the per-call info tensor
- launch.py: SM counts, FIFO shape, co-residency
- registered.py: allocation and exchange of registered buffers (CUDA IPC / fabric handles)
- engine.py: the call sequence (layout kernel, dispatch kernel, combine kernel)
- backend.py: the Backend used by HybridEPBuffer, one rank per process
- emulation.py: W virtual ranks on one GPU, for tests and benchmarks
"""

from __future__ import annotations

import importlib


def load_extension():
    """hybrid_ep._C, or ImportError with the reason."""
    return importlib.import_module("hybrid_ep._C")


__all__ = ["load_extension"]
