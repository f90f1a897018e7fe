"""NVLink domains of 36 ranks on the CPU model: the kernels of a GB200 NVL36 domain (G = 36) and
of two such domains (W = 72, past the count kernel's first window of 64 ranks), against the
oracle.

One domain holds 36 writers per reader, past the 8 that keep ring_chunks slots each
(csrc/bindings/buffer_layout.h), so its receive and partial rings run at the 2-slot floor here
and turn over many times; the direct path stores every route straight into its final row at one
of 36 ranks. Each case is the seed shape's routing at 36 or 72 virtual ranks with odd token
counts, a rank without tokens and chunks that cross.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from harness.emulated import GroupCache, check_emulated
from harness.hierarchy_cases import hierarchy_case
from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.backends.cuda.layout import (
    MAX_DOMAIN_RANKS,
    MAX_LAUNCH_RANKS,
    MAX_NODES,
    MAX_RANKS,
    check_geometry,
    registered_layout,
)
from hybrid_ep.config import BufferConfig
from hybrid_ep.topology import MAX_DOMAIN_RANKS as TOPOLOGY_DOMAIN_RANKS

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")
_cached = GroupCache("cpu")
TOKENS = (17, 0, 40, 1, 33, 64, 5, 9)  # odd, zero, chunk-crossing


def _case(N: int, G: int, **kw):
    tokens = tuple(TOKENS[r % len(TOKENS)] for r in range(N * G))
    return hierarchy_case(N, G, tokens=tokens, num_experts=2 * N * G, topk=8, **kw)


def _run(case, data_path: str):
    group = _cached(case, num_sms_dispatch=1, num_sms_combine=1, data_path=data_path)
    model.set_seed(case.world_size)
    res = check_emulated(group, case)
    assert {r.handle.data_path for r in res} == {data_path}
    return group


def test_one_domain_of_36_ranks_on_the_direct_path_matches_the_oracle():
    """36 ranks in one NVLink domain, the direct path: every route stored into its row at one of
    36 ranks, every combine read from there; the launch's ranks past the 16 its parameters hold
    are read from device memory (LaunchArgs::more_ranks)."""
    group = _run(_case(1, 36), "direct")
    assert group.config.ranks_per_node == 36 and group.config.num_nodes == 1
    assert registered_layout(group.config).recv.slots == 2  # 8 x 8 slots shared by 36 writers, at the floor


def test_a_launch_past_its_inline_ranks_reads_the_rest_from_device_memory():
    """2 domains of 9, 18 ranks in one emulated launch, whose parameters hold 16 ranks
    (kInlineLaunchRanks): ranks 16 and 17, on the second domain, run from the copy in device memory
    and forward and receive through their rail peers. Each launch copies them into a block of its
    own, given back when it ends (on a GPU: on the launch's stream), so no launch reads another's."""
    blocks, launches = model.more_ranks_blocks(), model.stats()["launches"]
    _run(_case(2, 9), "direct")
    made = model.more_ranks_blocks()["made"] - blocks["made"]
    assert made == model.stats()["launches"] - launches >= 4  # count, dispatch, combine, redispatch
    assert model.more_ranks_blocks()["live"] == 0


@pytest.mark.slow
def test_one_domain_of_36_ranks_on_the_receive_path_turns_its_2_slot_rings():
    """The receive path at 36 writers per reader: rings of 2 slots (a writer's share of 8 x 8),
    every source's rows through them, fp32 rows and probs applied."""
    case = _case(1, 36, dtype=torch.float32, apply_probs=True)
    reg = registered_layout(_run(case, "receive").config)
    assert (reg.recv.rings, reg.recv.slots) == (36, 2) and (reg.partial.rings, reg.partial.slots) == (36, 2)


@pytest.mark.slow
@pytest.mark.parametrize("data_path", ["direct", "receive"])
def test_two_domains_of_36_ranks_match_the_oracle(data_path):
    """W = 72 as 2 domains of 36: rail peers forward through the RDMA rings (loopback), and the
    count kernel counts the ranks past 64 in its second window."""
    _run(_case(2, 36), data_path)


def test_limits_name_the_argument_past_them():
    """The ranks one domain, one group and one emulated launch hold, each refused by name past its
    limit; the domain's limit is topology's (GB200 NVL72)."""
    assert (MAX_DOMAIN_RANKS, MAX_LAUNCH_RANKS) == (TOPOLOGY_DOMAIN_RANKS, 72) and MAX_RANKS >= 288
    with pytest.raises(ValueError, match=r"ranks_per_node must be <= 72 .* got 144"):
        check_geometry(BufferConfig(128, 8, 144, 144, 144).validate())
    with pytest.raises(ValueError, match=r"world_size must be in \[1, 72\] for emulation, got 73"):
        EmulatedGroup(73, 128, 8, 73, device="cpu")
    with pytest.raises(ValueError, match=rf"world_size: .* up to {MAX_RANKS} ranks, got {MAX_RANKS + 1}"):
        check_geometry(BufferConfig(128, 8, MAX_RANKS + 1, MAX_RANKS + 1, 1).validate(), inter_node=True)
    with pytest.raises(ValueError, match=rf"ranks_per_node=1 makes 256 nodes .* up to {MAX_NODES}"):
        check_geometry(BufferConfig(128, 8, 256, 256, 1).validate(), inter_node=True)
    check_geometry(BufferConfig(7168, 4096, 288, 288, 72).validate(), inter_node=True)  # 4 domains of 72
