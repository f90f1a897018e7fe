"""Host synchronisations found on the CPU (harness.host_sync): each rule of the
recorder on a small case; the reference backend's static-size round trip, the GPU test
tests/gpu/test_reference_nccl.py::test_static_size_makes_no_host_sync, on emulated CUDA ranks,
where every synchronisation is listed instead of the first; and a static-size training step.

The emulation leaves its stand-ins in the ranks it ran on, so each test closes its pool."""

from __future__ import annotations

import pytest
import torch

from helpers import static_reference_round_trip

pytestmark = pytest.mark.unit


def _each_case_recorded():
    """Per case: the operators recorded as host synchronisations."""
    from harness.host_sync import emulated_cuda

    dev = torch.device("cuda")
    found = {}
    with emulated_cuda() as recorder:
        a = torch.zeros(5, dtype=torch.int64, device=dev)
        b = torch.ones(3, 4, device=dev)
        i = torch.arange(3, device=dev)
        pinned = torch.tensor([1, 2]).pin_memory()
        cases = {
            "element = number": lambda: a.__setitem__(4, 7),
            "row = number": lambda: b.__setitem__(1, 0),
            "element fill_": lambda: a[4].fill_(7),
            "int()": lambda: int(a.sum()),
            "tolist": lambda: a.tolist(),
            "mask index": lambda: b[b > 0],
            "mask = number": lambda: b.__setitem__(b > 0, 2.0),
            "indices = number": lambda: b.__setitem__((i, i), 2.0),
            "indices = tensor": lambda: b.__setitem__((i, i), torch.ones(3, device=dev)),
            "host indices": lambda: b[torch.tensor([0, 1])],
            "torch.tensor on the device": lambda: torch.tensor([1, 2], device=dev),
            "pinned non_blocking": lambda: pinned.to(dev, non_blocking=True),
            "pageable non_blocking": lambda: torch.tensor([1, 2]).to(dev, non_blocking=True),
            "to the host": lambda: b.cpu(),
            "to pinned, non_blocking": lambda: torch.empty(3, 4, pin_memory=True).copy_(b, non_blocking=True),
            "repeat_interleave": lambda: torch.repeat_interleave(i),
            "repeat_interleave output_size": lambda: torch.repeat_interleave(i, output_size=3),
            "nonzero": lambda: a.nonzero(),
            "unique": lambda: torch.unique(a),
            "host operand": lambda: b + torch.ones(3, 4),
            "host 0-dim operand": lambda: b * torch.tensor(2.0),
            "where with a number": lambda: torch.where(b > 0, b, 0.0),
            "equal": lambda: torch.equal(b, b),
            "synchronize": lambda: torch.cuda.synchronize(),
        }
        for name, case in cases.items():
            with recorder.record() as syncs:
                case()
            found[name] = [s.op for s in syncs]
            syncs.clear()
    return found


EXPECTED = {
    "element = number": ["copy_"],  # torch makes the number a CPU tensor, then copies one element
    "row = number": [],  # a slice is filled from the CPU scalar (fill_ reads it on the host)
    "element fill_": [],
    "int()": ["_local_scalar_dense"],
    "tolist": ["_to_copy"],
    "mask index": ["index"],
    "mask = number": [],  # torch turns it into masked_fill_
    "indices = number": ["index_put_"],
    "indices = tensor": [],
    "host indices": ["index"],
    "torch.tensor on the device": ["_to_copy"],
    "pinned non_blocking": [],
    "pageable non_blocking": ["_to_copy"],
    "to the host": ["_to_copy"],
    "to pinned, non_blocking": [],
    "repeat_interleave": ["repeat_interleave"],
    "repeat_interleave output_size": [],
    "nonzero": ["nonzero"],
    "unique": ["_unique2"],
    "host operand": ["add"],
    "host 0-dim operand": [],
    "where with a number": [],
    "equal": ["equal"],
    "synchronize": ["torch.cuda.synchronize"],
}


