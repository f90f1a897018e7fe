"""The cuda backend's errors: what a kernel recorded when it failed, and a rank's failure in setup.

Kernels record a failure (a bounded wait that ran out, a bad route) in pinned host memory
(csrc common/params.h, ErrorRecord): the host polls the records' words per call without a
call into the extension and raises a RuntimeError naming the rank, the peer, the phase and
the call, or a RoutingError naming the bad route. The texts of the phases and of the
shared-memory rings a wait names are here, keyed by csrc's names (ext.PHASES,
ext.PIPE_SITES; engine.check_extension makes sure the two agree).

Setting a buffer up takes steps every rank of the group takes together (SetupStep): a rank that
fails in one (an allocation out of memory, a handle it can not open) tells the others in the
collective that ends the step, and every rank raises the same SetupError naming it, instead of
leaving them waiting in the next collective until the process group's timeout.
"""

from __future__ import annotations

import ctypes

import torch.distributed as dist

from ...refusals import refused_by_peer
from ...routing import bad_route_text
from .layout import ERROR_RECORD_CALL_OFFSET, ERROR_RECORD_PHASE_OFFSET

BAD_ROUTE_READS = 1000  # reads of a bad-route record being written before a call leaves it to the next

# What a kernel waited for when it gave up, by the name of its phase: the codes are csrc's
# (common/params.h, Phase), read from the loaded module as ext.PHASES {name: code};
# check_extension makes sure this table names every phase there but "none".
PHASE_TEXT = {
    "bad_routing": "routing check",
    "dispatch_flow": "dispatch flow control (waiting for the peer to finish reading the previous dispatch)",
    "counts": "dispatch count exchange",
    "dispatch_rows": "dispatch rows (waiting for the peer's chunk in the receive ring; expected and saw are slot "
                     "tags, the call and the chunk written there: csrc/kernels/peer_ring.cuh)",
    "combine_flow": "combine flow control (waiting for the peer to finish reading the previous combine)",
    "combine_rows": "combine partial sums (waiting for the expert host's chunk in the partial-sum ring; expected "
                    "and saw are slot tags, as for dispatch_rows)",
    "pipeline": "its shared-memory pipeline",
    "rdma_flow": "inter-node flow control (waiting for its rail peer on that node to finish reading the previous call)",
    "rdma_counts": "inter-node count exchange",
    "rdma_rows": "forwarding (waiting for the rail peer's rows from that node in the staging ring, by RDMA; expected "
                 "and saw are slot tags, as for dispatch_rows)",
    "node_partials": "the node partial sums (waiting for a rank of its own node to store its partials of a forwarded "
                     "chunk in the forwarding ring; expected and saw are slot tags, as for dispatch_rows)",
    "rdma_partials": "combine node partials (waiting for the rail peer on that node in the node-partial ring, by "
                     "RDMA; expected and saw are slot tags, as for dispatch_rows)",
    "direct_tensors": "the direct path (waiting for the peer to publish its tensors of the call)",
    "direct_rows": "the direct path's dispatch (waiting for the peer to finish writing this rank's rows)",
    "direct_reads": "the direct path's combine (waiting for the peer to finish reading this rank's expert_out)",
    # the writers' waits of the rings between ranks (csrc/kernels/peer_ring.cuh; the readers' are above)
    "recv_ring": "the dispatch's receive ring (waiting for the peer to read a chunk and free its slot; expected and "
                 "saw are slot tags, the call and the chunk read there: csrc/kernels/peer_ring.cuh)",
    "partial_ring": "the combine's partial-sum ring (waiting for the source to free the chunk slot its next partials "
                    "go to; expected and saw are slot tags, as for recv_ring)",
    "forward_ring": "the combine's forwarding ring (waiting for the source's rail peer on this node to free the chunk "
                    "slot its next partials go to; expected and saw are slot tags, as for recv_ring)",
    "node_part_ring": "the combine's node-partial ring (waiting for the source on that node to free the chunk slot "
                      "its next node partials go to, by RDMA; expected and saw are slot tags, as for recv_ring)",
    "staged_ring": "the dispatch's staging for that node (waiting for the rail peer to forward a chunk and free its "
                   "slot; expected and saw are slot tags, as for recv_ring)",
}

