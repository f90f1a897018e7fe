"""Byte layout of one rank's registered buffer and of the per-call info tensor.

Planned here, in Python, so memory_plan() can say how much a buffer needs before anything is
allocated; the kernels receive these offsets (csrc/common/params.h: RegLayout, InfoLayout).
The sizes of csrc's structs and its limits come from the compiled module (`compiled`: both
builds export them, csrc/bindings/common.h); none is written here a second time.

Legend: W ranks, N nodes, L local experts, Tmax = max_tokens_per_rank, H hidden.
"""

from __future__ import annotations

import dataclasses
import importlib

from ...config import FP8_BLOCK, BufferConfig
from ...rows import check_hidden_dim


def _compiled():
    """hybrid_ep._model (built by every install, loads without a GPU), else hybrid_ep._C: both
    bind csrc/common/params.h's constants and struct sizes under the same names."""
    errors = []
    for name in ("hybrid_ep._model", "hybrid_ep._C"):
        try:
            return importlib.import_module(name)
        except ImportError as err:
            errors.append(f"{name}: {err}")
    raise ImportError("the cuda backend's buffer layout takes csrc's struct sizes from a compiled module, and "
                      "neither is installed (" + "; ".join(errors) + ")")


compiled = _compiled()
ALIGN = 128  # every region starts on its own 128-byte line (a choice of this plan, passed down as offsets)
MAX_TOPK: int = compiled.MAX_TOPK  # routes per token
MAX_RANKS: int = compiled.MAX_RANKS
MAX_EXPERTS: int = compiled.MAX_EXPERTS
MAX_LAUNCH_RANKS: int = compiled.MAX_LAUNCH_RANKS  # virtual ranks one emulated launch holds
LOCAL_STATE_BYTES: int = compiled.LOCAL_STATE_BYTES
CHUNK_TOKENS: int = compiled.CHUNK_TOKENS  # tokens per chunk, the unit of signalling between ranks
CHUNK_SIGNAL_BYTES: int = compiled.CHUNK_SIGNAL_BYTES
META_ENTRY_BYTES: int = compiled.META_ENTRY_BYTES
TOKEN_META_BYTES: int = compiled.TOKEN_META_BYTES  # expert, ordinal and weight of every route
PEER_TENSORS_BYTES: int = compiled.PEER_TENSORS_BYTES  # a rank's published tensors of one call (direct path)
COUNT_ROW_TAIL: int = compiled.COUNT_ROW_TAIL  # a count row's source tokens and first bad route
ERROR_RECORD_PHASE_OFFSET: int = compiled.ERROR_RECORD_PHASE_OFFSET  # ErrorRecord's words the host polls
ERROR_RECORD_EPOCH_OFFSET: int = compiled.ERROR_RECORD_EPOCH_OFFSET
CHUNK_META_HEADER: int = compiled.CHUNK_META_HEADER  # a staged chunk's routing starts with its row count
RING_TAG_CHUNK_BITS: int = compiled.RING_TAG_CHUNK_BITS  # a ring slot's tag: the call above chunk + 1
MAX_ROW_ELEM_BYTES = 4  # receive rows are sized for fp32, the widest dispatch dtype (this plan's choice)
BAD_ROUTE_WORDS = 3  # info's bad_route: the lowest bad rank (-1: none), its first bad token, that route's id

# The names `compiled` and every loaded module must give the same values (engine.check_extension):
# a module built from other sources than the one this plan read is stale.
COMPILED_CONSTANTS = ("MAX_TOPK", "MAX_RANKS", "MAX_EXPERTS", "MAX_LAUNCH_RANKS", "LOCAL_STATE_BYTES", "CHUNK_TOKENS",
                      "CHUNK_SIGNAL_BYTES", "META_ENTRY_BYTES", "TOKEN_META_BYTES", "PEER_TENSORS_BYTES",
                      "COUNT_ROW_TAIL", "ERROR_RECORD_PHASE_OFFSET", "ERROR_RECORD_EPOCH_OFFSET",
                      "COMBINE_MAX_SEG_COLS", "MAX_STAGES", "MAX_STORE_GROUPS", "PULL_PIPELINES", "CHUNK_META_HEADER",
                      "DIRECT_STORE_THREADS", "RING_TAG_CHUNK_BITS")


def ring_tag(call: int, chunk: int) -> int:
    """What a ring slot's signal and credit words hold for chunk `chunk` of call `call`
    (csrc/kernels/peer_ring.cuh, PeerRing::tag): what a timeout record of a ring's wait shows."""
    return call << RING_TAG_CHUNK_BITS | (chunk + 1)


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class _Regions:
    """Consecutive regions of a buffer, each starting on its own ALIGN-byte line."""

    def __init__(self):
        self.offset = 0

    def take(self, nbytes: int) -> int:
        start = self.offset
        self.offset = _round_up(self.offset + nbytes, ALIGN)
        return start