def test_each_rule_records_what_syncs_and_only_that(pool_for):
    with pool_for(1) as pool:
        found = pool.run(_each_case_recorded)[0]
    assert found == EXPECTED


def _static_round_trip_on_emulated_cuda():
    from harness.host_sync import emulated_cuda

    with emulated_cuda() as recorder:
        out = static_reference_round_trip(recorder.record)
        return out, [str(s) for s in recorder.syncs]


@pytest.mark.parametrize("world_size", [1, 2])
def test_static_size_makes_no_host_sync_on_emulated_cuda(pool_for, world_size):
    with pool_for(world_size) as pool:
        out = pool.run(_static_round_trip_on_emulated_cuda)
    assert [o[0] for o in out] == [("reference", 40, 0, True)] * world_size
    syncs = [f"rank {r}: {s}" for r, o in enumerate(out) for s in o[1]]
    assert not syncs, "host synchronisations of a static-size round trip on CUDA:\n" + "\n".join(syncs)


def _static_training_step_on_emulated_cuda():
    """A static-size step as training makes it: autograd dispatch and combine, the backward of
    both (the probs backward included), then a dispatch with the handle."""
    import hybrid_ep as hep
    from harness.host_sync import emulated_cuda

    T, H, E = 16, 256, 4
    with emulated_cuda() as recorder:
        buf = hep.HybridEPBuffer(None, H, T, E, backend="reference")
        dev = buf.device
        t = torch.arange(T, device=dev)
        idx = torch.stack([t % E, (t + 1) % E], dim=1)
        w = torch.rand(T, 2, device=dev, requires_grad=True)
        x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, requires_grad=True)

        def step():
            res = hep.dispatch(buf, x, idx, w, num_out_tokens=2 * T + 8)
            y = hep.combine(buf, res.tokens * res.probs[:, None].to(res.tokens.dtype), res.handle)
            y.float().sum().backward()
            return buf.dispatch(x.detach(), handle=res.handle).tokens.shape[0]

        step()
        with recorder.record():
            rows = step()
        return rows, [str(s) for s in recorder.syncs]


def test_static_training_step_makes_no_host_sync_on_emulated_cuda(pool_for):
    with pool_for(1) as pool:
        rows, syncs = pool.run(_static_training_step_on_emulated_cuda)[0]
    assert rows == 40
    assert not syncs, "host synchronisations of a static-size training step on CUDA:\n" + "\n".join(syncs)


def _routing_checks_on_emulated_cuda():
    """Host reads of check_topk_values on a CUDA topk_idx: good ids, an id out of range, a route
    twice (each error still named)."""
    from harness.host_sync import emulated_cuda
    from hybrid_ep.routing import check_topk_values

    dev = torch.device("cuda")
    found = {}
    with emulated_cuda() as recorder:
        cases = {"good": [[0, 3], [2, -1], [1, 2]], "out of range": [[0, 9], [2, -1]], "twice": [[0, 3], [2, 2]]}
        for name, ids in cases.items():
            idx = torch.tensor(ids, dtype=torch.int64).to(dev)
            with recorder.record() as syncs:
                try:
                    check_topk_values(idx, 4)
                    error = None
                except ValueError as e:
                    error = str(e)
            found[name] = (len(syncs), error)
            syncs.clear()
    return found


def test_routing_checks_read_the_device_once(pool_for):
    """A dynamic-size dispatch checks topk_idx on the host (the cuda backend's static size leaves
    it to the count kernel); each read waits for the GPU's queue and leaves it idle while the
    host works on, so min, max and the duplicate test are one read (they were three)."""
    with pool_for(1) as pool:
        found = pool.run(_routing_checks_on_emulated_cuda)[0]
    assert found["good"] == (1, None)
    n, error = found["out of range"]
    assert n == 1 and "[-1, 3]" in error and "max 9" in error
    n, error = found["twice"]
    assert n == 4 and "token 1" in error  # then three reads for the message (which token, its ids)
