"""fp8 on the wire through the cuda kernels on the CPU model: bf16 tokens quantized by the
blockwise rule (megatron_patches.wire_fp8's quantizer without Transformer Engine), dispatched,
and an output gradient quantized alike and dispatched with the same handles (the combine's
backward in fp8); every rank's fp8 rows and scales equal the oracle's bit for bit."""

from __future__ import annotations

import pytest
import torch

from harness.emulated import emulated_group_for
from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.verify.cases import Case, make_rank_inputs
from hybrid_ep.verify.oracle import dispatch_oracle
from megatron_patches.wire_fp8 import BlockwiseQuantizer

pytestmark = pytest.mark.model

CASES = [
    # 2 nodes x 2, odd and zero token counts
    Case(4, 2, 8, 256, (17, 0, 5, 33), 3, torch.bfloat16, backend="cuda", seed=1),
    # one node, a static size that drops rows
    Case(2, 2, 4, 128, (9, 4), 2, torch.bfloat16, backend="cuda", num_out_tokens=6, seed=2),
]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_blockwise_rows_and_gradient_dispatch_on_the_model(case):
    quantizer = BlockwiseQuantizer(use_te=False)
    inputs = make_rank_inputs(case)
    idx = [i["topk_idx"] for i in inputs]
    weights = [i["topk_weights"] for i in inputs]
    wire = [quantizer(i["x"]) for i in inputs]
    gen = torch.Generator().manual_seed(case.seed + 5)
    grads = [quantizer(torch.randn(i["x"].shape, generator=gen).to(torch.bfloat16)) for i in inputs]
    group = emulated_group_for(case, "cpu", num_sms_dispatch=2, num_sms_combine=2)
    try:
        res = group.dispatch([q for q, _ in wire], idx, weights, scales=[s for _, s in wire],
                             num_out_tokens=case.num_out_tokens)
        back = group.redispatch([q for q, _ in grads], [r.handle for r in res], scales=[s for _, s in grads])
        group.synchronize()
    finally:
        group.close()
    for got, sent in ((res, wire), (back, grads)):
        run = dispatch_oracle(case.config, [q for q, _ in sent], idx, weights, [s for _, s in sent],
                              case.num_out_tokens)
        for r, want in enumerate(run.ranks):
            assert got[r].tokens.dtype == FP8_DTYPE
            assert _same(got[r].tokens, want.tokens), f"{case} rank {r}: rows"
            assert _same(got[r].scales, want.scales), f"{case} rank {r}: scales"
    assert any(int(r.handle.num_dropped) > 0 for r in res) == (case.num_out_tokens is not None)