@dataclasses.dataclass(frozen=True)
class RegisteredLayout:
    """Offsets (bytes) of one rank's registered buffer; field names match csrc RegLayout."""

    count_epoch: int
    chunk_signal: int
    max_chunks: int
    ring_chunks: int
    combine_signal: int
    done_dispatch: int
    done_combine: int
    state: int
    count_in: int
    count_row_ints: int
    recv_meta: int
    meta_entries: int
    recv_rows: int
    row_stride: int
    recv_scales: int
    scale_stride: int
    recv_credit: int
    comb_rows: int
    comb_stride: int
    comb_fwd: int
    comb_fwd_signal: int
    comb_credit: int
    direct_tensors: int
    direct_first: int
    direct_done: int
    total: int

    def region_bytes(self) -> dict[str, int]:
        """Size of each region, for the memory plan."""
        order = ["count_epoch", "chunk_signal", "combine_signal", "done_dispatch", "done_combine", "state",
                 "count_in", "recv_meta", "recv_rows", "recv_scales", "recv_credit", "comb_rows", "comb_fwd",
                 "comb_fwd_signal", "comb_credit", "direct_tensors", "direct_first", "direct_done"]
        starts = [getattr(self, name) for name in order] + [self.total]
        return {name: starts[i + 1] - starts[i] for i, name in enumerate(order)}


