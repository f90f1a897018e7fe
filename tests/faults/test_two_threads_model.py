"""Two buffers driven from two threads on the CPU model: each thread its own EmulatedGroup, many
calls each, every one right against the oracle. Kernel launches give up the GIL while they run (a
peer's kernel may need this process's chunk server), so the two threads' launches meet in the
model; its state is the process's and one lock runs their launches one after the other, each
whole, while what a thread declares for its own launches stays its own
(csrc/device/model/runtime.h, threads)."""

from __future__ import annotations

import dataclasses
import importlib
import threading

import pytest
import torch

from hybrid_ep.testing.cases import Case
from hybrid_ep.testing.emulated import check_emulated, emulated_group_for

pytestmark = pytest.mark.faults

model = importlib.import_module("hybrid_ep._model")
CALLS = 12  # per thread
# A bound far above the run (about 5 s on a 2-core VM): a thread that waits for the other's
# launch forever (a lock held across a wait for the GIL) fails here instead of hanging the suite.
JOIN_S = 240.0


def _case(path_seed: int) -> Case:
    return Case(world_size=2, ranks_per_node=2, num_experts=4, hidden=128, tokens=(17, 40), topk=2,
                dtype=torch.float32, backend="cuda", seed=path_seed)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("paths", [("direct", "receive"), ("direct", "direct")])
def test_two_threads_each_driving_its_own_buffer_match_the_oracle(paths, device):
    """On the CPU model; and on a GPU (the same emulation, each thread launching on the device)."""
    groups = [emulated_group_for(_case(0), device, data_path=p, num_sms_dispatch=1, num_sms_combine=1) for p in paths]
    done = [0, 0]
    errors: list[str] = []

    def drive(t: int) -> None:
        try:
            for call in range(CALLS):
                check_emulated(groups[t], dataclasses.replace(_case(0), seed=100 * t + call))
                done[t] += 1
        except BaseException as err:  # reported by the main thread, with the call
            errors.append(f"thread {t}, call {done[t]}: {type(err).__name__}: {err}")

    before = model.stats()["launches"] if device == "cpu" else 0
    threads = [threading.Thread(target=drive, args=(t,), daemon=True) for t in range(2)]
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(JOIN_S)
        assert not any(thread.is_alive() for thread in threads), f"a thread still runs after {JOIN_S} s: {done}"
        assert errors == [] and done == [CALLS, CALLS]
        if device == "cpu":  # count + dispatch + combine + a redispatch's: every launch of both ran in the model
            assert model.stats()["launches"] - before >= 2 * CALLS * 3
    finally:
        for group in groups:
            group.close()

