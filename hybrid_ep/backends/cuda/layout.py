"""Byte layouts of one rank's registered buffer, its RDMA region and the per-call info tensor.

The registered buffer's and the RDMA region's layouts are built in C++ from the list of rings
between ranks (csrc/bindings/buffer_layout.h) and read here, with their regions, so
memory_plan() can say how much a buffer needs before anything is allocated; the info tensor's
is planned here. The kernels receive these offsets (csrc/common/params.h: RegLayout,
RdmaLayout, InfoLayout). The sizes of csrc's structs and its limits come from the compiled
module (`compiled`, loaded by hybrid_ep.limits: both builds export them,
csrc/bindings/common.h); none is written here a second time.

Legend: W ranks, N nodes, L local experts, Tmax = max_tokens_per_rank, H hidden.
"""

from __future__ import annotations

import dataclasses
import functools

from ...config import FP8_BLOCK, BufferConfig
from ...limits import MAX_DOMAIN_RANKS as MAX_DOMAIN_RANKS  # hybrid_ep.limits' limits, as the cuda backend reads them
from ...limits import MAX_EXPERTS as MAX_EXPERTS
from ...limits import MAX_NODES as MAX_NODES
from ...limits import MAX_RANKS as MAX_RANKS
from ...limits import MAX_TOPK as MAX_TOPK
from ...limits import check_group, compiled
from ...rows import check_hidden_dim

MAX_LAUNCH_RANKS: int = compiled.MAX_LAUNCH_RANKS  # virtual ranks one emulated launch holds
LOCAL_STATE_BYTES: int = compiled.LOCAL_STATE_BYTES
CHUNK_TOKENS: int = compiled.CHUNK_TOKENS  # tokens per chunk, the unit of signalling between ranks
CHUNK_SIGNAL_BYTES: int = compiled.CHUNK_SIGNAL_BYTES
META_ENTRY_BYTES: int = compiled.META_ENTRY_BYTES
TOKEN_META_BYTES: int = compiled.TOKEN_META_BYTES  # expert, ordinal and weight of every route
PEER_TENSORS_BYTES: int = compiled.PEER_TENSORS_BYTES  # a rank's published tensors of one call (direct path)
COUNT_ROW_TAIL: int = compiled.COUNT_ROW_TAIL  # a count row's source tokens and first bad route
ERROR_RECORD_PHASE_OFFSET: int = compiled.ERROR_RECORD_PHASE_OFFSET  # ErrorRecord's words the host polls
ERROR_RECORD_CALL_OFFSET: int = compiled.ERROR_RECORD_CALL_OFFSET  # its call word (a bad route's, polled)
CHUNK_META_HEADER: int = compiled.CHUNK_META_HEADER  # a staged chunk's routing starts with its row count
AGREE_WORDS: int = compiled.AGREE_WORDS  # a rank's words of the data-path agreement (RankArgs.agree)
RING_TAG_CHUNK_BITS: int = compiled.RING_TAG_CHUNK_BITS  # a ring slot's tag: the call above chunk + 1
BAD_ROUTE_WORDS = 3  # info's bad_route: the lowest bad rank (-1: none), its first bad token, that route's id

# The names `compiled` and every loaded module must give the same values (engine.check_extension):
# a module built from other sources than the one this plan read is stale.
COMPILED_CONSTANTS = ("MAX_TOPK", "MAX_RANKS", "MAX_DOMAIN_RANKS", "MAX_NODES", "MAX_EXPERTS", "MAX_LAUNCH_RANKS",
                      "LOCAL_STATE_BYTES", "CHUNK_TOKENS",
                      "CHUNK_SIGNAL_BYTES", "META_ENTRY_BYTES", "TOKEN_META_BYTES", "PEER_TENSORS_BYTES",
                      "COUNT_ROW_TAIL", "AGREE_WORDS", "ERROR_RECORD_PHASE_OFFSET", "ERROR_RECORD_CALL_OFFSET",
                      "COMBINE_MAX_SEG_COLS", "MAX_STAGES", "MAX_STORE_GROUPS", "DIRECT_COMBINE_PIPELINES",
                      "CHUNK_META_HEADER", "DIRECT_STORE_THREADS", "STATIC_SMEM_RESERVE", "RING_TAG_CHUNK_BITS",
                      "REDUCER_WAIT_OBSERVE", "REDUCER_WAIT_ELECT", "REDUCER_WAIT_CONVERGED", "REDUCER_WARPS_NARROW",
                      "REDUCER_WARPS_WIDE")


def ring_tag(call: int, chunk: int) -> int:
    """What a ring slot's signal and credit words hold for chunk `chunk` of call `call`
    (csrc/kernels/peer_ring.cuh, PeerRing::tag): what a timeout record of a ring's wait shows."""
    return call << RING_TAG_CHUNK_BITS | (chunk + 1)


def _shape(module, config: BufferConfig):
    """csrc's BufferShape of `config`: what its layouts are built from."""
    shape = module.BufferShape()
    shape.world_size, shape.ranks_per_node = config.world_size, config.ranks_per_node
    shape.local_experts, shape.max_tokens = config.experts_per_rank, config.max_tokens_per_rank
    shape.hidden, shape.ring_chunks = config.hidden_dim, config.ring_chunks
    shape.scale_cols = config.hidden_dim // FP8_BLOCK if config.hidden_dim % FP8_BLOCK == 0 else 0
    shape.ring_elem_bytes = config.ring_dtype.itemsize
    return shape


