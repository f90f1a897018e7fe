"""Two buffers driven from two threads on the reference backend: each buffer on a process group
of its own (two groups of the same two ranks), each thread its own buffer, many calls each, every
combine the oracle's. A group's collectives must come in the same order on every rank, so two
buffers of one group are driven from one thread (docs/architecture.md, Threads);
tests/faults/test_two_threads_model.py shows the cuda backend's kernels on the CPU model."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.faults

CALLS = 20


def _two_threads(calls: int):
    import threading

    import torch
    import torch.distributed as dist

    import hybrid_ep as hep

    rank = dist.get_rank()
    buffers = [hep.HybridEPBuffer(dist.new_group(backend="gloo"), 128, 32, 8, backend="reference") for _ in range(2)]
    errors: list[str] = []
    done = [0, 0]

    def drive(t: int) -> None:
        gen = torch.Generator().manual_seed(1000 * t + rank)
        try:
            for call in range(calls):
                x = torch.randn(20, 128, generator=gen)
                idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(20)])
                res = buffers[t].dispatch(x, topk_idx=idx)
                y = buffers[t].combine(res.tokens, res.handle)  # each token's two rows, summed
                if not torch.allclose(y, 2 * x, rtol=1e-6, atol=1e-5):
                    errors.append(f"thread {t}, call {call}: combine differs from the oracle")
                done[t] += 1
        except Exception as err:  # reported by the test, with the call
            errors.append(f"thread {t}, call {done[t]}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=drive, args=(t,), daemon=True) for t in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return errors, done, any(thread.is_alive() for thread in threads)


def test_two_threads_each_driving_a_buffer_of_its_own_group_match_the_oracle(pool_for):
    for errors, done, alive in pool_for(2).run(_two_threads, [(CALLS,)] * 2):
        assert (errors, done, alive) == ([], [CALLS, CALLS], False)
