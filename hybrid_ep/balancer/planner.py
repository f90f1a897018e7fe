"""Expert placement: which expert each slot holds, planned from tokens per expert.

A slot holding expert e carries load[e] / replicas(e) (the router splits an expert's
tokens evenly over its replicas) and a rank carries the sum over its slots; the plan keeps
the largest rank small. The search runs per layer in C++ (hybrid_ep._planner,
csrc/balancer/): a local search is sequential, and a Python loop over it costs
far more than the search. Fresh plan: replica counts from one global budget of spare
slots (each to the largest load / replicas, so a very hot expert gets as many copies as it
needs, on any node), slots packed onto ranks by balanced differencing, copies of one
expert moved apart, then swaps at the most loaded rank; EPLB's plan and a greedy plan,
swapped the same way, replace it where they end lower; finally ranks are ordered onto
nodes so an expert's copies share nodes (a permutation: it never changes the balance).
With a previous placement, the planner keeps it and changes few slots: swaps and
one-slot replica changes at the most loaded rank (docs/balancer.md); a move budget caps the
slots one call changes, at the cost of imbalance until the next call.
Legend: L layers, E experts, S slots, W ranks, N nodes, G = W / N ranks per node,
P = S / W slots per rank, R most replicas of one expert.
"""

from __future__ import annotations

import numpy as np
import torch

from .. import _planner
from .knobs import DEFAULT_TOLERANCE, check_knobs
from .metrics import rank_loads
from .placement import Placement, check_sizes, expert_to_slots

# Halvings of the allowed peak when a move budget binds: the interval ends 2**-6 of the way
# from the tolerance's peak to previous's own.
_BUDGET_STEPS = 6


def plan_placement(load, num_slots: int, num_nodes: int, num_ranks: int,
                   previous: Placement | None = None, *, tolerance: float = DEFAULT_TOLERANCE,
                   move_budget: float | None = None, rdma_weight: float | None = None) -> Placement:
    """Balanced placement for load [L, E] (or [E]) tokens per expert; deterministic.

    With previous (same shape), per layer, the first of these whose rank imbalance
    ((max - mean) / mean) is at most the fresh plan's + tolerance: previous unchanged;
    previous re-fitted (at the most loaded rank, the cheapest move that brings it within:
    one slot turned into a copy of another expert, or a swap of two slots; else the move
    with the largest drop per changed slot; chains and cycles through several over-loaded
    ranks where they change fewer slots), where it gets within and the fresh plan matched
    onto previous does not change fewer slots; else that matched fresh plan. Migration
    moves weights and optimizer state, so a tolerance of 0.01 (the default) saves most
    moves; tolerance=0 keeps only what is as good as the fresh plan. The refit's costliest
    searches (count shifts and the one-slot exchange, on layers that change more than 9% of
    their slots) run at most max(8, L / 4) times per call, on the layers just over 10% first,
    which keeps 61 layers within 25 ms; so with many layers a layer's plan can depend on the
    others in the call.

    move_budget (a fraction of each layer's slots) caps what one call changes, for users who
    bound a rebalance's migration: in a layer where the plan above changes more, of the
    plans within the budget that the same search finds stopped at the budget (toward the
    tolerance's peak and toward higher ones, bisected up to previous's own), the one that
    leaves the fewest further rebalances to the tolerance on this load, then the lowest peak.
    The imbalance may then exceed the fresh plan's + tolerance; calling again with the
    result as previous continues toward it.

    rdma_weight (None: the node-agnostic plan above, for the spreading rule, where copies go to
    any node): with a number and num_nodes > 1, the node-aware plan for the replica choice by
    locality (SlotTable.set_shape, slots.py): experts stay on their home node e // (E / N), the
    node their group maps to under node-limited routing, and get satellite copies that serve
    other nodes' own routes; an expert moves to another node only where the drop in imbalance
    is above rdma_weight x the routes it then serves off its home node (a fraction of all
    routes). Imbalance and tolerance are then those of the locality rule (metrics, nodes=N),
    and a kept plan must be within tolerance of the fresh plan's imbalance + rdma_weight x its
    off-home routes (docs/balancer.md, "Node-aware plans").
    """
    check_knobs(required=("tolerance",), tolerance=tolerance, move_budget=move_budget, rdma_weight=rdma_weight)
    load_LE = _as_load(load)
    num_experts = load_LE.shape[1]
    check_sizes(num_experts, num_slots, num_ranks, num_nodes)
    if num_experts % num_nodes != 0:
        raise ValueError(f"num_nodes ({num_nodes}) must divide the number of experts ({num_experts}) "
                         "so every node holds the same number of experts")
    if rdma_weight is not None and num_nodes > 1:
        return _plan_local(load_LE, num_slots, num_nodes, num_ranks, previous, tolerance, move_budget,
                           float(rdma_weight))
    # with previous, only the fresh plan's copies and peak count until it is matched onto
    # previous (_keep_most), so its ranks are ordered onto nodes only there
    fresh_LS = _planner.plan_fresh(load_LE, num_slots, num_nodes, num_ranks, onto_nodes=previous is None)
    if previous is None:
        return Placement(torch.from_numpy(fresh_LS), num_ranks, num_nodes, num_experts).validate()
    _check_previous(previous, load_LE.shape[0], num_experts, num_slots, num_nodes, num_ranks)
    prev_LS = previous.slot_to_expert.numpy()
    mean_L = load_LE.sum(1) / num_ranks
    allowed_L = peak(load_LE, fresh_LS, num_ranks) + (tolerance + 1e-9) * mean_L  # relative: scale-free
    keep_L = peak(load_LE, prev_LS, num_ranks) <= allowed_L
    if keep_L.all():
        return previous
    todo = np.flatnonzero(~keep_L)
    out_LS = prev_LS.copy()
    out_LS[todo] = _keep_most(load_LE[todo], prev_LS[todo], fresh_LS[todo], allowed_L[todo], num_nodes, num_ranks)
    if move_budget is not None:
        cap = int(np.floor(move_budget * num_slots + 1e-9))
        over = np.flatnonzero((out_LS != prev_LS).sum(1) > cap)
        if over.size:
            out_LS[over] = _fit_budget(load_LE[over], prev_LS[over], fresh_LS[over], allowed_L[over], cap,
                                       num_nodes, num_ranks)
    return Placement(torch.from_numpy(np.ascontiguousarray(out_LS)), num_ranks, num_nodes,
                     num_experts).validate()


