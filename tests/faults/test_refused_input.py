"""Bad input on one rank only: that rank still makes the call's exchange, with a refusal in it,
so every rank raises the same InputRefused naming the rank and the argument at once (it waited
the whole HYBRID_EP_TIMEOUT_S, and the group was unusable afterwards), and the next call works.

The reference backend on gloo ranks (its message headers carry the refusal); the cuda kernels on
the CPU model, where the count kernel's exchange carries it (one launch of every virtual rank,
the refusing one with no tokens, as a process per GPU makes it)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybrid_ep.refusals import InputRefused, code_of
from hybrid_ep.spawn import ProcessGroupPool
from hybrid_ep.testing.cases import Case, Expected
from hybrid_ep.testing.emulated import check_emulated, emulated_group_for
from hybrid_ep.testing.fault_cases import refused_input_on_rank

pytestmark = pytest.mark.faults

T = 4.0  # HYBRID_EP_TIMEOUT_S: a refusal that only timed out would take this long
W = 3
BF16 = Case(world_size=W, ranks_per_node=W, num_experts=6, hidden=256, tokens=(9, 0, 7), topk=2)
FP8 = dataclasses.replace(BF16, dtype=torch.float8_e4m3fn, tokens=(9, 5, 7))


@pytest.fixture(scope="module")
def pool():
    with ProcessGroupPool(W, env={"HYBRID_EP_TIMEOUT_S": str(T)}, start_method="forkserver") as pool:
        yield pool


@pytest.mark.parametrize("kind,case,argument", [
    ("dynamic", FP8, "scales"), ("static", BF16, "topk_weights"), ("handle", FP8, "scales"),
    ("dynamic", BF16, "x"), ("combine", BF16, "expert_out"),
])
def test_every_rank_raises_the_refusal_at_once_and_the_next_call_works(pool, kind, case, argument):
    want = Expected.of(case)
    got = pool.run(refused_input_on_rank, [(case, want.inputs[r], want.expert_outs[r], 1, argument, kind)
                                           for r in range(W)], timeout_s=120)
    for r, g in enumerate(got):
        assert g["error"] in ("InputRefused", "InputTypeRefused"), (r, g)
        assert (g["rank"], g["argument"]) == (1, argument), (r, g)
        assert g["seconds"] < 0.25 * T, (r, g["seconds"])
        assert f"rank 1 refused its input ({argument})" in g["words"], g["words"]
    assert "must" in got[1]["words"] or "more than" in got[1]["words"] or "does not match" in got[1]["words"]
    want.check_call([g["next"] for g in got], f" after a refused {kind} call")


CUDA = Case(world_size=4, ranks_per_node=4, num_experts=8, hidden=256, tokens=(6, 5, 7, 3), topk=2, backend="cuda")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("ranks_per_node", [4, 2], ids=["one_node", "two_nodes"])
@pytest.mark.parametrize("static", [False, True], ids=["dynamic", "static"])
def test_the_count_exchange_carries_a_refusal_to_every_rank(ranks_per_node, static, device):
    """Virtual rank 2 refuses (its count row says so, no tokens): the read of every rank holds
    it (a static size: the next call raises it); the call after that matches the oracle. The
    kernels on the CPU model, and on a GPU where there is one."""
    case = dataclasses.replace(CUDA, ranks_per_node=ranks_per_node)
    group = emulated_group_for(case, device, num_sms_dispatch=1, num_sms_combine=1)
    try:
        want = Expected.of(case)
        xs = [i["x"].to(group.device) for i in want.inputs]
        idx = [i["topk_idx"].to(group.device) for i in want.inputs]
        xs[2], idx[2] = xs[2][:0], idx[2][:0]  # the refusing rank's call: no tokens
        group.engine.host.set_refused(2, code_of("scales"))
        try:
            with pytest.raises(InputRefused) as raised:
                group.dispatch(xs, idx, num_out_tokens=64 if static else None)
                group.synchronize()
                group.dispatch(xs, idx, num_out_tokens=64)  # a static call's refusal: at the next call
        finally:
            group.engine.host.set_refused(2, 0)
        assert (raised.value.rank, raised.value.argument) == (2, "scales")
        check_emulated(group, case)
    finally:
        group.close()
