"""Which ranks of an EP group share a node (an NVLink domain): the G of "rank r is on node r // G".

The launcher says where each process runs only through LOCAL_WORLD_SIZE: torchrun and srun's
block distribution number processes node by node, so global rank g runs on launcher node
g // LOCAL_WORLD_SIZE. An EP group is not always a contiguous run of global ranks: Megatron
strides it by the expert tensor-parallel size, so with ETP 2 on nodes of 8 GPUs an EP group
of 8 spans two nodes, 4 ranks on each. G therefore comes from the launcher nodes of the
group's members, in group order; LOCAL_WORLD_SIZE alone would put all 8 on one node, and the
kernels would reach the other node's ranks over NVLink.
"""

from __future__ import annotations

import os

import torch.distributed as dist

from .checks import is_int


def launcher_local_world_size() -> int | None:
    """LOCAL_WORLD_SIZE as a positive int, or None where the launcher did not set it."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    return int(raw) if raw is not None and raw.isdigit() and int(raw) > 0 else None


def member_nodes(global_ranks: list[int], local_world_size: int) -> list[int]:
    """Launcher node of each member (global ranks numbered node by node)."""
    return [g // local_world_size for g in global_ranks]


def contiguous_ranks_per_node(nodes: list[int]) -> int | None:
    """G where the members come node by node, G on each node; None where they do not
    (a node's members split by another node's, or nodes holding different counts)."""
    runs: list[list[int]] = []  # [node, members]
    for n in nodes:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    if len({n for n, _ in runs}) != len(runs) or len({count for _, count in runs}) != 1:
        return None
    return runs[0][1]


def resolve_ranks_per_node(global_ranks: list[int], requested, local_world_size: int | None) -> int:
    """G for an EP group whose members, in group order, have these global ranks.

    requested None: the launcher's layout (all members on one node without LOCAL_WORLD_SIZE).
    A requested G may split a launcher node into several (a multi-node test on one machine),
    never join members of different launcher nodes into one. Values that are not a positive
    divisor of the group size pass through for BufferConfig to refuse by name.
    """
    W = len(global_ranks)
    if local_world_size is None:
        return W if requested is None else requested
    nodes = member_nodes(global_ranks, local_world_size)
    if requested is None:
        G = contiguous_ranks_per_node(nodes)
        if G is None:
            raise ValueError(
                f"ranks_per_node: the EP group's {W} ranks do not come node by node (launcher node of each, "
                f"in group order, from LOCAL_WORLD_SIZE={local_world_size}: {nodes}); pass ranks_per_node "
                "explicitly (1 treats every rank as a node of its own) or build the group node by node")
        return G
    if not is_int(requested, 1) or W % requested:
        return requested
    for first in range(0, W, requested):
        block = nodes[first:first + requested]
        if len(set(block)) > 1:
            raise ValueError(
                f"ranks_per_node={requested} puts EP ranks {first}..{first + requested - 1} on one node, but the "
                f"launcher runs them on different nodes ({block}, from LOCAL_WORLD_SIZE={local_world_size} and "
                f"their global ranks {global_ranks[first:first + requested]}); ranks on different nodes cannot "
                f"share NVLink. Leave ranks_per_node unset (this group: "
                f"{contiguous_ranks_per_node(nodes) or 1}) or use a divisor of it")
    return requested


def group_ranks_per_node(group, requested=None) -> int:
    """G of a process group (None: the world) from its members and the launcher's layout."""
    group = dist.group.WORLD if group is None else group
    return resolve_ranks_per_node(dist.get_process_group_ranks(group), requested, launcher_local_world_size())
