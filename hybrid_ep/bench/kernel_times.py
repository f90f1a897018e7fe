"""GPU time of each hybrid-ep kernel inside a timed call, from torch.profiler's CUDA activity.

A call's CUDA-event time holds its kernels and whatever keeps the GPU idle between them: a
dynamic-size dispatch launches the layout kernel, reads the output size on the host, then
launches the dispatch kernel, so the host's work between the two (in the single-GPU emulation:
every virtual rank's, one after another) lies inside the timed interval. The per-kernel times
say which part shrinks with SMs (the dispatch and combine kernels) and which does not (the
layout kernel, the host gap).
"""

from __future__ import annotations

import collections
import re
from typing import Callable, Iterable

import torch

# hybrid_ep's kernels live in namespaces `<name>_impl` (csrc/kernels/*.cuh), so their
# demangled names read `...<name>_impl::<name>_kernel<...>(LaunchArgs)`; torch's own kernels
# (the L2 flush's fill) do not.
_KERNEL = re.compile(r"\b\w+_impl::(\w+_kernel)\b")


def kernel_name(demangled: str) -> str | None:
    """The short name of a hybrid_ep kernel ("layout_kernel", "dispatch_direct_kernel", ...),
    None for any other kernel."""
    m = _KERNEL.search(demangled)
    return m.group(1) if m else None


def per_call_ms(events: Iterable[tuple[str, float]], calls: int) -> dict[str, float]:
    """{kernel: GPU ms per call} from (demangled name, microseconds) of the profiled kernels of
    `calls` calls; other kernels are left out."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    total_us: dict[str, float] = collections.defaultdict(float)
    for name, us in events:
        short = kernel_name(name)
        if short is not None:
            total_us[short] += us
    return {k: us / calls / 1e3 for k, us in sorted(total_us.items())}


def profiled_kernel_ms(fn: Callable[[], object], calls: int, before: Callable[[], object] | None = None
                       ) -> dict[str, float] | None:
    """GPU ms per call of each hybrid_ep kernel over `calls` calls of fn (each after `before`, the
    L2 flush), or None where the profiler records no CUDA activity (a build without CUPTI)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    kernels = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]
    if not kernels:
        return None
    return per_call_ms(kernels, calls)
