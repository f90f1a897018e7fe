"""Move slot contents between EP ranks in place, and sum replicas' gradients.

Every rank derives the same transfer list from (old, new) placements, so no sizes are
exchanged: a new slot whose expert changed takes its contents from a slot that held that
expert before, on its own rank when there is one (a local copy), else from a holder chosen
to spread the sends (fewest sends so far, then lowest slot id). Sources are read into
scratch buffers before any slot is written, so swaps and cycles are safe. The remote part
is one `all_to_all_single` over the EP group per dtype for all layers together; the
tensors are written with `copy_`, never re-created, so optimizer references and captured
CUDA graphs stay valid. Gradient storage of every rewritten slot is zeroed.

Old placement rows may hold -1: a slot with no valid contents yet (spare slots before the
first placement), never used as a source.

Under an optimizer that shards each parameter over data-parallel members (Megatron's
distributed optimizer), `migrate_shards_` moves pieces instead: every member of the source
rank's shard group sends its own piece over the EP group to the member with the same index
on the destination rank, which passes sub-pieces within its shard group to the members
that own them under the destination slot's layout (a slot's pieces lie at other offsets
than another slot's). Two all_to_alls per dtype; no rank ever holds a whole slot.

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


def _union_dtypes(dtypes: list, groups) -> list:
    """The dtypes any rank of `groups` (chained: EP, then shard group) moves, in one order."""
    names = sorted({str(d) for d in dtypes})
    for g in groups:
        if g is not None and dist.is_initialized() and dist.get_world_size(g) > 1:
            gathered = [None] * dist.get_world_size(g)
            dist.all_gather_object(gathered, names, group=g)
            names = sorted({n for part in gathered for n in part})
    return [getattr(torch, n.split(".")[-1]) for n in names]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> tuple[int, int] | None:
    lo, hi = max(a[0], b[0]), min(a[1], b[1])
    return (lo, hi) if hi > lo else None


def migrate_shards_(slot_slices, transfers: list[Transfer], *, rank: int, num_ranks: int,
                    slots_per_rank: int, group=None, shard_group=None, device=None) -> dict:
    """Apply `transfers` to slots whose parameters are sharded over `shard_group` members.

    slot_slices(layer, local_slot) -> list of state.ShardedSlice, one per parameter, in the
    same order on every slot; a slice's `ranges` are the same on every EP rank (the members'
    flat buffers are laid out alike). Stage 1 (over the EP group `group`): each member sends
    its piece of every source slot to the member with its index on the destination rank,
    and copies its pieces of local sources, before any slot is written. Stage 2 (over
    `shard_group`): each member sends every other member the part of a staged piece that
    member owns under the destination slot's layout, and writes what it owns. Returns counts.
    """
    P = slots_per_rank
    mine = lambda slot: slot // P == rank  # noqa: E731
    member = 0 if shard_group is None else dist.get_rank(shard_group)
    members = 1 if shard_group is None else dist.get_world_size(shard_group)
    local_dtypes = {x.dtype for t in transfers[:1] for sl in slot_slices(t.layer, 0) for x in sl.tensors}
    dtypes = _union_dtypes(list(local_dtypes), [group, shard_group])
    if device is None:
        device = slot_slices(transfers[0].layer, 0)[0].tensors[0].device if transfers else torch.device("cpu")
    ending_here = sorted((t for t in transfers if mine(t.dst_slot)), key=lambda t: (t.layer, t.dst_slot))
    outgoing = sorted((t for t in transfers if mine(t.src_slot) and not mine(t.dst_slot)),
                      key=lambda t: (t.dst_slot // P, t.layer, t.dst_slot))
    incoming = sorted((t for t in ending_here if not mine(t.src_slot)),
                      key=lambda t: (t.src_slot // P, t.layer, t.dst_slot))
    # Stage 1: pieces of every source, laid out as the source slot's, staged per transfer.
    staged = {}
    for t in ending_here:
        source = slot_slices(t.layer, t.src_slot % P)
        if mine(t.src_slot):
            staged[t] = [[x.clone() for x in sl.tensors] for sl in source]
        else:
            staged[t] = [[torch.empty_like(x) for x in sl.tensors] for sl in source]
    if num_ranks > 1 and any((t.src_slot // P) != (t.dst_slot // P) for t in transfers):
        for dtype in dtypes:
            send = [x.reshape(-1) for t in outgoing for sl in slot_slices(t.layer, t.src_slot % P)
                    for x in sl.tensors if x.dtype == dtype]
            numel = lambda t: sum(x.numel() for xs in staged[t] for x in xs if x.dtype == dtype)  # noqa: E731
            sizes = lambda t: sum(x.numel() for sl in slot_slices(t.layer, t.src_slot % P)  # noqa: E731
                                  for x in sl.tensors if x.dtype == dtype)
            in_splits = [sum(sizes(t) for t in outgoing if t.dst_slot // P == q) for q in range(num_ranks)]
            out_splits = [sum(numel(t) for t in incoming if t.src_slot // P == q) for q in range(num_ranks)]
            send_buf = torch.cat(send) if send else torch.empty(0, dtype=dtype, device=device)
            recv_buf = torch.empty(sum(out_splits), dtype=dtype, device=device)
            dist.all_to_all_single(recv_buf, send_buf, out_splits, in_splits, group=group)
            offset = 0
            for t in incoming:
                for xs in staged[t]:
                    for x in xs:
                        if x.dtype == dtype:
                            x.copy_(recv_buf[offset : offset + x.numel()].view(x.shape))
                            offset += x.numel()
    # Stage 2: each staged piece to the members owning it under the destination's layout.
    plan = []  # (transfer, slice index, staged piece list, source ranges, destination slice)
    for t in ending_here:
        source = slot_slices(t.layer, t.src_slot % P)
        dest = slot_slices(t.layer, t.dst_slot % P)
        for k, (src, dst) in enumerate(zip(source, dest)):
            plan.append((staged[t][k], src.ranges, dst))
    for dtype in dtypes:
        send: list[list[torch.Tensor]] = [[] for _ in range(members)]
        for pieces, src_ranges, dst in plan:
            lo = src_ranges[member][0]
            for m in range(members):
                cut = _overlap(src_ranges[member], dst.ranges[m])
                if cut is not None:
                    send[m].extend(x[cut[0] - lo : cut[1] - lo] for x in pieces if x.dtype == dtype)
        writes: list[list[torch.Tensor]] = [[] for _ in range(members)]
        for pieces, src_ranges, dst in plan:
            lo = dst.ranges[member][0]
            for m in range(members):
                cut = _overlap(src_ranges[m], dst.ranges[member])
                if cut is not None:
                    writes[m].extend(x[cut[0] - lo : cut[1] - lo] for x in dst.tensors if x.dtype == dtype)
        if members > 1 and ending_here:
            in_splits = [sum(x.numel() for x in part) for part in send]
            out_splits = [sum(x.numel() for x in part) for part in writes]
            flat = [x for part in send for x in part]
            send_buf = torch.cat(flat) if flat else torch.empty(0, dtype=dtype, device=device)
            recv_buf = torch.empty(sum(out_splits), dtype=dtype, device=device)
            dist.all_to_all_single(recv_buf, send_buf, out_splits, in_splits, group=shard_group)
            offset = 0
            for part in writes:
                for x in part:
                    x.copy_(recv_buf[offset : offset + x.numel()])
                    offset += x.numel()
        else:
            for x, y in zip(writes[member], send[member]):
                x.copy_(y)
    return {"local_copies": sum(1 for t in ending_here if mine(t.src_slot)), "sent": len(outgoing),
            "received": len(incoming)}


@dataclasses.dataclass(frozen=True)
class ReplicaPlacement:
    """Which (layer, expert) rows a replica-gradient sum covers, and this rank's slots in each."""

    rows: tuple[tuple[int, int], ...]                          # replicated (layer, expert), same on all ranks
    holders: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]  # (row, ((layer, local slot), ...)) here


