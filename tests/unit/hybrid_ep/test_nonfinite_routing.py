"""NaN or inf in a routing weight (topk_weights, or Megatron's probs) or in a token's values, on
the reference backend: taken as given (nothing reads values to check them), carried to that
token's rows and combined sum only: every other token's outputs are those of the same call with
finite inputs, bit for bit. tests/model/test_nonfinite_routing_model.py shows the same on the
cuda backend (docs/architecture.md, Errors)."""

from __future__ import annotations

import pytest
import torch

import hybrid_ep as hep

pytestmark = pytest.mark.unit

H, E, T, K = 128, 8, 8, 2
BAD_WEIGHTS, BAD_X = (2, 5), 4  # token 2: a NaN weight, token 5: an inf weight, token 4: a NaN value


def _call(buf, x, idx, weights=None, routing_map=None, probs=None):
    res = buf.dispatch(x, topk_idx=idx, topk_weights=weights, routing_map=routing_map, probs=probs)
    return res.probs, buf.combine(res.tokens * 2, res.handle, apply_probs=True)


def test_a_non_finite_weight_or_value_reaches_only_its_token(single_rank_group):
    buf = hep.HybridEPBuffer(single_rank_group, H, T, E, backend="reference")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(T, H, generator=gen)
    idx = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
    weights = torch.rand(T, K, generator=gen)
    bad_w, bad_x = weights.clone(), x.clone()
    bad_w[BAD_WEIGHTS[0], 0], bad_w[BAD_WEIGHTS[1], 1] = float("nan"), float("inf")
    bad_x[BAD_X, 7] = float("nan")
    probs, y = _call(buf, x, idx, weights)
    bad_probs, bad_y = _call(buf, bad_x, idx, bad_w)
    assert int((~torch.isfinite(bad_probs)).sum()) == 2 and torch.isfinite(probs).all()
    bad = sorted((*BAD_WEIGHTS, BAD_X))
    assert [t for t in range(T) if not torch.isfinite(bad_y[t]).all()] == bad
    good = [t for t in range(T) if t not in bad]
    assert torch.equal(bad_y[good], y[good])
    # Megatron's form: probs [T, E] with a NaN where token 2 is routed
    routing_map = torch.zeros(T, E, dtype=torch.bool).scatter_(1, idx, True)
    full = torch.rand(T, E, generator=gen)
    bad_full = full.clone()
    bad_full[BAD_WEIGHTS[0], idx[BAD_WEIGHTS[0], 0]] = float("nan")
    _, y = _call(buf, x, None, routing_map=routing_map, probs=full)
    _, bad_y = _call(buf, x, None, routing_map=routing_map, probs=bad_full)
    assert [t for t in range(T) if not torch.isfinite(bad_y[t]).all()] == [BAD_WEIGHTS[0]]
    assert torch.equal(bad_y[[t for t in range(T) if t != BAD_WEIGHTS[0]]],
                       y[[t for t in range(T) if t != BAD_WEIGHTS[0]]])
