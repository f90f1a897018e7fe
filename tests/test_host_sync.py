"""Host synchronisations found on the CPU (hybrid_ep.testing.host_sync): each rule of the
recorder on a small case.

The emulation leaves its stand-ins in the ranks it ran on, so each test closes its pool."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.unit


def _each_case_recorded():
    """Per case: the operators recorded as host synchronisations."""
    from hybrid_ep.testing.host_sync import emulated_cuda

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
            "narrowed fill_": lambda: a[4:].fill_(7),
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
    "narrowed fill_": [],
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
