"""Faults injected between processes, for the fault tier (tests/faults/): what each rank of a
gloo pool runs, and what it measured (seconds to the error, the error's words, descriptors and
chunk mappings before and after).

The code under test is the production code: the peer memory's channels and agreement
(peer_memory.py, chunk_channel.py, fabric_channel.py, agreement.py) on the CPU model's memory,
and HybridEPBuffer on the reference backend. What is injected is only the fault: a peer that
never grows, a peer's chunk server that stalls, a process outside the job, a record written by
it, a rank whose input is bad or that exits in the middle of a call.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from ..config import BufferConfig
from .peer_cases import H, _chunk_mappings, _open_fds


def _leaks(fds_before: int, maps_before: int) -> dict:
    return {"fds_leaked": _open_fds() - fds_before, "mappings_left": _chunk_mappings() - maps_before}


def _agreement(world_size: int):
    from ..backends.cuda import load_extension
    from ..backends.cuda.peer_setup import process_agreement

    config = BufferConfig(H, 4096, 2 * world_size, world_size, world_size).validate()
    return process_agreement(load_extension("cpu"), config, dist.group.WORLD, dist.get_rank(), torch.device("cpu"))


def silent_peers_on_rank(timeout_s: float) -> dict:
    """Every rank agreed that ranks 1.. grow, and none does (each alive, its server answering
    "not yet"): rank 0 maps their new chunks before its next call within one deadline of
    timeout_s, not one per peer. Rank 0 returns the seconds its words took and why it is not
    ready."""
    from ..backends.cuda import peer_memory
    from ..backends.cuda.peer_setup import close_peer_memory

    fds, maps = _open_fds(), _chunk_mappings()
    agreement = _agreement(dist.get_world_size())
    out: dict = {}
    dist.barrier()
    if dist.get_rank() == 0:
        for p in range(1, dist.get_world_size()):
            agreement.state[p].target = peer_memory.CHUNK
        start = time.monotonic()
        words = agreement.words(0, start + timeout_s)[0]
        out = {"seconds": time.monotonic() - start, "ready": words[0],
               "failed_imports": agreement.views[0].failed_imports}
    dist.barrier()  # the peers answered "not yet" meanwhile
    close_peer_memory(agreement)
    return out | _leaks(fds, maps)


def stalled_owner_on_rank(timeout_s: float) -> dict:
    """Rank 1's chunk server answers "not yet" once, then stalls (a process stopped in the middle
    of serving, or one whose host is overloaded): rank 0's fetch ends at its deadline, not a
    request's timeout after it. Rank 0 returns the seconds and the reason."""
    from ..backends.cuda import peer_memory
    from ..backends.cuda.peer_setup import close_peer_memory

    fds, maps = _open_fds(), _chunk_mappings()
    agreement = _agreement(2)
    rank = dist.get_rank()
    if rank == 1:
        server = agreement.servers[0]
        answered = server._answer

        def stall_after_one(conn, calls=[]):  # noqa: B006 - counts this server's answers
            calls.append(1)
            if len(calls) > 1:
                time.sleep(3 * timeout_s)  # long past the asker's deadline
            return answered(conn)

        server._answer = stall_after_one
    dist.barrier()
    out: dict = {}
    if rank == 0:
        agreement.state[1].target = peer_memory.CHUNK
        views = agreement.views[0]
        start = time.monotonic()
        why = views.sync(1, peer_memory.CHUNK, start + timeout_s, agreement.reads)
        out = {"seconds": time.monotonic() - start, "why": why}
    dist.barrier()
    if rank == 1:
        time.sleep(3 * timeout_s)  # the stalled answer ends before the server closes
    close_peer_memory(agreement)
    return out | _leaks(fds, maps)


# A process outside the job (same user, no key, empty environment) that read the token, asking
# the owner's server for a chunk as the channel's first version took requests (the offset alone),
# then with a made-up proof; it prints what it got (descriptors, bytes). Plain Python: run it
# with `python -c OUTSIDER TOKEN OWNER OFFSET`.
OUTSIDER = """
import json, os, socket, struct, sys
token, owner, offset = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
got = {"fds": 0, "bytes": 0}
address = f"\\0hybrid_ep/{token}/{owner}".encode()
for request in (struct.pack("<q", offset), struct.pack("<qq16s32s", offset, 0, b"\\1" * 16, b"\\2" * 32)):
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2.0)
        try:
            sock.connect(address)
            sock.sendall(request)
            msg, fds, _, _ = socket.recv_fds(sock, 64, 4)
        except OSError:
            continue
        got["fds"] += len(fds)
        got["bytes"] += len(msg)
        for fd in fds:
            os.close(fd)
print(json.dumps(got))
"""