# The rings of a block's shared memory a pipeline wait names (ErrorRecord.site; the codes and
# which warps fill and free each ring: PipeSite in csrc/common/params.h): (the ring, what fills
# a stage, what frees it).
PIPE_SITE_TEXT = {
    "none": ("a ring", "its producer", "its consumer"),
    "send_fifo": ("the dispatch's send FIFO", "the bulk loads of this rank's token rows",
                  "the send warp's stores to the destinations"),
    "expand_fifo": ("the dispatch's expand FIFO", "the bulk loads of the received rows",
                    "the expand warp's stores to the output rows"),
    "send_entries": ("the dispatch's routing-entry ring", "the warps writing a chunk's routing entries",
                     "the send warp signalling the chunk"),
    "expand_tables": ("the dispatch's position-table ring", "the warps building a received chunk's positions",
                      "the expand load and store warps"),
    "staged_rows": ("the dispatch's staged-rows ring", "the send warp staging rows for other nodes",
                    "the RDMA warps"),
    "host_inputs": ("the combine's expert-output ring", "the bulk loads of the expert outputs",
                    "the expert host's reducers"),
    "host_partials": ("the combine's partial-sum ring", "the expert host's reducers",
                      "the store warp sending partials to the sources"),
    "source_partials": ("the combine's source ring", "the bulk loads of the partials", "the source's reducers"),
    "forward_puts": ("the combine's forward-put ring", "the reducers of the node partials",
                     "the warp putting node partials to other nodes"),
    "direct_rows": ("the direct dispatch's FIFO", "the bulk loads of this rank's token rows",
                    "the store warps writing each route's row"),
    "direct_tables": ("the direct dispatch's route-table ring", "the warp building a chunk's route table",
                      "the store warps"),
    "direct_combine_routes": ("the direct combine's route ring", "the bulk loads of the routes' expert outputs",
                    "the reducers"),
    "direct_done": ("the direct dispatch's done ring", "the store warps finishing a chunk",
                    "the RDMA warp putting staged rows to other nodes"),
    "direct_combine_puts": ("the direct combine's node-partial put ring", "the reducers of the node partials",
                  "the warp putting node partials to other nodes"),
}


# Workspaces kept per call layout for reuse: two, because a buffer's last_call keeps the last


class RoutingError(ValueError):
    pass


def bad_route_error(num_experts: int, max_tokens: int, rank: int, token: int, value: int) -> ValueError:
    """The error of the count kernel's bad-route words, the same on every rank: a route the
    device found bad (RoutingError), or the input a rank refused (refusals.InputRefused: the
    token max_tokens, which no route has, and the argument's code)."""
    if token == max_tokens:
        return refused_by_peer(rank, "dispatch", value)
    return RoutingError(bad_route_text(num_experts, rank, token, value))


class SetupError(RuntimeError):
    """A rank of the EP group failed while a buffer was set up: raised alike on every rank (the
    lowest failed rank and its error first, then any other's), after each rank released what
    it had allocated or opened for the buffer. `failures`: {rank: its error}."""

    def __init__(self, step: str, failures: dict[int, str]):
        self.step, self.failures = step, dict(failures)
        self.rank = min(self.failures)
        others = "".join(f"; rank {r}: {why}" for r, why in sorted(self.failures.items()) if r != self.rank)
        super().__init__(f"hybrid_ep: rank {self.rank} failed {step}: {self.failures[self.rank]}{others}. Every "
                         f"rank of the group raised this error and released what it had set up for the buffer; "
                         f"fix the cause on that rank and create the buffer again")

    def __reduce__(self):
        return SetupError, (self.step, self.failures)


class SetupStep:
    """A step of a buffer's setup that every rank of `group` takes: the block runs on this rank,
    then every rank's outcome, and what it shares (`share`), go round the group in one
    all_gather_object. Where any rank's block raised an Exception, every rank raises the same
    SetupError from the exit of the block (the caller's own handlers release what it set up);
    else `shared` holds every rank's shared value, by rank. The gather is also a barrier: no
    rank leaves the step before every rank finished its block.

        with SetupStep(group, "opening the node peers' registered buffers") as step:
            ...
            step.share(value)
        values = step.shared
    """

    def __init__(self, group, step: str):
        self.group, self.step = group, step
        self._mine = None
        self.shared: list = []

    def share(self, value) -> None:
        self._mine = value

    def __enter__(self) -> "SetupStep":
        return self

    def __exit__(self, kind, error, traceback) -> bool:
        if error is not None and not isinstance(error, Exception):
            return False  # KeyboardInterrupt, SystemExit: this process is leaving
        why = None if error is None else f"{type(error).__name__}: {error}"
        outcomes: list = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(outcomes, (why, self._mine), group=self.group)
        failures = {r: w for r, (w, _) in enumerate(outcomes) if w is not None}
        if failures:
            raise SetupError(self.step, failures) from error
        self.shared = [value for _, value in outcomes]
        return False


