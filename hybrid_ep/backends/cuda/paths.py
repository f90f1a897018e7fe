"""Where a dispatch's outputs go, and so which data path it takes: one object per engine with
decide_known (a call whose sizes are known before the count kernel), decide_read (after the
call's one host read) and take (a direct call's blocks).

- PeerOutputs: ranks in separate processes (production), or their emulation: outputs in each
  rank's growable peer memory, every call's path agreed on the count exchange (agreement.py).
- AllocatorOutputs: every rank of the group in one process (the single-GPU emulation): ranks
  address each other's tensors as they are, so outputs come from PyTorch's allocator and the
  path is the buffer's (launch.data_path).
"""

from __future__ import annotations

import torch

from . import capture
from .agreement import Agreement, Decision, expert_out_block_layout
from .arena import arena_take


class AllocatorOutputs:
    """Ranks in one process: the buffer's path on every call, outputs from PyTorch's allocator."""

    words = 0  # agreement words read after the count kernel's needed and bad_route

    def __init__(self, direct: bool):
        self._decision = Decision(direct, [], [])

    def decide_known(self, static_rows: int, bounds: list[int] | None, dtype, fp8: bool) -> Decision:
        return self._decision

    def before_count(self, host, stream: int, deadline: float) -> None:
        """Nothing to tell the peers: every rank of the group takes the buffer's path."""

    def decide_read(self, words: list[int], static_rows: int, dtype, fp8: bool) -> Decision:
        return self._decision

    def bounds(self, static_rows: int, known: list[int] | None, words: list[int] | None) -> list[int] | None:
        return None

    def take(self, rows: list[int], dtype, fp8: bool, stream: int, decision: Decision):
        return None


class PeerOutputs:
    """Ranks in separate processes: a call whose every rank's size is known (num_out_tokens, or
    a handle's bounds) and that the ledger holds goes direct without a read; any other call
    puts every driven rank's agreement words into the count kernel's count rows, reads them with
    the sizes, and decides. A direct call's outputs are blocks of each rank's peer memory."""

    def __init__(self, peer: Agreement, ext, config, ranks: list[int], device: torch.device, words: int):
        self.peer, self.ext, self.ranks, self.device, self.words = peer, ext, ranks, device, words
        self.W = config.world_size
        self.hidden = config.hidden_dim
        self.arenas = [m.arena for m in peer.own]
        # Per driven rank, its expert-out block in peer memory (None until a direct call takes one).
        self.expert_out_blocks: list[torch.Tensor | None] = [None] * len(ranks)

    def _rows_all(self, static_rows: int, bounds: list[int] | None) -> list[int] | None:
        return [static_rows] * self.W if static_rows >= 0 else bounds

    def decide_known(self, static_rows: int, bounds: list[int] | None, dtype, fp8: bool) -> Decision | None:
        """The ledger's decision, or None: the call reads."""
        rows_all = self._rows_all(static_rows, bounds)
        if rows_all is None:
            return None
        return self.peer.decide_ledger(rows_all, dtype, fp8, capture.capturing(self.device))

    def before_count(self, host, stream: int, deadline: float) -> None:
        """Every driven rank's agreement words, after mapping its peers' new chunks, every wait
        ending by `deadline` (the call's)."""
        for i, words in enumerate(self.peer.words(stream, deadline)):
            host.set_agree(i, words)

    def decide_read(self, words: list[int], static_rows: int, dtype, fp8: bool) -> Decision:
        return self.peer.decide_read(words, [static_rows] * self.W if static_rows >= 0 else None, dtype, fp8)

    def bounds(self, static_rows: int, known: list[int] | None, words: list[int] | None) -> list[int]:
        """Every rank's rows its block was sized for (CudaReceiveTable.bounds)."""
        rows_all = self._rows_all(static_rows, known)
        return rows_all if rows_all is not None else self.peer.bounds(words)

    def take(self, rows: list[int], dtype: torch.dtype, fp8: bool, stream: int, decision: Decision):
        """A direct call's blocks in peer memory (and new expert-out blocks), each below the limit
        the agreement set; None on the receive path. Every rank decided from the same numbers that
        they fit, so a block that does not is a broken invariant, raised as such."""
        if not decision.direct:
            return None
        taken = arena_take(self.arenas, rows, self.hidden, dtype, fp8, stream, decision.limits)
        if taken.failed >= 0:
            raise RuntimeError(f"hybrid_ep: rank {self.ranks[taken.failed]}'s peer memory could not hold the block "
                               f"every rank agreed it holds ({rows[taken.failed]} rows); please report this")
        for i, nbytes in enumerate(decision.new_expert_out_blocks):
            if nbytes:
                arena = self.arenas[i]
                got = self.ext.ArenaTaken([arena.core], expert_out_block_layout(self.ext), [nbytes], stream,
                                          arena.capturing(), [decision.limits[i]])
                if got.failed >= 0:
                    raise RuntimeError(f"hybrid_ep: rank {self.ranks[i]}'s peer memory could not hold the "
                                       f"expert-out block every rank agreed it holds ({nbytes} bytes); please "
                                       f"report this")
                self.expert_out_blocks[i] = got.tensors()[0][0]
        return taken