def comb_ring(config: BufferConfig) -> int:
    """Chunk slots of each combine ring (csrc comb_ring): ring_chunks, or the chunks of the
    largest source where that is fewer."""
    return min(config.ring_chunks, max(1, -(-config.max_tokens_per_rank // CHUNK_TOKENS)))


def registered_layout(config: BufferConfig) -> RegisteredLayout:
    W, N, L = config.world_size, config.num_nodes, config.experts_per_rank
    Tmax, H = config.max_tokens_per_rank, config.hidden_dim
    take = _Regions().take

    fields = {}
    fields["count_epoch"] = take(8 * W)
    fields["max_chunks"] = max(1, -(-Tmax // CHUNK_TOKENS))
    fields["ring_chunks"] = config.ring_chunks
    fields["chunk_signal"] = take(CHUNK_SIGNAL_BYTES * W * fields["max_chunks"])
    ring = comb_ring(config)
    fields["combine_signal"] = take(8 * W * ring)
    fields["done_dispatch"] = take(8)
    fields["done_combine"] = take(8)
    fields["state"] = take(LOCAL_STATE_BYTES)
    fields["count_row_ints"] = W + N + L + COUNT_ROW_TAIL
    fields["count_in"] = take(4 * W * fields["count_row_ints"])
    # The receive ring: ring_chunks chunk slots of CHUNK_TOKENS rows per source, whatever the
    # routing (a call that sends a rank more waits for it to free slots), and the credit words
    # its readers free them with, [N source node][G reader][ring_chunks] in the writer's buffer.
    ring_rows = W * config.ring_chunks * CHUNK_TOKENS
    fields["meta_entries"] = min(L, MAX_TOPK)
    fields["recv_meta"] = take(META_ENTRY_BYTES * ring_rows * fields["meta_entries"])
    fields["row_stride"] = _round_up(H * MAX_ROW_ELEM_BYTES, 16)
    fields["recv_rows"] = take(ring_rows * fields["row_stride"])
    fields["scale_stride"] = _round_up(H // FP8_BLOCK * 4, 16) if H % FP8_BLOCK == 0 else 0
    fields["recv_scales"] = take(ring_rows * fields["scale_stride"])
    fields["recv_credit"] = take(8 * W * config.ring_chunks)
    fields["comb_stride"] = _round_up(H * 4, 16)
    # Partial sums: a ring of `ring` chunk slots per expert host (the reader frees a slot with a
    # credit in the writer's comb_credit), whatever max_tokens and the routing.
    fields["comb_rows"] = take(W * ring * CHUNK_TOKENS * fields["comb_stride"])
    # With several nodes: partials of sources on other nodes, from this node's ranks, when this
    # rank is the source's rail peer here (a ring per source node and writer: [N][G][ring] chunk
    # slots), and their signals.
    forwarding = N > 1
    fields["comb_fwd"] = take(W * ring * CHUNK_TOKENS * fields["comb_stride"] if forwarding else 0)
    fields["comb_fwd_signal"] = take(8 * W * ring if forwarding else 0)
    fields["comb_credit"] = take(8 * W * ring)
    # The direct path: this rank's published tensors of a dispatch and a combine, the first
    # output row of each (source, local expert), and each source's completion per kernel.
    fields["direct_tensors"] = take(2 * PEER_TENSORS_BYTES)
    fields["direct_first"] = take(4 * W * L)
    fields["direct_done"] = take(8 * 2 * W)
    fields["total"] = take(0)
    return RegisteredLayout(**fields)


@dataclasses.dataclass(frozen=True)
class RdmaLayout:
    """Offsets (bytes) of one rank's RDMA region (the symmetric heap on clusters); names match
    csrc RdmaLayout. Empty (total 0) for a single node."""

    count_epoch: int
    count_out: int
    count_in: int
    done_dispatch: int
    done_combine: int
    disp_signal: int
    token_meta_bytes: int
    chunk_meta_bytes: int
    disp_meta_out: int
    disp_meta_in: int
    disp_rows_out: int
    disp_rows_in: int
    disp_credit: int
    comb_signal: int
    comb_credit: int
    comb_rows_out: int
    comb_rows_in: int
    total: int

    def region_bytes(self) -> dict[str, int]:
        order = ["count_epoch", "count_out", "count_in", "done_dispatch", "done_combine", "disp_signal",
                 "disp_meta_out", "disp_meta_in", "disp_rows_out", "disp_rows_in", "disp_credit", "comb_signal",
                 "comb_credit",
                 "comb_rows_out", "comb_rows_in"]
        starts = [getattr(self, name) for name in order] + [self.total]
        return {name: starts[i + 1] - starts[i] for i, name in enumerate(order)}


def rdma_layout(config: BufferConfig) -> RdmaLayout:
    """The dispatch's staging is a ring per node, [node][ring_chunks] chunk slots of
    CHUNK_TOKENS rows and a chunk's routing, and its credit words; the combine's node partials a
    ring per node too, [node][(chunk % ring) * CHUNK_TOKENS + q], with a signal and a credit word
    per slot; whatever the routing. The areas for this rank's own node stay unused, which keeps
    every offset the same on every rank."""
    W, N, G = config.world_size, config.num_nodes, config.ranks_per_node
    H = config.hidden_dim
    reg = registered_layout(config)
    if N == 1:
        return RdmaLayout(**{f.name: 0 for f in dataclasses.fields(RdmaLayout)})
    chunks = reg.max_chunks
    row_ints = _round_up(reg.count_row_ints, 4)
    scale_cols = H // FP8_BLOCK if H % FP8_BLOCK == 0 else 0
    take = _Regions().take

    f = {}
    f["count_epoch"] = take(8 * W)
    f["count_out"] = take(4 * W * row_ints)
    f["count_in"] = take(4 * 2 * W * row_ints)
    f["done_dispatch"] = take(8 * N)
    f["done_combine"] = take(8 * N)
    f["disp_signal"] = take(8 * N * chunks)
    f["token_meta_bytes"] = _round_up(TOKEN_META_BYTES + 4 * G + 4 * scale_cols, 16)
    f["chunk_meta_bytes"] = CHUNK_META_HEADER + CHUNK_TOKENS * f["token_meta_bytes"]
    ring = config.ring_chunks
    f["disp_meta_out"] = take(N * ring * f["chunk_meta_bytes"])
    f["disp_meta_in"] = take(N * ring * f["chunk_meta_bytes"])
    f["disp_rows_out"] = take(N * ring * CHUNK_TOKENS * reg.row_stride)
    f["disp_rows_in"] = take(N * ring * CHUNK_TOKENS * reg.row_stride)
    f["disp_credit"] = take(8 * N * ring)
    # Node partials: a ring of `ring` chunk slots per node, freed by the source's credits.
    ring = comb_ring(config)
    f["comb_signal"] = take(8 * N * ring)
    f["comb_credit"] = take(8 * N * ring)
    f["comb_rows_out"] = take(N * ring * CHUNK_TOKENS * reg.comb_stride)
    f["comb_rows_in"] = take(N * ring * CHUNK_TOKENS * reg.comb_stride)
    f["total"] = take(0)
    return RdmaLayout(**f)


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
        ("bad_route", BAD_ROUTE_WORDS), ("dropped", 1),
        ("num_recv", 1), ("count_matrix", W * W), ("node_counts", W * N),
    ]
    fields, offset = {}, 0
    for name, n in sizes:
        fields[name] = offset
        offset += n
    fields["total"] = offset
    return InfoLayout(**fields)


def check_geometry(config: BufferConfig, inter_node: bool = False) -> None:
    """Limits of the kernels, as errors that name the argument. inter_node: the caller has an
    inter-node transport (the loopback of the emulation, or NVSHMEM)."""
    if config.world_size > MAX_RANKS:
        raise ValueError(f"the cuda backend supports EP groups of up to {MAX_RANKS} ranks, got {config.world_size}")
    if config.num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts must be <= {MAX_EXPERTS} for the cuda backend, got {config.num_experts}")
    if config.num_nodes > 1 and not inter_node:
        raise ValueError(
            f"ranks_per_node={config.ranks_per_node} < world size {config.world_size} needs the cuda backend's "
            f"inter-node transport (NVSHMEM), which this process does not have: build hybrid_ep with the "
            f"nvidia-nvshmem wheel installed, or use backend='reference'"
        )
    check_hidden_dim(config.hidden_dim)  # the 16-byte row rule every backend shares
