"""The combine staging region: one per rank and buffer, in front of the arena, where a direct
combine copies an expert_out (and probs) that lies outside the arena, so that its peers can
read it.

Why one shared region and not room in every dispatch's arena block: a training step keeps
each MoE layer's dispatch output and handle alive until that layer's backward, and room for
an fp32 expert_out per dispatch tripled what a layer in flight pinned in the arena. A
combine needs the copy only while its kernel runs, so one region serves every combine of the
buffer in turn. It holds fp32 rows of hidden_dim and their probs, as many as the arena holds rows of a
bf16 call (never more than the largest call the buffer can make), allocated with the arena
and listed by memory_plan() (`combine_staging`): a combine of a direct dispatch never needs
memory it can not get. A dispatch whose rows it can not hold takes the receive path
(engine.py, Engine._choose_path).

When the region is free again. A combine kernel publishes its expert_out to the peers once it
runs, after the copy in front of it on its stream; a peer reads it only after that, and the
kernel returns only once every peer said it is done reading (csrc kernels/direct.cuh,
finish_direct). So the region is free when the last combine kernel that staged there has
completed: on the same stream, stream order gives that; a combine on another stream (the EP
overlap schedule's communication stream, a backward on another stream) first makes its
stream wait on the device for an event recorded after the previous user's kernel
(StreamOrder; no host sync). Two combines of one buffer in flight on two streams thus run one
after the other, which the kernels need anyway: a combine kernel takes its call number from
the rank's state when it starts and writes it back when it ends.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...routing import max_output_rows
from . import capture
from .arena import aligned, arena_bytes, memory_tensor
from .layout import MAX_TOPK


def staging_rows(config) -> int:
    """fp32 rows the region holds: the rows of a bf16 call the arena holds, at most the
    largest dispatch output the buffer can make (dynamic size); 0 without an arena."""
    bf16_rows = arena_bytes(config) // (config.hidden_dim * 2 + 4)
    return min(bf16_rows, max_output_rows(config, min(config.experts_per_rank, MAX_TOPK)))


def _probs_at(config) -> int:
    return aligned(staging_rows(config) * config.hidden_dim * 4)


def staging_bytes(config) -> int:
    """Bytes of each rank's staging region: staging_rows fp32 rows and their probs (0
    without an arena)."""
    if staging_rows(config) == 0:
        return 0
    return _probs_at(config) + aligned(staging_rows(config) * 4)


def direct_region_bytes(config) -> int:
    """Bytes of the peer-mapped tail of each rank's registered allocation: the staging
    region, then the arena; none with several nodes (the direct path runs inside one node)."""
    n = arena_bytes(config)
    return staging_bytes(config) + n if n and config.num_nodes == 1 else 0


class StreamOrder:
    """Orders the users of a region shared across streams: a user on another stream than the
    last one waits, on the device, for an event recorded after the last one's work.

    `record()` returns a marker of the work enqueued so far on the current stream and
    `wait(marker)` makes the current stream wait for it; the defaults are torch.cuda's (one
    event, re-recorded: a wait takes the record current when it is enqueued). On the CPU
    model every launch completes in the call, so there is nothing to order. Inside a CUDA
    graph capture nothing is recorded or waited for: torch.cuda.graph synchronizes the device
    before it captures, and a replay runs in its stream's order like any launch."""

    def __init__(self, device: torch.device, record: Callable[[], object] | None = None,
                 wait: Callable[[object], None] | None = None):
        self.device = torch.device(device)
        if record is None:
            record, wait = self._cuda_hooks() if self.device.type == "cuda" else (lambda: None, lambda _: None)
        self._record, self._wait = record, wait
        self.last_stream: int | None = None  # stream of the last user; None: none since capture or start
        self._marker = None
        self.waits = 0  # device waits enqueued (tests)

    def _cuda_hooks(self):
        event = torch.cuda.Event()
        device = self.device

        def record():
            event.record(torch.cuda.current_stream(device))
            return event

        def wait(marker):
            torch.cuda.current_stream(device).wait_event(marker)

        return record, wait

    def _capturing(self) -> bool:
        return capture.capturing(self.device)

    def before(self, stream: int) -> None:
        """Before this stream's user touches the region."""
        if self.last_stream is not None and self.last_stream != stream and not self._capturing():
            self._wait(self._marker)
            self.waits += 1

    def after(self, stream: int) -> None:
        """After this stream's user enqueued its last work on the region."""
        if self._capturing():
            self.last_stream, self._marker = None, None
            return
        self._marker = self._record()
        self.last_stream = stream


class CombineStaging:
    """Every driven rank's staging region (a uint8 tensor over the start of the rank's
    peer-mapped tail) and the order of their users: one combine launch covers all the ranks
    this process drives, so they share one StreamOrder."""

    def __init__(self, config, bases: list[int], device: torch.device):
        self.rows = staging_rows(config)
        self.nbytes = staging_bytes(config)
        self._probs_at = _probs_at(config)
        self.regions = [memory_tensor(b, self.nbytes, device) for b in bases]
        self.order = StreamOrder(device)
        self.uses = 0  # combines that copied into the regions (tests)

    def holds(self, rows: int) -> bool:
        """Whether a direct dispatch of `rows` output rows can have its combine staged here."""
        return rows <= self.rows

    def stage(self, i: int, x: torch.Tensor, p: torch.Tensor, copy_x: bool, copy_p: bool):
        """(x, p), each copied into rank i's region where asked (x at its start, p at the end);
        the caller orders the copies (order.before) and records its kernel after (order.after)."""
        region = self.regions[i]
        if copy_x:
            x = region[:x.numel() * x.element_size()].view(x.dtype).view(x.shape).copy_(x)
        if copy_p:
            p = region[self._probs_at:self._probs_at + p.numel() * 4].view(torch.float32).copy_(p)
        return x, p
