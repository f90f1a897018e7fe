"""Byte layout of one rank's registered buffer and of the per-call info tensor.

Planned here, in Python, so memory_plan() can say how much a buffer needs before anything is
allocated; the kernels receive these offsets (csrc/common/params.h: RegLayout, InfoLayout).

Legend: W ranks, N nodes, L local experts, Tmax = max_tokens_per_rank, H hidden.
"""

from __future__ import annotations

import dataclasses

from ...config import FP8_BLOCK, BufferConfig

ALIGN = 128  # every region starts on its own 128-byte line
MAX_TOPK = 16  # csrc kMaxTopK: routes per token
MAX_RANKS = 64  # csrc kMaxRanks
MAX_EXPERTS = 1024  # csrc kMaxExperts
LOCAL_STATE_BYTES = 8 + 8 + 4 + 4  # csrc LocalState
CHUNK_TOKENS = 32  # csrc kChunkTokens: tokens per chunk, the unit of signalling between ranks
CHUNK_SIGNAL_BYTES = 16  # csrc ChunkSignal
META_ENTRY_BYTES = 16  # csrc MetaEntry
MAX_ROW_ELEM_BYTES = 4  # receive rows are sized for fp32, the widest dispatch dtype


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


@dataclasses.dataclass(frozen=True)
class RegisteredLayout:
    """Offsets (bytes) of one rank's registered buffer; field names match csrc RegLayout."""

    count_epoch: int
    chunk_signal: int
    max_chunks: int
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
    comb_rows: int
    comb_stride: int
    total: int

    def region_bytes(self) -> dict[str, int]:
        """Size of each region, for the memory plan."""
        order = ["count_epoch", "chunk_signal", "combine_signal", "done_dispatch", "done_combine", "state",
                 "count_in", "recv_meta", "recv_rows", "recv_scales", "comb_rows"]
        starts = [getattr(self, name) for name in order] + [self.total]
        return {name: starts[i + 1] - starts[i] for i, name in enumerate(order)}


def registered_layout(config: BufferConfig) -> RegisteredLayout:
    W, N, L = config.world_size, config.num_nodes, config.experts_per_rank
    Tmax, H = config.max_tokens_per_rank, config.hidden_dim
    offset = 0

    def take(nbytes: int) -> int:
        nonlocal offset
        start = offset
        offset = _round_up(offset + nbytes, ALIGN)
        return start

    fields = {}
    fields["count_epoch"] = take(8 * W)
    fields["max_chunks"] = max(1, -(-Tmax // CHUNK_TOKENS))
    fields["chunk_signal"] = take(CHUNK_SIGNAL_BYTES * W * fields["max_chunks"])
    fields["combine_signal"] = take(8 * W * fields["max_chunks"])
    fields["done_dispatch"] = take(8)
    fields["done_combine"] = take(8)
    fields["state"] = take(LOCAL_STATE_BYTES)
    fields["count_row_ints"] = W + N + L + 1
    fields["count_in"] = take(4 * W * fields["count_row_ints"])
    fields["meta_entries"] = min(L, MAX_TOPK)
    fields["recv_meta"] = take(META_ENTRY_BYTES * W * Tmax * fields["meta_entries"])
    fields["row_stride"] = _round_up(H * MAX_ROW_ELEM_BYTES, 16)
    fields["recv_rows"] = take(W * Tmax * fields["row_stride"])
    fields["scale_stride"] = _round_up(H // FP8_BLOCK * 4, 16) if H % FP8_BLOCK == 0 else 0
    fields["recv_scales"] = take(W * Tmax * fields["scale_stride"])
    fields["comb_stride"] = _round_up(H * 4, 16)
    fields["comb_rows"] = take(W * Tmax * fields["comb_stride"])
    fields["total"] = offset
    return RegisteredLayout(**fields)


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
    dropped: int
    num_recv: int
    count_matrix: int
    node_counts: int
    total: int


def info_layout(config: BufferConfig) -> InfoLayout:
    W, N, L = config.world_size, config.num_nodes, config.experts_per_rank
    sizes = [
        ("tokens_per_expert", L), ("expert_start", L), ("expert_rows", L), ("src_prefix", W * L),
        ("recv_count", W), ("src_tokens", W), ("recv_offset", W), ("send_count", W), ("needed", 1), ("dropped", 1),
        ("num_recv", 1), ("count_matrix", W * W), ("node_counts", W * N),
    ]
    fields, offset = {}, 0
    for name, n in sizes:
        fields[name] = offset
        offset += n
    fields["total"] = offset
    return InfoLayout(**fields)


def check_geometry(config: BufferConfig) -> None:
    """Limits of the kernels, as errors that name the argument."""
    if config.world_size > MAX_RANKS:
        raise ValueError(f"the cuda backend supports EP groups of up to {MAX_RANKS} ranks, got {config.world_size}")
    if config.num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts must be <= {MAX_EXPERTS} for the cuda backend, got {config.num_experts}")
    if config.num_nodes > 1:
        raise ValueError(
            f"the cuda backend moves rows over NVLink inside one node; ranks_per_node={config.ranks_per_node} "
            f"< world size {config.world_size} needs the inter-node transport, which is not in this build "
            f"(use backend='reference')"
        )
    if config.hidden_dim % 4 != 0:
        raise ValueError(f"hidden_dim must be a multiple of 4 for the cuda backend (16-byte rows), got {config.hidden_dim}")
