"""The cuda kernels in single-GPU emulation against the dense oracle (needs a GPU).

W virtual ranks run in one process on one GPU (hybrid_ep.backends.cuda.emulation); every
rank's dispatch must equal the oracle bitwise and every combine must be within one ulp of
the float64 oracle (plus the fp32 accumulation bound).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.emulated import GroupCache, buffer_key, check_emulated, check_emulated_autograd, on_device
from harness.faults import ranks_absent
from harness.hierarchy_cases import feature_cases, topology_cases
from helpers import LEASE_COMBINE_VARIANTS
from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.verify.cases import Case, make_rank_inputs
from hybrid_ep.verify.compare import assert_combine_close, assert_dispatch_matches
from hybrid_ep.verify.oracle import combine_oracle, dispatch_oracle

pytestmark = pytest.mark.gpu

group_for = GroupCache("cuda")
PATHS = ("direct", "receive")  # launch.DATA_PATHS: emulation's own, and that of one process per GPU


def run_and_check(case: Case, num_sms: int | None = None, path: str = "direct"):
    return check_emulated(group_for(case, data_path=path), case, num_sms=num_sms)


def _case(W, **kw):
    base = dict(world_size=W, ranks_per_node=W, num_experts=2 * W, hidden=2048, tokens=(17,) * W, topk=2,
                dtype=torch.bfloat16, backend="cuda")
    base.update(kw)
    return Case(**base)


CASES = [
    # world sizes, odd and zero token counts
    _case(1, tokens=(17,), topk=1),
    _case(2, tokens=(0, 17)),
    _case(4, tokens=(1, 17, 0, 4095), topk=8, num_experts=16),
    _case(8, tokens=(4096,) * 8, topk=8, num_experts=16, hidden=8192),
    # hidden sizes and dtypes
    _case(4, hidden=128, dtype=torch.float32, tokens=(17, 1, 0, 33)),
    _case(4, hidden=7168, dtype=FP8_DTYPE, tokens=(4095, 17, 1, 0), topk=8, num_experts=32),
    _case(2, hidden=8192, dtype=torch.float32, tokens=(4096, 4095)),
    _case(8, hidden=128, dtype=FP8_DTYPE, tokens=(0, 1, 17, 4095, 4096, 5, 0, 9), topk=8, num_experts=64),
    _case(4, hidden=7168, dtype=FP8_DTYPE, tokens=(4095, 17, 1, 0), topk=8, num_experts=32, scale_format="mxfp8"),
    # routing shapes: dropped routes, one hot expert
    _case(4, drop_fraction=0.3, topk=8, num_experts=16, tokens=(200, 17, 0, 129)),
    _case(8, routing="one-expert", topk=2, tokens=(333,) * 8),
    _case(4, routing="zipf", topk=8, num_experts=32, tokens=(1000, 999, 1, 0)),
    # padding, minimum rows, apply_probs
    _case(4, pad_multiple=16, tokens=(17, 0, 3, 40)),
    _case(2, pad_multiple=64, topk=1, tokens=(100, 1)),
    _case(4, pad_multiple=16, min_rows_per_expert=16, num_experts=32, tokens=(5, 0, 1, 2)),
    _case(4, apply_probs=True, topk=8, num_experts=16, dtype=torch.float32, tokens=(64, 17, 0, 5)),
    # combine's wire: fp32 partials for bf16 rows (default: bf16, rounded once per hop)
    _case(4, hidden=7168, topk=8, num_experts=16, tokens=(4095, 17, 1, 0), wire_dtype=torch.float32),
    _case(8, hidden=7168, topk=8, num_experts=64, tokens=(2048,) * 8, dtype=torch.float16, wire_dtype=torch.float32),
    # small rows batched 32 to a FIFO stage, with partial stages
    _case(4, hidden=128, topk=8, num_experts=16, tokens=(4096, 33, 17, 0)),
    # static size: overflow (drops counted), exact, larger (trailing zero rows), zero
    _case(4, num_out_tokens=10, topk=8, num_experts=16, tokens=(64, 17, 0, 5)),
    _case(4, num_out_tokens=4000, topk=2, tokens=(64, 17, 0, 5), pad_multiple=16),
    _case(2, num_out_tokens=0, tokens=(8, 8)),
]


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_emulated_matches_oracle(case, path):
    run_and_check(case, path=path)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("num_sms", [1, 2, 4, 16])
def test_sm_count_per_call_gives_identical_results(num_sms, path):
    run_and_check(_case(4, topk=8, num_experts=16, tokens=(500, 17, 0, 129)), num_sms=num_sms, path=path)


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("stages, stage, wait, warps",
                         [("2", None, None, None), (None, None, "elect", None), (None, None, None, "8"),
                          (None, None, "converged", None)] + [(None, *v) for v in LEASE_COMBINE_VARIANTS])
def test_direct_combine_variants_match_the_oracle(monkeypatch, stages, stage, wait, warps, nodes):
    """The direct combine's measurement knobs the lease times without checking outputs, each alone
    and in every combination the lease times (HYBRID_EP_DIRECT_COMBINE_STAGES: the fewest stages;
    HYBRID_EP_COMBINE_STAGE=token: a stage per token segment; HYBRID_EP_REDUCER_WAIT=elect: lane 0's
    wait and the warp's __syncwarp alone, =converged: every lane's own wait, =named: one waiter per
    reducer group and a named barrier; HYBRID_EP_REDUCER_WARPS=8: each segment over 8 reducer warps)
    give the oracle's sums on the GPU, one node and two; rows of 7168 bf16 columns, top-8, so each
    token's parts wrap the rings."""
    from harness.emulated import emulated_group_for
    from hybrid_ep.backends.cuda import launch

    for name, value in ((launch.DIRECT_COMBINE_STAGES_ENV, stages), (launch.COMBINE_STAGE_ENV, stage),
                        (launch.REDUCER_WAIT_ENV, wait), (launch.REDUCER_WARPS_ENV, warps)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    case = _case(4, hidden=7168, topk=8, num_experts=16, tokens=(500, 17, 0, 129), ranks_per_node=4 // nodes)
    group = emulated_group_for(case, "cuda", data_path="direct")  # a buffer of its own: knobs are read at its making
    try:
        for seed in (0, 1):
            check_emulated(group, dataclasses.replace(case, seed=seed), num_sms=1)
        [args] = [a for key, a in group.engine._launch_cache.items() if key[0] == "combine_direct"]
        assert stages is None or args.src_stages == int(stages)
        assert args.combine_stage == launch.COMBINE_STAGES[stage or "route"]
        assert args.reducer_wait == launch.REDUCER_WAITS[wait or "observe"]
        assert args.reducer_warps == int(warps or launch.REDUCER_WARPS_NARROW)
    finally:
        group.close()


@pytest.mark.parametrize("nodes", [1, 2])
@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.bfloat16])
def test_store_runs_match_the_oracle(monkeypatch, dtype, nodes):
    """HYBRID_EP_STORE_RUNS=1 (the direct dispatch's runs of consecutive rows as one bulk store,
    which the lease times for fp8) gives the oracle's rows on the GPU: fp8 rows of 8 KiB two to a
    stage, bf16 rows of 256 bytes 32 to a stage, few experts so runs are common."""
    from harness.emulated import emulated_group_for
    from hybrid_ep.backends.cuda import launch

    monkeypatch.setenv(launch.STORE_RUNS_ENV, "1")
    hidden = 8192 if dtype == FP8_DTYPE else 128
    case = _case(4, hidden=hidden, dtype=dtype, topk=2, num_experts=4, tokens=(500, 17, 0, 129),
                 ranks_per_node=4 // nodes)
    group = emulated_group_for(case, "cuda", data_path="direct")  # a buffer of its own: knobs are read at its making
    try:
        for seed in (0, 1):
            check_emulated(group, dataclasses.replace(case, seed=seed), num_sms=1)
        [args] = [a for key, a in group.engine._launch_cache.items() if key[0] == "dispatch_direct"]
        assert args.store_runs == 1
    finally:
        group.close()


@pytest.mark.parametrize("nodes", [1, 2])
def test_ranks_through_peer_memory_match_the_oracle(nodes):
    """The emulation of separate processes (each rank's peer memory, mapped by the others at
    addresses of their own) on the GPU, as the process bench's `emulation_peer` times it: the
    first call grows the memory and takes the receive path, and the same call again goes direct
    once the peers mapped what it grew (each check's re-dispatch keeps a second output alive,
    which may grow the memory once more; tests/model/test_peer_emulation.py has the rule)."""
    from harness.emulated import emulated_group_for

    case = _case(4, topk=8, num_experts=16, tokens=(500, 17, 0, 129), ranks_per_node=4 // nodes)
    group = emulated_group_for(case, "cuda", separate_processes=True, peer_reserve=1 << 30)
    try:
        paths = [check_emulated(group, case)[0].handle.data_path for _ in range(3)]
        assert paths[0] == "receive" and paths[-1] == "direct", paths
    finally:
        group.close()


def test_back_to_back_calls_on_one_buffer():
    """Monotonic flags: 24 calls in a row on one buffer, other routings and token counts each
    time (never above the buffer's max tokens), no reset in between."""
    first = _case(4, topk=8, num_experts=16, tokens=(128, 17, 0, 3))
    group = group_for(first)
    for seed in range(24):
        case = _case(4, topk=8, num_experts=16, seed=seed,
                     tokens=(128, (17 * seed) % 129, seed % 5, 128 - seed))
        assert buffer_key(case) == buffer_key(first)
        check_emulated(group, case)
        assert group_for(case) is group


def test_fp8_redispatch_needs_scales():
    case = _case(2, hidden=256, dtype=FP8_DTYPE, tokens=(9, 4))
    group = group_for(case)
    res = check_emulated(group, case)
    inputs = make_rank_inputs(case)
    xs = [i["x"].to(group.device) for i in inputs]
    with pytest.raises(ValueError, match="scales"):
        group.redispatch(xs, [r.handle for r in res])


def test_combine_of_a_misaligned_view():
    """expert_out starting 2 bytes past a 16-byte boundary: copied to an aligned buffer."""
    case = _case(2, tokens=(17, 5))
    group = group_for(case)
    inputs = make_rank_inputs(case)
    dev = group.device
    xs, idx, weights, _ = on_device(inputs, dev)
    res = group.dispatch(xs, idx, weights)
    outs = []
    for r in res:
        R, H = r.tokens.shape
        backing = torch.randn(R * H + 1, device=dev).to(torch.bfloat16)
        view = backing[1:].view(R, H)
        assert view.data_ptr() % 16 != 0
        outs.append(view)
    ys = group.combine(outs, [r.handle for r in res])
    group.synchronize()
    run = dispatch_oracle(group.config, [i["x"] for i in inputs], [i["topk_idx"] for i in inputs],
                          [i["topk_weights"] for i in inputs])
    want_y, magnitude = combine_oracle(group.config, run, [o.cpu() for o in outs], [i["topk_idx"] for i in inputs])
    for r in range(2):
        assert_combine_close(ys[r], want_y[r], magnitude[r], case.topk, f"rank {r}")


def test_autograd_through_dispatch_and_combine():
    case = _case(4, dtype=torch.float32, topk=4, num_experts=8, hidden=128, tokens=(33, 0, 17, 5),
                 drop_fraction=0.2)
    check_emulated_autograd(group_for(case), case)


@pytest.mark.parametrize("case", topology_cases(hidden=2048) + feature_cases(hidden=2048), ids=str)
def test_hierarchical_emulation_matches_oracle(case):
    """N nodes x G ranks, the loopback transport between virtual nodes (exactly where a
    cluster uses NVSHMEM); forwarding checked against the forward plan and traffic model.
    Several nodes take the receive path (the direct path serves one node)."""
    run_and_check(case, path="direct" if case.ranks_per_node == case.world_size else "receive")


@pytest.mark.parametrize("ranks_per_node", [4, 2], ids=["one node", "two nodes"])
def test_cuda_graph_replays_with_new_routings(ranks_per_node):
    """Static size: dispatch + expert + combine captured once, replayed with other routings."""
    case = _case(4, topk=8, num_experts=16, tokens=(256,) * 4, num_out_tokens=1024, pad_multiple=16,
                 ranks_per_node=ranks_per_node)
    group = group_for(case)
    cfg = group.config
    dev = group.device
    static_x, static_idx, static_w, _ = on_device(make_rank_inputs(case), dev)

    def step():
        res = group.dispatch(static_x, static_idx, static_w, num_out_tokens=case.num_out_tokens)
        outs = [r.tokens * 2 for r in res]
        return res, group.combine(outs, [r.handle for r in res])

    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        step()  # warm-up outside the graph
    torch.cuda.current_stream(dev).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res, ys = step()
    for seed in range(1, 5):
        new = make_rank_inputs(dataclasses.replace(case, seed=seed))
        for r in range(case.world_size):
            static_x[r].copy_(new[r]["x"].to(dev))
            static_idx[r].copy_(new[r]["topk_idx"].to(dev))
            static_w[r].copy_(new[r]["topk_weights"].to(dev))
        graph.replay()
        group.synchronize()
        run = dispatch_oracle(cfg, [i["x"] for i in new], [i["topk_idx"] for i in new],
                              [i["topk_weights"] for i in new], None, case.num_out_tokens)
        expert_outs = [(o.tokens.float() * 2).to(o.tokens.dtype) for o in run.ranks]
        want_y, magnitude = combine_oracle(cfg, run, expert_outs, [i["topk_idx"] for i in new])
        for r in range(case.world_size):
            where = f"replay {seed} rank {r}"
            got = {"tokens": res[r].tokens, "scales": None, "probs": res[r].probs,
                   "tokens_per_expert": res[r].tokens_per_expert, "num_dropped": int(res[r].handle.num_dropped)}
            assert_dispatch_matches(got, run.ranks[r], where)
            assert_combine_close(ys[r], want_y[r], magnitude[r], case.topk, where,
                                 hops=2 if cfg.num_nodes > 1 else 1)


def test_a_missing_node_times_out_naming_the_node(monkeypatch):
    from hybrid_ep.backends.cuda.emulation import EmulatedGroup

    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "2")
    group = EmulatedGroup(4, 2048, 64, 8, ranks_per_node=2)
    try:
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(64, 2048, generator=gen).to(torch.bfloat16).cuda() for _ in range(4)]
        idx = [torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(64)]).cuda() for _ in range(4)]
        with ranks_absent(group, {2, 3}):
            group.dispatch(xs, idx, num_out_tokens=256)
        with pytest.raises(RuntimeError, match=r"waiting for peer rank [23] on node 1 in inter-node count exchange"):
            group.synchronize()
    finally:
        group.close()


