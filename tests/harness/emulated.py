"""One oracle check of the kernels in emulation, shared by the GPU tests, the CPU-model tests
and the GPU scripts (`python -m harness.emulated_check`).

`check_emulated(group, case)` builds the inputs of every virtual rank, runs dispatch,
combine and a dispatch that reuses the handles on the group (GPU or CPU model), and compares
every rank with the dense oracle: dispatch bitwise, combine within the fp32-accumulation
bound plus one rounding. The oracle runs on the group's device, in float64.
"""

from __future__ import annotations

import torch

from hybrid_ep.fp8 import FP8_DTYPE
from hybrid_ep.traffic import count_tables
from hybrid_ep.traffic.model import row_counts
from hybrid_ep.verify.cases import Case, dense_autograd_oracle, expert_fn, make_rank_inputs
from hybrid_ep.verify.compare import assert_combine_close, assert_combine_within, assert_dispatch_matches
from hybrid_ep.verify.oracle import combine_hops_oracle, combine_oracle, dispatch_oracle


def emulated_group_for(case: Case, device, **kwargs):
    """The case's buffer shape on `device`, its peer memory pre-sized by `case.peer_memory_bytes` (with
    separate_processes) unless kwargs name a size."""
    from hybrid_ep.backends.cuda.emulation import EmulatedGroup

    kwargs.setdefault("peer_memory_bytes", case.peer_memory_bytes)
    return EmulatedGroup(case.world_size, case.hidden, max(max(case.tokens), 1), case.num_experts,
                         pad_multiple=case.pad_multiple, min_rows_per_expert=case.min_rows_per_expert,
                         device=device, ranks_per_node=case.ranks_per_node, **kwargs)


def buffer_key(case: Case) -> tuple:
    """Cases with equal keys can share one EmulatedGroup."""
    return (case.world_size, case.ranks_per_node, case.hidden, max(max(case.tokens), 1), case.num_experts,
            case.pad_multiple, case.min_rows_per_expert, case.peer_memory_bytes)


class GroupCache:
    """One live EmulatedGroup at a time, reused while cases share its buffer shape (the
    previous one is closed first: registered buffers are large)."""

    def __init__(self, device, **group_kwargs):
        self.device, self.group_kwargs = device, group_kwargs
        self._key, self._group = None, None

    def __call__(self, case: Case, **kwargs):
        key = (buffer_key(case), tuple(sorted(kwargs.items())))
        if key != self._key:
            if self._group is not None:
                self._group.close()
            self._group = emulated_group_for(case, self.device, **{**self.group_kwargs, **kwargs})
            self._key = key
        return self._group

    def clear(self) -> None:
        """Close the live group, if any: its registered buffers go back to the device."""
        if self._group is not None:
            self._group.close()
        self._key, self._group = None, None


def on_device(inputs: list[dict], dev) -> tuple[list, list, list, list]:
    """(x, topk_idx, topk_weights, scales) of every rank, moved to dev (scales may be None)."""
    return ([i["x"].to(dev) for i in inputs], [i["topk_idx"].to(dev) for i in inputs],
            [i["topk_weights"].to(dev) for i in inputs],
            [None if i["scales"] is None else i["scales"].to(dev) for i in inputs])


def check_emulated(group, case: Case, num_sms: int | None = None, check: bool = True):
    """Run `case` on the group and (with check) assert every rank against the oracle.

    Returns the dispatch results, so callers can inspect handles."""
    cfg = group.config
    dev = group.device
    xs, idx, weights, scales = on_device(make_rank_inputs(case), dev)
    res = group.dispatch(xs, idx, weights, scales=scales, num_out_tokens=case.num_out_tokens, num_sms=num_sms)
    gen = torch.Generator(device=dev).manual_seed(case.seed + 1)
    expert_outs = [torch.randn(r.tokens.shape[0], cfg.hidden_dim, generator=gen, device=dev).to(case.combine_dtype)
                   for r in res]
    ys = group.combine(expert_outs, [r.handle for r in res], apply_probs=case.apply_probs, num_sms=num_sms,
                       wire_dtype=case.wire_dtype)
    again = group.redispatch(xs, [r.handle for r in res], scales=scales if case.dtype == FP8_DTYPE else None,
                             num_sms=num_sms)
    group.synchronize()
    if not check:
        return res
    run = dispatch_oracle(cfg, xs, idx, weights, scales if case.dtype == FP8_DTYPE else None, case.num_out_tokens,
                          device=dev)
    want_y, magnitude = combine_oracle(cfg, run, expert_outs, idx, case.apply_probs)
    direct = res[0].handle.data_path == "direct"  # the call's path: the buffer's, or receive where the
    # agreement sent it there (every rank the same)
    assert {r.handle.data_path for r in res} == {res[0].handle.data_path}, f"{case}: ranks took different paths"
    if group.engine.data_path == "direct" and group.engine.peer is None:
        # ranks in one process: outputs from PyTorch's allocator serve any call
        assert direct, f"{case}: the buffer's direct path fell back to the receive path in one process"
    if direct:
        for r, arena in enumerate(group.engine.arenas):
            assert arena.contains(res[r].tokens) and arena.contains(res[r].probs), (
                f"{case} rank {r}: a direct dispatch's output outside its peer memory")
    hops = combine_hops_oracle(cfg, run, expert_outs, idx, case.apply_probs, case.wire_dtype, direct=direct)
    want_rows, want_nodes = count_tables([i.cpu() for i in idx], cfg)  # what the traffic model counts
    for r in range(case.world_size):
        where = f"{case} rank {r}"
        got_rows, got_nodes = res[r].handle.count_matrix_WW.cpu(), res[r].handle.node_counts_WN.cpu()
        assert torch.equal(got_rows, want_rows), f"{where}: rows per (source, destination) {got_rows.tolist()} != " \
                                                 f"{want_rows.tolist()}"
        assert torch.equal(got_nodes, want_nodes), f"{where}: tokens per (source, node) {got_nodes.tolist()} != " \
                                                   f"{want_nodes.tolist()}"
        got = {"tokens": res[r].tokens, "scales": res[r].scales, "probs": res[r].probs,
               "tokens_per_expert": res[r].tokens_per_expert, "num_dropped": int(res[r].handle.num_dropped)}
        assert_dispatch_matches(got, run.ranks[r], where)
        assert int(res[r].handle.num_needed_rows) == run.ranks[r].num_needed_rows, f"{where}: num_needed_rows"
        assert torch.equal(again[r].tokens.view(torch.uint8), res[r].tokens.view(torch.uint8)), (
            f"{where}: a dispatch that reuses the handle gave other rows")
        if res[r].scales is not None:
            assert torch.equal(again[r].scales, res[r].scales), f"{where}: reused handle, other scales"
        assert_combine_close(ys[r], want_y[r], magnitude[r], case.topk, where, case.wire_dtype,
                             hops=(cfg.num_nodes > 1) if direct else 2 if cfg.num_nodes > 1 else 1)
        assert_combine_within(ys[r], hops[r], where)  # every rounding of the hierarchy reproduced
    if cfg.num_nodes > 1:
        check_forwarding(cfg, res, idx, want_rows, want_nodes, direct)
    return res


