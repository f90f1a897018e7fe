"""The reference backend's one collective (a variable-size all-to-all of byte rows), its waits,
and its one host read per routing.

Every message is one block per peer: `header_rows` rows that carry the agreement header
(reference_agreement), then the rows for that peer. How the ranks wait differs by transport:

- gloo (CPU ranks, no watchdog): each peer's receive is posted at the largest size any call
  of the buffer can send (`cap_bytes`), into one receive buffer allocated once, so a peer
  that made another call (other counts, another row format) delivers a shorter message that
  the header then names, instead of an overlong one that gloo would abort the process on. Each
  wait is bounded by HYBRID_EP_TIMEOUT_S and raises naming rank and phase.
- NCCL: exact sizes, and no host wait at all: the collective is ordered on the current stream
  and bounded by the process group's own timeout and watchdog (`ReferenceExchange.bound_group`
  sets it from HYBRID_EP_TIMEOUT_S when that is set). The routing's counts reach the host the
  way Megatron's alltoall dispatcher does it: a non-blocking copy into pinned memory on a
  side stream, started before the caller queues its packing work, waited for (bounded) after.
  Headers of calls that make no host read are copied the same way and checked at the next
  routing's count read, when every rank has them (`defer_check`).

Legend: W ranks, B bytes per row.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import os
import time

import torch
import torch.distributed as dist

from ..config import time_left, timeout_seconds


@dataclasses.dataclass
class HostCopy:
    """A device tensor on its way to pinned host memory (on the CPU: the tensor itself)."""

    host: torch.Tensor
    event: torch.cuda.Event | None = None


class ReferenceExchange:
    def __init__(self, group, rank: int, world_size: int, device: torch.device, cap_bytes: int):
        self.group, self.rank, self.world_size, self.device = group, rank, world_size, device
        self.on_gpu = device.type == "cuda"
        self.cap_bytes = cap_bytes  # the longest message one peer can send in any call of the buffer
        self._recv_bytes: torch.Tensor | None = None  # gloo: the receive buffer, allocated on first use
        self._send_bytes: torch.Tensor | None = None  # gloo: the send buffer, grown to the longest message
        self._side_stream: torch.cuda.Stream | None = None  # NCCL: the stream of the counts' device-to-host copy
        self._in_flight: collections.deque = collections.deque()  # NCCL: (event, phase, start) per exchange
        self._deferred: list = []  # NCCL: (HostCopy, check) of headers not checked yet
        self.timeout_s = timeout_seconds()  # HYBRID_EP_TIMEOUT_S, read once per buffer
        self._deadline: float | None = None  # the current call's (start_call): every wait draws on it

    def start_call(self) -> None:
        """A call begins: its waits, however many, end by one deadline HYBRID_EP_TIMEOUT_S from now."""
        self._deadline = time.monotonic() + self.timeout_s

    def _limit(self) -> float:
        """Seconds the next wait may take: what is left of the call's deadline (config.time_left)."""
        if self._deadline is None:
            return self.timeout_s
        return time_left(self._deadline, self.timeout_s)

    # -- bounds ----------------------------------------------------------------------------

    @staticmethod
    def bound_group(group) -> None:
        """NCCL: the group's own timeout bounds every collective (its watchdog ends the process);
        HYBRID_EP_TIMEOUT_S, when set, sets it. Without it the group keeps its own (10 minutes by
        default in PyTorch, --distributed-timeout-minutes in Megatron-LM): the EP group may carry
        other collectives, so it is changed only when asked for."""
        if "HYBRID_EP_TIMEOUT_S" in os.environ:
            set_timeout = getattr(dist, "set_timeout", None) or dist.distributed_c10d._set_pg_timeout  # older torch
            set_timeout(datetime.timedelta(seconds=timeout_seconds()), group)

    def _wait(self, work, phase: str) -> None:
        """gloo: wait for the collective, within the call's deadline (HYBRID_EP_TIMEOUT_S from its start)."""
        limit = self._limit()
        start = time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=limit))
        except RuntimeError as err:
            elapsed = time.monotonic() - start
            if elapsed < limit:  # the transport failed first: a peer process exited or its link broke
                cause = (f"failed after {elapsed:.1f} s in {phase}: the connection to a peer rank broke "
                         f"(did a peer process exit or crash? check its log)")
            else:
                cause = (f"gave up in {phase} after {elapsed:.1f} s, its call's deadline (HYBRID_EP_TIMEOUT_S="
                         f"{self.timeout_s:g} s for all of a call's waits): a peer rank did not make the same call")
            raise RuntimeError(self._unusable(cause, err)) from err

    def _unusable(self, cause: str, err=None) -> str:
        tail = f" ({err})" if err is not None else ""
        return (f"hybrid_ep: rank {self.rank} of the EP group {cause}. The process group is unusable after "
                f"this error.{tail}")

    # -- the collective --------------------------------------------------------------------

    def all_to_all(self, send_rows_PB: torch.Tensor, send_W: list[int], recv_W: list[int], header_rows: int,
                   phase: str) -> tuple[torch.Tensor, list[int]]:
        """Send send_W[d] rows (header rows included) to each rank d, in rank order from the first
        row of send_rows_PB; receive recv_W[s] rows from each rank s. Returns the receive rows
        [rows + 1, B], whose last row is zero (a gather's "none"), and the row where each peer's
        block starts. header_rows > 0 marks a call whose agreement is not known yet: on gloo its
        receives are posted at cap_bytes (see the module docstring)."""
        W, B = self.world_size, send_rows_PB.shape[1]
        total_send = sum(send_W)
        if W == 1:
            recv = torch.empty(total_send + 1, B, dtype=torch.uint8, device=send_rows_PB.device)
            recv[:total_send] = send_rows_PB[:total_send]
            recv[total_send] = 0
            return recv, [0]
        if self.on_gpu:
            posted = list(recv_W)
            recv = torch.empty(sum(posted) + 1, B, dtype=torch.uint8, device=send_rows_PB.device)
        else:
            cap_rows = -(-self.cap_bytes // B)
            posted = [r if s == self.rank or not header_rows else max(cap_rows, r) for s, r in enumerate(recv_W)]
            recv = self._gloo_buffer(sum(posted) + 1, B)
        total = sum(posted)
        recv[total] = 0
        work = dist.all_to_all_single(
            recv[:total].view(-1), send_rows_PB[:total_send].reshape(-1), [r * B for r in posted],
            [s * B for s in send_W], group=self.group, async_op=not self.on_gpu,
        )
        if self.on_gpu:
            self._note_in_flight(phase)
        else:
            self._wait(work, phase)
        starts = [0] * W
        for s in range(1, W):
            starts[s] = starts[s - 1] + posted[s - 1]
        return recv, starts

    def message(self, rows: int, row_bytes: int) -> torch.Tensor:
        """[rows, row_bytes] uint8 for the next call's message. On the CPU a view of one buffer
        kept across calls (a gloo exchange has finished with it when the call returns; fresh
        memory would cost page faults on every call); on a GPU the caching allocator's."""
        if self.on_gpu:
            return torch.empty(rows, row_bytes, dtype=torch.uint8, device=self.device)
        self._send_bytes = _at_least(self._send_bytes, rows * row_bytes)
        return self._send_bytes[:rows * row_bytes].view(rows, row_bytes)

    def _gloo_buffer(self, rows: int, row_bytes: int) -> torch.Tensor:
        """[rows, row_bytes] view of the receive buffer; sized once for the longest call."""
        self._recv_bytes = _at_least(self._recv_bytes, rows * row_bytes)
        return self._recv_bytes[:rows * row_bytes].view(rows, row_bytes)

    def _note_in_flight(self, phase: str) -> None:
        """NCCL: remember which call each queued collective belongs to, for the timeout message."""
        event = torch.cuda.Event()
        event.record()
        self._in_flight.append((event, phase, time.monotonic()))
        while self._in_flight and self._in_flight[0][0].query():
            self._in_flight.popleft()

    # -- the host read of the counts -------------------------------------------------------

    def start_host_copy(self, tensor: torch.Tensor) -> HostCopy:
        """Start moving tensor to the host without waiting: on a side stream that waits only for
        the work queued so far (the exchange that produced it), so what the caller queues next
        does not delay it."""
        if not self.on_gpu:
            return HostCopy(tensor)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream()
        side = self._side_stream
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            host.copy_(tensor, non_blocking=True)
            tensor.record_stream(side)
            event = torch.cuda.Event()
            event.record(side)
        return HostCopy(host, event)

    def finish_host_copy(self, copy: HostCopy, phase: str) -> torch.Tensor:
        """The host tensor, once its copy has landed: polled, at most HYBRID_EP_TIMEOUT_S (the
        one host wait of a routing; the message names the oldest collective not finished)."""
        if copy.event is None:
            return copy.host
        limit = self._limit()
        start = time.monotonic()
        while not copy.event.query():
            if time.monotonic() - start > limit:
                late = [p for e, p, _ in self._in_flight if not e.query()]
                raise RuntimeError(self._unusable(
                    f"gave up in {late[0] if late else phase} at its call's deadline (HYBRID_EP_TIMEOUT_S="
                    f"{self.timeout_s:g} s for all of a call's waits): a peer rank did not make the same call; the "
                    f"NCCL watchdog ends the process at the group's timeout"))
            time.sleep(0)
        self.run_deferred_checks()
        return copy.host

    # -- agreement checks without a host read ----------------------------------------------

    def check_headers(self, table_WH: torch.Tensor, check) -> None:
        """Run check(table as lists) now on the CPU; on a GPU copy the table to the host without
        waiting and run it at the next count read, where every rank runs the same checks."""
        if not self.on_gpu:
            check(table_WH.tolist())
            return
        copy = HostCopy(torch.empty(table_WH.shape, dtype=table_WH.dtype, pin_memory=True))
        copy.host.copy_(table_WH, non_blocking=True)
        copy.event = torch.cuda.Event()
        copy.event.record()
        self._deferred.append((copy, check))

    def run_deferred_checks(self) -> None:
        """Run, in call order, the checks whose headers have reached the host. At a count read
        all have (the count exchange was queued after them), on every rank alike; without one
        (a static size) ranks may run a check at different calls."""
        while self._deferred and self._deferred[0][0].event.query():
            copy, check = self._deferred.pop(0)
            check(copy.host.tolist())


def _at_least(buffer: torch.Tensor | None, num_bytes: int) -> torch.Tensor:
    return buffer if buffer is not None and buffer.numel() >= num_bytes else torch.empty(num_bytes, dtype=torch.uint8)
