"""The arena: a fixed, peer-mapped region of a rank's registered memory that the direct data
path allocates its tensors from.

The direct path's kernels publish a rank's tensors to its peers as offsets from the rank's
arena base (csrc kernels/direct.cuh), and every peer adds its own mapping of that base: a
tensor a peer writes or reads must lie inside the arena. The arena is one region mapped once
at construction (the registered buffer's tail, opened by every peer with the same handles),
so the tensors are carved out of it here rather than by torch's allocator: a torch MemPool
over a pluggable allocator would still need this sub-allocator for its segments, and a
symmetric-memory tensor per call would need a collective rendezvous per call.

A block is returned to the arena when the last tensor viewing it dies. Blocks are reused in
the order of the stream they were allocated on (as torch's caching allocator reuses its
blocks): a free range remembers that stream, and only a call on the same stream takes it
again. Blocks allocated while a CUDA graph is being captured stay taken for the arena's life,
because every replay of the graph writes into them. Exhaustion returns None: the engine then
takes the receive path for the call.
"""

from __future__ import annotations

import bisect
import functools
import math
import threading

import numpy as np
import torch

from ...config import FP8_BLOCK
from ...routing import max_output_rows
from .layout import MAX_TOPK

ALIGN = 256  # bytes; every block starts on this boundary (the kernels need 16, TMA likes 128)


def aligned(nbytes: int) -> int:
    return (nbytes + ALIGN - 1) // ALIGN * ALIGN


class _Memory:
    """nbytes of device (or CPU model) memory at ptr, as torch.as_tensor / np.asarray take it
    (the array interface); a tensor made from it keeps this object alive."""

    def __init__(self, ptr: int, nbytes: int, device: torch.device):
        interface = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2, "strides": None}
        if device.type == "cuda":
            self.__cuda_array_interface__ = interface
        else:
            self.__array_interface__ = dict(interface, version=3)


