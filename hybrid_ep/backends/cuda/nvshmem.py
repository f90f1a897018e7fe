"""NVSHMEM for the inter-node transport: one initialisation per process, symmetric allocations.

NVSHMEM is bootstrapped with a unique id that rank 0 of the EP group creates and shares over
torch.distributed, so no MPI or PMI launcher is needed. Its symmetric heap is sized before
initialisation (NVSHMEM_SYMMETRIC_SIZE) from the bytes the buffers need, so the size is
known to memory_plan() and a heap that is too small fails here with the numbers, not later
in a kernel. Errors say what is missing and what to do (docs/testing_on_clusters.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import re

from ...checks import require_int
from ...memory import BufferSpec

HEAP_ENV = "NVSHMEM_SYMMETRIC_SIZE"
HEAP_ALIGN = 2 << 20  # CUDA's allocation granularity for the heap's physical memory
# Room in the heap for NVSHMEM's own symmetric objects (team and collective scratch), which it
# allocates there at initialisation; a chosen margin, checked by the GPU self-test's allocation.
HEAP_RESERVE = 32 << 20
STATUS_NAMES = {0: "not initialised", 1: "bootstrapped", 2: "initialised",
                3: "initialised, limited support of several PEs per GPU (no MPS)",
                4: "initialised, full support of several PEs per GPU (MPS)"}
DOCS = "docs/testing_on_clusters.md"


class NvshmemError(RuntimeError):
    """NVSHMEM could not be used; the message says why and what to do."""


class NvshmemNotBuilt(NvshmemError):
    pass


class NvshmemInitError(NvshmemError):
    pass


class NvshmemHeapTooSmall(NvshmemError):
    pass


def symmetric_heap_bytes(region_bytes: int) -> int:
    """NVSHMEM_SYMMETRIC_SIZE for a rank whose symmetric allocations total `region_bytes`."""
    region_bytes = require_int("region_bytes", region_bytes, 0, what="an int number of bytes")
    return -(-(region_bytes + HEAP_RESERVE) // HEAP_ALIGN) * HEAP_ALIGN


def heap_spec(region_bytes: int) -> BufferSpec:
    """memory_plan()'s line for the symmetric heap of a group that spans nodes."""
    return BufferSpec("nvshmem_heap", symmetric_heap_bytes(region_bytes), True,
                      f"NVSHMEM symmetric heap ({HEAP_ENV}): the RDMA region and NVSHMEM's own objects")


_SIZE = re.compile(r"^\s*(\d+\.?\d*|\.\d+)\s*([kmgt]?)", re.IGNORECASE)


def parse_size(text: str) -> int:
    """NVSHMEM's size syntax: a number with an optional K/M/G/T multiplier (powers of 1024),
    characters after the multiplier ignored ("1GB" is 1G, "0.5m" half a MiB), rounded up."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"{HEAP_ENV} must be a byte count such as 1073741824 or 1G, got {text!r}")
    scale = 1024 ** "_kmgt".index(match.group(2).lower() or "_")
    return math.ceil(float(match.group(1)) * scale)


def export_heap_size(needed: int, environ=None) -> int:
    """Set NVSHMEM_SYMMETRIC_SIZE to `needed` bytes unless the user set a size at least as large;
    the heap's size in bytes."""
    environ = os.environ if environ is None else environ
    needed = require_int("needed", needed, 0, what="an int number of bytes")
    user = environ.get(HEAP_ENV)
    if user:
        size = parse_size(user)
        if size < needed:
            raise NvshmemHeapTooSmall(
                f"{HEAP_ENV}={user} ({size} bytes) is smaller than the {needed} bytes this rank's buffers need "
                f"(memory_plan() lists them): unset {HEAP_ENV} or set it to at least {needed}")
        return size
    environ[HEAP_ENV] = str(needed)
    return needed


@dataclasses.dataclass
class Session:
    """This process's NVSHMEM: its PE, the PEs, the heap and what is allocated from it."""
    ext: object
    pe: int
    n_pes: int
    heap_bytes: int
    allocated: int = 0

    @property
    def status(self) -> str:
        return STATUS_NAMES.get(self.ext.nvshmem_init_status(), "unknown")


@dataclasses.dataclass(frozen=True)
class SymmetricAllocation:
    ptr: int  # this PE's address; the same offset names the same bytes on every PE
    nbytes: int


_session: Session | None = None
_finalized = False


def session() -> Session | None:
    """This process's NVSHMEM session, None before initialize()."""
    return _session


def require_built(ext):
    """The extension if it was built with NVSHMEM, else NvshmemNotBuilt saying how to get it."""
    if not getattr(ext, "has_nvshmem", lambda: False)():
        raise NvshmemNotBuilt(
            "hybrid_ep._C was built without NVSHMEM, so groups that span nodes have no inter-node transport: "
            "pip install nvidia-nvshmem-cu13 (or -cu12, matching torch.version.cuda) or set NVSHMEM_HOME, "
            f"then rebuild (pip install --no-build-isolation -e .); see {DOCS}")
    return ext


