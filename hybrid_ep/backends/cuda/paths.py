"""Which data path a dispatch takes, and the one log line when it leaves the direct path.

The direct path needs every destination's outputs where its peers can write them: in one
process (the single-GPU emulation) any tensor; with ranks in separate processes an arena
block (arena.py). A call whose blocks do not fit takes the receive path, whose results are
the same, on every rank of the group (the vote, where this process drives only some).
"""

from __future__ import annotations

import logging

import torch

from .arena import arena_take, call_bytes

_log = logging.getLogger("hybrid_ep")
_fallbacks_logged: set[str] = set()  # the reason of the first call that left the direct path (once per process)


# How to size the arena, in the fallback line: what a training step keeps there.
ARENA_SIZING = ("The arena (HybridEPBuffer(arena_bytes=...), opt-in, for ranks in separate processes) holds "
                "each dispatch output kept alive (in training, one per MoE layer in flight until its backward): "
                "arena.call_bytes(rows, hidden, dtype) each, arena.training_bytes(layers_in_flight, rows, hidden, "
                "dtype) for a training step")


def log_fallback(reason: str) -> None:
    if not _fallbacks_logged:
        _fallbacks_logged.add(reason)
        _log.warning("hybrid_ep: a dispatch took the receive path instead of the direct path (%s); "
                     "logged once per process", reason)


def choose_path(engine, rows: list[int], dtype: torch.dtype, fp8: bool, stream: int) -> tuple[bool, object]:
    """(direct, the arena blocks of a direct dispatch or None) for a call of `rows` output
    rows per rank: the buffer's data path. With arenas, every driven rank's arena block
    (arena.arena_take: the tensors are made after the launch), unless some rank's arena can
    not hold it, or its combine could not be staged (more rows than the staging region
    holds): the call then takes the receive path, on every rank of the group (the vote,
    where this process drives only some), with one log line per process."""
    if engine.data_path != "direct":
        return False, None
    if not engine.arenas:  # ranks in one process: outputs from PyTorch's allocator
        return True, None
    H = engine.config.hidden_dim
    taken, reason = None, None
    if max(rows) > engine.staging.rows:
        i = next(i for i, R in enumerate(rows) if not engine.staging.holds(R))
        reason = (f"rank {engine.ranks[i]}'s combine staging region holds {engine.staging.rows} fp32 rows (as many "
                  f"as a bf16 call the arena holds); the call has {rows[i]}. {ARENA_SIZING}")
    else:
        taken = arena_take(engine.arenas, rows, H, dtype, fp8, stream)
        if taken.failed >= 0:
            i, taken = taken.failed, None
            arena, R = engine.arenas[i], rows[i]
            reason = (f"rank {engine.ranks[i]}'s arena can not hold {R} output rows: "
                      f"{call_bytes(R, H, dtype, fp8)} bytes needed, {arena.used} of {arena.capacity} in use, "
                      f"largest free range {arena.largest_free(stream)}. {ARENA_SIZING}")
    ok = reason is None
    if engine.vote is not None and engine.vote(ok) != ok:
        ok, reason = False, "another rank's arena could not hold its output of the call"
    if not ok:
        log_fallback(reason)
        return False, None
    return True, taken
