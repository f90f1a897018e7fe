"""The reference backend's agreement check: every message between ranks starts with a header
naming the call, and every rank compares all of them before it uses a row.

Rows travel as raw bytes and counts are each rank's own, so ranks that make different calls,
reuse handles of different dispatches or send rows of another format would exchange wrong
rows without an error. Each rank sends the same header to every peer, so after an exchange
every rank holds the same table of headers and raises the same ValueError; the exchange itself
completed, so the group stays usable. The header rides in the exchange the call makes anyway
(the routing's count exchange, or the rows of a call with a handle): no extra message.

Header words (int64): the call, ranks_per_node, the handle's serial number and count
checksum (0, 0 for a new routing), the refusal (0, or the code of the argument the rank refused:
hybrid_ep/refusals.py; it then makes the call with no rows of its own), then FORMAT row-format
slots (zero where a call has fewer fields). A refusal is checked first: every rank raises the
lowest refusing rank's InputRefused, whatever else differs.
"""

from __future__ import annotations

import functools
import zlib

import torch

from ..refusals import refused_by_peer

# The collective calls, as the header numbers them and the errors name them.
NEW_ROUTING, WITH_HANDLE, COMBINE, PROBS_BACKWARD = range(4)
CALLS = ("dispatch with a routing", "dispatch with a handle", "combine", "probs backward")
PHASES = ("dispatch", "dispatch", "combine", "probs backward")
_HEAD = 5  # call, ranks_per_node, handle serial, handle count checksum, refusal
_REFUSAL = 4
_FORMAT = 5  # row-format slots: the most fields of any call (dispatch's)
HEADER_WORDS = _HEAD + _FORMAT

_DTYPES = [v for v in vars(torch).values() if isinstance(v, torch.dtype)]


@functools.cache
def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())  # the same in every process (hash() is salted)


@functools.cache
def _dtype_names() -> dict[int, str]:
    return {_dtype_code(d): str(d) for d in _DTYPES}


def header(call: int, ranks_per_node: int, fields: dict, serial: int = 0, checksum: int = 0,
           refused: int = 0) -> list[int]:
    """The HEADER_WORDS integers a rank sends every peer before the call's rows (refused: the
    code of the argument this rank refused, refusals.code_of)."""
    values = [_dtype_code(v) if isinstance(v, torch.dtype) else int(v) for v in fields.values()]
    return [call, ranks_per_node, serial, checksum, refused] + values + [0] * (_FORMAT - len(values))


def checksum(count_WW: torch.Tensor) -> int:
    """The [W, W] count matrix of a routing comes from one exchange, so it is the same on every
    rank: two ranks whose handles' checksums differ hold handles of different dispatches.
    count_WW must be on the host (the routing's one host read brought it there)."""
    return zlib.crc32(count_WW.contiguous().numpy().tobytes())


def check(call: int, fields: dict, table: list[list[int]]) -> None:
    """Raise the same ValueError on every rank when the ranks' headers (table: one row per rank)
    differ: the call first (in another call the other slots mean something else), then
    ranks_per_node, the handle and the row format fields."""
    if all(row == table[0] for row in table) and not table[0][_REFUSAL]:  # the usual case: nothing to name
        return
    refusing = next((r for r, row in enumerate(table) if row[_REFUSAL]), None)
    if refusing is not None:
        own_call = table[refusing][0]
        raise refused_by_peer(refusing, PHASES[own_call] if 0 <= own_call < len(PHASES) else "call",
                              table[refusing][_REFUSAL])

    def differ(what: str, shown: list, rule: str, prefix: str = f"hybrid_ep {PHASES[call]}") -> None:
        if len(set(shown)) > 1:
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))
            raise ValueError(f"{prefix}: the EP ranks disagree on {what} ({per_rank}); {rule}")

    column = [list(c) for c in zip(*table)]
    differ("the call", [CALLS[c] if 0 <= c < len(CALLS) else f"unknown call {c}" for c in column[0]],
           "every rank must make the same calls in the same order",
           prefix="hybrid_ep")  # the same text on every rank, whatever its own call
    differ("ranks_per_node", column[1], "every rank must build its buffer with the same ranks_per_node")
    serials, sums = column[2], column[3]
    same_serial = len(set(serials)) == 1
    differ("the handle", [f"dispatch #{s}" + (f" with count checksum {c:08x}" if same_serial else "")
                          for s, c in zip(serials, sums)],
           "every rank must pass the handle of the same dispatch (a buffer numbers its dispatches "
           "with a routing in call order)")
    for j, (name, value) in enumerate(fields.items()):
        col = column[_HEAD + j]
        if isinstance(value, torch.dtype):
            col = [_dtype_names().get(c, c) for c in col]
        elif isinstance(value, bool):
            col = [bool(c) for c in col]
        differ(name, col, "every rank must make the same call with the same row format")
