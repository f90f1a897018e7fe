"""How many slots any refit must change: a lower bound, to judge the planner's moves against.

A refit (plan_placement with previous=) must bring every rank to at most an allowed peak A.
A rank whose slots all stay (unchanged) changes load only through copy counts: it drops when
one of its experts gains a copy and rises when one loses a copy. Each changed slot sits on one
rank, and every copy an expert gains is a changed slot, so with C the ranks that change a slot
and t the copies gained (= copies lost, at most S - E):

    changed slots >= max(|C|, t).

Two necessary conditions bound C from below:
1. Every over-loaded rank (load > A) is in C or relieved by gained copies. Gaining one copy of
   y lowers rank r by at most n_ry * (L_y / c_y - L_y / (c_y + 1)), the first copy lowering it
   most, so a relieved rank needs sum over gains of min(1, that drop / its excess) >= 1; one
   gain adds at most V = max_y sum over over-loaded holders of that share: t gains relieve at
   most t * V ranks. A rank that no number of gains can relieve is in C.
2. The total excess X (sum over over-loaded ranks of load - A) goes somewhere: total load is
   fixed and every rank ends at most A, so X <= the room (A - load) of the changed ranks that
   were not over-loaded + what unchanged ranks take through lost copies. One lost copy of x
   raises x's holders by at most n_rx * L_x / c_x each, up to their room: t losses take at
   most t * D, D the largest such sum.
With S = E no copy count can change (t = 0): every over-loaded rank changes a slot, and ranks
with room must change too until their room covers X. The same t = 0 bound holds for any plan
that keeps every expert's copy count (keep_counts=True), whatever S: where it is above a move
target and the bound with counts free is not, only plans that change copy counts can meet it.
Legend: L layers, E experts, S slots, W ranks, P = S / W, n_re copies of e on rank r, c_e copies.
"""

from __future__ import annotations

import numpy as np

_EPS = 1e-12  # relative slack in the comparisons, so rounding never raises the bound


def refit_lower_bound(load_LE, previous_LS, num_ranks: int, allowed_L, *, keep_counts: bool = False) -> np.ndarray:
    """[L] int64: changed slots every placement within allowed_L (peak per layer) needs from previous_LS
    (with keep_counts, every such placement that keeps each expert's copy count)."""
    load_LE = np.atleast_2d(np.asarray(load_LE, dtype=np.float64))
    prev_LS = np.atleast_2d(np.asarray(previous_LS, dtype=np.int64))
    allowed_L = np.broadcast_to(np.asarray(allowed_L, dtype=np.float64), (load_LE.shape[0],))
    return np.array([_layer_bound(load_LE[l], prev_LS[l], num_ranks, float(allowed_L[l]), keep_counts)
                     for l in range(load_LE.shape[0])], dtype=np.int64)


def over_loaded_ranks(load_E: np.ndarray, prev_S: np.ndarray, W: int, allowed: float) -> np.ndarray:
    """Ranks of prev_S whose load exceeds allowed (each needs a changed slot or a gained copy)."""
    return np.flatnonzero(_rank_loads(load_E, prev_S, W) > allowed)


def _rank_loads(load_E: np.ndarray, prev_S: np.ndarray, W: int) -> np.ndarray:
    copies = np.bincount(prev_S, minlength=load_E.shape[0])
    return (load_E[prev_S] / copies[prev_S]).reshape(W, -1).sum(1)


def _layer_bound(load: np.ndarray, prev: np.ndarray, W: int, A: float, keep_counts: bool) -> int:
    E, S = load.shape[0], prev.shape[0]
    n_WE = np.zeros((W, E))
    np.add.at(n_WE, (np.arange(S) // (S // W), prev), 1.0)
    c_E = n_WE.sum(0)
    rank = (n_WE * np.where(c_E > 0, load / np.maximum(c_E, 1), 0.0)).sum(1)
    over = rank > A
    if not over.any():
        return 0
    excess = rank[over] - A
    total_excess = float(excess.sum())
    room = np.sort(np.maximum(A - rank[~over], 0.0))[::-1]
    room_cum = np.concatenate([[0.0], np.cumsum(room)])
    spare = 0 if keep_counts else S - E  # copies that can be lost (every expert keeps one)
    fixed, relief = int(over.sum()), 0.0
    take = 0.0
    if spare > 0:
        fixed, relief = _gain_relief(load, n_WE[over], c_E, excess, spare)
        take = _loss_take(load, n_WE[~over], c_E, A - rank[~over])
    best = None
    for t in range(spare + 1):
        changed_over = max(fixed, int(over.sum()) - int(np.floor(t * relief * (1 + _EPS))))
        need = total_excess - t * take
        absorbers = 0 if need <= 0 else int(np.searchsorted(room_cum, need * (1 - _EPS)))
        if absorbers > room.shape[0]:
            continue  # not enough room even if every rank changes
        value = max(changed_over + absorbers, t)
        best = value if best is None else min(best, value)
        if t >= best:
            break  # max(., t) only grows from here
    return int(best if best is not None else 0)


def _gain_relief(load, n_OE, c_E, excess, spare):
    """(over-loaded ranks no gains can relieve, largest relief share of one gained copy V)."""
    drop_E = np.where(c_E > 0, load / np.maximum(c_E, 1) - load / (c_E + 1), 0.0)
    most_E = np.where(c_E > 0, load / np.maximum(c_E, 1) - load / (c_E + spare), 0.0)
    share_OE = np.minimum(1.0, n_OE * drop_E[None, :] / excess[:, None])
    relievable = (n_OE * most_E[None, :]).sum(1) >= excess * (1 - _EPS)
    fixed = int((~relievable).sum())
    relief = float(share_OE[relievable].sum(0).max()) if relievable.any() else 0.0
    return fixed, relief


def _loss_take(load, n_RE, c_E, room_R):
    """Most load that one lost copy moves onto unchanged ranks with room (D)."""
    rise_RE = n_RE * np.where(c_E >= 2, load / np.maximum(c_E, 1), 0.0)[None, :]
    return float(np.minimum(rise_RE, np.maximum(room_R, 0.0)[:, None]).sum(0).max()) if n_RE.size else 0.0
