"""The hierarchical (several-node) path of the cuda kernels on the CPU model, against the oracle.

W = N x G virtual ranks: NVLink peer tables reach only a rank's own node (the others are
null, so a kernel that wrote across nodes directly would fault), and everything between
nodes goes through the loopback transport, which the kernels use exactly where a cluster
uses NVSHMEM. Every rank's dispatch must equal the oracle bitwise, its combine must be
within the bound of the hierarchy's roundings (rank partial, node partial), and what each
rank forwarded must equal the forward plan and the traffic model's RDMA rows
(harness.emulated.check_forwarding).
"""

from __future__ import annotations

import dataclasses
import importlib
import re

import pytest
import torch

from harness.emulated import GroupCache, buffer_key, check_emulated, check_emulated_autograd
from harness.faults import ranks_absent
from harness.hierarchy_cases import feature_cases, hierarchy_case, topology_cases
from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.backends.cuda.layout import CHUNK_TOKENS
from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.verify.cases import Case

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

MODEL_SMS = 2
_cached = GroupCache("cpu")


PATHS = ("direct", "receive")  # launch.DATA_PATHS: both serve several nodes


def group_for(case: Case, sms: int = MODEL_SMS, path: str | None = None) -> EmulatedGroup:
    return _cached(case, num_sms_dispatch=sms, num_sms_combine=sms, data_path=path)


def _case(N, G, **kw):
    return hierarchy_case(N, G, **kw)


def _oracle_cases() -> list:
    """Every topology and feature case; the two widest, 3 and 4 nodes of 4 ranks (12 and 16
    ranks, about a fifth of the matrix's time), in the full tier: 3 and 4 nodes are in CI's tier
    with 1 and 2 ranks a node, and nodes of 4 ranks with 2 nodes."""
    wide = {(3, 4), (4, 4)}
    return [pytest.param(c, id=str(c), marks=pytest.mark.slow if (c.world_size // c.ranks_per_node,
                                                                  c.ranks_per_node) in wide else ())
            for c in topology_cases()] + [pytest.param(c, id=str(c)) for c in feature_cases()]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", _oracle_cases())
def test_hierarchical_kernels_match_the_oracle(case, path):
    model.set_seed(case.world_size)
    res = check_emulated(group_for(case, path=path), case)
    assert {r.handle.data_path for r in res} == {path}


def _two_slot_cases() -> list:
    """The oracle's cases again, on rings of 2 slots. CI's tier takes the shapes where the
    rings wrap most or differently (a node of 1 rank and 4 nodes only in the full tier, and of
    the features: fp8, one expert, dropped routes, static overflow, several chunks per source);
    each of the others runs on the default rings above in every tier."""
    topology = [pytest.param(c, id=str(c), marks=() if (c.world_size // c.ranks_per_node, c.ranks_per_node)
                             in {(2, 2), (3, 2), (2, 4)} else pytest.mark.slow) for c in topology_cases()]
    features = [pytest.param(c, id=str(c), marks=() if _wraps_rings_its_own_way(c) else pytest.mark.slow)
                for c in feature_cases()]
    return topology + features


def _wraps_rings_its_own_way(c: Case) -> bool:
    """The feature cases CI's tier runs on two-slot rings: fp8 rows with their scales, every token
    on one expert, dropped routes, a static size that overflows (bf16; fp8's is the full tier's),
    several chunks per source."""
    overflows = c.num_out_tokens is not None and c.num_out_tokens < sum(c.tokens)
    fp8 = c.dtype == FP8_DTYPE
    return ((fp8 and c.num_out_tokens is None) or c.routing == "one-expert" or c.drop_fraction > 0
            or (overflows and not fp8) or max(c.tokens) > 4 * CHUNK_TOKENS)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", _two_slot_cases())
def test_hierarchical_kernels_on_two_slot_rings(case, path):
    """The same cases with the rings at their fewest slots (ring_chunks=2)."""
    model.set_seed(case.world_size + 1)
    group = _cached(case, num_sms_dispatch=MODEL_SMS, num_sms_combine=MODEL_SMS, ring_chunks=2, data_path=path)
    check_emulated(group, dataclasses.replace(case, seed=case.world_size + 1))


def test_a_second_schedule_seed_gives_the_same_results():
    case = _case(3, 2, topk=6)
    model.set_seed(7)
    check_emulated(group_for(case), dataclasses.replace(case, seed=7))


def test_back_to_back_calls_across_nodes():
    """Flow control between nodes (rail peers' done flags, count rows by call parity) over
    many calls on one buffer, with other routings, token counts and dtypes every call."""
    first = _case(2, 2, tokens=(64, 0, 0, 33))
    group = group_for(first)
    dtypes = (torch.bfloat16, torch.float32, FP8_DTYPE, torch.float16)
    for call in range(12):
        case = _case(2, 2, seed=call, dtype=dtypes[call % 4], topk=2 + call % 3,
                     tokens=(64, (17 * call) % 65, call % 3, 33), drop_fraction=0.25 * (call % 2))
        assert buffer_key(case) == buffer_key(first)
        model.set_seed(call)
        check_emulated(group, case)
    assert group_for(first) is group


def test_autograd_across_nodes():
    case = _case(2, 2, dtype=torch.float32, topk=3, tokens=(17, 5, 0, 33))
    check_emulated_autograd(group_for(case), case)


def _inputs(W, T=16, E=8, H=128, K=2):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=gen).to(torch.bfloat16) for _ in range(W)]
    idx = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) for _ in range(W)]
    return xs, idx


