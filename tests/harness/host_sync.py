"""Host synchronisations of CUDA code, found on a machine without a GPU.

On a GPU, torch.cuda.set_sync_debug_mode("error") raises at the first operation that makes the
host wait for the device, so one run shows one of them. `emulated_cuda()` finds all of them on
the CPU: inside it, a tensor made for device "cuda" is a CPU tensor that says it is on cuda:0
(`DeviceTensor`); every aten operation is seen, those that would make a real GPU's host wait
are recorded by the rules of `SYNC_RULES` (what set_sync_debug_mode flags, and what it would
flag once the device is reached: mixed host and device operands), and the code runs on with
the CPU's values, so one run finds every one, each with the line that made it.

Around the tensors, what a CUDA rank has is stood in for while the context lasts: torch.cuda
reports one device; its streams and events do their work at once (event.query() is True;
synchronize() is recorded as a wait); torch.distributed reports the "nccl" transport and runs
all_to_all_single on the tensors' CPU data over the real (gloo) group. The stand-ins stay in
the process after it (torch's CUDA initialisation is marked done), so run it in a process of
its own (a ProcessGroupPool rank that is closed afterwards).

Not modelled: the caching allocator's own waits (cudaMalloc when the cache is empty, cudaFree
on a cache flush) and the waits inside collectives, which set_sync_debug_mode does not flag
either; an operation whose CUDA kernel reads a value on the host without a rule here is not
recorded (the rules are the ones the reference backend's code paths need; add one where code
meets a new kind).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import traceback
from typing import Callable
from unittest import mock

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

CUDA = torch.device("cuda", 0)
_EMULATED_TYPES = ("cuda", "meta")  # a DeviceTensor is a meta tensor to C++ (no device guard there)
_TORCH_DIR = os.path.dirname(torch.__file__)


@dataclasses.dataclass(frozen=True)
class HostSync:
    """One operation that would make the host wait for the device."""

    op: str  # the aten operator (or the torch.cuda call)
    why: str  # the rule's reason
    where: str  # file:line of the code that called it (outside torch and this module)
    line: str  # that line's source

    def __str__(self) -> str:
        return f"{self.where}: {self.op} ({self.why}): {self.line}"


# -- the rules ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SyncRule:
    """Operators (aten overload packets) that wait for the device when `when(call)` holds."""

    ops: frozenset[str]
    why: str
    when: Callable[["_Call"], bool] = lambda call: True


def _rule(ops: str, why: str, when=None) -> SyncRule:
    return SyncRule(frozenset(ops.split()), why, when or (lambda call: True))


_INDEX_PUT = "index_put_ index_put _index_put_impl_"
_COPIES = "copy_ copy _copy_from _to_copy"


class _Call:
    """One aten call as the rules see it: which operands are on the device, which host memory
    is pinned."""

    def __init__(self, func, args, kwargs, pinned: Callable[[torch.Tensor], bool]):
        self.name, self.overload = func.overloadpacket.__name__, func._overloadname
        self.args, self.kwargs, self.pinned = args, kwargs, pinned

    def arg(self, i: int, key: str, default=None):
        return self.args[i] if len(self.args) > i else self.kwargs.get(key, default)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in tree_leaves((self.args, self.kwargs)) if isinstance(t, torch.Tensor)]

    def on_device(self) -> bool:
        return any(_is_device(t) for t in self.tensors())

    def indices(self) -> list[torch.Tensor]:
        return [t for t in (self.arg(1, "indices") or []) if t is not None]

    def mask_index(self) -> bool:
        return any(t.dtype in (torch.bool, torch.uint8) for t in self.indices())

    def host_index(self) -> bool:
        return _is_device(self.args[0]) and any(not _is_device(t) for t in self.indices())

    def masked_fill(self) -> bool:
        """index_put_ that torch turns into masked_fill_ (a host scalar value, one mask index of
        the indexed dimensions' shape, no accumulate): no nonzero, the value read on the host."""
        value, given = self.arg(2, "values"), self.arg(1, "indices") or []
        masks = [t for t in given if t is not None]
        if self.arg(3, "accumulate", False) or value.numel() != 1 or _is_device(value) or len(masks) != 1:
            return False
        mask, first = masks[0], next(i for i, t in enumerate(given) if t is not None)
        return (mask.dtype in (torch.bool, torch.uint8) and _is_device(mask) == _is_device(self.args[0])
                and tuple(mask.shape) == tuple(self.args[0].shape[first:first + mask.dim()]))

    def host_scalar_value(self) -> bool:
        value = self.arg(2, "values")
        return _is_device(self.args[0]) and not _is_device(value) and value.dim() == 0

    def transfer(self) -> bool:
        """A copy between host memory and the device that waits: all but non_blocking copies
        from or to pinned memory (a non_blocking _to_copy to the host pins its output)."""
        if self.name == "_to_copy":
            src, dst_device = self.args[0], self.kwargs.get("device")
            if dst_device is None or (torch.device(dst_device).type in _EMULATED_TYPES) == _is_device(src):
                return False
            to_host = _is_device(src)
            return not (self.kwargs.get("non_blocking", False) and (to_host or self.pinned(src)))
        dst, src = (self.args[1], self.args[0]) if self.name == "_copy_from" else (self.args[0], self.args[1])
        if _is_device(dst) == _is_device(src):
            return False
        host = src if _is_device(dst) else dst
        return not (self.arg(2, "non_blocking", False) and self.pinned(host))

    def host_operand(self) -> bool:
        """A host tensor of one or more dimensions beside a device tensor (0-dim host tensors are
        read on the host as constants by elementwise kernels)."""
        return self.on_device() and any(not _is_device(t) and t.dim() > 0 for t in self.tensors())


_OWN_HOST_RULES = frozenset(f"{_INDEX_PUT} {_COPIES} index fill_ lift_fresh".split())  # ops with their own host rule

SYNC_RULES: tuple[SyncRule, ...] = (
    _rule("_local_scalar_dense", "reads a device value on the host: item(), int(), float(), bool(), tolist(), "
          "a tensor as a condition or a 0-dim tensor index"),
    _rule("nonzero masked_select", "the output size is the number of nonzero entries, read on the host"),
    _rule("_unique _unique2 unique_dim unique_consecutive unique_dim_consecutive",
          "the output size is the number of distinct values, read on the host"),
    _rule("bincount", "the output size is the largest value + 1, read on the host"),
    _rule("equal is_nonzero", "returns a Python bool, read on the host"),
    _rule("repeat_interleave", "without output_size the output size is the sum of the repeats, read on the host",
          lambda c: c.overload in ("Tensor", "self_Tensor") and c.on_device() and c.kwargs.get("output_size") is None),
    _rule(f"index {_INDEX_PUT}", "a boolean mask index becomes the indices of its nonzero entries (nonzero)",
          lambda c: c.mask_index() and c.on_device() and not (c.name != "index" and c.masked_fill())),
    _rule(f"index {_INDEX_PUT}", "host index tensors are copied to the device first (a blocking copy)",
          lambda c: c.host_index()),
    _rule(_INDEX_PUT, "a host scalar value (a Python number set at tensor indices) is copied to the device "
          "first (a blocking copy)", lambda c: c.host_scalar_value() and not c.masked_fill()),
    _rule(_COPIES, "a copy between host memory and the device waits unless it is non_blocking from or to "
          "pinned memory (a Python number set at an element: setitem makes it a CPU tensor, then copies it)",
          lambda c: c.transfer()),
    _rule("*", "a host tensor in a device operation: an error on CUDA or a copy to the device first",
          lambda c: c.name not in _OWN_HOST_RULES and c.host_operand()),
)


def _sync_reasons(call: _Call) -> list[str]:
    return [r.why for r in SYNC_RULES if (call.name in r.ops or "*" in r.ops) and r.when(call)]


# -- the device tensor ----------------------------------------------------------------------


class DeviceTensor(torch.Tensor):
    """A CPU tensor that Python sees on cuda:0 (C++ sees a meta tensor: no CUDA device guard,
    no CUDA call); only emulated_cuda() runs operations on it."""

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(cls, data.shape, strides=data.stride(),
                                                   storage_offset=data.storage_offset(), dtype=data.dtype,
                                                   device=torch.device("meta"), requires_grad=data.requires_grad)

    def __init__(self, data: torch.Tensor):
        self.data_on_host = data

    device = property(lambda self: CUDA)
    is_cuda = property(lambda self: True)
    is_cpu = property(lambda self: False)
    is_meta = property(lambda self: False)

    def __setitem__(self, index, value):
        # As torch does for a CUDA tensor: a Python number becomes a CPU scalar tensor, then an
        # element is copied from it (copy_), a slice filled (fill_) or indices put (index_put_).
        if isinstance(value, (bool, int, float, complex)):
            value = torch.tensor(value, dtype=self.dtype)
        torch.Tensor.__setitem__(self, index, value)

    def tolist(self):
        return torch.ops.aten._to_copy.default(self, device=torch.device("cpu")).tolist()

    def numpy(self, *args, **kwargs):
        raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the tensor to "
                        "host memory first.")

    def __repr__(self):
        return f"DeviceTensor({self.data_on_host!r})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"harness.host_sync: {func} on a DeviceTensor outside emulated_cuda()")


