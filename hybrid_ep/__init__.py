"""hybrid-ep: hierarchical NVLink + RDMA expert-parallel dispatch and combine for MoE training.

Start with `HybridEPBuffer` (docs/architecture.md, Public API); `dispatch` / `combine` are the autograd
versions of its two calls.
"""

from .autograd import combine, dispatch
from .buffer import HybridEPBuffer
from .config import BufferConfig, KernelConfig
from .fp8 import dequantize_fp8, quantize_fp8
from .handle import DispatchHandle, DispatchResult
from .memory import MemoryPlan
from .traffic import Traffic

__version__ = "0.1.0"

__all__ = [
    "BufferConfig",
    "DispatchHandle",
    "DispatchResult",
    "HybridEPBuffer",
    "KernelConfig",
    "MemoryPlan",
    "Traffic",
    "combine",
    "dequantize_fp8",
    "dispatch",
    "quantize_fp8",
]