def test_missing_rank_times_out_with_rank_peer_and_phase(monkeypatch):
    from hybrid_ep.backends.cuda.emulation import EmulatedGroup

    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "1")
    group = EmulatedGroup(4, 256, 64, 8)
    try:
        gen = torch.Generator().manual_seed(0)
        xs = [torch.randn(16, 256, generator=gen).to(torch.bfloat16).cuda() for _ in range(4)]
        idx = [torch.randint(0, 8, (16, 1), generator=gen).cuda() for _ in range(4)]
        with ranks_absent(group, {3}):
            group.dispatch(xs, idx, num_out_tokens=64)
        with pytest.raises(RuntimeError, match=r"rank [012] gave up .* waiting for peer rank 3 in dispatch "
                                               r"count exchange \(call 1,"):
            group.synchronize()
        with pytest.raises(RuntimeError, match="can not be used after this error"):
            group.dispatch(xs, idx, num_out_tokens=64)
    finally:
        group.close()


def test_bad_expert_index_in_static_mode_is_reported_and_leaves_the_buffer_usable(monkeypatch):
    """The CPU model's static-size tests of tests/model/test_routing_device.py on the GPU: the call
    with a bad route completes without moving rows, synchronize() raises the route once, and
    the next calls on the buffer (static, then dynamic) match the oracle."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "5")
    case = Case(3, 3, 6, 256, (17, 40, 33), 3, torch.bfloat16, drop_fraction=0.2, backend="cuda", num_out_tokens=64)
    from harness.emulated import emulated_group_for

    group = emulated_group_for(case, "cuda")
    try:
        xs, idx, weights, _ = on_device(make_rank_inputs(case), "cuda")
        bad = idx[1].clone()
        bad[39, 0] = 9
        group.dispatch(xs, [idx[0], bad, idx[2]], weights, num_out_tokens=64)
        with pytest.raises(ValueError) as err:
            group.synchronize()
        assert str(err.value) == "topk_idx values must be in [-1, 5] (num_experts=6), got 9 at token 39 on rank 1"
        group.synchronize()  # raised once
        check_emulated(group, case)
        check_emulated(group, dataclasses.replace(case, num_out_tokens=None))
    finally:
        group.close()


def test_bad_expert_index_in_dynamic_mode_leaves_the_buffer_usable(monkeypatch):
    """The CPU model's tests/model/test_routing_device.py on the GPU: the count kernel's bad route
    raised by the dynamic dispatch's host read, then the next call on the buffer."""
    monkeypatch.setenv("HYBRID_EP_TIMEOUT_S", "5")
    case = Case(3, 3, 6, 256, (17, 40, 33), 3, torch.bfloat16, drop_fraction=0.2, backend="cuda")
    from harness.emulated import emulated_group_for

    group = emulated_group_for(case, "cuda")
    try:
        xs, idx, weights, _ = on_device(make_rank_inputs(case), "cuda")
        bad = idx[1].clone()
        bad[39, 0] = -2
        with pytest.raises(ValueError) as err:
            group.dispatch(xs, [idx[0], bad, idx[2]], weights)
        assert str(err.value) == "topk_idx values must be in [-1, 5] (num_experts=6), got -2 at token 39 on rank 1"
        check_emulated(group, case)
    finally:
        group.close()