def _is_device(t) -> bool:
    return isinstance(t, DeviceTensor)


def _emulated(device) -> bool:
    return device is not None and torch.device(device).type in _EMULATED_TYPES


# -- the recorder ---------------------------------------------------------------------------


class SyncRecorder(TorchDispatchMode):
    """Runs every aten operation on the CPU data of its operands and records the host
    synchronisations of those made while `recording`."""

    def __init__(self):
        super().__init__()
        self.syncs: list[HostSync] = []
        self.recording = False
        self._pinned: dict[int, object] = {}  # data pointer -> storage (kept alive: no reuse of the address)

    @contextlib.contextmanager
    def record(self):
        """Record what runs inside (the calls before it set things up: caches, pinned memory)."""
        self.recording = True
        try:
            yield self.syncs
        finally:
            self.recording = False

    def note(self, op: str, why: str) -> None:
        if self.recording:
            self.syncs.append(HostSync(op, why, *_caller()))

    def _pin(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        self._pinned[storage.data_ptr()] = storage
        return t

    def pinned(self, t: torch.Tensor) -> bool:
        return not _is_device(t) and t.untyped_storage().data_ptr() in self._pinned

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        for why in _sync_reasons(_Call(func, args, kwargs, self.pinned)):
            self.note(name, why)
        if name == "is_pinned":
            return self.pinned(args[0])
        if name in ("_pin_memory", "pin_memory"):
            return self._pin(args[0].clone())
        if name == "record_stream":
            return None
        wrappers = {id(t.data_on_host): t for t in tree_leaves((args, kwargs)) if _is_device(t)}
        device = kwargs.get("device")
        on_device = _emulated(device) if device is not None else bool(wrappers)
        pin = bool(kwargs.get("pin_memory")) or (name == "_to_copy" and not on_device and bool(wrappers)
                                                 and kwargs.get("non_blocking", False))
        run_kwargs = tree_map(_host, kwargs)
        if "pin_memory" in run_kwargs:
            run_kwargs["pin_memory"] = False
        out = func(*tree_map(_host, args), **run_kwargs)

        def wrap(t):
            if not isinstance(t, torch.Tensor):
                return t
            if id(t) in wrappers:  # in place or out=: the caller's tensor
                return wrappers[id(t)]
            if on_device:
                return DeviceTensor(t)
            return self._pin(t) if pin else t

        return tree_map(wrap, out)


def _host(x):
    """An operand as the CPU runs it: a DeviceTensor's data, the CPU for the device."""
    if _is_device(x):
        return x.data_on_host
    if isinstance(x, torch.device) and x.type in _EMULATED_TYPES:
        return torch.device("cpu")
    return x


def _caller() -> tuple[str, str]:
    """The innermost frame outside torch and this module: where the operation was asked for."""
    here = os.path.abspath(__file__)
    for frame in reversed(traceback.extract_stack()):
        path = os.path.abspath(frame.filename)
        if path != here and not path.startswith(_TORCH_DIR):
            root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
            shown = os.path.relpath(path, root) if path.startswith(root) else path
            return f"{shown}:{frame.lineno}", (frame.line or "").strip()
    return "?", ""


# -- the stand-ins for torch.cuda and the NCCL transport -----------------------------------


class _Event:
    """torch.cuda.Event: the work before it is done when it is recorded (the CPU ran it)."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def query(self) -> bool:
        return True

    def wait(self, stream=None):
        pass

    def synchronize(self):
        _active().note("torch.cuda.Event.synchronize", "the host waits for the event")


class _Stream(_Event):
    """torch.cuda.Stream: work queued on it is done at once."""

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def synchronize(self):
        _active().note("torch.cuda.Stream.synchronize", "the host waits for the stream")


_RECORDERS: list[SyncRecorder] = []


def _active() -> SyncRecorder:
    return _RECORDERS[-1]


def _synchronize(device=None):
    _active().note("torch.cuda.synchronize", "the host waits for the device")


def _to(original):
    """Tensor.to: a move to the device goes to aten._to_copy directly (torch's binding would set
    the CUDA device first)."""

    def to(self, *args, **kwargs):
        device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
        if not _emulated(device):
            return original(self, *args, **kwargs)
        if _is_device(self) and (dtype is None or dtype == self.dtype) and not kwargs.get("copy", False):
            return self
        return torch.ops.aten._to_copy.default(self, dtype=dtype or self.dtype, device=CUDA, non_blocking=non_blocking)

    return to


def _new_tensor(original):
    """torch.tensor / torch.as_tensor with device="cuda": the data made on the host, then copied
    (blocking, as torch does)."""

    def make(data, *args, device=None, **kwargs):
        if not _emulated(device):
            return original(data, *args, device=device, **kwargs)
        host = original(data, *args, **kwargs)
        return torch.ops.aten._to_copy.default(host, device=CUDA)

    return make


def _all_to_all_single(original):
    """The NCCL collective on the CPU data of device tensors, over the process's gloo group."""

    def all_to_all_single(output, input, *args, **kwargs):
        return original(_host(output), _host(input), *args, **kwargs)

    return all_to_all_single


@contextlib.contextmanager
def emulated_cuda():
    """Inside: a CUDA rank's torch on the CPU, every host synchronisation recorded while the
    recorder's `record()` lasts (see the module docstring)."""
    recorder = SyncRecorder()
    patches = [
        (torch.cuda, "_lazy_init", lambda: None),
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "Event", _Event),
        (torch.cuda, "Stream", _Stream),
        (torch.cuda, "current_stream", lambda device=None: _Stream()),
        (torch.cuda, "stream", lambda stream: contextlib.nullcontext()),
        (torch.cuda, "synchronize", _synchronize),
        (torch.Tensor, "to", _to(torch.Tensor.to)),
        (torch.Tensor, "record_stream", lambda self, stream: None),
        (torch, "tensor", _new_tensor(torch.tensor)),
        (torch, "as_tensor", _new_tensor(torch.as_tensor)),
        (dist, "get_backend", lambda group=None: "nccl"),
        (dist, "all_to_all_single", _all_to_all_single(dist.all_to_all_single)),
    ]
    with contextlib.ExitStack() as stack:
        for owner, name, value in patches:
            stack.enter_context(mock.patch.object(owner, name, value))
        _RECORDERS.append(recorder)
        stack.callback(_RECORDERS.pop)
        stack.enter_context(recorder)
        yield recorder
