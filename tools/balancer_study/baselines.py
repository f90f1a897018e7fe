"""Planners the quality benchmark compares against, written from their published descriptions.

EPLB (DeepSeek's expert-parallelism load balancer, `rebalance_experts`), as its README
describes it:
  hierarchical: pack groups of experts onto nodes (heaviest group first into the lightest
  node with room), replicate within each node (each spare slot to the expert with the
  largest load / replicas), pack each node's slots onto its ranks the same way;
  global: the same with one group per expert and one node (replicate over all slots,
  pack onto all ranks). `eplb` returns, per layer, the better of the two.
Greedy: replicate the largest load / replicas until the spare slots are spent, then
longest-processing-time packing (heaviest slot to the least loaded rank with room,
avoiding a rank that holds the expert already when one with room does not).
All return slot_to_expert [L, S] int64 with rank r owning slots r*P .. (r+1)*P - 1.
The planner runs the same two plans natively (csrc/balancer/baselines.cpp) as candidates;
these stay an independent reference: tests check the native ones give identical plans, and
the quality benchmark compares against these.
Legend: L layers, E experts, S slots, W ranks, N nodes, P = S / W slots per rank.
"""

from __future__ import annotations

import numpy as np

from hybrid_ep.balancer.planner import peak


def eplb(load_LE: np.ndarray, num_slots: int, num_nodes: int, num_ranks: int,
         num_groups: int | None = None) -> np.ndarray:
    """[L, S] per layer the better (smaller peak rank) of EPLB's hierarchical and global plans.

    num_groups: expert groups of the hierarchical policy (default E: one expert per group,
    its most flexible setting); it must be a multiple of num_nodes.
    """
    load_LE = np.asarray(load_LE, dtype=np.float64)
    groups = load_LE.shape[1] if num_groups is None else num_groups
    hier = eplb_hierarchical(load_LE, num_slots, groups, num_nodes, num_ranks)
    flat = eplb_hierarchical(load_LE, num_slots, load_LE.shape[1], 1, num_ranks)
    better = peak(load_LE, flat, num_ranks) < peak(load_LE, hier, num_ranks)
    return np.where(better[:, None], flat, hier)


def eplb_hierarchical(load_LE: np.ndarray, num_slots: int, num_groups: int, num_nodes: int,
                      num_ranks: int) -> np.ndarray:
    """[L, S] EPLB's hierarchical policy (num_nodes=1 with num_groups=E is its global policy)."""
    L, E = load_LE.shape
    N, G = num_nodes, num_ranks // num_nodes
    if E % num_groups or num_groups % N or num_slots % num_ranks or num_ranks % N:
        raise ValueError(f"EPLB needs E ({E}) divisible by num_groups ({num_groups}), num_groups by "
                         f"num_nodes ({N}), num_slots ({num_slots}) by num_ranks ({num_ranks})")
    group_size, X, per_node = E // num_groups, E // N, num_slots // N
    group_load = load_LE.reshape(L, num_groups, group_size).sum(-1)
    group_node, group_pos = _balanced_packing(group_load, N)  # [L, groups]
    first = (group_node * (num_groups // N) + group_pos) * group_size  # node-major position of each group
    pos_LE = (first[:, :, None] + np.arange(group_size)).reshape(L, E)
    node_expert = np.argsort(pos_LE, axis=1)  # [L, E] expert at each node-major position
    node_load = np.take_along_axis(load_LE, node_expert, 1).reshape(L * N, X)
    reps = _replicate(node_load, per_node)  # [L*N, X]
    copy_local = np.repeat(np.tile(np.arange(X), L * N), reps.ravel()).reshape(L * N, per_node)
    copy_w = np.take_along_axis(node_load / reps, copy_local, 1)
    rank, pos = _balanced_packing(copy_w, G)  # [L*N, per_node]
    local = np.empty_like(copy_local)
    np.put_along_axis(local, rank * (per_node // G) + pos, copy_local, 1)
    node_pos = local.reshape(L, N, per_node) + (np.arange(N) * X)[None, :, None]
    return np.take_along_axis(node_expert, node_pos.reshape(L, num_slots), 1).astype(np.int64)


def greedy(load_LE: np.ndarray, num_slots: int, num_ranks: int) -> np.ndarray:
    """[L, S] replicate the largest load / replicas, then longest-processing-time packing."""
    load_LE = np.asarray(load_LE, dtype=np.float64)
    L, E = load_LE.shape
    W, P = num_ranks, num_slots // num_ranks
    reps = _replicate(load_LE, num_slots)
    copy = np.repeat(np.tile(np.arange(E), L), reps.ravel()).reshape(L, num_slots)
    w = np.take_along_axis(load_LE / reps, copy, 1)
    order = np.argsort(-w, axis=1, kind="stable")
    copy, w = np.take_along_axis(copy, order, 1), np.take_along_axis(w, order, 1)
    rows = np.arange(L)
    rank_load = np.zeros((L, W))
    count = np.zeros((L, W), dtype=np.int64)
    holds = np.zeros((L, W, E), dtype=bool)
    out = np.empty((L, W, P), dtype=np.int64)
    for k in range(num_slots):
        e = copy[:, k]
        full = count >= P
        free = np.where(full | holds[rows, :, e], np.inf, rank_load)
        pick = np.where(np.isinf(free).all(1), np.where(full, np.inf, rank_load).argmin(1), free.argmin(1))
        rank_load[rows, pick] += w[:, k]
        out[rows, pick, count[rows, pick]] = e
        count[rows, pick] += 1
        holds[rows, pick, e] = True
    return out.reshape(L, num_slots)


def _replicate(load_XE: np.ndarray, slots: int) -> np.ndarray:
    """[X, E] copies: each spare slot to the largest load / copies (no cap; ties: lower id)."""
    X, E = load_XE.shape
    reps = np.ones((X, E), dtype=np.int64)
    rows = np.arange(X)
    for _ in range(slots - E):
        best = (load_XE / reps).argmax(1)
        reps[rows, best] += 1
    return reps


def _balanced_packing(weight_XI: np.ndarray, packs: int) -> tuple[np.ndarray, np.ndarray]:
    """(pack [X, I], position in pack [X, I]): heaviest item first into the lightest pack with room."""
    X, I = weight_XI.shape
    cap = I // packs
    order = np.argsort(-weight_XI, axis=1, kind="stable")
    rows = np.arange(X)
    pack_load = np.zeros((X, packs))
    count = np.zeros((X, packs), dtype=np.int64)
    pack = np.empty((X, I), dtype=np.int64)
    pos = np.empty((X, I), dtype=np.int64)
    for k in range(I):
        item = order[:, k]
        p = np.where(count < cap, pack_load, np.inf).argmin(1)
        pack[rows, item] = p
        pos[rows, item] = count[rows, p]
        pack_load[rows, p] += weight_XI[rows, item]
        count[rows, p] += 1
    return pack, pos
