"""Every rank of every node takes the same data path on every dispatch, with peer memory that
grows on demand, agreed on the count exchange the count kernel already makes.

The direct path's kernels on every rank wait for every peer's published tensors, the receive
path's for every peer's rows: a call runs only if every rank chose the same path, and a rank
may write a peer's output only into memory it has mapped. Before each dispatch that reads
(below) every rank puts `AGREE_WORDS` words about its peer memory into its count rows
(RankArgs.agree): whether it has mapped what its node peers announced (ready), its largest free
range in the memory every node peer has confirmed mapping (free_acked), its largest free range
in all its memory (free_all), its free tail and its extent. The count kernel hands every rank every rank's words and the
routes every rank receives (InfoLayout.agreement), read with the output size in the call's one
host read. From the same numbers every rank decides the same thing, with no barrier of its own
and across nodes as within one:

- the rows each rank's block needs are bounded by the routes it receives plus the padding
  bound (exact without padding), and a rank may use free_all only where every rank of its node
  is ready, else free_acked; the call goes direct only if every rank's block (and, the first
  time a rank needs it, its expert-out block) fits what it may use;
- a rank short of memory grows by a rule every rank computes alike (its extent plus what its
  free tail lacks, in CHUNK steps): that call takes the receive path, the rank maps a new chunk
  at once, its node peers fetch and map it before their next call that reads (PeerViews.sync, as
  they make its words; a peer on its host that comes first waits for the chunk, within the
  call's deadline: one HYBRID_EP_TIMEOUT_S from the call's start for all its waits, whatever the
  number of peers), and from that call on (every peer ready) the memory is used;
- a growth or an import that fails costs that call the receive path and one log line: the
  owner's extent word tells every rank that it did not grow, a peer that could not import says
  it is not ready, and the next call tries again;
- between two reads (a static size, a reused handle's sizes: no host read) every rank keeps the
  same ledger of what each rank may still take (what it could use at the last read, less the
  blocks taken since): a call the ledger holds goes direct, one it does not hold reads (outside
  graph capture: the static call then waits for its count kernel once), or, while a CUDA graph
  is being captured, takes the receive path (nothing grows inside a capture); a call the ledger
  holds sets no words (no rank reads them) and maps nothing: its blocks end within the limits
  of the last read, in memory every peer had mapped then;
- release_unused() retires each rank's free tail: that call takes the receive path, peers unmap
  before their next call that reads, and the owner releases the chunks once every peer is ready
  again.

Every rank must make the same sequence of calls with the same kind of size (num_out_tokens on
all ranks or on none), as the kernels already need.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from ...dtypes import combine_dtype_for
from ...fp8 import FP8_DTYPE
from ...logs import log_once
from .arena import _layout, aligned, call_bytes
from .layout import AGREE_WORDS
from .peer_memory import CHUNK, OwnMemory, PeerViews, round_up

UNIT = 4096  # the agreement's words count bytes in these units (int32 words: up to 8 TiB)
_SIZES_KEPT = 256  # need_bytes' remembered row counts (a static size or a few handles' in training)
READY, FREE_ACKED, FREE_ALL, TAIL, EXTENT = range(AGREE_WORDS)
_log = logging.getLogger("hybrid_ep")


def log_fallback(what: str, reason: str) -> None:
    """One log line per kind of event and process: a growth or an import that failed."""
    log_once(_log, logging.WARNING,
             f"hybrid_ep: {what} ({reason}); that call took the receive path. Logged once per process",
             key=("receive path", what))


def expert_out_width(dtype: torch.dtype, fp8: bool) -> int:
    """Bytes per value of the expert_out a dispatch of `dtype` rows is combined from
    (dtypes.combine_dtype_for: bf16 for fp8 rows)."""
    return combine_dtype_for(FP8_DTYPE if fp8 else dtype).itemsize


def expert_out_block_bytes(rows: int, hidden: int, dtype: torch.dtype = torch.bfloat16, fp8: bool = False) -> int:
    """An expert-out block for the expert_out of a dispatch of `rows` rows of `dtype`, copied
    there from outside peer memory: rows of hidden values at expert_out_width. The routing
    weights need no room: a combine reads its handle's, which a direct dispatch left in peer
    memory."""
    return aligned(rows * hidden * expert_out_width(dtype, fp8))


def expert_out_block_layout(ext):
    """The extension's layout of an expert-out block: bytes."""
    got = _EXPERT_OUT_LAYOUTS.get(ext)
    if got is None:
        got = _EXPERT_OUT_LAYOUTS[ext] = _layout([(0, torch.uint8)], ext)
    return got


_EXPERT_OUT_LAYOUTS: dict = {}


