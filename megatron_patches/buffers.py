"""One HybridEPBuffer per EP group and shape, created on first use and shared by all layers.

A buffer registers its memory once for the worst case (and, on the cuda backend, exchanges
handles between ranks), so every MoE layer with the same EP group, hidden size, expert count
and padding uses the same buffer: dispatch/combine calls of different layers never overlap,
and per-call outputs come from the PyTorch allocator. Creating a buffer is collective, which
is why the size is agreed on by all ranks of the group (max over ranks) on the first call.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

import hybrid_ep


@dataclasses.dataclass(frozen=True)
class BufferKey:
    group_id: int
    hidden_dim: int
    num_experts: int
    pad_multiple: int
    min_rows_per_expert: int
    ranks_per_node: int | None
    backend: str
    num_sms_dispatch: int | None
    num_sms_combine: int | None


class BufferCache:
    """Buffers keyed by BufferKey; the group object is kept alive with its buffer."""

    def __init__(self):
        self._entries: dict[BufferKey, tuple[object, hybrid_ep.HybridEPBuffer]] = {}

    def get(self, group, key: BufferKey, num_tokens: int, max_tokens_per_rank: int | None,
            device: torch.device) -> hybrid_ep.HybridEPBuffer:
        entry = self._entries.get(key)
        if entry is not None:
            buf = entry[1]
            if num_tokens > buf.config.max_tokens_per_rank:
                raise ValueError(
                    f"hybrid_ep dispatcher: {num_tokens} tokens on EP rank {buf.rank} exceed the "
                    f"buffer size of {buf.config.max_tokens_per_rank} tokens per rank (taken from "
                    "the first call); set --hybrid-ep-max-tokens-per-rank (or "
                    "HybridEPOptions.max_tokens_per_rank) to the largest tokens per rank"
                )
            return buf
        if max_tokens_per_rank is None:
            size = torch.tensor([num_tokens], dtype=torch.int64, device=device)
            dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group)
            max_tokens_per_rank = max(1, int(size.item()))
        kwargs = dict(
            ranks_per_node=key.ranks_per_node,
            backend=key.backend,
            pad_multiple=key.pad_multiple,
            num_sms_dispatch=key.num_sms_dispatch,
            num_sms_combine=key.num_sms_combine,
            min_rows_per_expert=key.min_rows_per_expert,
        )
        buf = hybrid_ep.HybridEPBuffer(group, key.hidden_dim, max_tokens_per_rank, key.num_experts, **kwargs)
        self._entries[key] = (group, buf)
        return buf

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


# Process-wide on purpose: sharing registered memory across layers is the point of the cache.
BUFFERS = BufferCache()
