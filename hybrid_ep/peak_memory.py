"""The peak bytes of live tensor storages in one process, counted the same way on every device.

torch keeps allocator statistics for CUDA only (torch.cuda.max_memory_allocated), so code that
runs on CPU ranks (the Megatron layer bench on gloo) measures its memory with `PeakMemoryMeter`:
a TorchDispatchMode that sees every aten operation's outputs while it is on, counts a storage's
bytes when an operation creates it, and subtracts them when the storage is freed
(weakref.finalize on the storage: torch keeps one Python object per storage, so the finalizer
runs when the storage itself is freed, not when a Python reference to it goes). Views, in-place
results and aliases of a storage count once (a storage is known by its identity and its data
pointer); a storage that an operation grows (resize_, out=) counts at its new size.

    with PeakMemoryMeter() as meter:
        loss = model(x).sum(); loss.backward()
    meter.peak_bytes  # the most bytes the storages created inside held at one time

What it counts, against torch.cuda.max_memory_allocated() - memory_allocated() at the start, on
a GPU (use device="cuda" there, so that host tensors stay out):
- only storages created while the meter is on: one created before and freed inside does not
  lower the count, where the allocator's figure drops, so this peak is never below that part;
- a storage's exact nbytes, where the caching allocator counts blocks rounded up to 512 bytes;
- not the temporaries an operator allocates and frees inside its own implementation (cuBLAS
  workspaces, a sort's scratch), which the allocator's figure includes, nor memory allocated
  outside PyTorch's allocator (NCCL's buffers, cudaMalloc by an extension: neither counts it);
- a storage freed while another stream still uses it (record_stream) leaves the count at its
  last reference, where the allocator keeps the block until the stream's work is done;
- storages made without an aten operator (torch.from_numpy, torch.frombuffer, DLPack) are not
  seen; torch.tensor(data) is (aten.lift_fresh).
The meter's own work runs on every operation while it is on: meter a step of its own, not
one that is timed.
"""

from __future__ import annotations

import threading
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Operators whose result is an input that no earlier operator made (torch.tensor(data) builds
# its tensor outside the dispatcher, then passes it through this one).
_FRESH_INPUTS = (torch.ops.aten.lift_fresh.default,)


def _storage(t) -> torch.UntypedStorage | None:
    """The storage of a tensor that has one in memory (not meta, sparse or nested)."""
    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
        return None
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


class PeakMemoryMeter(TorchDispatchMode):
    """Bytes of the live tensor storages created while it is on (`live_bytes`) and their most
    at one time (`peak_bytes`, since the meter started or since `reset_peak()`).

    device: count only storages on this device ("cpu", "cuda", "cuda:1"); None counts every
    device. Finalizers may run on autograd's device threads, so the counts sit behind a lock.
    """

    def __init__(self, device: str | torch.device | None = None):
        super().__init__()
        self.device = None if device is None else torch.device(device)
        self.live_bytes = 0
        self.peak_bytes = 0
        self._lock = threading.RLock()
        self._by_ptr: dict[int, list[int]] = {}  # data pointer -> [nbytes, storages that share it]
        self._by_storage: dict[int, int] = {}  # storage identity (its C++ address) -> its data pointer

    def reset_peak(self) -> None:
        """Start a new window: the peak becomes the bytes live now."""
        with self._lock:
            self.peak_bytes = self.live_bytes

    def _counts(self, storage: torch.UntypedStorage) -> bool:
        if self.device is None:
            return True
        device = storage.device
        return device.type == self.device.type and (self.device.index is None or device.index == self.device.index)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        fresh = func in _FRESH_INPUTS
        # The inputs' storages as they were: an output among them is a view, an in-place or out=
        # result (counted only if the operation moved or grew it), not a new allocation.
        before = {}
        if not fresh:
            for t in tree_leaves((args, kwargs)):
                s = _storage(t)
                if s is not None:
                    before[s._cdata] = (s.data_ptr(), s.nbytes())
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            s = _storage(t)
            if s is None or not self._counts(s):
                continue
            if before.get(s._cdata) == (s.data_ptr(), s.nbytes()) and s._cdata not in self._by_storage:
                continue  # an unchanged storage from before the meter (a view of a weight, x.add_(1))
            self._see(s)
        return out

    def _see(self, storage: torch.UntypedStorage) -> None:
        key, ptr, nbytes = storage._cdata, storage.data_ptr(), storage.nbytes()
        if not nbytes or not ptr:
            return
        with self._lock:
            known = self._by_storage.get(key)
            if known == ptr:
                record = self._by_ptr[ptr]
                if nbytes > record[0]:  # grown where it lies
                    self._add(nbytes - record[0])
                    record[0] = nbytes
                return
            if known is not None:  # moved (resize_ to a larger size): its old memory is freed
                self._forget(key)
            self._by_storage[key] = ptr
            record = self._by_ptr.get(ptr)
            if record is None:
                self._by_ptr[ptr] = [nbytes, 1]
                self._add(nbytes)
            else:  # another storage object over the same memory (an alias)
                record[1] += 1
                if nbytes > record[0]:
                    self._add(nbytes - record[0])
                    record[0] = nbytes
        if known is None:
            weakref.finalize(storage, self._forget, key).atexit = False

    def _add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes

    def _forget(self, key: int) -> None:
        """The storage `key` was freed (or moved): its memory leaves the count with its last holder."""
        with self._lock:
            ptr = self._by_storage.pop(key, None)
            if ptr is None:
                return
            record = self._by_ptr[ptr]
            record[1] -= 1
            if record[1] == 0:
                del self._by_ptr[ptr]
                self.live_bytes -= record[0]