@functools.lru_cache(maxsize=64)
def _layouts(module, config: BufferConfig):
    return module.buffer_layouts(_shape(module, config))


def buffer_layouts(config: BufferConfig, module=None):
    """The layouts of one rank's registered buffer and RDMA region (module.BufferLayouts: reg,
    rdma, and their regions), built by csrc/bindings/buffer_layout.h from the list of rings
    between ranks. `module`: the extension whose Geometry takes them (default `compiled`)."""
    return _layouts(module or compiled, config)


def registered_layout(config: BufferConfig):
    """Offsets (bytes) of one rank's registered buffer (csrc RegLayout)."""
    return buffer_layouts(config).reg


def rdma_layout(config: BufferConfig):
    """Offsets (bytes) of one rank's RDMA region, the symmetric heap on clusters (csrc
    RdmaLayout); total 0 for a single node."""
    return buffer_layouts(config).rdma


def registered_regions(config: BufferConfig) -> list:
    """The registered buffer's regions in order (name, offset, bytes, purpose): memory_plan()'s lines."""
    return list(buffer_layouts(config).registered)


def rdma_regions(config: BufferConfig) -> list:
    """The RDMA region's regions in order (name, offset, bytes, purpose); none for a single node."""
    return list(buffer_layouts(config).rdma_regions)


# BufferShape's fields (csrc/bindings/buffer_layout.h) by the argument of BufferConfig that sets each.
SHAPE_ARGUMENTS = {"world_size": "world_size", "ranks_per_node": "ranks_per_node",
                   "local_experts": "num_experts / world_size", "max_tokens": "max_tokens_per_rank",
                   "hidden": "hidden_dim", "ring_chunks": "ring_chunks", "scale_cols": "hidden_dim",
                   "ring_elem_bytes": "ring_dtype"}


def _fields(prefix: str, value) -> list[tuple[str, int]]:
    """A bound csrc struct's fields in csrc's order (pybind11 keeps the order they were bound in),
    a nested one's as prefix.field.sub."""
    out = []
    for name, attr in type(value).__dict__.items():
        if not isinstance(attr, property):
            continue
        item = getattr(value, name)
        out += [(f"{prefix}.{name}", item)] if isinstance(item, int) else _fields(f"{prefix}.{name}", item)
    return out


@functools.lru_cache(maxsize=64)
def layout_fields(config: BufferConfig) -> tuple[tuple[str, int], ...]:
    """Every field that places a region of the registered buffer or of the RDMA region, as (name,
    value) in csrc's order: what the layout is built from (shape.*, BufferShape), then every offset,
    stride and ring of the registered layout (reg.*, RegLayout) and of the RDMA layout (rdma.*,
    RdmaLayout). Ranks whose fields differ would write into each other's other regions."""
    layouts = buffer_layouts(config)
    return tuple(_fields("shape", _shape(compiled, config)) + _fields("reg", layouts.reg) +
                 _fields("rdma", layouts.rdma))


@dataclasses.dataclass(frozen=True)
class InfoLayout:
    """Offsets (int64 elements) of the per-call info tensor; names match csrc InfoLayout."""

    tokens_per_expert: int
    expert_start: int
    expert_rows: int
    src_prefix: int
    recv_count: int
    src_tokens: int
    recv_offset: int
    send_count: int
    needed: int
    bad_route: int
    agreement: int
    dropped: int
    num_recv: int
    count_matrix: int
    node_counts: int
    total: int


def info_layout(config: BufferConfig) -> InfoLayout:
    W, N, L = config.world_size, config.num_nodes, config.experts_per_rank
    # needed and bad_route side by side: a dynamic-size dispatch reads both in one host read.
    sizes = [
        ("tokens_per_expert", L), ("expert_start", L), ("expert_rows", L), ("src_prefix", W * L),
        ("recv_count", W), ("src_tokens", W), ("recv_offset", W), ("send_count", W), ("needed", 1),
        ("bad_route", BAD_ROUTE_WORDS), ("agreement", W * (1 + AGREE_WORDS)), ("dropped", 1),
        ("num_recv", 1), ("count_matrix", W * W), ("node_counts", W * N),
    ]
    fields, offset = {}, 0
    for name, n in sizes:
        fields[name] = offset
        offset += n
    fields["total"] = offset
    return InfoLayout(**fields)


def check_geometry(config: BufferConfig, inter_node: bool = False) -> None:
    """Limits of the kernels, as errors that name the argument: the group's (hybrid_ep.limits, every
    backend's), and the cuda backend's own. inter_node: the caller has an inter-node transport (the
    loopback of the emulation, or NVSHMEM)."""
    check_group(config.world_size, config.ranks_per_node, config.num_experts)
    if config.num_nodes > 1 and not inter_node:
        raise ValueError(
            f"ranks_per_node={config.ranks_per_node} < world size {config.world_size} needs the cuda backend's "
            f"inter-node transport (NVSHMEM), which this process does not have: build hybrid_ep with the "
            f"nvidia-nvshmem wheel installed, or use backend='reference'"
        )
    check_hidden_dim(config.hidden_dim)  # the 16-byte row rule every backend shares