def peer_bases(agreement: "Agreement", rank: int) -> list[int]:
    """Where driven rank `rank` sees every rank's peer memory: its own base, its views of its node
    peers (other addresses than their owners'), 0 for ranks of other nodes."""
    i = agreement.ranks.index(rank)
    views = agreement.views[i]
    out = []
    for d in range(agreement.W):
        if d == rank:
            out.append(agreement.own[i].base)
        elif views is not None and d in views.bases:
            out.append(views.bases[d])
        else:
            out.append(0)
    return out


@dataclasses.dataclass
class RankState:
    """What every rank of a node knows alike about one rank's peer memory."""

    target: int = 0  # the extent every node peer maps before its next call that reads
    acked: int = 0  # the extent every node peer confirmed mapping
    expert_out_bytes: int = 0  # bytes of its expert-out block (0: none yet)
    retiring: bool = False  # a retired tail is still mapped somewhere


@dataclasses.dataclass(frozen=True)
class Decision:
    """A call's path and what it takes; kept and handed out again for held calls: never changed."""

    direct: bool
    limits: list[int]  # per driven rank: its block ends within this many bytes of its base
    new_expert_out_blocks: list[int]  # per driven rank: bytes of a new expert-out block to take, 0: keep


class Agreement:
    """The data-path agreement of the ranks one engine drives (one per process; all W in the
    emulation of separate processes), with their own memory and their views of their peers'."""

    def __init__(self, config, ranks: list[int], own: list[OwnMemory], views: list[PeerViews],
                 stage_combines: bool = True):
        self.config, self.ranks, self.own, self.views = config, ranks, own, views
        self.G, self.W = config.ranks_per_node, config.world_size
        self.state = [RankState() for _ in range(self.W)]
        self.stage_combines = stage_combines
        self.ledger: list[int] | None = None  # bytes each rank may still take; None: read first
        self.limit = [0] * self.W  # where each rank's blocks may end since the last read
        self.trim_requested = False
        self.reads = self.directs = 0  # reads decided, of them direct (tests, bench)
        self._sizes: dict = {}  # (rows, dtype, fp8) -> (block bytes, expert-out block bytes): need_bytes
        # A held call's decision when it takes no expert-out block, with the `limit` list it was made from
        self._ledger_decision: tuple[list[int], Decision] | None = None

    # -- before the count kernel ------------------------------------------------------

    def words(self, stream: int, deadline: float) -> list[list[int]]:
        """Each driven rank's words for this call's count rows, after mapping what its node peers
        announced at the last read; every wait for a peer's chunk ends by `deadline`
        (time.monotonic(): the call's, one for all its waits)."""
        out = []
        for i, r in enumerate(self.ranks):
            ready = 1
            views = self.views[i]
            if views is not None:
                for p in views.bases:
                    why = views.sync(p, self.state[p].target, deadline, self.reads)
                    if why is not None:
                        ready = 0
                        log_fallback("a rank could not map a peer's new memory", why)
            mem = self.own[i]
            a = mem.arena
            st = self.state[r]
            out.append([ready, a.largest_free_below(stream, min(st.acked, mem.extent)) // UNIT,
                        a.largest_free_below(stream, mem.extent) // UNIT, a.tail_free(stream) // UNIT,
                        mem.extent // UNIT])
        return out

    # -- after the read ----------------------------------------------------------------

    def need_bytes(self, rows: int, dtype: torch.dtype, fp8: bool, held: int) -> tuple[int, int]:
        """(bytes one rank's call of `rows` output rows takes, of them a new expert-out block)."""
        key = (rows, dtype, fp8)
        sizes = self._sizes.get(key)
        if sizes is None:  # (its block, the expert-out block a call of its rows needs)
            H = self.config.hidden_dim
            if len(self._sizes) >= _SIZES_KEPT:
                self._sizes.clear()
            sizes = self._sizes[key] = (call_bytes(rows, H, dtype, fp8),
                                        expert_out_block_bytes(rows, H, dtype, fp8) if self.stage_combines else 0)
        out, stage = sizes
        new_stage = stage if stage > held else 0
        return out + new_stage, new_stage

    def bounds(self, read_row: list[int]) -> list[int]:
        """Output rows each rank's block is sized for, from the routes it receives."""
        c = self.config
        pad = c.experts_per_rank * (c.min_rows_per_expert + c.pad_multiple - 1)
        width = 1 + AGREE_WORDS
        return [read_row[d * width] + pad for d in range(self.W)]

    def decide_read(self, read_row: list[int], rows: list[int] | None, dtype, fp8: bool) -> Decision:
        """The path of a call whose count kernel's agreement words were read (`read_row`: one
        rank's info from `agreement` on, the same on every rank), and the growth and retiring it
        implies. rows: a static size's rows of every rank, None to size by the routes. It runs
        between the read and the dispatch launch, while a GPU idles: one pass per rank, rank d's
        words read in place (read_row[d * width + 1 + word])."""
        width = 1 + AGREE_WORDS
        W, G, state = self.W, self.G, self.state
        bounds = rows if rows is not None else self.bounds(read_row)
        self.reads += 1
        node_ready = [all(read_row[d * width + 1 + READY] for d in range(n * G, (n + 1) * G)) for n in range(W // G)]
        extents, usable, limits, needs, stages = [], [], [], [], []
        for d in range(W):
            st, at = state[d], d * width + 1
            extent = read_row[at + EXTENT] * UNIT
            extents.append(extent)
            if node_ready[d // G]:
                st.acked = extent if not st.retiring else min(st.acked, extent)
                usable.append(read_row[at + FREE_ALL] * UNIT)
                limits.append(extent)
            else:
                usable.append(read_row[at + FREE_ACKED] * UNIT)
                limits.append(min(st.acked, extent))
            need, new_stage = self.need_bytes(bounds[d], dtype, fp8, st.expert_out_bytes)
            needs.append(need)
            stages.append(new_stage)
        trim = self.trim_requested
        self.trim_requested = False
        direct = not trim and all(n <= u for n, u in zip(needs, usable))
        for d in range(W):
            st, at, extent = state[d], d * width + 1, extents[d]
            if st.retiring and node_ready[d // G]:
                st.retiring = False  # every peer unmapped the retired tail
                if d in self.ranks:
                    self.own[self.ranks.index(d)].release_retired()
            st.target = extent
            if trim:
                st.target = self._trim_target(d, extent, read_row[at + TAIL] * UNIT)
                st.retiring = st.target < extent
            elif not direct and needs[d] > read_row[at + FREE_ALL] * UNIT and not st.retiring:
                st.target = extent + round_up(needs[d] - read_row[at + TAIL] * UNIT, CHUNK)
        if direct:
            self.directs += 1
            for d, nbytes in enumerate(stages):
                if nbytes:
                    state[d].expert_out_bytes = nbytes  # larger than the block it replaces (need_bytes)
            self.ledger = [u - n for u, n in zip(usable, needs)]
        else:
            self.ledger = [u if not trim else 0 for u in usable]
            stages = [0] * W
        self.limit = limits
        self._apply_own(trim)
        return Decision(direct, [limits[r] for r in self.ranks], [stages[r] for r in self.ranks])

    def _trim_target(self, d: int, extent: int, tail: int) -> int:
        """Where rank d's memory ends once its free tail is retired: the first of its chunk
        boundaries at or past extent - tail, as its owner and its node peers know them (a rank of
        another node maps none of it, and keeps the extent)."""
        if d in self.ranks:
            chunks = self.own[self.ranks.index(d)].chunks
        else:
            chunks = next((v.chunks[d] for v in self.views if v is not None and d in v.chunks), [])
        ends = [0] + [c.offset + c.nbytes for c in chunks]
        return min((b for b in ends if b >= extent - tail), default=extent)

    def _apply_own(self, trim: bool) -> None:
        """The driven ranks grow to (or retire down to) the targets every rank computed."""
        for i, r in enumerate(self.ranks):
            mem, st = self.own[i], self.state[r]
            if trim and st.retiring:
                if not mem.retire_to(st.target):
                    st.target = mem.extent  # its words at the next call tell every peer
                    st.retiring = False
            elif st.target > mem.extent:
                why = mem.grow_to(st.target, self.reads)
                if why is not None:
                    log_fallback("a rank could not grow its peer memory", why)

    def decide_ledger(self, rows: list[int], dtype, fp8: bool, capturing: bool) -> Decision | None:
        """The path of a call without a read, from the ledger every rank keeps alike: direct when
        every rank's block fits what it may still take, receive while capturing a graph, else
        None (the call reads). On the host path of every static call: one pass over the ranks."""
        ledger = self.ledger
        if ledger is None or self.trim_requested:
            return Decision(False, [], []) if capturing else None
        left, stages, state = [], None, self.state
        for d, r in enumerate(rows):
            need, new_stage = self.need_bytes(r, dtype, fp8, state[d].expert_out_bytes)
            if need > ledger[d]:
                return Decision(False, [], []) if capturing else None
            left.append(ledger[d] - need)
            if new_stage:
                stages = stages or [0] * self.W
                stages[d] = new_stage
        self.ledger = left
        self.directs += 1
        if stages is None:  # no expert-out block: one decision per setting of the limits
            kept = self._ledger_decision
            if kept is None or kept[0] is not self.limit:
                kept = self._ledger_decision = (self.limit, Decision(True, [self.limit[r] for r in self.ranks],
                                                                     [0] * len(self.ranks)))
            return kept[1]
        for d, nbytes in enumerate(stages):
            if nbytes:
                state[d].expert_out_bytes = nbytes  # larger than the block it replaces (need_bytes)
        return Decision(True, [self.limit[r] for r in self.ranks], [stages[r] for r in self.ranks])

    def held(self) -> int:
        """Bytes of peer memory the driven ranks hold."""
        return sum(m.mapped for m in self.own)

