"""What the storages alive at a step's peak of memory are, per dispatcher, on rank 0.

    python benchmarks/results/2026-11-26-cpu-layer-bench-memory/peak_composition.py [tiny|mid|deepseek]

The layer bench's layers and step (megatron_patches.layer_bench), 4 gloo ranks as 2 nodes of 2;
each dispatcher's first step and two more under a PeakMemoryMeter that also notes, for each
storage, the operator that made it and the three innermost callers outside torch. Prints, for
rank 0, the bytes alive at each step's peak grouped by (operator, callers), largest first, and
what the first step holds at its peak beyond the last step.
"""

from __future__ import annotations

import collections
import gc
import sys
import traceback

import torch.distributed as dist

from hybrid_ep.peak_memory import PeakMemoryMeter


class NotingMeter(PeakMemoryMeter):
    def __init__(self):
        super().__init__()
        self.origin, self.at_peak, self._op = {}, {}, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._op = str(func)
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _see(self, storage):
        if storage._cdata not in self._by_storage:
            frames = [f for f in traceback.extract_stack() if "/torch/" not in f.filename
                      and f.name not in ("__torch_dispatch__", "_see")]
            where = " < ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in frames[-3:][::-1])
            self.origin[storage.data_ptr()] = (self._op, where)
        super()._see(storage)

    def _add(self, nbytes):
        super()._add(nbytes)
        if self.live_bytes == self.peak_bytes:
            self.at_peak = {ptr: (rec[0], *self.origin.get(ptr, ("?", "?"))) for ptr, rec in self._by_ptr.items()}

    def groups(self) -> collections.Counter:
        out = collections.Counter()
        for nbytes, op, where in self.at_peak.values():
            out[op, where] += nbytes
        return out


def _step(layer, x, grad_out) -> NotingMeter:
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    gc.collect()
    dist.barrier()
    with NotingMeter() as meter:
        out, _ = layer(x)
        out.backward(grad_out)
    return meter


def rank_steps(shape: str) -> dict:
    from megatron_patches import layer_bench
    from megatron_patches.buffers import BUFFERS
    from megatron_patches.local.common import init_megatron, quiet_libraries
    from megatron_patches.local.layer import case_tensors, seeded_layer
    from megatron_patches.options import HybridEPOptions

    quiet_libraries()
    world, rank = dist.get_world_size(), dist.get_rank()
    init_megatron(world)
    BUFFERS.clear()
    out = {}
    for name in layer_bench.DISPATCHERS:
        case = layer_bench._case(shape, name, world)
        _, _, _, x, grad_out = case_tensors(case)
        layer = seeded_layer(case, rank, {"hybrid_ep_options": HybridEPOptions(ranks_per_node=2)})
        meters = [_step(layer, x[rank].float(), grad_out[rank].float()) for _ in range(3)]
        out[name] = [(m.peak_bytes, m.groups()) for m in meters]
    return out


def main(shape: str) -> None:
    from hybrid_ep.spawn import ProcessGroupPool

    pool = ProcessGroupPool(4, backend="gloo", env={"HYBRID_EP_TIMEOUT_S": "120"})
    try:
        steps = pool.run(rank_steps, [(shape,)] * 4, timeout_s=1800)[0]
    finally:
        pool.close()
    for name, runs in steps.items():
        print(f"== {shape} {name}, rank 0: peaks of the first and two more steps {[p for p, _ in runs]} bytes")
        for (op, where), nbytes in runs[-1][1].most_common():
            print(f"{nbytes:>10}  {op:<32} {where}")
        extra = runs[0][1].copy()
        extra.subtract(runs[-1][1])
        print(f"-- alive at the first step's peak beyond the last step's ({runs[0][0] - runs[-1][0]} bytes):")
        for (op, where), nbytes in sorted(extra.items(), key=lambda kv: -kv[1]):
            if nbytes:
                print(f"{nbytes:>10}  {op:<32} {where}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "tiny")