def _tensor_over(memory: _Memory, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.as_tensor(memory, device=device)
    return torch.from_numpy(np.asarray(memory))


def memory_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over [ptr, ptr + nbytes) that owns nothing (the combine staging region:
    staging.py); the memory must outlive it."""
    return _tensor_over(_Memory(ptr, nbytes, device), device)


class _Block(_Memory):
    """One allocation; alive exactly as long as some tensor views it (the tensor's storage
    holds it through the array interface), then it returns its range."""

    def __init__(self, arena: "Arena", offset: int, nbytes: int, stream: int, kept: bool, used_bytes: int):
        super().__init__(arena.base + offset, used_bytes, arena.device)
        self.arena, self.offset, self.nbytes, self.stream, self.kept = arena, offset, nbytes, stream, kept

    def __del__(self):
        if not self.kept:
            self.arena._release(self.offset, self.nbytes, self.stream)


class Arena:
    """First-fit sub-allocator over [base, base + capacity) of device memory (or of the CPU
    model's host memory), handing out torch tensors."""

    def __init__(self, base: int, capacity: int, device: torch.device):
        if base % ALIGN != 0:
            raise ValueError(f"arena base {base:#x} is not {ALIGN}-byte aligned")
        self.base, self.capacity, self.device = base, capacity // ALIGN * ALIGN, torch.device(device)
        # Free ranges, sorted by offset: offsets, and (size, stream) of each; stream None: never used.
        self._starts: list[int] = [0] if self.capacity else []
        self._ranges: list[tuple[int, int | None]] = [(self.capacity, None)] if self.capacity else []
        self.used = 0  # bytes in blocks that are taken (kept ones included)
        # A block may die on another thread (autograd's backward threads free tensors too).
        self._lock = threading.Lock()
        self.kept = 0  # bytes taken for good by CUDA graph captures

    def contains(self, t: torch.Tensor) -> bool:
        """Whether all of t's memory lies inside the arena (t contiguous, as the kernels take it)."""
        if t.device != self.device:
            return False
        if t.numel() == 0:
            return True  # nothing a peer could address
        start = t.data_ptr()
        return self.base <= start and start + t.numel() * t.element_size() <= self.base + self.capacity

    def largest_free(self, stream: int = 0) -> int:
        return max((size for size, s in self._ranges if s is None or s == stream), default=0)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, stream: int = 0) -> torch.Tensor | None:
        """A new, uninitialised tensor in the arena, or None when no free range fits."""
        numel = 1
        for n in shape:
            numel *= n
        raw = self.empty_bytes(numel * dtype.itemsize, stream)
        if raw is None:
            return None
        if dtype != torch.uint8:
            raw = raw.view(dtype)
        return raw.view(shape) if len(shape) != 1 else raw

    def empty_bytes(self, used: int, stream: int = 0) -> torch.Tensor | None:
        """A new uint8 tensor of `used` bytes on a block of its own, or None when none fits."""
        nbytes = aligned(max(used, 1))
        offset = self._take(nbytes, stream)
        if offset is None:
            return None
        capturing = self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        block = _Block(self, offset, nbytes, stream, capturing, used)
        if capturing:
            self.kept += nbytes
        return _tensor_over(block, self.device)

    def _take(self, nbytes: int, stream: int) -> int | None:
        with self._lock:
            return self._take_locked(nbytes, stream)

    def _take_locked(self, nbytes: int, stream: int) -> int | None:
        for i, (size, s) in enumerate(self._ranges):
            if size >= nbytes and (s is None or s == stream):
                offset = self._starts[i]
                if size == nbytes:
                    del self._starts[i], self._ranges[i]
                else:
                    self._starts[i] += nbytes
                    self._ranges[i] = (size - nbytes, s)
                self.used += nbytes
                return offset
        return None

    def _release(self, offset: int, nbytes: int, stream: int) -> None:
        with self._lock:
            self._release_locked(offset, nbytes, stream)

    def _release_locked(self, offset: int, nbytes: int, stream: int) -> None:
        self.used -= nbytes
        i = bisect.bisect_left(self._starts, offset)
        self._starts.insert(i, offset)
        self._ranges.insert(i, (nbytes, stream))
        # Merge with the neighbours: ranges of the same stream, or never used (which then
        # belong to this stream: conservative, never wrong).
        if i + 1 < len(self._starts) and self._starts[i] + self._ranges[i][0] == self._starts[i + 1]:
            self._merge(i)
        if i > 0 and self._starts[i - 1] + self._ranges[i - 1][0] == self._starts[i]:
            self._merge(i - 1)

    def _merge(self, i: int) -> None:
        (a, sa), (b, sb) = self._ranges[i], self._ranges[i + 1]
        if sa is not None and sb is not None and sa != sb:
            return
        self._ranges[i] = (a + b, sa if sa is not None else sb)
        del self._starts[i + 1], self._ranges[i + 1]


def _call_specs(rows: int, hidden: int, dtype: torch.dtype, fp8: bool) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """The arena tensors of one direct dispatch of `rows` output rows on one rank: the rows,
    their probs and the fp8 scales. What a layer in flight keeps in the arena until its
    backward; its combine copies an expert_out from outside the arena into the buffer's one
    staging region (staging.py), not into room of its own."""
    specs = [((rows, hidden), dtype), ((rows,), torch.float32)]
    if fp8:
        specs.append(((rows, hidden // FP8_BLOCK), torch.float32))
    return specs


@functools.lru_cache(maxsize=64)
def _call_layout(rows: int, hidden: int, dtype: torch.dtype, fp8: bool):
    """Byte offset of each of _call_specs' tensors in the call's one block, and its bytes."""
    at, places = 0, []
    for shape, dt in _call_specs(rows, hidden, dtype, fp8):
        numel = 1
        for n in shape:
            numel *= n
        places.append((shape, dt, at))
        at += aligned(max(numel * dt.itemsize, 1))
    return tuple(places), at


def call_bytes(rows: int, hidden: int, dtype: torch.dtype, fp8: bool = False) -> int:
    """Arena bytes one direct dispatch of `rows` output rows takes on one rank, as long as its
    outputs or its handle live (in training: until the layer's backward)."""
    return _call_layout(rows, hidden, dtype, fp8)[1]


def expected_rows(tokens: int, topk: int, imbalance: float, local_experts: int, pad_multiple: int = 1,
                  min_rows_per_expert: int = 0) -> int:
    """Output rows of one rank's dispatch to plan an arena for: every rank's `tokens` tokens
    routed `topk` ways give tokens x topk rows per rank on average; the busiest rank gets
    `imbalance` times that, plus the padding bound of its local experts."""
    if not imbalance >= 1.0:
        raise ValueError(f"imbalance must be >= 1 (the busiest rank over the mean), got {imbalance}")
    return math.ceil(imbalance * tokens * topk) + local_experts * (min_rows_per_expert + pad_multiple - 1)


def training_bytes(layers_in_flight: int, rows: int, hidden: int, dtype: torch.dtype, fp8: bool = False) -> int:
    """An arena for a training step: one call of `rows` output rows per MoE layer in flight
    (MoE layers of the pipeline stage x micro-batches in flight, each kept until its
    backward), plus one for backward's dispatch of an output gradient, which lives while the
    layer's forward output still does."""
    if layers_in_flight < 1:
        raise ValueError(f"layers_in_flight must be >= 1, got {layers_in_flight}")
    return (layers_in_flight + 1) * call_bytes(rows, hidden, dtype, fp8)


def call_tensors(arena: Arena, rows: int, hidden: int, dtype: torch.dtype, fp8: bool, stream: int = 0):
    """(rows [R, H], probs [R], scales [R, H / 128] or None) of one direct dispatch, on one
    arena block (a few tensor operations per call: the host path is short), or None when it
    does not fit. The block returns when the last of them dies."""
    places, total = _call_layout(rows, hidden, dtype, fp8)
    raw = arena.empty_bytes(total, stream)
    if raw is None:
        return None
    typed = {torch.uint8: raw}
    got = []
    for shape, dt, at in places:
        base = typed.get(dt)
        if base is None:
            base = typed[dt] = raw.view(dt)
        strides = (shape[1], 1) if len(shape) == 2 else (1,)
        got.append(base.as_strided(shape, strides, at // dt.itemsize))
    return got[0], got[1], got[2] if fp8 else None


def default_bytes(config) -> int:
    """One worst-case direct call's outputs (every output row the buffer allows, fp32 rows:
    any dtype fits, as the receive buffers are sized): BufferConfig.arena_bytes when unset.
    With the staging region beside it (staging.py, as large) the default takes what one
    call with its own combine room took before."""
    rows = max_output_rows(config, min(config.experts_per_rank, MAX_TOPK))
    return call_bytes(rows, config.hidden_dim, torch.float32)


def arena_bytes(config) -> int:
    """Bytes of each rank's arena for dispatch outputs: BufferConfig.arena_bytes, else
    default_bytes."""
    return aligned(default_bytes(config) if config.arena_bytes is None else config.arena_bytes)
