"""Placement algorithms over the layer axis: replica counts, packing slots onto ranks, swaps.

Every function loops over items (spare slots, rounds, swaps) and runs numpy over layers,
so 61 layers cost little more than one. A slot holding expert e weighs load[e] / replicas(e)
and a rank carries the sum over its P slots; the goal is a small largest rank.
Legend: L layers, E experts, S slots, W ranks, P = S / W slots per rank.
"""

from __future__ import annotations

import numpy as np

# Swap partners per improvement step: this many lightest ranks + this many with the lightest slot.
_SWAP_CANDIDATES = 8
# A swap must lower the peak rank's load by this fraction of the mean rank load: smaller
# gains are below the noise of the statistics and only lengthen the loop's tail.
_MIN_DROP = 1e-4


def replica_counts(load_LE: np.ndarray, num_slots: int, cap: int) -> np.ndarray:
    """[L, E] int64 slots per expert: each spare slot to the largest load / replicas (at most cap).

    The greedy choice minimises the largest slot weight, the lower bound every packing
    meets. cap (the number of ranks) keeps copies on distinct ranks: a second copy on a
    rank adds to that rank's load instead of splitting it. Ties go to the lower expert id.
    """
    L, E = load_LE.shape
    reps = np.ones((L, E), dtype=np.int64)
    score = load_LE.copy()
    rows = np.arange(L)
    for _ in range(num_slots - E):
        best = score.argmax(axis=1)
        reps[rows, best] += 1
        r = reps[rows, best]
        score[rows, best] = np.where(r < cap, load_LE[rows, best] / r, -np.inf)
    return reps


