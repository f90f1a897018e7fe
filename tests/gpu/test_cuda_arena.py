"""The direct path with one process per rank (needs a GPU): several processes on one GPU, a
gloo group between them, registered buffers opened through CUDA IPC and peer memory that grows
on demand (peer_memory_bytes pre-sizes it). Every rank's direct dispatch output comes from its
peer memory and every peer writes and reads it there; a call that the memory can not hold, on
any rank, takes the whole group to the receive path while it grows; combines on two streams
take the expert-out block in turn (one process). Against the oracle."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.arena_cases import run_uneven_arena_on_rank
from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.verify.cases import Case, check_case, make_rank_inputs
from hybrid_ep.verify.compare import assert_combine_within, assert_dispatch_matches
from hybrid_ep.verify.oracle import combine_hops_oracle, dispatch_oracle

pytestmark = pytest.mark.gpu

W = 3  # processes on the one GPU


@pytest.fixture(scope="module")
def pool():
    from helpers import built_cuda_extension
    from hybrid_ep.spawn import ProcessGroupPool

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    built_cuda_extension()
    with ProcessGroupPool(W, backend="gloo") as p:
        yield p


ARENA = 64 << 20  # holds every call below many times over


def _cases() -> list[Case]:
    tokens = (37, 0, 21)
    return [
        Case(W, W, 2 * W, 2048, tokens, 2, torch.bfloat16, pad_multiple=8, backend="cuda", peer_memory_bytes=ARENA),
        Case(W, W, 2 * W, 1024, tokens, 3, FP8_DTYPE, drop_fraction=0.2, backend="cuda", peer_memory_bytes=ARENA),
        Case(W, W, 2 * W, 256, tokens, 2, torch.float32, num_out_tokens=24, apply_probs=True, backend="cuda",
             peer_memory_bytes=ARENA),
    ]


@pytest.mark.parametrize("case", _cases(), ids=str)
def test_processes_on_one_gpu_take_the_direct_path(pool, case):
    results = check_case(pool, case)
    assert [r["data_path"] for r in results] == ["direct"] * W


def test_the_first_call_without_pre_sizing_takes_the_receive_path(pool):
    """Without peer_memory_bytes (the default) peer memory starts empty: the first call takes the
    receive path, whose rings hold bounded memory, while every rank's memory grows."""
    case = dataclasses.replace(_cases()[0], peer_memory_bytes=None)
    results = check_case(pool, case)
    assert [r["data_path"] for r in results] == ["receive"] * W


def test_a_call_larger_than_the_peer_memory_takes_every_process_to_the_receive_path_once(pool):
    """Peer memory pre-sized to one 2 MiB chunk (peer_memory_bytes=4096, rounded up) can not
    hold a call of about 4.8 MB of rows: every process takes the receive path while the memory
    grows, and the next call goes direct."""
    case = dataclasses.replace(_cases()[0], tokens=(370, 0, 210), peer_memory_bytes=4096)
    results = check_case(pool, case, calls=2)
    assert [r["call_paths"] for r in results] == [["receive", "direct"]] * W


def test_one_full_peer_memory_sends_the_whole_group_to_the_receive_path(pool):
    """Peer memory pre-sized for one call and its expert-out block (rounded up to 4 MiB, which
    holds no second call of 1.6 MB): only rank 1 keeps its first output, so only its memory can
    not hold the second call, and the whole group takes the receive path for it."""
    case = Case(W, W, 2 * W, 4096, (30, 12, 25), 2, torch.bfloat16, num_out_tokens=200, backend="cuda")
    inputs = make_rank_inputs(case)
    run = dispatch_oracle(case.config, [i["x"] for i in inputs], [i["topk_idx"] for i in inputs],
                          [i["topk_weights"] for i in inputs], None, case.num_out_tokens)
    gen = torch.Generator().manual_seed(5)
    outs = [torch.randn(case.num_out_tokens, case.hidden, generator=gen).to(torch.bfloat16) for _ in range(W)]
    got = pool.run(run_uneven_arena_on_rank, [(case, inputs[r], outs[r], r == 1) for r in range(W)])
    assert [g["paths"] for g in got] == [("direct", "receive")] * W
    want_y = combine_hops_oracle(case.config, run, outs, [i["topk_idx"] for i in inputs], False, None)
    for r, g in enumerate(got):
        assert_dispatch_matches(g, run.ranks[r], f"rank {r}")
        assert_combine_within(g["y"], want_y[r], f"rank {r}")


def test_combines_on_two_streams_take_the_expert_out_block_in_turn():
    """One process, two virtual ranks (separate processes emulated): two combines of one direct
    dispatch's handles, with expert_outs outside peer memory, on two streams issued back to
    back. Both copy into each rank's one expert-out block; the second stream waits on the device
    for an event recorded after the first's kernel (expert_out_order.StreamOrder), so the second copy never
    overwrites rows
    the first kernel's peers still read, and the kernels' call numbers stay in order. The
    first combine is made long (1 SM, 2048 tokens of H=4096 per rank) so that without that
    wait the second could overlap it. Both match the oracle."""
    from harness.emulated import emulated_group_for, on_device
    from helpers import built_cuda_extension
    from hybrid_ep.verify.compare import assert_combine_close
    from hybrid_ep.verify.oracle import combine_oracle

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    built_cuda_extension()
    case = Case(2, 2, 4, 4096, (2048, 1999), 2, torch.bfloat16, backend="cuda", peer_memory_bytes=256 << 20)
    group = emulated_group_for(case, "cuda", num_sms_dispatch=2, num_sms_combine=1, separate_processes=True)
    try:
        dev = group.device
        xs, idx, w, _ = on_device(make_rank_inputs(case), dev)
        res = group.dispatch(xs, idx, w)
        assert [r.handle.data_path for r in res] == ["direct"] * 2
        run = dispatch_oracle(group.config, xs, idx, w, None, None, device=dev)
        gen = torch.Generator(device=dev).manual_seed(1)
        outs = [[torch.randn(r.tokens.shape, generator=gen, device=dev).to(torch.bfloat16) for r in res]
                for _ in range(2)]
        handles = [r.handle for r in res]
        main = torch.cuda.current_stream(dev)
        streams = [torch.cuda.Stream(dev), torch.cuda.Stream(dev)]
        ys = []
        for s, o in zip(streams, outs):
            s.wait_stream(main)
            with torch.cuda.stream(s):
                ys.append(group.combine(o, handles))
        for s in streams:
            main.wait_stream(s)
        group.synchronize()
        engine = group.engine
        assert engine.expert_out_copies == 2 and engine.expert_out_order.waits == 1
        for k, (y, o) in enumerate(zip(ys, outs)):
            want, magnitude = combine_oracle(group.config, run, o, idx, False)
            for r in range(2):
                assert_combine_close(y[r], want[r], magnitude[r], case.topk, f"combine {k} rank {r}")
    finally:
        group.close()