def replica_placement(placement_LS: torch.Tensor, *, rank: int, num_ranks: int) -> ReplicaPlacement:
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
    return ReplicaPlacement(tuple(rows), tuple((row, tuple(slots)) for row, slots in sorted(holders.items())))


def _grad_pieces(items) -> list[tuple[torch.Tensor, int, int]]:
    """Normalise slot_grads output: a tensor is its own whole piece (t, 0, t.numel())."""
    return [(x, 0, x.numel()) if torch.is_tensor(x) else x for x in items]


def sum_replica_grads_(placement_LS: torch.Tensor | None, slot_grads, *, rank: int, num_ranks: int,
                       group=None, replicas: ReplicaPlacement | None = None, shard_group=None,
                       max_bytes: int = 256 << 20) -> int:
    """Make every replica's gradient the sum over all replicas of its expert (in place).

    slot_grads(layer, local_slot) -> list of gradient tensors (the ones the optimizer reads),
    or of pieces (tensor, offset, numel): this rank's part of a parameter's flat gradient,
    as a sharding optimizer holds it. Each rank adds its pieces into a zeroed buffer of
    whole (layer, expert) rows, the buffer is summed over the EP group and then over
    `shard_group` (the members holding the other pieces), and every holder reads its piece
    back: all holders read the same sums, so replicas stay bit-identical. Rows go in batches
    of at most `max_bytes` (one all_reduce per group, dtype and batch). Pass the placement,
    or its precomputed `replicas`. Returns the number of (layer, expert) pairs summed.
    """
    if replicas is None:
        replicas = replica_placement(placement_LS, rank=rank, num_ranks=num_ranks)
    rows = replicas.rows
    if not rows:
        return 0
    example = {}
    for layer, _ in rows:
        if layer not in example:
            example[layer] = _grad_pieces(slot_grads(layer, 0))
    dtypes = []
    for pieces in example.values():
        for g, _, _ in pieces:
            if g.dtype not in dtypes:
                dtypes.append(g.dtype)
    device = next(iter(example.values()))[0][0].device
    holders = dict(replicas.holders)
    for dtype in dtypes:
        sizes = [sum(n for g, _, n in example[layer] if g.dtype == dtype) for layer, _ in rows]
        for batch in _batches(sizes, max_bytes // max(1, torch.empty(0, dtype=dtype).element_size())):
            start = batch[0]
            offsets = {row: sum(sizes[start:row]) for row in batch}
            buf = torch.zeros(sum(sizes[row] for row in batch), dtype=dtype, device=device)
            for row in batch:
                for layer, j in holders.get(row, ()):
                    _scatter_pieces(buf, offsets[row], slot_grads(layer, j), dtype, add=True)
            if num_ranks > 1:
                dist.all_reduce(buf, group=group)
            if shard_group is not None and dist.get_world_size(shard_group) > 1:
                dist.all_reduce(buf, group=shard_group)
            for row in batch:
                for layer, j in holders.get(row, ()):
                    _scatter_pieces(buf, offsets[row], slot_grads(layer, j), dtype, add=False)
    return len(rows)


def _batches(sizes: list[int], limit: int) -> list[list[int]]:
    """Consecutive row indices, each batch at most `limit` elements (a larger row alone)."""
    out, current, total = [], [], 0
    for i, n in enumerate(sizes):
        if current and total + n > limit:
            out.append(current)
            current, total = [], 0
        current.append(i)
        total += n
    if current:
        out.append(current)
    return out


def _scatter_pieces(buf: torch.Tensor, base: int, items, dtype, *, add: bool) -> None:
    """add=True: buf[row] += pieces; add=False: pieces = buf[row] (pieces of `dtype` only)."""
    offset = base
    for g, lo, n in _grad_pieces(items):
        if g.dtype != dtype:
            continue
        view = buf[offset + lo : offset + lo + g.numel()]
        if add:
            view += g.reshape(-1)
        else:
            g.copy_(view.view(g.shape))
        offset += n