def _buffer_cases(world_size):
    tokens = tuple((7 * r + 17) % 40 for r in range(world_size))
    return [
        Case(world_size, world_size, 4 * world_size, 2048, tokens, 2, torch.bfloat16, pad_multiple=8, backend="cuda"),
        Case(world_size, world_size, 4 * world_size, 7168, tokens, 4, FP8_DTYPE, drop_fraction=0.2, backend="cuda"),
        Case(world_size, world_size, 4 * world_size, 256, tokens, 2, torch.float32, num_out_tokens=16,
             backend="cuda"),
    ]


def test_buffer_api_on_the_production_launcher():
    """HybridEPBuffer(backend='cuda'): one process per rank, registered buffers over CUDA IPC."""
    from hybrid_ep.spawn import ProcessGroupPool
    from hybrid_ep.verify import check_case

    with ProcessGroupPool(1, backend="nccl") as pool:
        for case in _buffer_cases(1):
            check_case(pool, case)


@pytest.mark.multigpu
def test_buffer_api_across_gpus_of_one_node():
    from hybrid_ep.spawn import ProcessGroupPool
    from hybrid_ep.verify import check_case

    world = min(torch.cuda.device_count(), 8)
    with ProcessGroupPool(world, backend="nccl") as pool:
        for case in _buffer_cases(world):
            check_case(pool, case)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
