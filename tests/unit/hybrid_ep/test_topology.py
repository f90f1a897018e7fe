"""ranks_per_node of an EP group from its members' launcher nodes (hybrid_ep/topology.py)."""

from __future__ import annotations

import pytest

from hybrid_ep.topology import contiguous_ranks_per_node, resolve_ranks_per_node

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("members,local,want", [
    (list(range(8)), 8, 8),  # one node
    (list(range(16)), 8, 8),  # two nodes, contiguous
    (list(range(0, 16, 2)), 8, 4),  # strided by expert TP 2: 4 members on each of 2 nodes
    ([0, 2], 2, 1),  # one member per node
    ([1, 3, 5, 7], 2, 1),
    (list(range(6)), 3, 3),  # a node size that is not a power of two
    ([5], 4, 1),
])
def test_auto_follows_the_members_nodes(members, local, want):
    assert resolve_ranks_per_node(members, None, local) == want


def test_without_launcher_layout_everything_is_one_node_or_as_asked():
    assert resolve_ranks_per_node(list(range(0, 16, 2)), None, None) == 8
    assert resolve_ranks_per_node(list(range(8)), 2, None) == 2


@pytest.mark.parametrize("members,local,shown", [
    ([0, 4, 1, 5], 4, "[0, 1, 0, 1]"),  # a node's members split by another node's
    ([0, 1, 2, 4], 3, "[0, 0, 0, 1]"),  # nodes holding different counts
])
def test_auto_refuses_a_group_that_does_not_come_node_by_node(members, local, shown):
    with pytest.raises(ValueError, match=r"ranks_per_node: the EP group's 4 ranks do not come node by node") as info:
        resolve_ranks_per_node(members, None, local)
    assert shown in str(info.value) and "pass ranks_per_node" in str(info.value)
    assert resolve_ranks_per_node(members, 1, local) == 1  # the way out the message names


def test_an_explicit_value_may_split_a_node_but_never_join_two():
    assert resolve_ranks_per_node(list(range(8)), 2, 8) == 2  # 4 emulated nodes on one launcher node
    assert resolve_ranks_per_node(list(range(0, 16, 2)), 2, 8) == 2
    with pytest.raises(ValueError, match=r"ranks_per_node=8 puts EP ranks 0..7 on one node, but the launcher runs "
                                         r"them on different nodes \(\[0, 0, 0, 0, 1, 1, 1, 1\]") as info:
        resolve_ranks_per_node(list(range(0, 16, 2)), 8, 8)
    assert "this group: 4" in str(info.value)


def test_values_buffer_config_refuses_pass_through():
    for bad in (3, 0, True, 2.0):
        assert resolve_ranks_per_node(list(range(4)), bad, 2) is bad


def test_contiguous_ranks_per_node():
    assert contiguous_ranks_per_node([0, 0, 1, 1, 2, 2]) == 2
    assert contiguous_ranks_per_node([3, 3, 3]) == 3
    assert contiguous_ranks_per_node([0, 1, 0]) is None
    assert contiguous_ranks_per_node([0, 0, 1]) is None


def _strided_group_buffer():
    import torch
    import torch.distributed as dist

    import hybrid_ep as hep

    rank = dist.get_rank()
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every process makes every group
    buf = hep.HybridEPBuffer(groups[rank % 2], 16, 8, 2, backend="reference")
    buf.dispatch(torch.randn(4, 16), torch.tensor([[0, 1]] * 4))  # every token to both members
    traffic = buf.last_traffic
    outside = None
    try:
        hep.HybridEPBuffer(groups[(rank + 1) % 2], 16, 8, 2, backend="reference")
    except ValueError as err:
        outside = str(err)
    return buf.config.ranks_per_node, buf.config.num_nodes, traffic.nvlink_bytes, traffic.rdma_bytes, outside


def test_strided_ep_group_spans_two_nodes():
    """4 processes launched as 2 nodes x 2 (global ranks 0, 1 on node 0), EP groups {0, 2} and
    {1, 3}: each has one member per node, so tokens for the peer cross the network. Before
    the members were looked at, LOCAL_WORLD_SIZE alone put both on one node (RDMA bytes 0)."""
    from hybrid_ep.spawn import ProcessGroupPool

    with ProcessGroupPool(4, env={"HYBRID_EP_TIMEOUT_S": "30", "LOCAL_WORLD_SIZE": "2"}) as pool:
        results = pool.run(_strided_group_buffer, timeout_s=120)
    for rank, (per_node, nodes, nvlink, rdma, outside) in enumerate(results):
        assert (per_node, nodes) == (1, 2), rank
        assert nvlink == 0 and rdma > 0, (rank, nvlink, rdma)
        assert outside is not None and f"this process (global rank {rank}) is not a member of the EP group" in outside


def test_megatron_balancer_plans_for_the_buffers_nodes(monkeypatch):
    """The planner's node count is the buffer's: from the members' launcher nodes, or an
    explicit ranks_per_node that splits a launcher node (it ignored that one when
    LOCAL_WORLD_SIZE was set: buffer 2 nodes, plan 1)."""
    import megatron_patches.balancer as mb

    members = {"strided": list(range(0, 16, 2)), "four": list(range(4)), "split": [0, 4, 1, 5]}
    monkeypatch.setattr(mb, "group_ranks_per_node",
                        lambda group, requested: resolve_ranks_per_node(members[group], requested, local[0]))
    local = [8]
    assert mb._num_nodes("strided", 8, None) == 2  # 4 members on each of 2 launcher nodes
    local = [4]
    assert mb._num_nodes("four", 4, None) == 1
    assert mb._num_nodes("four", 4, 2) == 2  # a launcher node split in two, as the buffer does
    with pytest.raises(ValueError, match="do not come node by node"):  # as the buffer refuses it
        mb._num_nodes("split", 4, None)
    assert mb._num_nodes("split", 4, 1) == 4
    local = [None]  # no LOCAL_WORLD_SIZE: the option, else one node
    assert mb._num_nodes("four", 4, 2) == 2
    assert mb._num_nodes("four", 4, None) == 1
