"""Move slot contents between EP ranks in place, and sum replicas' gradients.

Every rank derives the same transfer list from (old, new) placements, so no sizes are
exchanged: a new slot whose expert changed takes its contents from a slot that held that
expert before, on its own rank when there is one (a local copy), else from a holder chosen
to spread the sends (fewest sends so far, then lowest slot id). Sources are read into
staging buffers before any slot is written, so swaps and cycles are safe. The remote part
is one `all_to_all_single` over the EP group per dtype for all layers together; the
tensors are written with `copy_`, never re-created, so optimizer references and captured
CUDA graphs stay valid. Gradient storage of every rewritten slot is zeroed.

Old placement rows may hold -1: a slot with no valid contents yet (spare slots before the
first placement), never used as a source.

Legend: W EP ranks, P slots per rank, S = W * P slots, L layers.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class Transfer:
    layer: int
    src_slot: int
    dst_slot: int


def plan_transfers(old_LS: torch.Tensor, new_LS: torch.Tensor, num_ranks: int) -> list[Transfer]:
    """Transfers that turn placement `old` into `new` (slots whose expert is unchanged stay)."""
    old_LS = torch.as_tensor(old_LS).to("cpu", torch.int64)
    new_LS = torch.as_tensor(new_LS).to("cpu", torch.int64)
    if old_LS.shape != new_LS.shape:
        raise ValueError(f"old placement {tuple(old_LS.shape)} and new {tuple(new_LS.shape)} differ in shape")
    L, S = new_LS.shape
    if S % num_ranks:
        raise ValueError(f"{S} slots do not divide over {num_ranks} ranks")
    P = S // num_ranks
    transfers = []
    for layer in range(L):
        old, new = old_LS[layer].tolist(), new_LS[layer].tolist()
        holders: dict[int, list[int]] = {}
        for s, e in enumerate(old):
            if e >= 0:
                holders.setdefault(e, []).append(s)
        sends = [0] * S
        for dst, e in enumerate(new):
            if old[dst] == e:
                continue
            srcs = holders.get(e)
            if not srcs:
                raise ValueError(f"layer {layer}: expert {e} of the new placement has no holder in the old one")
            local = [s for s in srcs if s // P == dst // P]
            src = local[0] if local else min(srcs, key=lambda s: (sends[s], s))
            if not local:
                sends[src] += 1
            transfers.append(Transfer(layer, src, dst))
    return transfers


def _pack(tensors: list[torch.Tensor], dtype, device) -> torch.Tensor:
    parts = [t.reshape(-1).to(device) for t in tensors if t.dtype == dtype]
    return torch.cat(parts) if parts else torch.empty(0, dtype=dtype, device=device)


def _unpack_(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        if t.dtype != flat.dtype:
            continue
        n = t.numel()
        t.copy_(flat[offset : offset + n].view(t.shape))
        offset += n


def migrate_slots_(slot_tensors, transfers: list[Transfer], *, rank: int, num_ranks: int,
                   slots_per_rank: int, group=None, device=None) -> dict:
    """Apply `transfers` to this rank's slots.

    slot_tensors(layer, local_slot) -> list of tensors to move (same dtypes and shapes on
    every slot of a layer and on every rank). Returns counts of what moved.
    """
    P = slots_per_rank
    mine = lambda slot: slot // P == rank  # noqa: E731
    dtypes = []
    sample = {}
    for t in transfers:
        if t.layer not in sample:
            sample[t.layer] = slot_tensors(t.layer, 0)
            for x in sample[t.layer]:
                if x.dtype not in dtypes:
                    dtypes.append(x.dtype)
    if device is None:
        device = sample[transfers[0].layer][0].device if transfers else torch.device("cpu")
    # Stage everything this rank sends or copies locally before writing any slot.
    local = [(t, [x.clone() for x in slot_tensors(t.layer, t.src_slot % P)])
             for t in transfers if mine(t.src_slot) and mine(t.dst_slot)]
    remote = [t for t in transfers if mine(t.src_slot) != mine(t.dst_slot) and (mine(t.src_slot) or mine(t.dst_slot))]
    outgoing = sorted((t for t in remote if mine(t.src_slot)), key=lambda t: (t.dst_slot // P, t.layer, t.dst_slot))
    incoming = sorted((t for t in remote if mine(t.dst_slot)), key=lambda t: (t.src_slot // P, t.layer, t.dst_slot))
    # Every rank must join the collective when any rank moves something remotely.
    any_remote = any((t.src_slot // P) != (t.dst_slot // P) for t in transfers)
    received = 0
    if any_remote and num_ranks > 1:
        for dtype in dtypes:
            numel = {layer: sum(x.numel() for x in xs if x.dtype == dtype) for layer, xs in sample.items()}
            send = [_pack(slot_tensors(t.layer, t.src_slot % P), dtype, device) for t in outgoing]
            send_buf = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
            in_splits = [sum(numel[t.layer] for t in outgoing if t.dst_slot // P == q) for q in range(num_ranks)]
            out_splits = [sum(numel[t.layer] for t in incoming if t.src_slot // P == q) for q in range(num_ranks)]
            recv_buf = torch.empty(sum(out_splits), dtype=dtype, device=device)
            dist.all_to_all_single(recv_buf, send_buf, out_splits, in_splits, group=group)
            offset = 0
            for t in incoming:
                n = numel[t.layer]
                _unpack_(recv_buf[offset : offset + n], slot_tensors(t.layer, t.dst_slot % P))
                offset += n
            received += len(incoming)
    for t, staged in local:
        for dst, src in zip(slot_tensors(t.layer, t.dst_slot % P), staged):
            dst.copy_(src)
    return {"local_copies": len(local), "sent": len(outgoing), "received": len(incoming)}


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """Which (layer, expert) rows a replica-gradient sum covers, and this rank's slots in each."""

    rows: tuple[tuple[int, int], ...]                          # replicated (layer, expert), same on all ranks
    holders: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # (row, ((layer, local slot), ...)) here