def tokens_on_this_host() -> set[tuple[str, int]]:
    """What any user of the host reads in /proc/net/unix: (token, rank) of every chunk socket."""
    found = set()
    with open("/proc/net/unix") as f:
        for line in f:
            fields = line.split()
            name = fields[-1] if len(fields) > 7 else ""
            if name.startswith("@hybrid_ep/"):
                _, token, rank = name.split("/")
                found.add((token, int(rank)))
    return found


def _spoiled(argument: str, inputs: dict, case) -> dict:
    """This rank's arguments of a dispatch with `argument` broken (a shape off by one)."""
    kwargs = {"x": inputs["x"], "scales": inputs["scales"], "topk_idx": inputs["topk_idx"],
              "topk_weights": inputs["topk_weights"]}
    if argument == "scales":
        kwargs["scales"] = kwargs["scales"][:, :-1]
    elif argument == "topk_weights":
        kwargs["topk_weights"] = kwargs["topk_weights"][:, :-1]
    elif argument == "x":
        kwargs["x"] = torch.zeros(case.config.max_tokens_per_rank + 1, case.hidden, dtype=case.dtype)
    else:
        raise ValueError(f"no way to spoil {argument}")
    return kwargs


def refused_input_on_rank(case, inputs: dict, expert_out: torch.Tensor, bad_rank: int, argument: str,
                          kind: str) -> dict:
    """Every rank makes a call of the case's buffer (`kind`: a dispatch with exact sizes, "dynamic";
    with num_out_tokens, "static"; with a handle, "handle"; or a combine, "combine") in which rank
    bad_rank's `argument` is broken; then every rank makes the case's dispatch + combine, for the
    oracle. Returns the seconds to this rank's error, its class, rank, argument and words, and the
    next call's results."""
    from ..refusals import InputRefused
    from .cases import case_buffer, run_call

    buf = case_buffer(case)
    rank = dist.get_rank()
    first = buf.dispatch(inputs["x"], inputs["topk_idx"], inputs["topk_weights"], scales=inputs["scales"])
    kwargs = dict(x=inputs["x"], scales=inputs["scales"], topk_idx=inputs["topk_idx"],
                  topk_weights=inputs["topk_weights"])
    if rank == bad_rank and kind != "combine":
        kwargs = _spoiled(argument, inputs, case)
    start = time.monotonic()
    error = None
    try:
        if kind == "combine":
            rows = expert_out if rank != bad_rank else expert_out[:, :-8]  # expert_out of another width
            buf.combine(rows, first.handle)
        elif kind == "handle":
            buf.dispatch(kwargs["x"], scales=kwargs["scales"], handle=first.handle)
        else:
            buf.dispatch(kwargs["x"], kwargs["topk_idx"], kwargs["topk_weights"], scales=kwargs["scales"],
                         num_out_tokens=4 * case.config.max_tokens_per_rank if kind == "static" else None)
    except InputRefused as e:
        error = e
    seconds = time.monotonic() - start
    out = {"seconds": seconds, "error": type(error).__name__ if error is not None else None,
           "rank": getattr(error, "rank", None), "argument": getattr(error, "argument", None),
           "words": str(error) if error is not None else None}
    out["next"] = run_call(buf, case, inputs, expert_out)
    return out


def dies_in_a_call_on_rank(dying: int) -> dict:
    """Every rank dispatches on a reference buffer; rank `dying` leaves the group instead, its
    connections closing as a crash in the middle of the call closes them (the others are already
    in its exchange). The others return the seconds to their error and its words."""
    from ..buffer import HybridEPBuffer

    buf = HybridEPBuffer(None, 128, 8, 6, ranks_per_node=1, backend="reference")
    x, idx = torch.zeros(5, 128), torch.arange(10).view(5, 2) % 6
    buf.dispatch(x, idx)  # a first call: every connection up
    dist.barrier()
    if dist.get_rank() == dying:
        time.sleep(0.5)  # the others are waiting in the call's exchange
        dist.destroy_process_group()
        del buf
        import gc

        gc.collect()  # nothing holds the group: its connections close now, as in a crash
        return {"left": True}
    start = time.monotonic()
    try:
        buf.dispatch(x, idx)
    except RuntimeError as e:
        return {"seconds": time.monotonic() - start, "words": str(e)}
    return {"seconds": time.monotonic() - start, "words": "no error"}
