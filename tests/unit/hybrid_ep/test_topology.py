"""ranks_per_node of an EP group: its NVLink domain, from its members' places (hybrid_ep/topology.py):
the GPU fabric's clique, the host, the launcher's nodes, or a value given."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest

from hybrid_ep import logs, topology
from hybrid_ep.topology import MAX_DOMAIN_RANKS, Place, contiguous_ranks_per_node, decide_domain, resolve_ranks_per_node

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
    assert f"launcher node of each, in group order, from LOCAL_WORLD_SIZE={local}: {shown}" in str(info.value)
    assert "pass ranks_per_node" in str(info.value)
    assert resolve_ranks_per_node(members, 1, local) == 1  # the way out the message names


def test_an_explicit_value_may_split_a_node_but_never_join_two():
    assert resolve_ranks_per_node(list(range(8)), 2, 8) == 2  # 4 emulated nodes on one launcher node
    assert resolve_ranks_per_node(list(range(0, 16, 2)), 2, 8) == 2
    with pytest.raises(ValueError, match=r"ranks_per_node=8 puts EP ranks 0..7 in one NVLink domain, but they are in "
                                         r"different ones \(launcher node of each, in group order, from "
                                         r"LOCAL_WORLD_SIZE=8: \[0, 0, 0, 0, 1, 1, 1, 1\]") as info:
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


def _hosts(n: int, per_host: int, **fabric) -> list[Place]:
    """n members on hosts of per_host, in rank order; fabric: the same cluster and clique for all."""
    return [Place(f"host{r // per_host}", None, **fabric) for r in range(n)]


def _cliques(sizes: list[int], per_host: int = 4) -> list[Place]:
    """Members on hosts of per_host, clique c holding sizes[c] of them, in rank order."""
    out = []
    for c, size in enumerate(sizes):
        out += [Place(f"host{(len(out) + i) // per_host}", None, "c1" * 8, c + 1) for i in range(size)]
    return out


def _refused(places: list[Place], rank: int, why: str) -> list[Place]:
    return [dataclasses.replace(p, fabric=why) if r == rank else p for r, p in enumerate(places)]


NO_IMEX = "cuMemCreate (fabric) failed (CUresult 800): no IMEX channel is open to this process"

# (case, places, ranks_per_node asked, (G, unit, spans hosts) or the ValueError's words)
DOMAIN_TABLE = [
    ("one host of 8", _hosts(8, 8), None, (8, "host", False)),
    ("two hosts of 8, no fabric information", _hosts(16, 8), None, (8, "host", False)),
    ("NVL72: one clique of 72 on 18 hosts of 4", _cliques([72]), None, (72, "clique", True)),
    ("two cliques of 36 (NVL36 x 2)", _cliques([36, 36]), None, (36, "clique", True)),
    ("ETP 2 on NVL72: every second rank, 2 per host", _cliques([36], per_host=2), None, (36, "clique", True)),
    ("a clique within one host is the host", _cliques([4, 4]), None, (4, "clique", False)),
    ("a group splitting a clique unevenly: 36 of one, 4 of another", _cliques([36, 4]), None,
     "do not come node by node (NVLink domains, domains of 36 and 4 ranks; GPU fabric clique of each"),
    ("a clique's members not contiguous", [_cliques([4, 4])[i] for i in (0, 4, 1, 5, 2, 6, 3, 7)], None,
     "GPU fabric clique of each, in group order: [0, 1, 0, 1, 0, 1, 0, 1]"),
    ("forced: hosts of 4 inside NVL72", _cliques([72]), 4, (4, "clique", False)),
    ("forced: 8 across two hosts of a clique", _cliques([72]), 8, (8, "clique", True)),
    ("forced: 72 joining two cliques of 36", _cliques([36, 36]), 72,
     "ranks_per_node=72 puts EP ranks 0..71 in one NVLink domain, but they are in different ones"),
    ("no IMEX channel on rank 5: limited to the host", _refused(_cliques([72]), 5, NO_IMEX), None,
     (4, "host", False)),
    ("no IMEX channel, forced across hosts", _refused(_cliques([72]), 5, NO_IMEX), 8,
     "fabric handles are refused on rank 5 (host host1: " + NO_IMEX),
    ("HYBRID_EP_HANDLE=ipc: limited to the host", _refused(_cliques([8]), 0, "HYBRID_EP_HANDLE=ipc"), None,
     (4, "host", False)),
    ("fabric information on some ranks only", _cliques([4]) + _hosts(8, 4)[4:], None, (4, "host", False)),
    ("more than 72 on one host", _hosts(80, 80), None, "ranks_per_node: the EP group's NVLink domains hold 80 "
     "ranks each (host of each, in group order), more than the 72 hybrid_ep lays out; pass ranks_per_node=40"),
    ("more than 72 asked", _cliques([72, 72]), 144, "ranks_per_node=144: an NVLink domain holds at most 72 ranks"),
]


@pytest.mark.parametrize("case,places,asked,want", DOMAIN_TABLE, ids=[row[0] for row in DOMAIN_TABLE])
def test_the_nvlink_domain_of_a_group(case, places, asked, want):
    if isinstance(want, str):
        with pytest.raises(ValueError) as info:
            decide_domain(places, asked)
        assert want in str(info.value), (case, str(info.value))
        assert "ranks_per_node" in str(info.value)
        return
    domain = decide_domain(places, asked)
    assert (domain.ranks_per_node, domain.unit, domain.spans_hosts) == want, case


def test_a_clique_limited_to_the_host_says_why_in_one_line():
    domain = decide_domain(_refused(_refused(_cliques([72]), 5, NO_IMEX), 9, NO_IMEX))
    assert domain.note == (f"fabric handles are refused on rank 5 (host host1: {NO_IMEX}; and on ranks [9]): the "
                           "NVLink domain is limited to the host, not the GPU fabric's clique (72 ranks of this group)")
    mixed = decide_domain(_cliques([4]) + _hosts(8, 4)[4:])
    assert mixed.note is None  # nothing was lost: the clique lies within one host
    mixed = decide_domain([dataclasses.replace(p, cluster="") if r >= 8 else p for r, p in enumerate(_cliques([16]))])
    assert mixed.ranks_per_node == 4 and "ranks [8, 9, 10, 11, 12, 13, 14, 15] report no GPU fabric" in mixed.note
    assert decide_domain(_cliques([72])).note is None


def test_the_largest_domain_and_what_refusals_suggest():
    assert MAX_DOMAIN_RANKS == 72
    assert decide_domain(_cliques([72]), 72).ranks_per_node == 72
    with pytest.raises(ValueError, match=r"ranks_per_node=73: an NVLink domain holds at most 72 ranks"):
        decide_domain(_hosts(146, 146), 73)
    with pytest.raises(ValueError, match=r"this group: 4;"):  # the largest value that works: the hosts
        decide_domain(_cliques([36, 4]))
    for bad in (3, 0, True, 2.0):  # not a divisor or not an int: BufferConfig refuses them by name
        assert decide_domain(_cliques([8]), bad).ranks_per_node is bad


def test_launcher_nodes_and_host_names_both_separate_hosts():
    # Two "nodes" of one machine (LOCAL_WORLD_SIZE=2), and two machines that LOCAL_WORLD_SIZE would join.
    assert decide_domain([Place("m", r // 2) for r in range(4)]).ranks_per_node == 2
    assert decide_domain([Place(f"m{r // 2}", 0) for r in range(4)]).ranks_per_node == 2
    with pytest.raises(ValueError, match=r"host of each \(host name and launcher node from LOCAL_WORLD_SIZE=4\)"):
        decide_domain([Place(f"m{r % 2}", 0) for r in range(4)], local_world_size=4)


class _FakeNvml:
    """pynvml as far as fabric_clique calls it: one GPU in a clique, or one without a fabric."""

    NVML_SUCCESS, NVML_GPU_FABRIC_STATE_COMPLETED = 0, 3

    def __init__(self, cluster: bytes, clique: int, state: int = 3):
        self.cluster, self.cliqueid, self.state = cluster, clique, state
        self.calls: list[str] = []

    class c_nvmlGpuFabricInfo_t(ctypes.Structure):
        _fields_ = [("clusterUuid", ctypes.c_uint8 * 16), ("status", ctypes.c_int), ("cliqueId", ctypes.c_uint32),
                    ("state", ctypes.c_uint)]

    c_nvmlGpuFabricInfoV_t = c_nvmlGpuFabricInfo_t

    def nvmlInit(self):
        self.calls.append("init")

    def nvmlShutdown(self):
        self.calls.append("shutdown")

    def nvmlDeviceGetHandleByUUID(self, uuid):
        self.calls.append(uuid)
        return 7

    def _fill(self, handle, ref):
        info = ref._obj
        info.clusterUuid[:] = list(self.cluster)
        info.status, info.cliqueId, info.state = 0, self.cliqueid, self.state

    def nvmlDeviceGetGpuFabricInfo(self, handle, ref):
        self.calls.append("unversioned")
        self._fill(handle, ref)

    def nvmlDeviceGetGpuFabricInfoV(self, handle, ref):
        self.calls.append("versioned")
        self._fill(handle, ref)


class _OldNvml(_FakeNvml):
    """A pynvml from before the versioned call."""

    @property
    def nvmlDeviceGetGpuFabricInfoV(self):
        raise AttributeError("nvmlDeviceGetGpuFabricInfoV")


def test_fabric_clique_reads_nvml_and_falls_back_cleanly(monkeypatch):
    import sys

    class Props:
        uuid = "1234"

    monkeypatch.setattr(topology.torch.cuda, "get_device_properties", lambda i: Props())
    nvml = _FakeNvml(bytes(range(1, 17)), 5)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    assert topology.fabric_clique(0) == (bytes(range(1, 17)).hex(), 5, "")
    assert nvml.calls == ["init", "GPU-1234", "versioned", "shutdown"]
    assert topology.fabric_clique(0)[0] != "" and topology.fabric_clique(None) == ("", 0, "no CUDA device")
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(bytes(16), 0))  # a GPU outside a multi-node fabric
    assert topology.fabric_clique(0) == ("", 0, "no fabric cluster")
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(bytes(range(16)), 1, state=2))  # still registering
    assert topology.fabric_clique(0) == ("", 0, "fabric state 2, status 0")
    old = _OldNvml(bytes(range(1, 17)), 2)
    monkeypatch.setitem(sys.modules, "pynvml", old)
    assert topology.fabric_clique(0)[1] == 2 and "unversioned" in old.calls
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed
    assert topology.fabric_clique(0) == ("", 0, "pynvml (nvidia-ml-py) is not installed")


def test_group_domain_gathers_once_and_logs_a_refusal_once(single_rank_group, monkeypatch, caplog):
    place = dataclasses.replace(_cliques([8])[0], fabric=NO_IMEX)
    monkeypatch.setattr(topology, "local_place", lambda rank: place)
    gathers = []
    real = topology.dist.all_gather_object
    monkeypatch.setattr(topology.dist, "all_gather_object", lambda *a, **k: (gathers.append(1), real(*a, **k)))
    monkeypatch.setattr(logs, "_said", set())
    with caplog.at_level("INFO", logger="hybrid_ep"):
        assert topology.group_domain(single_rank_group).ranks_per_node == 1
        assert topology.group_ranks_per_node(single_rank_group) == 1
    assert len(gathers) == 2  # one per buffer made
    assert caplog.text.count("hybrid_ep: ") == 0  # one member: no clique across hosts, nothing lost
    places = _refused(_cliques([8]), 1, NO_IMEX)
    monkeypatch.setattr(topology, "decide_domain", lambda got, requested, **kw: decide_domain(places, requested))
    with caplog.at_level("INFO", logger="hybrid_ep"):
        for _ in range(3):
            assert topology.group_ranks_per_node(single_rank_group) == 4
    assert caplog.text.count("fabric handles are refused on rank 1") == 1
    assert topology.TROUBLESHOOTING in caplog.text


def test_this_process_without_a_gpu_has_no_fabric(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setattr(topology.torch.cuda, "is_available", lambda: False)
    place = topology.local_place(9)
    assert (place.node, place.cluster, place.fabric, place.no_clique) == (2, "", None, "no CUDA device")
    assert place.host == topology.this_host()


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
