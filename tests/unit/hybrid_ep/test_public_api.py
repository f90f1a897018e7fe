"""The public API of docs/architecture.md, and what each call reports."""

from __future__ import annotations

import inspect

import pytest
import torch

import hybrid_ep as hep

pytestmark = pytest.mark.unit


def test_names_and_signatures():
    for name in ("HybridEPBuffer", "dispatch", "combine", "DispatchResult", "DispatchHandle", "MemoryPlan"):
        assert hasattr(hep, name), name
    init = inspect.signature(hep.HybridEPBuffer.__init__).parameters
    assert list(init)[:5] == ["self", "group", "hidden_dim", "max_tokens_per_rank", "num_experts"]
    for kw in ("ranks_per_node", "backend", "pad_multiple", "num_sms_dispatch", "num_sms_combine"):
        assert init[kw].kind is inspect.Parameter.KEYWORD_ONLY, kw
    d = inspect.signature(hep.HybridEPBuffer.dispatch).parameters
    assert list(d)[:4] == ["self", "x", "topk_idx", "topk_weights"]
    for kw in ("scales", "handle", "num_out_tokens", "routing_map", "probs"):
        assert d[kw].kind is inspect.Parameter.KEYWORD_ONLY, kw
    c = inspect.signature(hep.HybridEPBuffer.combine).parameters
    assert list(c)[:3] == ["self", "expert_out", "handle"] and c["apply_probs"].default is False


def test_megatron_patches_importable_without_megatron():
    import megatron_patches

    assert callable(megatron_patches.apply)


def test_result_fields_memory_plan_and_traffic(single_rank_group):
    buf = hep.HybridEPBuffer(single_rank_group, 128, 64, 4, backend="reference", pad_multiple=8)
    assert buf.backend == "reference"
    plan = buf.memory_plan()
    assert plan.registered_bytes == 0  # the reference backend registers nothing
    assert plan.as_dict()["recv_rows"] == 1 * 64 * (128 * 4 + 5 * 4)
    assert "per call" in str(plan)
    x = torch.randn(10, 128, dtype=torch.bfloat16)
    idx = torch.tensor([[i % 4, (i + 1) % 4] for i in range(10)])
    res = buf.dispatch(x, idx, torch.full((10, 2), 0.5), num_sms=4)
    # 4 local experts with 5 rows each, padded to 8.
    assert res.tokens.shape == (32, 128) and res.tokens.dtype == torch.bfloat16
    assert res.tokens_per_expert.tolist() == [8, 8, 8, 8]
    assert res.probs.dtype == torch.float32 and res.scales is None
    t = buf.last_traffic
    assert (t.op, t.rows, t.row_bytes, t.nvlink_bytes, t.rdma_bytes) == ("dispatch", 10, 256, 0, 0)
    y = buf.combine(res.tokens, res.handle, num_sms=2)
    assert torch.equal(y, (x.float() * 2).to(torch.bfloat16))  # each token came back from two experts
    assert (buf.last_traffic.op, buf.last_traffic.row_bytes) == ("combine", 256)  # partials in bf16
    y32 = buf.combine(res.tokens, res.handle, wire_dtype=torch.float32)
    assert torch.equal(y32, y)  # two exact bf16 terms: either wire gives the same sum
    assert buf.last_traffic.row_bytes == 512  # twice the bytes on the wire


def test_expert_out_view_is_a_tensor_the_combine_takes(single_rank_group):
    """Where the backend cannot read its own memory in place (here: the reference backend), the
    view is a plain [rows, hidden] tensor of bf16 (or the dtype asked), not in peer memory; a
    combine reads it as any expert_out. A handle of another buffer is refused."""
    buf = hep.HybridEPBuffer(single_rank_group, 128, 64, 4, backend="reference")
    x = torch.randn(10, 128, dtype=torch.bfloat16)
    idx = torch.tensor([[i % 4, (i + 1) % 4] for i in range(10)])
    res = buf.dispatch(x, idx, torch.full((10, 2), 0.5))
    out = buf.expert_out_view(res.handle)
    assert out.shape == res.tokens.shape == (20, 128) and out.dtype == torch.bfloat16
    assert not buf.is_in_peer_memory(out) and not buf.is_in_peer_memory(res.tokens)
    assert buf.expert_out_view(res.handle, 64, torch.float32).shape == (20, 64)
    out.copy_(res.tokens * 3)
    assert torch.equal(buf.combine(out, res.handle), (x.float() * 6).to(torch.bfloat16))
    other = hep.HybridEPBuffer(single_rank_group, 128, 64, 4, backend="reference")
    with pytest.raises(ValueError, match="handle"):
        other.expert_out_view(res.handle)


def test_arena_bytes_is_the_deprecated_name_of_peer_memory_bytes(single_rank_group):
    """peer_memory_bytes is peer memory's initial size; arena_bytes, its former name, still sets
    it with a DeprecationWarning, and both at once is an error naming them."""
    with pytest.warns(DeprecationWarning, match="peer_memory_bytes"):
        buf = hep.HybridEPBuffer(single_rank_group, 128, 64, 4, backend="reference", arena_bytes=4096)
    assert buf.config.peer_memory_bytes == 4096
    with pytest.warns(DeprecationWarning, match="peer_memory_bytes"):
        assert buf.config.arena_bytes == 4096
    with pytest.raises(ValueError, match="pass peer_memory_bytes only: arena_bytes"):
        hep.HybridEPBuffer(single_rank_group, 128, 64, 4, backend="reference", peer_memory_bytes=1, arena_bytes=1)
