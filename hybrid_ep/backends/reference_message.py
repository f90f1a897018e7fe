"""Where rows sit in the reference backend's messages, and the index maps between orders.

A message to each peer is one block: header_rows rows for the agreement header
(reference_agreement), then that peer's rows. The maps turn a packed order (rank blocks of
counts_W[s] rows, back to back) into rows of a message or of a receive buffer, whose blocks
start wherever the exchange put them. Maps depend only on host integers, so the last few
are kept: calls with a handle ask for the same ones again. Nothing here reads a device value
on the host.

Legend: W ranks, B bytes per row, P rows of a message.
"""

from __future__ import annotations

import collections

import torch

from ..rows import from_byte_rows

_KEPT = 64


def _firsts(counts_W: list[int]) -> list[int]:
    """The packed index of each rank block's first row."""
    first = [0] * len(counts_W)
    for s in range(1, len(counts_W)):
        first[s] = first[s - 1] + counts_W[s - 1]
    return first


def message_rows(block_rows_W, header_rows: int) -> int:
    """Rows of a message of these blocks, each after its header rows, plus the dummy row."""
    return sum(block_rows_W) + len(block_rows_W) * header_rows + 1


def block_starts(block_rows_W, header_rows: int) -> list[int]:
    """The first row of each block of a message, each block after its header rows."""
    starts, row = [], 0
    for c in block_rows_W:
        starts.append(row)
        row += header_rows + c
    return starts


class Messages:
    def __init__(self, device: torch.device):
        self.device = device
        self._kept: collections.OrderedDict = collections.OrderedDict()

    def ints(self, values: list[int]) -> torch.Tensor:
        """Host integers on the device (pinned and non-blocking on a GPU: no synchronisation)."""
        host = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)

    def _recall(self, key):
        found = self._kept.get(key)
        if found is not None:
            self._kept.move_to_end(key)
        return found

    def _remember(self, key, value):
        self._kept[key] = value
        if len(self._kept) > _KEPT:
            self._kept.popitem(last=False)
        return value

    def row_map(self, starts: list[int], counts_W: list[int], header_rows: int, length: int, none_row: int):
        """[length + 1] int64: row r of the packed order -> starts[s] + header_rows + its place in
        rank s's block; rows past the blocks and the last entry -> none_row."""
        key = (tuple(starts), tuple(counts_W), header_rows, length, none_row)
        found = self._recall(key)
        if found is not None:
            return found
        return self._remember(key, self._new_row_map(starts, counts_W, header_rows, length, none_row))

    def value_slots(self, starts: list[int], counts_W: list[int], header_rows: int, rows_before_W: list[int],
                    row_floats: int, num_local: int, none_slot: int) -> torch.Tensor:
        """[sum(counts_W) + 1] int64: the first fp32 slot (in the flat fp32 view of a message of
        row_floats fp32 per row) of each packed row's num_local values. Rank s's values are
        dense, in packed order, in the rows after its header rows and rows_before_W[s] rows
        (the partial sums of a combine); the last entry -> none_slot."""
        key = ("values", tuple(starts), tuple(counts_W), header_rows, tuple(rows_before_W), row_floats, num_local,
               none_slot)
        found = self._recall(key)
        if found is not None:
            return found
        first = _firsts(counts_W)
        shift = [(starts[s] + header_rows + rows_before_W[s]) * row_floats - first[s] * num_local
                 for s in range(len(counts_W))]
        return self._remember(key, self._packed_map(shift, counts_W, sum(counts_W), none_slot, num_local))

    def _new_row_map(self, starts, counts_W, header_rows, length, none_row):
        first = _firsts(counts_W)
        shift = [starts[s] + header_rows - first[s] for s in range(len(counts_W))]
        return self._packed_map(shift, counts_W, length, none_row, 1)

    def _packed_map(self, shift_W: list[int], counts_W: list[int], length: int, none: int, scale: int):
        """[length + 1] int64: packed row r of rank s's block -> r * scale + shift_W[s]; rows past
        the blocks and the last entry -> none."""
        total = sum(counts_W)
        out = torch.full((length + 1,), none, dtype=torch.int64, device=self.device)
        if total:
            rank_of_row = torch.repeat_interleave(self.ints(shift_W), self.ints(counts_W), output_size=total)
            out[:total] = torch.arange(0, total * scale, scale, device=self.device) + rank_of_row
        return out

    def blocks(self, counts_W: list[int], header_rows: int, length: int
               ) -> tuple[torch.Tensor, list[int], torch.Tensor]:
        """A message of rank blocks that start with header_rows rows: the position of each packed
        row (length + 1 entries, the dummy last, going to the message's last row), the first
        row of each block, and the inverse map (message row -> packed row, length where none)."""
        key = ("blocks", tuple(counts_W), header_rows, length)
        found = self._recall(key)
        if found is not None:
            return found
        starts = block_starts(counts_W, header_rows)
        row = message_rows(counts_W, header_rows) - 1
        positions = self._new_row_map(starts, counts_W, header_rows, length, row)
        inverse = torch.full((row + 1,), length, dtype=torch.int64, device=self.device)
        inverse[positions] = torch.arange(length + 1, device=self.device)
        return self._remember(key, (positions, starts, inverse))

    def _header_rows(self, starts: list[int], header_rows: int) -> torch.Tensor:
        """The rows of every block's header, flat."""
        key = ("headers", tuple(starts), header_rows)
        found = self._recall(key)
        if found is not None:
            return found
        rows = self.ints(starts)[:, None] + torch.arange(header_rows, device=self.device)
        return self._remember(key, rows.reshape(-1))

    def _header_bytes(self, starts: list[int], row_bytes: int, num_bytes: int) -> torch.Tensor:
        """[blocks, num_bytes] int64: where the first num_bytes of every block lie in the flat bytes
        of a message of row_bytes per row."""
        key = ("header bytes", tuple(starts), row_bytes, num_bytes)
        found = self._recall(key)
        if found is not None:
            return found
        at = self.ints(starts)[:, None] * row_bytes + torch.arange(num_bytes, device=self.device)
        return self._remember(key, at)

    def put_headers(self, message_PB: torch.Tensor, words: torch.Tensor, starts: list[int], header_rows: int):
        """Write the header words (int64) at the start of every block, in one indexed copy; the
        rest of a block's header rows is never read."""
        if header_rows:
            at = self._header_bytes(starts, message_PB.shape[1], words.numel() * 8)
            message_PB.view(-1)[at] = words.view(torch.uint8)

    def read_headers(self, recv_PB: torch.Tensor, starts: list[int], num_words: int) -> torch.Tensor:
        """[W, num_words] int64: the first words of every peer's block."""
        B = recv_PB.shape[1]
        header_rows = -(-num_words * 8 // B)
        if header_rows == 1:  # the usual case: the words' columns of each block's first row, gathered dense
            return recv_PB[:, :num_words * 8].index_select(0, self._header_rows(starts, 1)).view(torch.int64)
        raw = recv_PB.index_select(0, self._header_rows(starts, header_rows))
        return from_byte_rows(raw.view(len(starts), header_rows * B)[:, :num_words * 8], torch.int64)
