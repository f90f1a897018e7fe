"""Rank-side checks of the cuda backend's path vote (backends/cuda/agreement.py), run by the
tests on a pool of CPU processes: the vote needs host shared memory and a process group, no
GPU."""

from __future__ import annotations

import torch.distributed as dist


def vote_sequence(oks: list[bool], skip_last: bool = False, timeout_s: float | None = None) -> dict:
    """Vote once per entry of `oks` (this rank's "my arena can serve"); with skip_last, leave
    the last vote out, as a rank that did not make the same call. Returns the agreed answers,
    or the error of the vote that gave up."""
    from ..backends.cuda.agreement import PathVote

    vote = PathVote.create(dist.group.WORLD, dist.get_rank())
    if timeout_s is not None:
        vote.timeout_s = timeout_s
    got, error = [], None
    try:
        for ok in oks[:-1] if skip_last else oks:
            got.append(vote(ok))
    except RuntimeError as e:
        error = str(e)
    finally:
        vote.close()
    return {"agreed": got, "error": error}
