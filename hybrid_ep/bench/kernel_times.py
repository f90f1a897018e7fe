"""GPU time of each hybrid-ep kernel inside a timed call, from torch.profiler's CUDA activity.

A call's CUDA-event time holds its kernels and whatever keeps the GPU idle between them: a
dynamic-size dispatch launches the count kernel, reads the output size on the host, then
launches the dispatch kernel, so the host's work between the two (in the single-GPU emulation:
every virtual rank's, one after another) lies inside the timed interval. The per-kernel times
say which part shrinks with SMs (the dispatch and combine kernels) and which does not (the
count kernel, the host gap). The other kernels a call runs (torch's own, memsets, copies) are
counted apart, so the time outside the hybrid_ep kernels splits into GPU work and idle gaps.
"""

from __future__ import annotations

import collections
import dataclasses
import re
from typing import Callable, Iterable

import torch

# hybrid_ep's kernels live in namespaces `<name>_impl` (csrc/kernels/*.cuh), so their
# demangled names read `...<name>_impl::<name>_kernel<...>(LaunchArgs)`; torch's own kernels
# (the L2 flush's fill) do not.
_KERNEL = re.compile(r"\b\w+_impl::(\w+_kernel)\b")


def kernel_name(demangled: str) -> str | None:
    """The short name of a hybrid_ep kernel ("count_kernel", "dispatch_direct_kernel", ...),
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


def other_kernels(events: Iterable[tuple[str, float]], calls: int) -> tuple[float, float]:
    """(launches, GPU ms) per call of the profiled kernels that are not hybrid_ep's: torch's
    own (fills, copies, index and reduction kernels of the host path), memsets and memcpys."""
    if calls < 1:
        raise ValueError(f"calls must be >= 1, got {calls}")
    others = [us for name, us in events if kernel_name(name) is None]
    return len(others) / calls, sum(others) / calls / 1e3


@dataclasses.dataclass
class CallKernels:
    """A call's GPU work from the profiler: `ours` {hybrid_ep kernel: ms per call}, and the
    other kernels' launches and ms per call (the L2 flush run before each call left out)."""

    ours: dict[str, float]
    other_launches: float
    other_ms: float


def _cuda_events(fn: Callable[[], object], calls: int, before: Callable[[], object] | None):
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            if before is not None:
                before()
            fn()
        torch.cuda.synchronize()
    return [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type == DeviceType.CUDA]


def profiled_kernels(fn: Callable[[], object], calls: int, before: Callable[[], object] | None = None
                     ) -> CallKernels | None:
    """GPU work per call over `calls` calls of fn (each after `before`, the L2 flush), or None
    where the profiler records no CUDA activity (a build without CUPTI). The flush's kernels,
    profiled alone as often, are taken off the other kernels' launches and time."""
    events = _cuda_events(fn, calls, before)
    if not events:
        return None
    launches, ms = other_kernels(events, calls)
    if before is not None:
        flush_launches, flush_ms = other_kernels(_cuda_events(before, calls, None), calls)
        launches, ms = max(launches - flush_launches, 0.0), max(ms - flush_ms, 0.0)
    return CallKernels(per_call_ms(events, calls), launches, ms)