def test_deepseek_v3_layer_at_ep8_fits_one_gpu_with_default_settings(dtype, path):
    """The shape users run: E=256, top-8, H=7168, 4096 tokens per rank, all eight ranks'
    buffers on one 80 GB GPU with default settings (no arena, default rings), against the
    oracle. What the buffers hold is memory_plan()'s, and each rank's is under 1 GB."""
    from hybrid_ep.backends.cuda.backend import memory_plan

    case = _case(8, hidden=7168, topk=8, num_experts=256, tokens=(4096,) * 8, dtype=dtype)
    assert memory_plan(case.config).held_bytes <= 1e9
    group_for.clear()  # the cache's other groups share the GPU
    before = torch.cuda.memory_allocated()
    group = group_for(case, data_path=path)
    assert group.buffers.allocation_bytes == memory_plan(group.config).held_bytes
    check_emulated(group, case)
    del group
    group_for.clear()
    torch.cuda.synchronize()
    left = torch.cuda.memory_allocated() - before
    if left > (1 << 20):  # say what still holds it: unreachable cycles, or tensors someone keeps
        import gc

        gc.collect()
        after_gc = torch.cuda.memory_allocated() - before
        live = sorted(((o.numel() * o.element_size(), tuple(o.shape), str(o.dtype),
                        sorted({type(r).__name__ for r in gc.get_referrers(o)})[:4])
                       for o in gc.get_objects() if torch.is_tensor(o) and o.is_cuda), reverse=True)[:8]
        raise AssertionError(f"{left} bytes still allocated after close, {after_gc} after gc.collect(); "
                             f"the largest live CUDA tensors (bytes, shape, dtype, referrer types): {live}")


def test_dispatch_outputs_return_to_pytorchs_allocator():
    """The direct path's outputs are ordinary tensors from PyTorch's caching allocator: the
    bytes torch counts as allocated grow by the call's outputs and come back when they die."""
    case = _case(4, hidden=2048, topk=8, num_experts=16, tokens=(1024,) * 4)
    group = group_for(case)
    dev = group.device
    xs, idx, weights, _ = on_device(make_rank_inputs(case), dev)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(dev)
    res = group.dispatch(xs, idx, weights)
    group.synchronize()
    assert res[0].handle.data_path == "direct"
    rows = sum(r.tokens.shape[0] for r in res)
    assert torch.cuda.memory_allocated(dev) >= before + rows * 2048 * 2  # the rows, at least
    del res
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated(dev) <= before + (1 << 20)  # a workspace may stay for reuse