def peak(load_LE: np.ndarray, s2e_LS: np.ndarray, W: int) -> np.ndarray:
    """[L] largest rank load of a placement (metrics.rank_loads: a slot weighs load[e] / replicas(e))."""
    return rank_loads(load_LE, torch.from_numpy(np.ascontiguousarray(s2e_LS)), W).max(1).values.numpy()


def objective(load_LE: np.ndarray, s2e_LS: np.ndarray, num_nodes: int, num_ranks: int,
              rdma_weight: float) -> tuple[np.ndarray, np.ndarray]:
    """([L] rank imbalance under the replica choice by locality, [L] rdma_weight x (routes
    served off their home node) / (all routes)): the two terms the node-aware plan minimises
    (metrics.rank_loads with nodes=N and metrics.off_home, computed natively)."""
    imbalance, off = _planner.local_terms(load_LE, np.ascontiguousarray(s2e_LS), num_nodes, num_ranks)
    return imbalance, rdma_weight * off


def _within(load_LE, s2e_LS, N, W, rdma_weight, goal) -> np.ndarray:
    """[L] both terms of the objective within tolerance of the fresh plan's (goal: theirs + tolerance)."""
    imbalance, cost = objective(load_LE, s2e_LS, N, W, rdma_weight)
    return (imbalance <= goal[0]) & (cost <= goal[1])