def expand(load_LE: np.ndarray, reps_LE: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(experts [L, S], weights [L, S]): one entry per slot, heaviest first (copies adjacent)."""
    L, E = load_LE.shape
    S = int(reps_LE[0].sum())
    experts = np.repeat(np.tile(np.arange(E), L), reps_LE.ravel()).reshape(L, S)
    weight = np.take_along_axis(load_LE / np.maximum(reps_LE, 1), experts, axis=1)
    order = np.argsort(-weight, axis=1, kind="stable")
    return np.take_along_axis(experts, order, 1), np.take_along_axis(weight, order, 1)


def pack_differencing(experts_LS: np.ndarray, weight_LS: np.ndarray, W: int) -> np.ndarray:
    """[L, S] slot_to_expert: balanced largest differencing (Karmarkar-Karp with P per rank).

    Slots sorted heaviest first form P rounds of W (one slot per rank each). The two
    partial solutions with the largest spread (max - min) merge, heaviest part of one with
    lightest of the other, until one is left: part j becomes rank j, P slots each.
    """
    L, S = experts_LS.shape
    P = S // W
    rows = np.arange(L)
    load = weight_LS.reshape(L, P, W).copy()  # [L, tuple, part]; tuple t starts as round t
    part = np.broadcast_to(np.arange(W), (L, P, W)).copy()  # part of each slot in its tuple
    owner = np.broadcast_to(np.arange(P), (L, P)).copy()  # tuple that holds each round
    alive = np.ones((L, P), dtype=bool)
    for _ in range(P - 1):
        spread = np.where(alive, load.max(-1) - load.min(-1), -np.inf)
        top2 = np.argsort(-spread, axis=1, kind="stable")[:, :2]
        a, b = top2[:, 0], top2[:, 1]
        order_a = np.argsort(-load[rows, a], axis=1, kind="stable")  # new part j: a's j-th heaviest
        order_b = np.argsort(load[rows, b], axis=1, kind="stable")  # ... with b's j-th lightest
        load[rows, a] = (np.take_along_axis(load[rows, a], order_a, 1)
                         + np.take_along_axis(load[rows, b], order_b, 1))
        alive[rows, b] = False
        inv_a, inv_b = np.argsort(order_a, axis=1), np.argsort(order_b, axis=1)
        in_a = (owner == a[:, None])[..., None]
        in_b = (owner == b[:, None])[..., None]
        new_a = np.take_along_axis(inv_a[:, None, :].repeat(P, 1), part, 2)
        new_b = np.take_along_axis(inv_b[:, None, :].repeat(P, 1), part, 2)
        part = np.where(in_a, new_a, np.where(in_b, new_b, part))
        owner = np.where(owner == b[:, None], a[:, None], owner)
    # slot (round t, position k) goes to rank part[t, k] at local slot t
    out = np.empty((L, W, P), dtype=np.int64)
    rounds = experts_LS.reshape(L, P, W)
    li = rows[:, None, None]
    out[li, part, np.arange(P)[None, :, None]] = rounds
    return out.reshape(L, S)


def separate_copies(load_LE: np.ndarray, s2e_LS: np.ndarray, W: int) -> np.ndarray:
    """Swap away second copies of an expert on one rank, with the partner slot that keeps the
    pair's larger load smallest; in place, returns s2e_LS. Copies stay together when every
    such swap would raise the layer's peak rank load (or no partner exists)."""
    L, S = s2e_LS.shape
    P = S // W
    slots = s2e_LS.reshape(L, W, P)
    stuck = np.zeros(L, dtype=bool)
    below = np.tri(P, k=-1, dtype=bool)
    for _ in range(S):
        has = ((slots[..., :, None] == slots[..., None, :]) & below).any(-1)  # [L, W, P] repeats an earlier slot
        layers = np.flatnonzero(has.reshape(L, -1).any(1) & ~stuck)
        if layers.size == 0:
            break
        flat = has[layers].reshape(layers.size, -1).argmax(1)
        a, i = flat // P, flat % P
        w = slot_weights(load_LE[layers], s2e_LS[layers]).reshape(layers.size, W, P)
        rank = w.sum(-1)
        sl = slots[layers]  # [l, W, P]
        n = np.arange(layers.size)
        e, we, la = sl[n, a, i], w[n, a, i], rank[n, a]
        ok = ~(sl == e[:, None, None]).any(-1, keepdims=True)  # the partner's rank lacks e
        ok = ok & ~(sl[..., None] == sl[n, a][:, None, None, :]).any(-1)  # a lacks the partner's expert
        d = we[:, None, None] - w
        pair = np.maximum(la[:, None, None] - d, rank[..., None] + d)
        score = np.where(ok, pair, np.inf).reshape(layers.size, -1)
        best = score.argmin(1)
        fix = score[n, best] <= rank.max(-1)  # never raises the layer's peak
        stuck[layers[~fix]] = True
        b, j = best[fix] // P, best[fix] % P
        fl, fa, fi = layers[fix], a[fix], i[fix]
        ea, eb = slots[fl, fa, fi], slots[fl, b, j]
        slots[fl, fa, fi], slots[fl, b, j] = eb, ea
    return s2e_LS


def pair_exchange(load_LE: np.ndarray, s2e_LS: np.ndarray, W: int, rounds: int) -> np.ndarray:
    """Rounds of swaps between the i-th heaviest and the i-th lightest rank, all pairs at once; in place.

    Each disjoint pair takes the swap that leaves its larger load smallest (no expert twice
    on a rank). It lowers many heavy ranks per round, where `improve` lowers one per step,
    so `improve` only has a short tail left.
    """
    L, S = s2e_LS.shape
    P, H = S // W, W // 2
    if H == 0 or L == 0:
        return s2e_LS
    slots = s2e_LS.reshape(L, W, P)
    w = slot_weights(load_LE, s2e_LS).reshape(L, W, P)
    li = np.arange(L)[:, None]
    for _ in range(rounds):
        rank = w.sum(-1)
        order = np.argsort(rank, axis=1, kind="stable")
        heavy, light = order[:, ::-1][:, :H], order[:, :H]
        la, lb = rank[li, heavy], rank[li, light]  # [L, H]
        wa, wb, ea, eb = w[li, heavy], w[li, light], slots[li, heavy], slots[li, light]  # [L, H, P]
        d = wa[..., :, None] - wb[..., None, :]  # [L, H, i, j]
        pair = np.maximum(la[..., None, None] - d, lb[..., None, None] + d)
        a_in_b = (ea[..., :, None] == eb[..., None, :]).any(-1)  # [L, H, i]
        b_in_a = (eb[..., :, None] == ea[..., None, :]).any(-1)  # [L, H, j]
        ok = (d > 0) & ~a_in_b[..., :, None] & ~b_in_a[..., None, :]
        score = np.where(ok, pair, np.inf).reshape(L, H, P * P)
        best = score.argmin(-1)
        gain = np.take_along_axis(score, best[..., None], -1)[..., 0] < la * (1 - 1e-9)
        if not gain.any():
            break
        lg, hg = np.nonzero(gain)
        i, j = best[lg, hg] // P, best[lg, hg] % P
        ra, rb = heavy[lg, hg], light[lg, hg]
        xa, xb = slots[lg, ra, i], slots[lg, rb, j]
        slots[lg, ra, i], slots[lg, rb, j] = xb, xa
        va, vb = w[lg, ra, i], w[lg, rb, j]
        w[lg, ra, i], w[lg, rb, j] = vb, va
    return s2e_LS


def improve(load_LE: np.ndarray, s2e_LS: np.ndarray, W: int, stop_peak_L: np.ndarray | None = None,
            max_steps: int | None = None) -> np.ndarray:
    """Swap slots between the most loaded rank and another while the peak drops; in place.

    Each swap lowers the sum of squared rank loads, so the loop ends. Partners tried: the
    _SWAP_CANDIDATES lightest ranks and the _SWAP_CANDIDATES ranks with the lightest slot
    (a rank holding a tiny expert can be the best partner without being light). A layer
    stops when no swap helps or once its peak is at most stop_peak_L [L] (to move few
    slots). Swaps never put an expert on a rank that already holds it.
    """
    L, S = s2e_LS.shape
    P = S // W
    if W < 2 or L == 0:
        return s2e_LS
    slots = s2e_LS.reshape(L, W, P)
    w = slot_weights(load_LE, s2e_LS).reshape(L, W, P)
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
    w_ids = w_LWP[ids]
    light_slot = np.argpartition(np.where(is_m, np.inf, w_ids.min(-1)), K - 1, axis=1)[:, :K]
    light = np.concatenate([light_rank, light_slot], axis=1)  # [l, 2K], never m (repeats harmless)
    K2 = light.shape[1]
    wm, em = w_ids[n, m], slots_LWP[ids, m]  # [l, P]
    wl = np.take_along_axis(w_ids, light[..., None], 1)  # [l, K2, P]
    el = np.take_along_axis(slots_LWP[ids], light[..., None], 1)
    ll = np.take_along_axis(r_load, light, 1)
    d = wm[:, None, :, None] - wl[:, :, None, :]  # [l, K2, i, j] load moved from m to the other
    pair = np.maximum(lm[:, None, None, None] - d, ll[:, :, None, None] + d)
    em_in_l = (el[:, :, None, :] == em[:, None, :, None]).any(-1)  # [l, K2, i]
    el_in_m = (el[:, :, :, None] == em[:, None, None, :]).any(-1)  # [l, K2, j]
    ok = (d > 0) & ~em_in_l[..., :, None] & ~el_in_m[..., None, :]
    score = np.where(ok, pair, np.inf).reshape(ids.size, -1)
    best = score.argmin(axis=1)
    gain = score[n, best] < np.minimum(lm - min_drop, lm * (1 - 1e-12))
    sel = ids[gain]
    k, i, j = np.unravel_index(best[gain], (K2, P, P))
    mg, rg = m[gain], light[gain, k]
    dg = d[gain, k, i, j]
    ea, eb = slots_LWP[sel, mg, i], slots_LWP[sel, rg, j]
    wa, wb = w_LWP[sel, mg, i], w_LWP[sel, rg, j]
    slots_LWP[sel, mg, i], slots_LWP[sel, rg, j] = eb, ea
    w_LWP[sel, mg, i], w_LWP[sel, rg, j] = wb, wa
    rank_LW[sel, mg] -= dg
    rank_LW[sel, rg] += dg
    return gain


def slot_weights(load_LE: np.ndarray, s2e_LS: np.ndarray) -> np.ndarray:
    """[L, S] load[e] / replicas(e) of each slot's expert."""
    L, E = load_LE.shape
    flat = (s2e_LS + np.arange(L)[:, None] * E).ravel()
    reps = np.bincount(flat, minlength=L * E).reshape(L, E)
    per_copy = load_LE / np.maximum(reps, 1)
    return np.take_along_axis(per_copy, s2e_LS, axis=1)


def peak(load_LE: np.ndarray, s2e_LS: np.ndarray, W: int) -> np.ndarray:
    """[L] largest rank load."""
    L, S = s2e_LS.shape
    return slot_weights(load_LE, s2e_LS).reshape(L, W, S // W).sum(-1).max(-1)