def replica_layout(placement_LS: torch.Tensor, *, rank: int, num_ranks: int) -> ReplicaLayout:
    """Computed once per placement (the balancer caches it), not per step."""
    placement_LS = torch.as_tensor(placement_LS).to("cpu", torch.int64)
    L, S = placement_LS.shape
    P = S // num_ranks
    rows = []
    for layer in range(L):
        counts = torch.bincount(placement_LS[layer].clamp(min=0))
        rows.extend((layer, int(e)) for e in torch.nonzero(counts > 1).flatten().tolist())
    index = {key: i for i, key in enumerate(rows)}
    holders: dict[int, list[tuple[int, int]]] = {}
    for layer in range(L):
        for j in range(P):
            e = int(placement_LS[layer, rank * P + j])
            if (layer, e) in index:
                holders.setdefault(index[(layer, e)], []).append((layer, j))
    return ReplicaLayout(tuple(rows), tuple((row, tuple(slots)) for row, slots in sorted(holders.items())))


def sum_replica_grads_(placement_LS: torch.Tensor | None, slot_grads, *, rank: int, num_ranks: int,
                       group=None, layout: ReplicaLayout | None = None) -> int:
    """Make every replica's gradient the sum over all replicas of its expert (in place).

    slot_grads(layer, local_slot) -> list of gradient tensors (the ones the optimizer reads).
    One all_reduce per dtype over the EP group, covering only replicated experts. Pass the
    placement, or its precomputed `layout`. Returns the number of (layer, expert) pairs summed.
    """
    if layout is None:
        layout = replica_layout(placement_LS, rank=rank, num_ranks=num_ranks)
    rows = layout.rows
    if not rows:
        return 0
    example = {}
    for layer, _ in rows:
        if layer not in example:
            example[layer] = slot_grads(layer, 0)
    dtypes = []
    for grads in example.values():
        for g in grads:
            if g.dtype not in dtypes:
                dtypes.append(g.dtype)
    device = next(iter(example.values()))[0].device
    for dtype in dtypes:
        sizes = [sum(g.numel() for g in example[layer] if g.dtype == dtype) for layer, _ in rows]
        offsets = [0]
        for n in sizes:
            offsets.append(offsets[-1] + n)
        buf = torch.zeros(offsets[-1], dtype=dtype, device=device)
        for row, slots in layout.holders:
            for layer, j in slots:
                buf[offsets[row] : offsets[row + 1]] += _pack(slot_grads(layer, j), dtype, device)
        if num_ranks > 1:
            dist.all_reduce(buf, group=group)
        for row, slots in layout.holders:
            for layer, j in slots:
                _unpack_(buf[offsets[row] : offsets[row + 1]], slot_grads(layer, j))
    return len(rows)
