"""Typed configuration of a buffer, validated once at construction.

`BufferConfig` is what is allocated (it fixes buffer sizes and the rank geometry);
`KernelConfig` is how the kernels run (it may change per call without a new buffer).
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings

import torch

from .checks import require_int

# Every fp8 row carries one fp32 scale per this many elements.
FP8_BLOCK = 128
# What a buffer's rings may be sized for (BufferConfig.ring_dtype): a value of 4 or 2 bytes.
RING_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclasses.dataclass(frozen=True)
class BufferConfig:
    """Shape of one EP group's buffer: W = num_nodes x ranks_per_node ranks."""

    hidden_dim: int
    max_tokens_per_rank: int
    num_experts: int
    world_size: int
    ranks_per_node: int
    pad_multiple: int = 1
    # Every local expert gets at least this many rows (zero rows past its real ones), so a
    # grouped GEMM never sees an empty group; the block is then rounded up to pad_multiple.
    min_rows_per_expert: int = 0
    # The cuda backend's peer memory at construction, optional: bytes per rank (rounded up to
    # 2 MiB) of the memory the direct path takes its dispatch outputs from when ranks are in
    # separate processes (peer_memory.py), each kept output (a training layer in flight) its
    # rows, fp8 scales and probs (arena.call_bytes; a training step: arena.training_bytes), plus
    # one expert-out block. None or 0: it starts empty and grows on demand.
    peer_memory_bytes: int | None = None
    # Chunks (of kChunkTokens tokens) one rank may have in a peer's ring before it waits for the
    # peer to free one: every ring of rows between ranks (receive rows, partial sums, RDMA
    # staging rings) holds this many chunks per peer, so the memory held is bounded independently of
    # the routing, and a call that routes more rows to one rank takes more turns of its ring.
    ring_chunks: int = 8
    # The widest value the rings' rows carry: dispatched rows and the combine's partial sums between
    # ranks. float32 carries every call; bfloat16 (or float16) halves the rings' memory and refuses
    # float32 rows and a float32 wire by name (fp8 rows fit either).
    ring_dtype: torch.dtype = torch.float32

    @property
    def arena_bytes(self) -> int | None:
        """Deprecated: peer_memory_bytes (peer memory's initial size)."""
        warnings.warn("BufferConfig.arena_bytes is deprecated: read peer_memory_bytes", DeprecationWarning,
                      stacklevel=2)
        return self.peer_memory_bytes

    def validate(self) -> "BufferConfig":
        require_int("hidden_dim", self.hidden_dim, 1)
        require_int("max_tokens_per_rank", self.max_tokens_per_rank, 0)
        require_int("num_experts", self.num_experts, 1)
        require_int("world_size", self.world_size, 1)
        require_int("ranks_per_node", self.ranks_per_node, 1)
        require_int("pad_multiple", self.pad_multiple, 1)
        require_int("min_rows_per_expert", self.min_rows_per_expert, 0)
        if self.peer_memory_bytes is not None:
            require_int("peer_memory_bytes", self.peer_memory_bytes, 0)
        require_int("ring_chunks", self.ring_chunks, 2)
        if self.ring_dtype not in RING_DTYPES:
            raise ValueError(f"ring_dtype must be one of {', '.join(str(d) for d in RING_DTYPES)}, "
                             f"got {self.ring_dtype!r}")
        if self.num_experts % self.world_size != 0:
            raise ValueError(
                f"num_experts ({self.num_experts}) must be divisible by the EP world size "
                f"({self.world_size})"
            )
        if self.world_size % self.ranks_per_node != 0:
            raise ValueError(
                f"ranks_per_node ({self.ranks_per_node}) must divide the EP world size "
                f"({self.world_size})"
            )
        return self

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.ranks_per_node

    @property
    def experts_per_rank(self) -> int:
        return self.num_experts // self.world_size

    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_index_of(self, rank: int) -> int:
        return rank % self.ranks_per_node


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """How the kernels run: SMs per kernel (None: the backend's default) and the dtype combine's
    partial sums travel in between ranks (None: the dtype of expert_out, so a bf16 combine
    rounds once per hop; torch.float32: rounded once, at the end, for twice the bytes)."""

    num_sms_dispatch: int | None = None
    num_sms_combine: int | None = None
    combine_wire_dtype: torch.dtype | None = None

    def validate(self) -> "KernelConfig":
        for name in ("num_sms_dispatch", "num_sms_combine"):
            value = getattr(self, name)
            if value is not None:
                require_int(name, value, 1)
        check_wire_dtype("combine_wire_dtype", self.combine_wire_dtype)
        return self

    def wire_dtype_for(self, expert_out_dtype: torch.dtype) -> torch.dtype:
        return expert_out_dtype if self.combine_wire_dtype is None else self.combine_wire_dtype


def check_wire_dtype(name: str, value) -> None:
    """The dtype of combine's partial sums between ranks: None (expert_out's) or torch.float32."""
    if value not in (None, torch.float32):
        raise ValueError(f"{name} must be None (the dtype of expert_out) or torch.float32, got {value}")


DEADLINE_FLOOR = 0.1  # of HYBRID_EP_TIMEOUT_S, at most DEADLINE_FLOOR_MAX_S: what a call's last wait is given
DEADLINE_FLOOR_MAX_S = 1.0


def time_left(deadline: float, timeout_s: float) -> float:
    """Seconds a call's next wait may take: what is left of its deadline (time.monotonic(), taken
    at the call's start as now + HYBRID_EP_TIMEOUT_S), but at least a tenth of the timeout (at
    most one second), so a call whose earlier waits took nearly all of it still makes its last
    exchange. A slow, dead or stalled peer so costs a call at most HYBRID_EP_TIMEOUT_S plus that
    floor, whatever the number of peers and waits (docs/troubleshooting.md)."""
    return max(deadline - time.monotonic(), min(DEADLINE_FLOOR * timeout_s, DEADLINE_FLOOR_MAX_S))


def timeout_seconds() -> float:
    """Bound of every wait, from HYBRID_EP_TIMEOUT_S (default 100 s)."""
    raw = os.environ.get("HYBRID_EP_TIMEOUT_S", "100")
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"HYBRID_EP_TIMEOUT_S must be a number of seconds, got {raw!r}") from None
    if not (0 < value < float("inf")):  # nan fails too
        raise ValueError(f"HYBRID_EP_TIMEOUT_S must be a finite number of seconds > 0, got {raw!r}")
    return value
