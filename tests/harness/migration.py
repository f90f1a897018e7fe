"""Multi-rank checks of slot migration and replica gradient sums on plain tensors.

Every slot's tensors are filled with values that encode (layer, expert, tensor, element),
so after a migration each rank can verify that every slot holds exactly its new expert's
contents, whatever moved where. Runs on each rank of a hybrid_ep.spawn.ProcessGroupPool.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybrid_ep.balancer.migration import migrate_slots_, plan_transfers, sum_replica_grads_

# Per slot: a bf16 weight, an fp32 master copy, two fp32 moments and an fp32 step scalar.
SHAPES = [((3, 5), torch.bfloat16), ((3, 5), torch.float32), ((3, 5), torch.float32), ((4,), torch.float32),
          ((), torch.float32)]


def encoded(layer: int, expert: int, k: int) -> torch.Tensor:
    shape, dtype = SHAPES[k]
    n = max(1, int(torch.tensor(shape).prod())) if shape else 1
    base = layer * 1000 + expert * 10 + k
    return (base + torch.arange(n, dtype=torch.float64) / 64).reshape(shape).to(dtype)


def random_placement(g: torch.Generator, layers: int, experts: int, slots: int) -> torch.Tensor:
    rows = []
    for _ in range(layers):
        extra = torch.randint(0, experts, (slots - experts,), generator=g)
        row = torch.cat([torch.arange(experts), extra])
        rows.append(row[torch.randperm(slots, generator=g)])
    return torch.stack(rows)


def migration_round_trip(seed: int, layers: int, experts: int, slots_per_rank: int, rounds: int) -> dict:
    rank, W = dist.get_rank(), dist.get_world_size()
    S = slots_per_rank * W
    g = torch.Generator().manual_seed(seed)
    current = random_placement(g, layers, experts, S)
    store = [[[encoded(l, int(current[l, rank * slots_per_rank + j]), k) for k in range(len(SHAPES))]
              for j in range(slots_per_rank)] for l in range(layers)]
    identities = [[[id(t) for t in slot] for slot in layer] for layer in store]
    moved_total, bad = 0, []
    for _ in range(rounds):
        new = random_placement(g, layers, experts, S)
        transfers = plan_transfers(current, new, W)
        moved = migrate_slots_(lambda l, j: store[l][j], transfers, rank=rank, num_ranks=W,
                               slots_per_rank=slots_per_rank)
        moved_total += moved["sent"] + moved["received"] + moved["local_copies"]
        current = new
        for l in range(layers):
            for j in range(slots_per_rank):
                e = int(current[l, rank * slots_per_rank + j])
                for k, t in enumerate(store[l][j]):
                    if not torch.equal(t, encoded(l, e, k)):
                        bad.append((l, j, e, k))
    same_storage = identities == [[[id(t) for t in slot] for slot in layer] for layer in store]
    return {"bad": bad, "moved": moved_total, "same_tensors": same_storage, "transfers_last": len(transfers)}


def replica_grad_sum(seed: int, layers: int, experts: int, slots_per_rank: int) -> dict:
    """Each slot's grad = a value known to all ranks; after the sum, every replica must hold
    the sum over all slots of its expert."""
    rank, W = dist.get_rank(), dist.get_world_size()
    S = slots_per_rank * W
    g = torch.Generator().manual_seed(seed)
    placement = random_placement(g, layers, experts, S)

    def value(layer: int, slot: int):
        return torch.full((2, 3), float(layer * 100 + slot + 1)), torch.full((4,), float(-slot - 1))

    grads = [[list(value(l, rank * slots_per_rank + j)) for j in range(slots_per_rank)] for l in range(layers)]
    summed = sum_replica_grads_(placement, lambda l, j: grads[l][j], rank=rank, num_ranks=W)
    bad = []
    for l in range(layers):
        for j in range(slots_per_rank):
            s = rank * slots_per_rank + j
            e = int(placement[l, s])
            holders = [t for t in range(S) if int(placement[l, t]) == e]
            if len(holders) == 1:
                expect = list(value(l, s))
            else:
                expect = [sum(value(l, t)[k] for t in holders) for k in range(2)]
            for k in range(2):
                if not torch.equal(grads[l][j][k], expect[k]):
                    bad.append((l, j, k))
    return {"bad": bad, "summed": summed}
