"""The arena: the sub-allocator over a rank's peer memory (peer_memory.py) that the direct
data path allocates its tensors from.

The direct path's kernels publish a rank's tensors to its peers as offsets from the rank's
peer memory base (csrc kernels/direct.cuh), and every peer adds its own mapping of that base:
a tensor a peer writes or reads must lie inside it. Peer memory is mapped by every peer as it
grows (agreement.py), not per tensor, so the tensors are carved out of it here rather than by
torch's allocator: a torch MemPool
over a pluggable allocator would still need this sub-allocator for its segments, and a
symmetric-memory tensor per call would need a collective rendezvous per call.

The free list and the tensors over a block live in the extension (ext.Arena,
csrc/bindings/arena.h): a direct dispatch takes one block per rank and makes its tensors on
every call, and in Python that (a tensor over the block through the array interface, a view
per dtype, an as_strided per tensor) cost more host time than the rest of the call; there
one call takes every driven rank's block and hands each tensor to torch as a DLPack capsule.
What a block holds is decided here (call_bytes, block_layout, cached per rows and dtype).

A block is returned to the arena when the last tensor viewing it dies. Blocks are reused in
the order of the stream they were allocated on (as torch's caching allocator reuses its
blocks): a free range remembers that stream, and only a call on the same stream takes it
again. Blocks allocated while a CUDA graph is being captured stay taken for the arena's life,
because every replay of the graph writes into them. Exhaustion returns None (the agreement
sizes every call to fit, so the engine raises it as a broken invariant).
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch

from ...config import FP8_BLOCK
from . import capture

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


def memory_tensor(ptr: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """A uint8 tensor over [ptr, ptr + nbytes) that owns nothing; the memory must outlive it."""
    memory = _Memory(ptr, nbytes, device)
    if device.type == "cuda":
        return torch.as_tensor(memory, device=device)
    return torch.from_numpy(np.asarray(memory))


# DLPack's (type code, bits) of each dtype an arena tensor may have: the extension hands the
# block's tensors to torch as DLPack capsules (csrc/bindings/arena.h).
DLPACK_DTYPES = {torch.uint8: (1, 8), torch.int8: (0, 8), torch.int32: (0, 32), torch.int64: (0, 64),
                 torch.float32: (2, 32), torch.float16: (2, 16), torch.float64: (2, 64), torch.bfloat16: (4, 16),
                 torch.float8_e4m3fn: (10, 8)}
_DLPACK_DEVICES = {"cpu": 1, "cuda": 2}


def _from_dlpack():
    """torch's function from a DLPack capsule to a tensor: its C entry where this torch has it
    (no Python checks in front), else the public one."""
    return getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack


def _layout(views: list[tuple[int, torch.dtype] | None], ext):
    """The extension's ArenaLayout of tensors (columns, 0 for 1-D; dtype; None: absent, no
    bytes and a None tensor) of any number of rows on one block, each starting on the next
    ALIGN boundary (as _block_places places them)."""
    specs: list[tuple[int, int, int, int] | None] = []
    for view in views:
        if view is None:
            specs.append(None)
            continue
        cols, dt = view
        if dt not in DLPACK_DTYPES:
            raise TypeError(f"the arena makes no {dt} tensors; it makes {sorted(map(str, DLPACK_DTYPES))}")
        code, bits = DLPACK_DTYPES[dt]
        specs.append((max(cols, 1) * dt.itemsize, code, bits, cols))
    return ext.ArenaLayout(specs, ALIGN)


class Arena:
    """First-fit sub-allocator over [base, base + capacity) of device memory (or of the CPU
    model's host memory), handing out torch tensors. The free list and the tensors live in
    the extension (ext.Arena, csrc/bindings/arena.h): a block returns when its last tensor
    dies, on any thread."""

    def __init__(self, base: int, capacity: int, device: torch.device):
        if base % ALIGN != 0:
            raise ValueError(f"arena base {base:#x} is not {ALIGN}-byte aligned")
        from . import load_extension

        self.base, self.device = base, torch.device(device)
        capacity = capacity // ALIGN * ALIGN
        self.ext = load_extension(self.device)
        index = self.device.index if self.device.index is not None else (
            torch.cuda.current_device() if self.device.type == "cuda" else 0)
        self.core = self.ext.Arena(base, capacity, _DLPACK_DEVICES[self.device.type], index, _from_dlpack())
        self.capacity = capacity  # grows and shrinks with the peer memory under it (grow, shrink)
        self._layouts: dict = {}  # (columns, dtype) -> ext.ArenaLayout of Arena.empty

    @property
    def used(self) -> int:
        """Bytes in blocks that are taken (kept ones included)."""
        return self.core.used

    @property
    def kept(self) -> int:
        """Bytes taken for good by CUDA graph captures."""
        return self.core.kept

    def capturing(self) -> bool:
        """Whether blocks taken now stay taken: a CUDA graph capture replays into them."""
        return capture.capturing(self.device)

    def contains(self, t: torch.Tensor) -> bool:
        """Whether all of t's memory lies inside the arena (t contiguous, as the kernels take it)."""
        if t.device != self.device:
            return False
        if t.numel() == 0:
            return True  # nothing a peer could address
        start = t.data_ptr()
        return self.base <= start and start + t.numel() * t.element_size() <= self.base + self.capacity

    def largest_free(self, stream: int = 0) -> int:
        return self.core.largest_free(stream)

    def largest_free_below(self, stream: int, limit: int) -> int:
        """The largest free range on `stream` below `limit` bytes from the base (the part of a
        range below it counting)."""
        return self.core.largest_free_below(stream, limit)

    def tail_free(self, stream: int = 0) -> int:
        """Bytes of the free range that ends at the capacity, on `stream` (0: none)."""
        return self.core.tail_free(stream)

    def grow(self, capacity: int) -> None:
        """More memory mapped at the end: the capacity raised to `capacity` bytes."""
        self.core.grow(capacity)
        self.capacity = max(self.capacity, capacity)

    def shrink(self, capacity: int) -> bool:
        """The free tail past `capacity` retired; False, nothing changed, when it is not free."""
        done = self.core.shrink(capacity)
        if done:
            self.capacity = capacity
        return done

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype, stream: int = 0) -> torch.Tensor | None:
        """A new, uninitialised tensor (1 or 2 dimensions) in the arena, or None when no free
        range fits."""
        if len(shape) not in (1, 2):
            raise ValueError(f"an arena tensor has 1 or 2 dimensions, got shape {tuple(shape)}")
        cols = shape[1] if len(shape) == 2 else 0
        if len(shape) == 2 and cols < 1:
            raise ValueError(f"a 2-D arena tensor needs columns, got shape {tuple(shape)}")
        key = (cols, dtype)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._layouts[key] = _layout([(cols, dtype)], self.ext)
        got = self.core.block(layout, shape[0], stream, self.capturing())
        return None if got is None else got[0]

    def empty_bytes(self, used: int, stream: int = 0) -> torch.Tensor | None:
        """A new uint8 tensor of `used` bytes on a block of its own, or None when none fits."""
        return self.empty((used,), torch.uint8, stream)


