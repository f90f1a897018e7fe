"""NaN or inf in a routing weight or in a token's values on the cuda backend (the CPU model, two
ranks): taken as given (the kernels check ids, not values), carried to that token's rows and
combined sum only: every other token's outputs are those of the same call with finite inputs,
bit for bit, as on the reference backend (tests/unit/hybrid_ep/test_nonfinite_routing.py)."""

from __future__ import annotations

import pytest
import torch

from hybrid_ep.backends.cuda.emulation import EmulatedGroup

pytestmark = pytest.mark.model

W, H, E, T, K = 2, 128, 8, 8, 2
BAD_WEIGHTS, BAD_X = (2, 5), 4  # on rank 1: token 2 a NaN weight, token 5 an inf weight, token 4 a NaN value


@pytest.mark.parametrize("path", ["direct", "receive"])
def test_a_non_finite_weight_or_value_reaches_only_its_token(path):
    group = EmulatedGroup(W, H, T, E, num_sms_dispatch=1, num_sms_combine=1, device="cpu", data_path=path)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=gen) for _ in range(W)]
    idx = [torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)]) for _ in range(W)]
    weights = [torch.rand(T, K, generator=gen) for _ in range(W)]
    bad_x, bad_w = [x.clone() for x in xs], [w.clone() for w in weights]
    bad_w[1][BAD_WEIGHTS[0], 0], bad_w[1][BAD_WEIGHTS[1], 1] = float("nan"), float("inf")
    bad_x[1][BAD_X, 7] = float("nan")

    def call(x, w):
        res = group.dispatch(x, idx, w)
        ys = group.combine([r.tokens * 2 for r in res], [r.handle for r in res], apply_probs=True)
        return [r.probs for r in res], ys

    try:
        probs, ys = call(xs, weights)
        bad_probs, bad_ys = call(bad_x, bad_w)
    finally:
        group.close()
    assert sum(int((~torch.isfinite(p)).sum()) for p in bad_probs) == 2
    assert all(torch.isfinite(p).all() for p in probs)
    bad = sorted((*BAD_WEIGHTS, BAD_X))
    assert [t for t in range(T) if not torch.isfinite(bad_ys[1][t]).all()] == bad
    good = [t for t in range(T) if t not in bad]
    assert torch.equal(bad_ys[1][good], ys[1][good]) and torch.equal(bad_ys[0], ys[0])