def _plan_local(load_LE: np.ndarray, S: int, N: int, W: int, previous: Placement | None, tolerance: float,
                move_budget: float | None, rdma_weight: float) -> Placement:
    """The node-aware plan (plan_placement's rdma_weight). With previous, the reference plan is
    the same search started from previous's node placement instead of the home placement (a local
    search either way; from previous it changes few nodes where the load changed little), and
    per layer the first of: previous unchanged, where its imbalance and its cost of off-home
    routes are each within tolerance of the reference's; else previous re-fitted node by node
    in the reference's placement (each node's slots by the refit of the node-agnostic plan) where
    that is within tolerance and changes at most a quarter of the slots, else whichever of it
    (if within) and the reference with the ranks of each node and the slots of each rank
    matched onto previous (always within) changes fewer slots. With move_budget, a layer
    changing more is re-fitted within previous's node placement, each node stopped at the
    budget's share of its slots."""
    E = load_LE.shape[1]
    if previous is None:
        return Placement(torch.from_numpy(_planner.plan_local(load_LE, S, N, W, rdma_weight)), W, N, E).validate()
    _check_previous(previous, load_LE.shape[0], E, S, N, W)
    prev_LS = previous.slot_to_expert.numpy()
    fresh_LS = _planner.plan_local(load_LE, S, N, W, rdma_weight)
    imbalance, cost = objective(load_LE, fresh_LS, N, W, rdma_weight)
    mean_L = load_LE.sum(1) / W
    goal = (imbalance + tolerance + 1e-9, cost + tolerance + 1e-9)
    keep_L = _within(load_LE, prev_LS, N, W, rdma_weight, goal)
    if keep_L.all():
        return previous
    todo = np.flatnonzero(~keep_L)
    allowed_L = (1 + imbalance[todo] + tolerance + 1e-9) * mean_L[todo]  # the reference's peak + tolerance
    out_LS = prev_LS.copy()
    refit, _ = _planner.keep_local(load_LE[todo], prev_LS[todo], fresh_LS[todo], N, W, rdma_weight, False, allowed_L,
                                   S)
    within = _within(load_LE[todo], refit, N, W, rdma_weight, (goal[0][todo], goal[1][todo]))
    # the reference matched onto previous where the refit is not within, or changes more than
    # a quarter of the slots (where matching may change fewer; a refit within that changes
    # less rarely loses to it)
    moved = (refit != prev_LS[todo]).sum(1)
    match = np.flatnonzero(~within | (moved > S // 4))
    out_LS[todo] = refit
    if match.size:
        aligned = _planner.align_within_nodes(fresh_LS[todo[match]], prev_LS[todo[match]], E, N, W)
        worse = ~within[match] | ((aligned != prev_LS[todo[match]]).sum(1) <= moved[match])
        out_LS[todo[match[worse]]] = aligned[worse]
    if move_budget is not None:
        cap = int(np.floor(move_budget * S / N + 1e-9))  # per node
        over = todo[(out_LS[todo] != prev_LS[todo]).reshape(len(todo), N, S // N).sum(2).max(1) > cap]
        if over.size:
            allowed_over = (1 + imbalance[over] + tolerance + 1e-9) * mean_L[over]
            out_LS[over] = _planner.keep_local(load_LE[over], prev_LS[over], None, N, W, rdma_weight, True,
                                               allowed_over, cap)[0]
    return Placement(torch.from_numpy(np.ascontiguousarray(out_LS)), W, N, E).validate()


# ----------------------------------------------------------------------------- checks

_MAX_LAYER_LOAD = 1e300  # far below float64's 1.8e308, so sums over ranks never overflow


def _as_load(load) -> np.ndarray:
    """[L, E] float64 copy of load ([E] is one layer); non-negative, finite, sums finite."""
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
    with np.errstate(over="ignore"):
        totals = arr.sum(1)
    if not (totals <= _MAX_LAYER_LOAD).all():  # rank sums and allowed peaks must stay finite
        layer = int(np.argmax(~(totals <= _MAX_LAYER_LOAD)))
        raise ValueError(f"load: layer {layer} sums to {totals[layer]:.3g}, above {_MAX_LAYER_LOAD:.0e}; "
                         "give the loads in a smaller unit (the plan does not depend on it)")
    return arr


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


# ----------------------------------------------------------------------------- keep slots

def _keep_most(load_LE: np.ndarray, prev_LS: np.ndarray, fresh_LS: np.ndarray, allowed_L: np.ndarray,
               N: int, W: int) -> np.ndarray:
    """[L, S] per layer the candidate within allowed_L that moves fewer slots: previous after
    swaps and one-slot replica changes (where the search reaches allowed_L), or the fresh plan
    matched onto previous (always within: it is the fresh plan, permuted), then turned back
    toward previous slot by slot while every rank stays within allowed_L. fresh_LS: the fresh
    plan before its ranks are ordered onto nodes (plan_fresh's onto_nodes=False)."""
    S, E = prev_LS.shape[1], load_LE.shape[1]
    kept, reached = _planner.keep_previous(load_LE, prev_LS, fresh_LS, allowed_L, W, S)
    check = np.flatnonzero(~reached | ((kept != prev_LS).sum(1) > S // 2))  # where matching can move fewer
    if check.size:
        grouped = _planner.group_nodes(fresh_LS[check], E, N, W)
        aligned = _align(grouped, prev_LS[check], N, W, E)
        aligned = _planner.walk_back(load_LE[check], prev_LS[check], aligned, allowed_L[check], W)
        better = ~reached[check] | ((aligned != prev_LS[check]).sum(1) < (kept[check] != prev_LS[check]).sum(1))
        kept[check[better]] = aligned[better]
    return kept


def _fit_budget(load_LE: np.ndarray, prev_LS: np.ndarray, fresh_LS: np.ndarray, allowed_L: np.ndarray,
                cap: int, N: int, W: int) -> np.ndarray:
    """[L, S] per layer the plan changing at most cap slots that leaves the fewest rebalances
    to allowed_L on this load, then the lowest peak. Candidates: the refit
    (_planner.keep_previous) stopped at cap toward allowed_L, and toward allowed peaks
    bisected between allowed_L and previous's own peak (the search is not monotone in the
    allowed peak, so every one counts). The rebalances a candidate leaves are the slots the
    unbudgeted plan from it (_keep_most) changes, in budgets. Picking the lowest peak alone
    left 4 of the quality benchmark's 16 layouts over 10% above the tolerance after three
    rebalances (this: none) and moved 26% more slots in four (tools/balancer_study/NOTES.md)."""
    if cap == 0:
        return prev_LS.copy()
    plans = [_planner.keep_previous(load_LE, prev_LS, fresh_LS, allowed_L, W, cap)[0]]  # <= cap changed
    lo_L, hi_L = allowed_L.astype(np.float64), peak(load_LE, prev_LS, W)
    for _ in range(_BUDGET_STEPS):
        mid_L = 0.5 * (lo_L + hi_L)
        plan_LS, reached_L = _planner.keep_previous(load_LE, prev_LS, fresh_LS, mid_L, W, cap)
        plans.append(plan_LS)
        hi_L = np.where(reached_L, mid_L, hi_L)
        lo_L = np.where(reached_L, lo_L, mid_L)
    best_LS = prev_LS.copy()
    best_rounds = np.full(len(prev_LS), np.iinfo(np.int64).max)
    best_peak = np.full(len(prev_LS), np.inf)
    for plan_LS in plans:
        got_L = peak(load_LE, plan_LS, W)
        short = np.flatnonzero(got_L > allowed_L)
        left_L = np.zeros(len(plan_LS), dtype=np.int64)
        if short.size:
            rest = _keep_most(load_LE[short], plan_LS[short], fresh_LS[short], allowed_L[short], N, W)
            left_L[short] = (rest != plan_LS[short]).sum(1)
        rounds_L = -(-left_L // cap)
        better = (rounds_L < best_rounds) | ((rounds_L == best_rounds) & (got_L < best_peak))
        best_LS[better], best_rounds[better], best_peak[better] = plan_LS[better], rounds_L[better], got_L[better]
    return best_LS


def _align(new_LS: np.ndarray, prev_LS: np.ndarray, N: int, W: int, E: int) -> np.ndarray:
    """new_LS with nodes, ranks within a node and slots within a rank permuted to match prev_LS.

    Greedy matching: node pairs by shared experts, then rank pairs within matched nodes, then
    slots. Rank loads are only permuted, so the balance is unchanged. (The node-aware plan,
    whose copies are placed for their nodes, keeps every node: _planner.align_within_nodes.)
    """
    L, S = new_LS.shape
    G, P = W // N, S // W
    overlap = _rank_overlap(new_LS, prev_LS, W, E)  # [L, Wnew, Wold]
    node_ov = overlap.reshape(L, N, G, N, G).sum(axis=(2, 4))
    node_map = _greedy_match(node_ov)  # [L, N] old node of each
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
    old_slots = expert_to_slots(prev_LS, E)  # [L, E, R]
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
