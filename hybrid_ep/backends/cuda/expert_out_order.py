"""The order of the users of a rank's expert-out block: the block of its peer memory where a
direct combine copies an expert_out (and probs) that lies outside peer memory, so that its
peers can read it (Engine._into_expert_out_block; the agreement sizes it, agreement.py).

Why one block per rank and not room in every dispatch's output block: a training step keeps
each MoE layer's dispatch output and handle alive until that layer's backward, and room for
an fp32 expert_out per dispatch tripled what a layer in flight pinned in peer memory. A
combine needs the copy only while its kernel runs, so one block serves every combine of the
buffer in turn.

When the block is free again. A combine kernel publishes its expert_out to the peers once it
runs, after the copy in front of it on its stream; a peer reads it only after that, and the
kernel returns only once every peer said it is done reading (csrc kernels/direct.cuh,
finish_direct). So the block is free when the last combine kernel that copied there has
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

from . import capture


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
