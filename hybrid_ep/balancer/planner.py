"""Expert placement: which expert each slot holds, planned from tokens per expert.

EPLB-style and hierarchical (DESIGN.md section 7): pack experts onto nodes, replicate the
hottest experts of each node into its spare slots, pack the node's slots onto its ranks,
then swap slots between the most loaded rank and light ranks while that lowers the peak.
A replicated expert's load splits evenly over its replicas, so a slot holding expert e
carries load[e] / replicas(e) and a rank carries the sum over its slots.

Every step loops over items (experts, slots, swaps) and runs numpy over the layer axis, so
61 layers cost about as much as one.
Legend: L layers, E experts, S slots, W ranks, N nodes, G = W / N ranks per node,
X = E / N experts per node, P = S / W slots per rank, R most replicas of one expert.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

# Swap partners per improvement step: this many lightest ranks + this many with the lightest slot.
_SWAP_CANDIDATES = 8
# A swap must lower the peak rank's load by this fraction of the mean rank load: smaller
# gains are below the noise of the statistics and only lengthen the loop's tail.
_MIN_DROP = 1e-3
# A plan counts as no better than another when its peak rank load is within this factor.
_REL_TOL = 1e-9
# plan_placement keeps previous slots unless that raises the peak rank load by more than this fraction.
DEFAULT_TOLERANCE = 1e-3


@dataclasses.dataclass(frozen=True, eq=False)
class Placement:
    """Expert held by every slot of every layer; rank r owns slots r*P .. (r+1)*P - 1."""

    slot_to_expert: torch.Tensor  # [L, S] int64
    num_ranks: int  # W, the EP size
    num_nodes: int
    num_experts: int  # E

    @property
    def num_layers(self) -> int:
        return int(self.slot_to_expert.shape[0])

    @property
    def num_slots(self) -> int:
        return int(self.slot_to_expert.shape[1])

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    @property
    def ranks_per_node(self) -> int:
        return self.num_ranks // self.num_nodes

    @property
    def expert_replicas(self) -> torch.Tensor:
        """[L, E] int64 slots holding each expert."""
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64)
        return counts.scatter_add_(1, self.slot_to_expert, torch.ones_like(self.slot_to_expert))

    @property
    def expert_to_slots(self) -> torch.Tensor:
        """[L, E, R] int64 slots of each expert, ascending, padded with -1."""
        return torch.from_numpy(_expert_to_slots(self.slot_to_expert.numpy(), self.num_experts))

    def validate(self) -> "Placement":
        """Raise ValueError naming the field that breaks a rule; return self."""
        s2e = self.slot_to_expert
        if not isinstance(s2e, torch.Tensor) or s2e.dim() != 2 or s2e.dtype != torch.int64:
            raise ValueError("slot_to_expert must be a 2-D int64 tensor [layers, num_slots], got "
                             f"{getattr(s2e, 'dtype', type(s2e))} {tuple(getattr(s2e, 'shape', ()))}")
        for name in ("num_ranks", "num_nodes", "num_experts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.num_slots % self.num_ranks != 0:
            raise ValueError(f"slot_to_expert has {self.num_slots} slots, not a multiple of num_ranks "
                             f"({self.num_ranks})")
        if self.num_ranks % self.num_nodes != 0:
            raise ValueError(f"num_ranks ({self.num_ranks}) must be a multiple of num_nodes ({self.num_nodes})")
        if self.num_slots < self.num_experts:
            raise ValueError(f"slot_to_expert has {self.num_slots} slots, fewer than num_experts "
                             f"({self.num_experts})")
        if s2e.numel() and (int(s2e.min()) < 0 or int(s2e.max()) >= self.num_experts):
            raise ValueError(f"slot_to_expert holds ids outside [0, num_experts={self.num_experts})")
        missing = (self.expert_replicas == 0).nonzero()
        if missing.numel():
            layer, expert = (int(v) for v in missing[0])
            raise ValueError(f"slot_to_expert: layer {layer} has no slot for expert {expert} "
                             f"({missing.shape[0]} (layer, expert) pairs missing)")
        return self

    def moves(self, other: "Placement") -> torch.Tensor:
        """[L] int64 slots whose expert differs between self and other (same shape)."""
        if other.slot_to_expert.shape != self.slot_to_expert.shape:
            raise ValueError(f"other.slot_to_expert has shape {tuple(other.slot_to_expert.shape)}, "
                             f"expected {tuple(self.slot_to_expert.shape)}")
        return (self.slot_to_expert != other.slot_to_expert).sum(dim=1)

    @staticmethod
    def identity(num_layers: int, num_experts: int, num_slots: int, num_ranks: int,
                 num_nodes: int) -> "Placement":
        """The layout before any statistics: expert e in slot r*P + e % (E/W) of rank r = e // (E/W).

        Spare slots (S > E) hold one more copy of experts of other ranks, round robin over
        ranks, so no rank holds an expert twice (while that is possible) and copies spread.
        """
        _check_sizes(num_experts, num_slots, num_ranks, num_nodes)
        if num_experts % num_ranks != 0:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of num_ranks ({num_ranks}) "
                             "for the identity layout")
        per_rank, slots_pr = num_experts // num_ranks, num_slots // num_ranks
        rank_W = np.arange(num_ranks)[:, None]
        own_WP = rank_W * per_rank + np.arange(per_rank)[None, :]
        spare = np.arange(slots_pr - per_rank)[None, :]
        others = max(num_ranks - 1, 1)
        src_rank = (rank_W + 1 + spare % others) % num_ranks
        local = (rank_W + spare // others) % per_rank
        layout_S = np.concatenate([own_WP, src_rank * per_rank + local], axis=1).reshape(-1)
        s2e = torch.from_numpy(np.tile(layout_S, (num_layers, 1)))
        return Placement(s2e.to(torch.int64), num_ranks, num_nodes, num_experts).validate()


def plan_placement(load, num_slots: int, num_nodes: int, num_ranks: int,
                   previous: Placement | None = None, *, tolerance: float = DEFAULT_TOLERANCE) -> Placement:
    """Balanced placement for load [L, E] (or [E]) tokens per expert; deterministic.

    With previous (same shape), per layer, the first of these whose peak rank load is at most
    (1 + tolerance) x the fresh plan's: previous unchanged; previous improved by swaps
    (stopping once within tolerance, so few slots move); the fresh plan with nodes, ranks
    and slots permuted to match previous (permutations do not change the balance).
    Migration moves weights and optimizer state, while 0.1% of the slowest rank's load is
    below the noise of one statistics window; tolerance=0 keeps only what is as good.
    """
    if not tolerance >= 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance!r}")
    load_LE = _as_load(load)
    num_experts = load_LE.shape[1]
    _check_sizes(num_experts, num_slots, num_ranks, num_nodes)
    if num_experts % num_nodes != 0:
        raise ValueError(f"num_nodes ({num_nodes}) must divide the number of experts ({num_experts}) "
                         "so every node holds the same number of experts")
    fresh_LS = _fresh_plan(load_LE, num_slots, num_nodes, num_ranks)
    if previous is None:
        return Placement(torch.from_numpy(fresh_LS), num_ranks, num_nodes, num_experts).validate()
    _check_previous(previous, load_LE.shape[0], num_experts, num_slots, num_nodes, num_ranks)
    prev_LS = previous.slot_to_expert.numpy()
    allowed_L = _peak(load_LE, fresh_LS, num_ranks) * (1 + tolerance + _REL_TOL)  # [L] peak rank load
    keep_L = _peak(load_LE, prev_LS, num_ranks) <= allowed_L
    if keep_L.all():
        return previous
    # at most W / 2 swaps: a longer repair moves as many slots as the aligned fresh plan
    warm_LS = _improve(load_LE, prev_LS.copy(), num_ranks, stop_peak_L=allowed_L, max_steps=num_ranks // 2)
    out_LS = np.where(keep_L[:, None], prev_LS, warm_LS)
    realign = np.flatnonzero(_peak(load_LE, warm_LS, num_ranks) > allowed_L)
    if realign.size:
        out_LS[realign] = _align(fresh_LS[realign], prev_LS[realign], num_nodes, num_ranks, num_experts)
    return Placement(torch.from_numpy(np.ascontiguousarray(out_LS)), num_ranks, num_nodes,
                     num_experts).validate()


# ----------------------------------------------------------------------------- checks

def _as_load(load) -> np.ndarray:
    """[L, E] float64 copy of load ([E] is one layer); non-negative and finite."""
    if isinstance(load, torch.Tensor):
        load = load.detach().cpu().to(torch.float64).numpy()
    arr = np.array(load, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ValueError(f"load must be [layers, num_experts] or [num_experts], got shape {np.shape(load)}")
    if not np.isfinite(arr).all():
        raise ValueError("load must be finite (found NaN or inf)")
    if (arr < 0).any():
        raise ValueError("load must be non-negative (token counts)")
    return arr


def _check_sizes(num_experts: int, num_slots: int, num_ranks: int, num_nodes: int) -> None:
    for name, value in (("num_slots", num_slots), ("num_ranks", num_ranks), ("num_nodes", num_nodes)):
        if int(value) != value or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if num_slots < num_experts:
        raise ValueError(f"num_slots ({num_slots}) must be >= the number of experts ({num_experts}): "
                         "every expert needs a slot")
    if num_slots % num_ranks != 0:
        raise ValueError(f"num_slots ({num_slots}) must be a multiple of num_ranks ({num_ranks}): "
                         "every rank holds the same number of slots")
    if num_ranks % num_nodes != 0:
        raise ValueError(f"num_ranks ({num_ranks}) must be a multiple of num_nodes ({num_nodes})")


def _check_previous(prev: Placement, L: int, E: int, S: int, N: int, W: int) -> None:
    if not isinstance(prev, Placement):
        raise ValueError(f"previous must be a Placement, got {type(prev).__name__}")
    want = {"shape": (L, S), "num_experts": E, "num_nodes": N, "num_ranks": W}
    got = {"shape": tuple(prev.slot_to_expert.shape), "num_experts": prev.num_experts,
           "num_nodes": prev.num_nodes, "num_ranks": prev.num_ranks}
    for key in want:
        if want[key] != got[key]:
            raise ValueError(f"previous.{key} is {got[key]}, expected {want[key]} (from load and arguments)")
    prev.validate()


# ----------------------------------------------------------------------------- loads

def _slot_weights(load_LE: np.ndarray, s2e_LS: np.ndarray) -> np.ndarray:
    """[L, S] load[e] / replicas(e) of each slot's expert."""
    L, E = load_LE.shape
    flat = (s2e_LS + np.arange(L)[:, None] * E).ravel()
    reps = np.bincount(flat, minlength=L * E).reshape(L, E)
    per_copy = load_LE / np.maximum(reps, 1)
    return np.take_along_axis(per_copy, s2e_LS, axis=1)