def _call_specs(rows: int, hidden: int, dtype: torch.dtype,
                fp8: bool) -> list[tuple[tuple[int, ...], torch.dtype] | None]:
    """The arena tensors of one direct dispatch of `rows` output rows on one rank, in the one
    order of a dispatch's outputs: the rows, the fp8 scales (None, absent, without fp8) and the
    probs (ext.OutputTensors' fields). What a layer in flight keeps in the arena until its
    backward; its combine copies an expert_out from outside peer memory into the rank's one
    expert-out block (expert_out_order.py), not into room of its own."""
    return [((rows, hidden), dtype), ((rows, hidden // FP8_BLOCK), torch.float32) if fp8 else None,
            ((rows,), torch.float32)]


@functools.lru_cache(maxsize=64)
def _block_places(rows: int, hidden: int, dtype: torch.dtype, fp8: bool):
    """Byte offset of each of _call_specs' tensors in the call's one block, and its bytes."""
    at, places = 0, []
    for spec in _call_specs(rows, hidden, dtype, fp8):
        if spec is None:
            continue
        shape, dt = spec
        numel = 1
        for n in shape:
            numel *= n
        places.append((shape, dt, at))
        at += aligned(max(numel * dt.itemsize, 1))
    return tuple(places), at


@functools.lru_cache(maxsize=64)
def block_layout(ext, hidden: int, dtype: torch.dtype, fp8: bool):
    """The extension's ArenaLayout of one direct dispatch's block (_call_specs, for any
    number of rows), made once per (hidden, dtype): a call hands it to ext.ArenaTaken as it is."""
    return _layout([None if spec is None else (spec[0][1] if len(spec[0]) == 2 else 0, spec[1])
                    for spec in _call_specs(1, hidden, dtype, fp8)], ext)


def call_bytes(rows: int, hidden: int, dtype: torch.dtype, fp8: bool = False) -> int:
    """Arena bytes one direct dispatch of `rows` output rows takes on one rank, as long as its
    outputs or its handle live (in training: until the layer's backward)."""
    return _block_places(rows, hidden, dtype, fp8)[1]


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
    """(rows [R, H], scales [R, H / 128] or None, probs [R]) of one direct dispatch, on one
    arena block, or None when it does not fit. The block returns when the last of them dies.
    The engine takes every rank's block in one call instead (arena_take)."""
    return arena.core.block(block_layout(arena.ext, hidden, dtype, fp8), rows, stream, arena.capturing())


def arena_take(arenas: list[Arena], rows: list[int], hidden: int, dtype: torch.dtype, fp8: bool,
               stream: int = 0, limits: list[int] | None = None):
    """The blocks of call_tensors on every arena (rows[i] output rows on arenas[i]), taken in
    one call into the extension, their tensors not made yet: an ext.ArenaTaken whose
    `addresses()` give each block's (rows, scales, probs) addresses (scales 0 without fp8) and
    whose `tensors()` make its (rows, scales, probs) tensors (scales None without fp8) after
    the launch (the engine has HostPath.dispatch_into or dispatch_rows_into do both, the tensors as
    ext.OutputTensors); its `failed` is the index of the first arena that can not hold its
    block (then none is taken), else -1. limits: per arena, the bytes from its base its block
    must end within (the part every peer has mapped), else anywhere."""
    return arenas[0].ext.ArenaTaken([a.core for a in arenas], block_layout(arenas[0].ext, hidden, dtype, fp8), rows,
                                    stream, arenas[0].capturing(), limits or [])


def arena_blocks(arenas: list[Arena], rows: list[int], hidden: int, dtype: torch.dtype, fp8: bool,
                 stream: int = 0) -> list | int:
    """arena_take's tensors: a list of (rows, scales or None, probs), or the failed index."""
    taken = arena_take(arenas, rows, hidden, dtype, fp8, stream)
    if taken.failed >= 0:
        return taken.failed
    return taken.tensors()