def check_forwarding(cfg, res, idx, count_WW, node_counts_WN, direct: bool = False) -> None:
    """What each rank forwarded (kept by its handle for the combine) against the forward plan,
    and the rows it received by RDMA against the traffic model's count (direct: the handle
    keeps each forwarded row's routes instead of its receive slots, checked by the dispatch's
    rows themselves)."""
    from .hierarchy import forward_plan

    plan = forward_plan([i.cpu() for i in idx], cfg)
    rdma_rows = row_counts(count_WW, node_counts_WN, cfg.ranks_per_node).combine_rdma
    G, N, chunk = cfg.ranks_per_node, cfg.num_nodes, plan.chunk_tokens
    for f, res_f in enumerate(res):
        want = plan.forwarders[f]
        got_rows = res_f.handle.dest.fwd_rows.cpu()
        got_slots = None if direct else res_f.handle.dest.fwd_slots.cpu()
        received = 0
        for n in range(N):
            if n == f // G:
                continue
            s = n * G + f % G
            chunks = -(-int(idx[s].shape[0]) // chunk)
            assert torch.equal(got_rows[n, :chunks], want.staged_rows[n, :chunks]), (
                f"rank {f}: rows forwarded per chunk of rank {s} {got_rows[n, :chunks].tolist()} != "
                f"{want.staged_rows[n, :chunks].tolist()}")
            for c in range(chunks):
                rows = int(want.staged_rows[n, c])
                received += rows
                if direct:
                    continue
                got_c, want_c = got_slots[n, c * chunk:c * chunk + rows], want.fwd_slots[n, c * chunk:c * chunk + rows]
                assert torch.equal(got_c, want_c), f"rank {f}: receive slots of chunk {c} of rank {s}"
        assert received == int(rdma_rows[f]), f"rank {f}: {received} rows by RDMA, traffic model {int(rdma_rows[f])}"


def check_emulated_autograd(group, case: Case) -> None:
    """Dispatch -> a different nonlinear function per expert (times the routing weight) ->
    combine, then backward, against the float64 autograd of the dense computation."""
    cfg, dev = group.config, group.device
    inputs = make_rank_inputs(case)
    run = dispatch_oracle(cfg, [i["x"] for i in inputs], [i["topk_idx"] for i in inputs],
                          [i["topk_weights"] for i in inputs])
    gen = torch.Generator().manual_seed(7)
    weights = torch.randn(cfg.num_experts, cfg.hidden_dim, cfg.hidden_dim, generator=gen) / cfg.hidden_dim ** 0.5
    grad_ys = [torch.randn(t, cfg.hidden_dim, generator=gen) for t in case.tokens]
    xs = [i["x"].to(dev, copy=True).requires_grad_(True) for i in inputs]  # leaves of this graph only
    ws = [i["topk_weights"].to(dev, copy=True).requires_grad_(True) for i in inputs]
    rows, probs, handles = group.dispatch_autograd(xs, [i["topk_idx"].to(dev) for i in inputs], ws)
    L = cfg.experts_per_rank
    outs = []
    for r in range(case.world_size):
        out = expert_fn(rows[r], weights.to(dev), list(range(r * L, r * L + L)), handles[r].tokens_per_expert.tolist())
        outs.append(out * probs[r][:, None])
    ys = group.combine_autograd(outs, probs, handles)
    sum((y * g.to(dev)).sum() for y, g in zip(ys, grad_ys)).backward()
    want = dense_autograd_oracle(case, inputs, weights, grad_ys, run.row_of_route)
    for r in range(case.world_size):
        torch.testing.assert_close(ys[r].detach().cpu().double(), want[r]["y"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(xs[r].grad.cpu().double(), want[r]["grad_x"], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(ws[r].grad.cpu().double(), want[r]["grad_weights"], rtol=1e-4, atol=1e-5)
