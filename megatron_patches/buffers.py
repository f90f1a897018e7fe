"""One HybridEPBuffer per EP group and shape, created on first use and shared by all layers.

A buffer registers its memory once for the worst case (and, on the cuda backend, exchanges
handles between ranks), so every MoE layer with the same EP group, hidden size, expert count
and padding uses the same buffer: dispatch/combine calls of different layers never overlap,
and per-call outputs come from the PyTorch allocator. Creating a buffer is collective, which
is why its size is a value every rank of the group holds: the max over ranks of the token
count, or --hybrid-ep-max-tokens-per-rank.

One buffer per key at most: a buffer that needs other rows per expert (drop-and-pad with
another capacity) or more tokens replaces the cached one, so the registered memory stays
that of one buffer per key however often the token count changes.

Each buffer created is announced in one log line on the group's rank 0 (`memory_line`): the
bytes it holds per GPU, by region, from its `memory_plan()`.
"""

from __future__ import annotations

import dataclasses
import datetime
import logging

import torch
import torch.distributed as dist

import hybrid_ep

MAX_TOKENS_FLAG = "--hybrid-ep-max-tokens-per-rank (HybridEPOptions.max_tokens_per_rank)"
LINE_LIMIT = 199  # characters of the startup line

_log = logging.getLogger(__name__)


def size(nbytes: float) -> str:
    """'17.63 GiB', '512.00 MiB', '0 B'."""
    from hybrid_ep.wording import byte_unit

    scale, unit = byte_unit(nbytes)
    return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes / scale:.2f} {unit}"


def memory_line(plan: hybrid_ep.MemoryPlan, config, expert_out_in_place: bool = False) -> str:
    """One line (at most LINE_LIMIT characters): the buffer's shape, the data path its calls
    take and on what (the plan's data_path: the cuda backend's), whether the forward combine
    reads the experts' output in place or copies it (direct path with peer memory:
    expert_out_in_place, the dispatcher's experts have megatron_patches.expert_out installed),
    the bytes it holds per GPU (registered regions and peer memory, largest first; the smallest
    are counted as "+N more" where the line would run over) and its per-call worst case."""
    nodes = config.world_size // config.ranks_per_node
    path = f", {plan.data_path}" if plan.data_path else ""
    if plan.data_path and plan.data_path.startswith("direct path, peer memory"):
        # Megatron's experts allocate their output outside peer memory: each combine copies it,
        # unless fc2 writes it into the expert-out block (expert_out.py)
        path += ", expert output in place" if expert_out_in_place else ", expert output copied"
    head = (f"hybrid_ep dispatcher: {plan.backend} buffer for EP {config.world_size} "
            f"({nodes} node{'s' if nodes > 1 else ''} x {config.ranks_per_node}), "
            f"{config.max_tokens_per_rank} tokens/rank{path}, holds {size(plan.registered_bytes)} per GPU")
    tail = f"; per call <= {size(plan.workspace_bytes)}"
    held = sorted((b for b in plan.buffers if b.registered and b.nbytes), key=lambda b: -b.nbytes)
    for shown in range(len(held), -1, -1):
        parts = [f"{b.name} {size(b.nbytes)}" for b in held[:shown]]
        if shown < len(held):
            parts.append(f"+{len(held) - shown} more")
        regions = f" ({', '.join(parts)})" if parts else ""
        line = head + regions + tail
        if len(line) <= LINE_LIMIT:
            return line
    return (head + tail)[:LINE_LIMIT]


@dataclasses.dataclass(frozen=True)
class BufferKey:
    group_id: int
    hidden_dim: int
    num_experts: int
    pad_multiple: int
    ranks_per_node: int | None
    backend: str
    num_sms_dispatch: int | None
    num_sms_combine: int | None
    ring_dtype: torch.dtype = torch.float32


# The key's fields HybridEPBuffer takes by keyword (the others: the group, and its positional arguments).
_BUFFER_KEYWORDS = ("ranks_per_node", "backend", "pad_multiple", "num_sms_dispatch", "num_sms_combine", "ring_dtype")


def ring_dtype_for(hidden_dtype: torch.dtype) -> torch.dtype:
    """The rings' width for a layer whose hidden states are `hidden_dtype`: every row and partial
    sum between ranks has their width or less (fp8 dispatch, the combine of the experts' output,
    both backward passes), so bf16 training holds rings of bf16 rows, half of fp32's."""
    return hidden_dtype if hidden_dtype in (torch.bfloat16, torch.float16) else torch.float32