class KernelErrors:
    """The two records one engine's kernels write: `error` (the first failure; the buffer is
    unusable after it) and `bad_route` (the last bad route of a static-size call, which
    moved no rows and left the buffer usable)."""

    def __init__(self, ext, timeout_ns: int, ranks_per_node: int, num_nodes: int, max_tokens: int):
        self.timeout_ns, self.ranks_per_node, self.num_nodes = timeout_ns, ranks_per_node, num_nodes
        self.max_tokens = max_tokens
        self.error = ext.ErrorRecord()
        # Its phase word (common/params.h ErrorRecord; 0 while no kernel failed), in host memory:
        # each call polls it here, without a call into the extension.
        self._error_phase = ctypes.c_int32.from_address(self.error.host_ptr + ERROR_RECORD_PHASE_OFFSET)
        self._phase_names = {code: name for name, code in ext.PHASES.items()}
        # The last bad route a count kernel recorded without a host read (a static size): not a
        # failure; each call compares its call word with the last one raised, without a sync.
        self.bad_route = ext.ErrorRecord()
        self._bad_route_call = ctypes.c_uint64.from_address(self.bad_route.host_ptr + ERROR_RECORD_CALL_OFFSET)
        self.bad_route_raised = 0
        self._site_names = {code: name for name, code in ext.PIPE_SITES.items()}
        self.failure: str | None = None

    def reported(self) -> bool:
        """Whether a kernel recorded something the host has not raised (pinned host memory)."""
        return (self.failure is not None or self._error_phase.value != 0
                or self._bad_route_call.value != self.bad_route_raised)

    def raise_if_failed(self) -> None:
        """Raise the first failure a kernel recorded, else a bad route of a static-size call not
        raised yet (reads pinned host memory; no sync)."""
        if self.failure is None:
            record = self.error.read()
            if record is not None:
                self.failure = self.describe(record)
        if self.failure is not None:
            raise RuntimeError(self.failure)
        self._raise_bad_route()

    def _raise_bad_route(self) -> None:
        """The route the last refused static-size call recorded, once: that call moved no rows and
        completed on every rank, so the buffer stays usable. The device zeroes the call word
        before the fields and writes it after them: a read between two equal non-zero readings
        of the call word is one call's route. A record still being written after BAD_ROUTE_READS
        reads is left to the next call: the host never waits on a kernel here."""
        for _ in range(BAD_ROUTE_READS):
            call = self._bad_route_call.value
            if call == self.bad_route_raised:
                return
            rec = self.bad_route.read()
            if call == 0 or rec is None or rec["call"] != call or self._bad_route_call.value != call:
                continue  # a count kernel is writing it
            self.bad_route_raised = call
            value = ctypes.c_int64(rec["observed"]).value  # the record holds it as u64
            raise bad_route_error(rec["expected"], self.max_tokens, rec["rank"], rec["peer"], value)

    def describe(self, rec: dict) -> str:
        code = rec["phase"]
        phase = self._phase_names.get(code)
        what = PHASE_TEXT.get(phase, f"phase {code}")
        if rec["peer"] < 0:  # a wait on this rank's own pipeline, no peer involved
            return self._describe_pipeline(rec, what)
        where = f" on node {rec['peer'] // self.ranks_per_node}" if self.num_nodes > 1 else ""
        return (f"hybrid_ep cuda backend: rank {rec['rank']} gave up after {self.timeout_ns / 1e9:g} s "
                f"(HYBRID_EP_TIMEOUT_S) waiting for peer rank {rec['peer']}{where} in "
                f"{what} (call {rec['call']}, expected {rec['expected']}, "
                f"saw {rec['observed']}): a peer did not make the same call. The buffer can not be used "
                f"after this error; create a new one.")

    def _describe_pipeline(self, rec: dict, what: str) -> str:
        """A wait between the warps of a block ran out (it has twice the bound of a peer's wait,
        so no peer's wait gave up first): name the ring and the side that stopped."""
        ring, fills, frees = PIPE_SITE_TEXT[self._site_names.get(rec.get("site", 0), "none")]
        free_slot = rec["observed"] == 1  # PipeSide: kWaitedForFreeSlot
        waited = f"for a free stage of {ring}" if free_slot else f"for data in {ring}"
        stalled = frees if free_slot else fills
        return (f"hybrid_ep cuda backend: rank {rec['rank']} gave up after {self.timeout_ns / 1e9:g} s "
                f"(HYBRID_EP_TIMEOUT_S) waiting in {what} {waited} (call {rec['call']}): {stalled} "
                f"stopped making progress while no wait on another rank ran out (a bulk copy that never "
                f"completed, or a warp of this block stalled). The buffer can not be used after this "
                f"error; create a new one.")
