"""One rule per limit on every backend (hybrid_ep/limits.py): top-k, experts and the group's size
refused alike by the reference backend and the cuda backend, with the same words; the numbers
are csrc's."""

from __future__ import annotations

import pytest
import torch

import hybrid_ep as hep
from hybrid_ep import limits
from hybrid_ep.backends.cuda.layout import check_geometry
from hybrid_ep.config import BufferConfig
from hybrid_ep.routing import normalize_routing

pytestmark = pytest.mark.unit

H = 128


def _refusal(call) -> str:
    with pytest.raises(ValueError) as err:
        call()
    return str(err.value)


def test_the_limits_are_the_compiled_modules():
    assert (limits.MAX_TOPK, limits.MAX_EXPERTS, limits.MAX_DOMAIN_RANKS) == (16, 1024, 72)
    assert limits.MAX_TOPK == limits.compiled.MAX_TOPK and limits.MAX_RANKS == limits.compiled.MAX_RANKS


def test_topk_past_the_limit_is_refused_by_the_reference_backend_as_by_the_cuda_one(single_rank_group):
    E, T = 32, 4
    buf = hep.HybridEPBuffer(single_rank_group, H, 8, E, backend="reference")
    x = torch.randn(T, H)
    idx = torch.stack([torch.randperm(E)[:17] for _ in range(T)])
    words = "topk_idx has 17 routes per token; a token may have at most 16"
    assert _refusal(lambda: buf.dispatch(x, topk_idx=idx, topk_weights=torch.rand(T, 17))) == words
    # the cuda backend's path: the same normalisation (the emulation's and one process per GPU)
    assert _refusal(lambda: normalize_routing(T, E, x.device, topk_idx=idx, check_values=False)) == words
    buf.dispatch(x, topk_idx=idx[:, :16], topk_weights=torch.rand(T, 16))  # 16 routes: taken
    routing_map = torch.zeros(T, E, dtype=torch.bool)
    routing_map[:, :2] = True
    routing_map[3, :17] = True
    assert _refusal(lambda: buf.dispatch(x, routing_map=routing_map, probs=torch.rand(T, E))) == (
        "routing_map routes token 3 to 17 experts; a token may have at most 16")


@pytest.mark.parametrize("shape, words", [
    (dict(num_experts=1088), "num_experts must be <= 1024, got 1088"),
    (dict(num_experts=578, world_size=289, ranks_per_node=1),
     "world_size: hybrid_ep supports EP groups of up to 288 ranks, got 289"),
    (dict(world_size=144, ranks_per_node=144), "ranks_per_node must be <= 72 (the ranks of one NVLink domain, GB200 "
                                               "NVL72), got 144"),
    (dict(world_size=256, ranks_per_node=1), "ranks_per_node=1 makes 256 nodes of the 256 ranks; hybrid_ep "
                                             "supports up to 128: pass a larger ranks_per_node"),
])
def test_a_group_past_a_limit_is_refused_alike_by_both_backends(single_rank_group, monkeypatch, shape, words):
    fields = dict(hidden_dim=H, max_tokens_per_rank=8, num_experts=2 * shape.get("world_size", 1), world_size=1,
                  ranks_per_node=1) | shape
    config = BufferConfig(**fields).validate()
    assert _refusal(lambda: check_geometry(config, inter_node=True)) == words
    from hybrid_ep.backends.reference import ReferenceBackend

    assert _refusal(lambda: ReferenceBackend(config, single_rank_group, 0, 0)) == words