@pytest.mark.parametrize("path", PATHS)
def test_a_missing_node_times_out_in_dispatch_naming_the_node(monkeypatch, path):
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    group = EmulatedGroup(4, 128, 16, 8, num_sms_dispatch=2, num_sms_combine=2, device="cpu", ranks_per_node=2,
                          data_path=path)
    try:
        xs, idx = _inputs(4)
        with ranks_absent(group, {2, 3}):
            group.dispatch(xs, idx, num_out_tokens=64)
        with pytest.raises(RuntimeError, match=r"rank [01] gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for "
                                               r"peer rank [23] on node 1 in inter-node count exchange \(call 1,"):
            group.synchronize()
    finally:
        group.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_node_missing_from_the_combine_times_out_naming_it(monkeypatch, path):
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    group = EmulatedGroup(4, 128, 16, 8, num_sms_dispatch=2, num_sms_combine=2, device="cpu", ranks_per_node=2,
                          data_path=path)
    try:
        xs, idx = _inputs(4)
        res = group.dispatch(xs, idx, num_out_tokens=64)
        group.synchronize()
        outs = [r.tokens for r in res]
        with ranks_absent(group, {2, 3}):
            group.combine(outs, [r.handle for r in res])
        with pytest.raises(RuntimeError, match=r"rank [01] gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for "
                                               r"peer rank [23] on node 1 in combine node partials"):
            group.synchronize()
    finally:
        group.close()


def _forwarded_combine(held_rank: int, absent=()):
    """The receive path's forwarder (combine_receive.cuh's put ring). Two nodes of one rank; rank 0's 256
    tokens all go to rank 1's experts, so rank 1 forwards 8 chunks of node partials back to
    rank 0 in the combine, more than its put ring holds (kPutStages, 4); rank 1 has no tokens.
    The combine runs with the loopback puts of `held_rank` stalled (model.hold_at) and the
    ranks `absent` missing. Returns the error the group raised (None), the virtual time the
    combine took, and rank 0's x and y."""
    group = EmulatedGroup(2, 128, 256, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu", ranks_per_node=1,
                          data_path="receive")
    try:
        xs = [torch.randn(256, 128).to(torch.bfloat16), torch.zeros(0, 128, dtype=torch.bfloat16)]
        idx = [torch.tensor([[2, 3]] * 256), torch.zeros(0, 2, dtype=torch.int64)]
        res = group.dispatch(xs, idx, num_out_tokens=512)
        group.synchronize()
        model.hold_at(held_rank, "combine_receive")
        before = model.stats()["virtual_ns"]
        with ranks_absent(group, absent):
            ys = group.combine([r.tokens for r in res], [r.handle for r in res])
        took_s = (model.stats()["virtual_ns"] - before) / 1e9
        try:
            group.synchronize()
        except RuntimeError as err:
            return str(err), took_s, xs[0], None
        return None, took_s, xs[0], ys[0]
    finally:
        group.close()


def test_a_stalled_forwarder_put_is_reported_by_the_source_it_starves(monkeypatch):
    """Rank 1's put warp stalls at its first put: its reducers fill the put ring and wait on it,
    and rank 0, whose node partials never come, gives up within HYBRID_EP_TIMEOUT_S naming
    rank 1; every wait of both ranks then returns (no hang)."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    message, took_s, _, _ = _forwarded_combine(held_rank=1)
    assert re.search(r"rank 0 gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting for peer rank 1 on node 1 in "
                     r"combine node partials \(waiting for the rail peer on that node in the node-partial ring, by "
                     r"RDMA; expected and saw are slot tags, as for dispatch_rows\) \(call 1,",
                     message or ""), message
    assert 1.0 <= took_s < 2.0, took_s


def test_the_forwarders_put_ring_times_out_on_its_own(monkeypatch):
    """The same stall with the source rank absent, so that no other wait runs out first: a
    pipeline record (twice the bound: state.cuh, mbar_wait) names the ring whose free stage
    never came and what stopped freeing it, and the launch ends. The reducers wait for a free
    stage of the put ring, whose consumer is the stalled put warp; the source load warp waits
    for a free stage of the source ring, whose consumers are those reducers. Which of the two
    began first, and so runs out first, depends on the schedule (seeds 0-7: the put ring at
    2.02 s in six, the source ring at 2.01 s in two); the record is one of the two, never a
    wait for data and never a peer."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    message, took_s, _, _ = _forwarded_combine(held_rank=1, absent={0})
    assert re.search(r"rank 1 gave up after 1 s \(HYBRID_EP_TIMEOUT_S\) waiting in its shared-memory pipeline "
                     r"for a free stage of (the combine's forward-put ring \(call 1\): the warp putting node "
                     r"partials to other nodes|the combine's source ring \(call 1\): the source's reducers) "
                     r"stopped making progress", message or ""), message
    assert 2.0 <= took_s < 3.0, took_s


def test_the_forwarder_puts_without_a_stall(monkeypatch):
    """The two tests above with nothing held (key -1 holds nowhere): the combine
    completes at once with each token's two routes summed, 2 x, exactly (one bf16 rounding of
    an exact sum per hop)."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    message, took_s, x, y = _forwarded_combine(held_rank=-1)
    assert message is None and took_s < 0.5, (message, took_s)
    assert torch.equal(y, 2 * x) and float(x.abs().sum()) > 0


def test_a_production_group_of_several_nodes_needs_the_transport():
    from hybrid_ep.backends.cuda.layout import check_geometry
    from hybrid_ep.config import BufferConfig

    config = BufferConfig(128, 16, 8, 4, 2).validate()
    with pytest.raises(ValueError, match="ranks_per_node=2 < world size 4 needs the cuda backend's inter-node "
                                         "transport"):
        check_geometry(config)
    check_geometry(config, inter_node=True)
