"""Timing of one collective call per rank, as docs/benchmarks/README.md describes.

CPU: all ranks meet at a barrier, then time.perf_counter() around the call.
GPU: write a 256 MB buffer to evict L2, barrier, then CUDA events around the call on the
current stream; event times are read once at the end so timing adds no host sync per call.
Samples are kept per key ("dispatch", "combine") in milliseconds.
"""

from __future__ import annotations

import collections
import time
from typing import Callable

import torch
import torch.distributed as dist

from .spec import L2_FLUSH_BYTES


class CpuTimer:
    method = "time.perf_counter around each call after a barrier"

    def __init__(self, group):
        self.group = group
        self._samples: dict[str, list[float]] = collections.defaultdict(list)

    def call(self, key: str, fn: Callable, record: bool):
        dist.barrier(group=self.group)
        start = time.perf_counter()
        out = fn()
        elapsed = time.perf_counter() - start
        if record:
            self._samples[key].append(elapsed * 1e3)
        return out

    def samples_ms(self, key: str) -> list[float]:
        return list(self._samples[key])


class CudaTimer:
    method = (f"CUDA events around each call, after an L2 flush ({L2_FLUSH_BYTES >> 20} MB write) "
              "and a barrier")

    def __init__(self, group, device: torch.device):
        self.group = group
        self.device = device
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=device)
        self._events: dict[str, list] = collections.defaultdict(list)

    def call(self, key: str, fn: Callable, record: bool):
        self._flush.zero_()
        dist.barrier(group=self.group, device_ids=[self._index])
        torch.cuda.synchronize(self.device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        if record:
            self._events[key].append((start, end))
        return out

    def samples_ms(self, key: str) -> list[float]:
        torch.cuda.synchronize(self.device)
        return [float(s.elapsed_time(e)) for s, e in self._events[key]]


def make_timer(group, device: torch.device):
    return CudaTimer(group, device) if device.type == "cuda" else CpuTimer(group)