def _peak(load_LE: np.ndarray, s2e_LS: np.ndarray, W: int) -> np.ndarray:
    """[L] largest rank load."""
    L, S = s2e_LS.shape
    return _slot_weights(load_LE, s2e_LS).reshape(L, W, S // W).sum(-1).max(-1)


def _expert_to_slots(s2e_LS: np.ndarray, E: int) -> np.ndarray:
    L, S = s2e_LS.shape
    order = np.argsort(s2e_LS, axis=1, kind="stable")  # slots grouped by expert, ascending
    experts = np.take_along_axis(s2e_LS, order, axis=1)
    flat = (s2e_LS + np.arange(L)[:, None] * E).ravel()
    reps = np.bincount(flat, minlength=L * E).reshape(L, E)
    start = np.cumsum(reps, axis=1) - reps
    pos = np.arange(S)[None, :] - np.take_along_axis(start, experts, axis=1)
    out = np.full((L, E, max(int(reps.max()), 1)), -1, dtype=np.int64)
    out[np.arange(L)[:, None], experts, pos] = order
    return out


# ----------------------------------------------------------------------------- fresh plan

def _fresh_plan(load_LE: np.ndarray, S: int, N: int, W: int) -> np.ndarray:
    """[L, S] int64: nodes, replicas, ranks, then swaps."""
    node_experts_LNX = _pack_nodes(load_LE, N)
    node_load_LNX = np.take_along_axis(load_LE[:, None, :], node_experts_LNX, axis=2)
    G = W // N
    replicas_LNX = _replicate(node_load_LNX, S // N, G)
    local_LNGP = _pack_ranks(node_load_LNX, replicas_LNX, G, S // W)
    s2e = np.take_along_axis(node_experts_LNX[:, :, None, :], local_LNGP, axis=3)
    return _improve(load_LE, s2e.reshape(load_LE.shape[0], S).astype(np.int64), W)


def _pack_nodes(load_LE: np.ndarray, N: int) -> np.ndarray:
    """[L, N, X] experts of each node: largest first into the least loaded node with room."""
    L, E = load_LE.shape
    X = E // N
    order_LE = np.argsort(-load_LE, axis=1, kind="stable")  # ties: lower expert id first
    rows = np.arange(L)
    node_load = np.zeros((L, N))
    count = np.zeros((L, N), dtype=np.int64)
    out = np.empty((L, N, X), dtype=np.int64)
    for k in range(E):
        e = order_LE[:, k]
        n = np.where(count < X, node_load, np.inf).argmin(axis=1)
        node_load[rows, n] += load_LE[rows, e]
        out[rows, n, count[rows, n]] = e
        count[rows, n] += 1
    return out


def _replicate(load_LNX: np.ndarray, slots_per_node: int, G: int) -> np.ndarray:
    """[L, N, X] replicas: each spare slot goes to the expert with the largest load / replicas.

    At most G replicas (one per rank of the node) unless the node has more slots than that
    allows, since a second copy on one rank raises that rank's load instead of splitting it.
    """
    L, N, X = load_LNX.shape
    cap = max(G, -(-slots_per_node // X))
    reps = np.ones((L, N, X), dtype=np.int64)
    for _ in range(slots_per_node - X):
        score = np.where(reps < cap, load_LNX / reps, -np.inf)
        best = score.argmax(axis=2)
        np.put_along_axis(reps, best[..., None], np.take_along_axis(reps, best[..., None], 2) + 1, 2)
    return reps


def _pack_ranks(load_LNX: np.ndarray, reps_LNX: np.ndarray, G: int, P: int) -> np.ndarray:
    """[L, N, G, P] local expert index (into the node's X experts) of every slot.

    Slot copies, heaviest first, go to the least loaded rank of the node that has room and
    does not yet hold that expert (or, when every such rank is full, any rank with room).
    """
    L, N, X = load_LNX.shape
    items = G * P
    local = np.repeat(np.tile(np.arange(X), L * N), reps_LNX.ravel()).reshape(L, N, items)
    weight = np.take_along_axis(load_LNX / reps_LNX, local, axis=2)
    order = np.argsort(-weight, axis=2, kind="stable")  # copies of one expert stay adjacent
    local = np.take_along_axis(local, order, axis=2)
    weight = np.take_along_axis(weight, order, axis=2)
    li, ni = np.arange(L)[:, None], np.arange(N)[None, :]
    rank_load = np.zeros((L, N, G))
    count = np.zeros((L, N, G), dtype=np.int64)
    holds = np.zeros((L, N, G, X), dtype=bool)
    out = np.empty((L, N, G, P), dtype=np.int64)
    for k in range(items):
        x = local[:, :, k]
        full = count >= P
        blocked = full | holds[li, ni, :, x]
        cand = np.where(blocked, np.inf, rank_load)
        fallback = np.where(full, np.inf, rank_load)
        g = np.where(np.isinf(cand).all(-1), fallback.argmin(-1), cand.argmin(-1))
        rank_load[li, ni, g] += weight[:, :, k]
        out[li, ni, g, count[li, ni, g]] = x
        count[li, ni, g] += 1
        holds[li, ni, g, x] = True
    return out


def _improve(load_LE: np.ndarray, s2e_LS: np.ndarray, W: int, stop_peak_L: np.ndarray | None = None,
             max_steps: int | None = None) -> np.ndarray:
    """Swap slots between the most loaded rank and another while the pair's peak drops.

    Each swap lowers the sum of squared rank loads, so the loop ends. Partners tried: the
    _SWAP_CANDIDATES lightest ranks and the _SWAP_CANDIDATES ranks with the lightest slot
    (a rank holding a tiny expert can be the best partner without being light); trying all
    ranks gave the same balance in the quality benchmark at twice the time. A layer stops
    when no swap helps or once its peak is at most stop_peak_L [L] (to move few slots).
    Swaps never put an expert on a rank that already holds it. Works in place on s2e_LS.
    """
    L, S = s2e_LS.shape
    P = S // W
    if W < 2:
        return s2e_LS
    slots = s2e_LS.reshape(L, W, P)
    w = _slot_weights(load_LE, s2e_LS).reshape(L, W, P)
    rank = w.sum(-1)
    active = np.ones(L, dtype=bool) if stop_peak_L is None else rank.max(-1) > stop_peak_L
    K = min(_SWAP_CANDIDATES, W - 1)
    min_drop_L = rank.mean(-1) * _MIN_DROP
    for _ in range(max_steps if max_steps is not None else 8 * W):
        ids = np.flatnonzero(active)
        if ids.size == 0:
            break
        gain = _swap_step(slots, w, rank, ids, K, min_drop_L[ids])
        active[ids[~gain]] = False
        if stop_peak_L is not None:
            sel = ids[gain]
            active[sel] &= rank[sel].max(-1) > stop_peak_L[sel]
    return s2e_LS


def _swap_step(slots_LWP: np.ndarray, w_LWP: np.ndarray, rank_LW: np.ndarray, ids: np.ndarray,
               K: int, min_drop: np.ndarray) -> np.ndarray:
    """One swap in each layer of ids between its peak rank and one of 2K candidate partners.

    Picks the swap that leaves the pair's larger load smallest; updates the arrays in
    place and returns [len(ids)] bool: whether the layer found a swap lowering its peak
    rank's load by at least min_drop [len(ids)].
    """
    P = slots_LWP.shape[2]
    n = np.arange(ids.size)
    r_load = rank_LW[ids]
    m = r_load.argmax(axis=1)
    lm = r_load[n, m]
    is_m = np.arange(r_load.shape[1])[None, :] == m[:, None]
    light_rank = np.argpartition(np.where(is_m, np.inf, r_load), K - 1, axis=1)[:, :K]
    light_slot = np.argpartition(np.where(is_m, np.inf, w_LWP[ids].min(-1)), K - 1, axis=1)[:, :K]
    light = np.sort(np.concatenate([light_rank, light_slot], axis=1), axis=1)  # [l, 2K], never m
    K = light.shape[1]
    wm, em = w_LWP[ids, m], slots_LWP[ids, m]  # [l, P]
    wl = np.take_along_axis(w_LWP[ids], light[..., None], 1)  # [l, K, P]
    el = np.take_along_axis(slots_LWP[ids], light[..., None], 1)
    ll = np.take_along_axis(r_load, light, 1)
    d = wm[:, None, :, None] - wl[:, :, None, :]  # [l, K, i, j] load moved from m to the other
    pair = np.maximum(lm[:, None, None, None] - d, ll[:, :, None, None] + d)
    em_in_l = (el[:, :, None, :] == em[:, None, :, None]).any(-1)  # [l, K, i]
    el_in_m = (el[:, :, :, None] == em[:, None, None, :]).any(-1)  # [l, K, j]
    ok = (d > 0) & ~em_in_l[..., :, None] & ~el_in_m[..., None, :]
    score = np.where(ok, pair, np.inf).reshape(ids.size, -1)
    best = score.argmin(axis=1)
    gain = score[n, best] < np.minimum(lm - min_drop, lm * (1 - 1e-12))
    sel = ids[gain]
    k, i, j = np.unravel_index(best[gain], (K, P, P))
    mg, rg = m[gain], light[gain, k]
    dg = d[gain, k, i, j]
    ea, eb = slots_LWP[sel, mg, i], slots_LWP[sel, rg, j]
    wa, wb = w_LWP[sel, mg, i], w_LWP[sel, rg, j]
    slots_LWP[sel, mg, i], slots_LWP[sel, rg, j] = eb, ea
    w_LWP[sel, mg, i], w_LWP[sel, rg, j] = wb, wa
    rank_LW[sel, mg] -= dg
    rank_LW[sel, rg] += dg
    return gain


# ----------------------------------------------------------------------------- keep slots

def _align(new_LS: np.ndarray, prev_LS: np.ndarray, N: int, W: int, E: int) -> np.ndarray:
    """new_LS with nodes, ranks within a node and slots within a rank permuted to match prev_LS.

    Greedy matching: node pairs by shared experts, then rank pairs within matched nodes,
    then slots. Rank loads are only permuted, so the balance is unchanged.
    """
    L, S = new_LS.shape
    G, P = W // N, S // W
    overlap = _rank_overlap(new_LS, prev_LS, W, E)  # [L, Wnew, Wold]
    node_ov = overlap.reshape(L, N, G, N, G).sum(axis=(2, 4))
    node_map = _greedy_match(node_ov)  # [L, N] old node for each new node
    rank_ov = overlap.reshape(L, N, G, N, G)
    rank_ov = np.take_along_axis(rank_ov, node_map[:, :, None, None, None], axis=3)[:, :, :, 0, :]  # [L, N, G, G]
    rank_map = _greedy_match(rank_ov.reshape(L * N, G, G)).reshape(L, N, G)
    dest_rank = (node_map[:, :, None] * G + rank_map).reshape(L, W)  # old rank position of new rank
    out_WP = np.empty((L, W, P), dtype=np.int64)
    np.put_along_axis(out_WP, dest_rank[:, :, None], new_LS.reshape(L, W, P), axis=1)
    return _align_slots(out_WP, prev_LS.reshape(L, W, P)).reshape(L, S)


def _rank_overlap(new_LS: np.ndarray, prev_LS: np.ndarray, W: int, E: int) -> np.ndarray:
    """[L, W, W] experts shared by new rank a and old rank b (copies counted per pair)."""
    L, S = new_LS.shape
    P = S // W
    old_slots = _expert_to_slots(prev_LS, E)  # [L, E, R]
    R = old_slots.shape[2]
    old_rank = np.take_along_axis(old_slots, new_LS[:, :, None].repeat(R, 2), axis=1)  # [L, S, R]
    valid = old_rank >= 0
    new_rank = np.broadcast_to((np.arange(S) // P)[None, :, None], old_rank.shape)
    layer = np.broadcast_to(np.arange(L)[:, None, None], old_rank.shape)
    flat = (layer * W + new_rank) * W + old_rank // P
    return np.bincount(flat[valid], minlength=L * W * W).reshape(L, W, W)


def _greedy_match(score_BAA: np.ndarray) -> np.ndarray:
    """[B, A] column matched to each row, taking the largest remaining entry first (ties: lowest index)."""
    B, A, _ = score_BAA.shape
    score = score_BAA.astype(np.float64).reshape(B, A * A).copy()
    out = np.empty((B, A), dtype=np.int64)
    rows = np.arange(B)
    for _ in range(A):
        best = score.argmax(axis=1)
        r, c = best // A, best % A
        out[rows, r] = c
        s3 = score.reshape(B, A, A)
        s3[rows, r, :] = -np.inf
        s3[rows, :, c] = -np.inf
    return out


def _align_slots(new_LWP: np.ndarray, prev_LWP: np.ndarray) -> np.ndarray:
    """Within each rank, put every expert that the old rank held in the same slot as before."""
    L, W, P = new_LWP.shape
    eq = new_LWP[..., :, None] == prev_LWP[..., None, :]  # [L, W, i new, j old]
    used = np.zeros((L, W, P), dtype=bool)
    out = np.full((L, W, P), -1, dtype=np.int64)
    for j in range(P):
        cand = eq[..., :, j] & ~used
        hit = cand.any(-1)
        i = cand.argmax(-1)
        l_idx, w_idx = np.nonzero(hit)
        out[l_idx, w_idx, j] = new_LWP[l_idx, w_idx, i[hit]]
        used[l_idx, w_idx, i[hit]] = True
    # the rest, in slot order, into the free positions in order
    rest_order = np.argsort(used, axis=-1, kind="stable")  # unused new slots first
    free_order = np.argsort(out >= 0, axis=-1, kind="stable")  # free positions first
    n_free = (out < 0).sum(-1, keepdims=True)
    take = np.arange(P)[None, None, :] < n_free
    src = np.take_along_axis(new_LWP, rest_order, -1)
    filled = np.take_along_axis(out, free_order, -1)
    filled = np.where(take, src, filled)
    np.put_along_axis(out, free_order, filled, -1)
    return out