def _dist():
    import torch.distributed as dist

    return dist


def _src_rank(dist, group) -> int:
    """The global rank of the group's rank 0 (broadcast_object_list takes a global rank)."""
    return 0 if group is None else dist.get_global_rank(group, 0)


def prepare(region_bytes: int = 0, *, ext=None):
    """What initialize checks on this rank alone before its collectives (no collective here): the
    extension's NVSHMEM, the heap's size (NVSHMEM_SYMMETRIC_SIZE set, or refused), and a session
    already made with too small a heap. (the extension, the session where there is one, the heap's
    bytes). NvshmemRegions gathers every rank's outcome before any rank enters initialize's
    collectives."""
    needed = symmetric_heap_bytes(region_bytes)
    if _session is not None:
        if needed > _session.heap_bytes:
            raise NvshmemHeapTooSmall(
                f"NVSHMEM was initialised in this process with a {_session.heap_bytes}-byte heap; these buffers need "
                f"{needed} bytes and NVSHMEM is initialised once per process: create the largest buffer first or "
                f"set {HEAP_ENV} to at least {needed} before the first one")
        return _session.ext, _session, _session.heap_bytes
    if _finalized:
        raise NvshmemInitError("NVSHMEM was finalised in this process and cannot be initialised again: "
                               "use one session for the life of the process")
    if ext is None:
        from . import load_extension

        ext = load_extension("cuda")
    require_built(ext)
    return ext, None, export_heap_size(needed)


def initialize(group=None, region_bytes: int = 0, *, ext=None, dist=None) -> Session:
    """Initialise NVSHMEM once in this process over the ranks of `group` (collective), with a
    heap for `region_bytes` of symmetric allocations; later calls return the same session."""
    global _session
    ext, session, heap = prepare(region_bytes, ext=ext)
    if session is not None:
        return session
    dist = _dist() if dist is None else dist
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    box = [ext.nvshmem_unique_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=_src_rank(dist, group), group=group)
    try:
        ext.nvshmem_init(rank, size, box[0])
    except RuntimeError as exc:
        raise NvshmemInitError(
            f"NVSHMEM initialisation failed on rank {rank} of {size} ({exc}); run with NVSHMEM_DEBUG=INFO to see "
            f"which bootstrap or transport failed, and see {DOCS}") from exc
    pe, n_pes = ext.nvshmem_my_pe(), ext.nvshmem_n_pes()
    if (pe, n_pes) != (rank, size):
        raise NvshmemInitError(f"NVSHMEM made rank {rank} of {size} PE {pe} of {n_pes}; expected PE {rank} of {size}")
    _session = Session(ext, pe, n_pes, heap)
    return _session


def check_room(nbytes: int) -> Session:
    """What allocate checks on this rank alone before its collective nvshmem_malloc: a session,
    and room for `nbytes` in its heap beside what is allocated and NVSHMEM's own objects."""
    nbytes = require_int("nbytes", nbytes, 0, what="an int number of bytes")
    s = _session
    if s is None:
        raise NvshmemError("NVSHMEM is not initialised in this process: call nvshmem.initialize(group, bytes) first")
    if s.allocated + nbytes + HEAP_RESERVE > s.heap_bytes:
        raise NvshmemHeapTooSmall(
            f"the symmetric heap has {s.heap_bytes} bytes, {s.allocated} allocated; {nbytes} more do not fit next to "
            f"NVSHMEM's own {HEAP_RESERVE}: initialise with the total (nvshmem.initialize(group, region_bytes)) or "
            f"raise {HEAP_ENV}")
    return s


def allocate(nbytes: int) -> SymmetricAllocation:
    """A zeroed symmetric allocation of `nbytes` (collective: every PE asks for the same size)."""
    s = check_room(nbytes)
    ptr = s.ext.nvshmem_malloc(nbytes)
    if ptr == 0:
        raise NvshmemHeapTooSmall(f"nvshmem_malloc({nbytes}) found no room in the {s.heap_bytes}-byte symmetric heap "
                                  f"({s.allocated} allocated): raise {HEAP_ENV}")
    s.allocated += nbytes
    return SymmetricAllocation(ptr, nbytes)


def free(allocation: SymmetricAllocation) -> None:
    """Give a symmetric allocation back (collective)."""
    s = _session
    if s is None:
        raise NvshmemError("NVSHMEM is not initialised in this process")
    s.ext.nvshmem_free(allocation.ptr)
    s.allocated -= allocation.nbytes


def pe_table(group=None, *, dist=None) -> list[int]:
    """The PE of every rank of `group` (collective over the group), for the transport's table."""
    if _session is None:
        raise NvshmemError("NVSHMEM is not initialised in this process")
    dist = _dist() if dist is None else dist
    pes = [None] * dist.get_world_size(group)
    dist.all_gather_object(pes, _session.pe, group=group)
    return pes


def finalize() -> None:
    """Finalise NVSHMEM in this process (collective); initialize() may not be called again."""
    global _session, _finalized
    if _session is not None:
        _session.ext.nvshmem_finalize()
        _session, _finalized = None, True
