"""hybrid-ep: hierarchical NVLink + RDMA expert-parallel dispatch and combine for MoE training.

Start with `HybridEPBuffer` (docs/architecture.md, Public API); `dispatch` / `combine` are the autograd
versions of its two calls.
"""

import importlib

__version__ = "0.1.0"

# The public names and their modules, imported on first use: `import hybrid_ep` (and a command
# line's argument check, hybrid_ep.cli_parser) loads no torch until one of them is asked for.
_EXPORTS = {
    "combine": ".autograd", "dispatch": ".autograd", "HybridEPBuffer": ".buffer", "BufferConfig": ".config",
    "KernelConfig": ".config", "dequantize_fp8": ".fp8", "quantize_fp8": ".fp8", "dequantize_mxfp8": ".fp8",
    "quantize_mxfp8": ".fp8", "DispatchHandle": ".handle",
    "DispatchResult": ".handle", "InputRefused": ".refusals", "MemoryPlan": ".memory", "Traffic": ".traffic",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    else:  # a submodule (hybrid_ep.routing after `import hybrid_ep`), as an eager package had them
        try:
            value = importlib.import_module(f".{name}", __name__)
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


__all__ = [
    "BufferConfig",
    "DispatchHandle",
    "DispatchResult",
    "HybridEPBuffer",
    "InputRefused",
    "KernelConfig",
    "MemoryPlan",
    "Traffic",
    "combine",
    "dequantize_fp8",
    "dequantize_mxfp8",
    "dispatch",
    "quantize_fp8",
    "quantize_mxfp8",
]