def group_max_tokens(group, num_tokens: int, device) -> int:
    """The largest token count over the ranks of `group` (collective, reads one int on the host);
    the wait is bounded by HYBRID_EP_TIMEOUT_S like every hybrid_ep collective."""
    from hybrid_ep.config import timeout_seconds

    limit = timeout_seconds()
    size = torch.tensor([num_tokens], dtype=torch.int64, device=device)
    work = dist.all_reduce(size, op=dist.ReduceOp.MAX, group=group, async_op=True)
    try:
        work.wait(timeout=datetime.timedelta(seconds=limit))
    except RuntimeError as err:
        raise RuntimeError(
            f"hybrid_ep dispatcher: EP rank {dist.get_rank(group)} waited more than {limit:g} s "
            f"(HYBRID_EP_TIMEOUT_S) for the group's token count: a peer rank did not dispatch ({err})"
        ) from err
    return int(size.item())


class BufferCache:
    """Buffers keyed by BufferKey; the group object is kept alive with its buffer."""

    def __init__(self):
        self._entries: dict[BufferKey, tuple[object, hybrid_ep.HybridEPBuffer]] = {}

    def get(self, group, key: BufferKey, num_tokens: int, max_tokens_per_rank: int | None,
            device: torch.device, *, min_rows_per_expert: int = 0,
            group_tokens: int | None = None, dtype: torch.dtype = torch.bfloat16,
            expert_out_in_place: bool = False) -> hybrid_ep.HybridEPBuffer:
        """The buffer for `key` with `min_rows_per_expert` that holds `num_tokens` tokens.

        group_tokens: the group's largest token count when the caller agreed it on every rank
        (then a buffer that is too small is replaced, or the same error raised, on every rank
        together). Without it, only a new min_rows_per_expert (the same on every rank: the
        capacity of drop-and-pad) replaces the buffer; more tokens than its size is an error
        raised by this rank alone, before any collective. dtype: of the rows dispatched, for
        the startup line's figures (memory_plan); expert_out_in_place: the caller's experts write
        the forward combine's expert_out in place (the startup line says so).
        """
        entry = self._entries.get(key)
        buf = None if entry is None else entry[1]
        needed = num_tokens if group_tokens is None else group_tokens
        if max_tokens_per_rank is not None and needed > max_tokens_per_rank:
            who = f"EP rank {dist.get_rank(group)}" if group_tokens is None else "a rank of the EP group"
            raise ValueError(
                f"hybrid_ep dispatcher: {needed} tokens on {who} exceed {MAX_TOKENS_FLAG}="
                f"{max_tokens_per_rank}; raise it to the largest tokens per rank"
            )
        if buf is not None and buf.config.min_rows_per_expert == min_rows_per_expert:
            if needed <= buf.config.max_tokens_per_rank:
                return buf
            if group_tokens is None:
                raise ValueError(
                    f"hybrid_ep dispatcher: {num_tokens} tokens on EP rank {buf.rank} exceed the buffer "
                    f"size of {buf.config.max_tokens_per_rank} tokens per rank (the EP group's largest "
                    "count so far); the token count is agreed between ranks on every call only with "
                    "variable_seq_lengths=True: set it when micro-batches change their token count, or "
                    f"set {MAX_TOKENS_FLAG} to the largest tokens per rank"
                )
        if max_tokens_per_rank is None:
            if group_tokens is None:
                group_tokens = group_max_tokens(group, num_tokens, device)
            old = 0 if buf is None else buf.config.max_tokens_per_rank
            max_tokens_per_rank = max(1, group_tokens, old)  # never shrinks: no churn
        kwargs = {name: getattr(key, name) for name in _BUFFER_KEYWORDS} | {"min_rows_per_expert": min_rows_per_expert}
        self._entries.pop(key, None)  # the stale buffer lives on only while a handle uses it
        buf = hybrid_ep.HybridEPBuffer(group, key.hidden_dim, max_tokens_per_rank, key.num_experts, **kwargs)
        self._entries[key] = (group, buf)
        if buf.rank == 0:
            _log.info("%s", memory_line(buf.memory_plan(dtype), buf.config, expert_out_in_place))
        return buf

    def clear(self) -> None:
        self._entries.clear()

    def buffers(self) -> list[hybrid_ep.HybridEPBuffer]:
        """The cached buffers (one per key)."""
        return [buf for _, buf in self._entries.values()]

    def __len__(self) -> int:
        return len(self._entries)


# Process-wide on purpose: sharing registered memory across layers is the point of the cache.
BUFFERS = BufferCache()
