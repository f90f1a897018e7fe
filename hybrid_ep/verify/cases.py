"""Test cases for any backend: inputs built in the parent, run on every rank, checked here.

`check_case(pool, case)` makes the inputs of all ranks, runs dispatch + combine (and a
dispatch that reuses the handle) on each rank of the pool, and compares every rank with the
dense oracle. The per-rank functions are module-level so spawned ranks can import them.

Legend: T tokens, K routes per token, E experts, H hidden, R output rows.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import BufferConfig
from ..dtypes import combine_dtype_for
from ..fp8 import FP8_DTYPE, quantize_fp8, quantize_mxfp8
from ..synthetic import drop_routes, iter_rank_routings, random_weights
from .compare import assert_combine_within, assert_dispatch_matches
from .oracle import combine_hops_oracle, dispatch_oracle


@dataclasses.dataclass(frozen=True)
class Case:
    world_size: int
    ranks_per_node: int
    num_experts: int
    hidden: int
    tokens: tuple[int, ...]  # tokens of each rank (may differ, may be 0)
    topk: int
    dtype: torch.dtype = torch.float32
    routing: str = "uniform"  # uniform | zipf | one-expert | one-rank
    drop_fraction: float = 0.0  # share of slots set to -1
    pad_multiple: int = 1
    min_rows_per_expert: int = 0
    num_out_tokens: int | None = None
    apply_probs: bool = False
    wire_dtype: torch.dtype | None = None  # combine's partials between ranks (None: the combine dtype)
    routing_map: bool = False  # pass Megatron's routing_map / probs instead of topk
    backend: str = "reference"
    seed: int = 0
    peer_memory_bytes: int | None = None  # the cuda backend's arena (None: its default)
    scale_format: str = "blockwise"  # fp8 rows' scales: "blockwise" (1x128 fp32) or "mxfp8" (1x32 E8M0)

    @property
    def config(self) -> BufferConfig:
        return BufferConfig(self.hidden, max(self.tokens), self.num_experts, self.world_size,
                            self.ranks_per_node, self.pad_multiple, self.min_rows_per_expert,
                            self.peer_memory_bytes).validate()

    @property
    def combine_dtype(self) -> torch.dtype:
        return combine_dtype_for(self.dtype)

    def __str__(self) -> str:
        dt = str(self.dtype).replace("torch.", "")
        return (f"W{self.world_size}xG{self.ranks_per_node} E{self.num_experts} H{self.hidden} "
                f"T{list(self.tokens)} K{self.topk} {dt} {self.routing} drop{self.drop_fraction} "
                f"pad{self.pad_multiple} min{self.min_rows_per_expert} out{self.num_out_tokens}"
                + ("" if self.wire_dtype is None else f" wire {str(self.wire_dtype).replace('torch.', '')}")
                + ("" if self.peer_memory_bytes is None else f" arena {self.peer_memory_bytes}")
                + ("" if self.scale_format == "blockwise" else f" {self.scale_format}"))


def make_rank_inputs(case: Case) -> list[dict]:
    gen = torch.Generator().manual_seed(case.seed)
    kind = "uniform" if case.routing in ("one-expert", "one-rank") else case.routing
    routings = iter_rank_routings(kind, case.tokens, case.num_experts, case.topk, case.seed)
    ranks = []
    for s, idx in enumerate(routings):
        T = case.tokens[s]
        if case.routing == "one-expert":
            # Every token's first choice is the same expert; the rest stay distinct from it.
            hot = case.num_experts // 2
            others = idx[:, : case.topk - 1]
            others = torch.where(others == hot, idx[:, case.topk - 1 :].expand_as(others), others)
            idx = torch.cat([torch.full((T, 1), hot, dtype=torch.int64), others], dim=1)
        if case.routing == "one-rank":
            # Every route of every token to the experts of one rank (topk <= experts per rank).
            L = case.num_experts // case.world_size
            if case.topk > L:
                raise ValueError(f"one-rank routing needs topk <= {L} experts per rank, got topk={case.topk}")
            first = case.world_size // 2 * L
            k = torch.arange(case.topk)[None, :] + torch.arange(T)[:, None]
            idx = first + k % L
        if case.drop_fraction > 0:
            idx = drop_routes(idx, case.drop_fraction, gen)
        weights = random_weights(idx, gen)
        x32 = torch.randn(T, case.hidden, generator=gen)
        inputs = {"topk_idx": idx, "topk_weights": weights}
        if case.dtype == FP8_DTYPE:
            quantize = quantize_mxfp8 if case.scale_format == "mxfp8" else quantize_fp8
            inputs["x"], inputs["scales"] = quantize(x32)
        else:
            inputs["x"], inputs["scales"] = x32.to(case.dtype), None
        ranks.append(inputs)
    return ranks


def _routing_kwargs(case: Case, inputs: dict) -> dict:
    if not case.routing_map:
        return {"topk_idx": inputs["topk_idx"], "topk_weights": inputs["topk_weights"]}
    idx, w = inputs["topk_idx"], inputs["topk_weights"]
    T = idx.shape[0]
    routing_map = torch.zeros(T, case.num_experts + 1, dtype=torch.bool)
    probs = torch.zeros(T, case.num_experts + 1, dtype=torch.float32)
    col = torch.where(idx >= 0, idx, case.num_experts)
    routing_map.scatter_(1, col, True)
    probs.scatter_(1, col, w)
    return {"routing_map": routing_map[:, :-1].contiguous(), "probs": probs[:, :-1].contiguous()}


def case_buffer(case: Case):
    """A buffer of the case's configuration on this rank (its process group: the default one)."""
    from ..buffer import HybridEPBuffer

    cfg = case.config
    return HybridEPBuffer(None, cfg.hidden_dim, cfg.max_tokens_per_rank, cfg.num_experts,
                          ranks_per_node=cfg.ranks_per_node, backend=case.backend, pad_multiple=cfg.pad_multiple,
                          min_rows_per_expert=cfg.min_rows_per_expert, peer_memory_bytes=cfg.peer_memory_bytes)


def run_case_on_rank(case: Case, inputs: dict, expert_out: torch.Tensor, calls: int = 1) -> list[dict]:
    """Runs on one rank of the pool: the case `calls` times on one buffer (a later call finds the
    peer memory the first one grew, so it takes the direct path where one process per rank can),
    each call's results."""
    buf = case_buffer(case)
    return [run_call(buf, case, inputs, expert_out) for _ in range(calls)]


def run_call(buf, case: Case, inputs: dict, expert_out: torch.Tensor) -> dict:
    """One dispatch + combine of the case on `buf` (and a dispatch that reuses the handle): what
    check_call compares with the oracle."""
    device = buf.device
    x = inputs["x"].to(device)
    scales = inputs["scales"].to(device) if inputs["scales"] is not None else None
    routing = {k: v.to(device) for k, v in _routing_kwargs(case, inputs).items()}
    res = buf.dispatch(x, scales=scales, num_out_tokens=case.num_out_tokens, **routing)
    dispatch_traffic = buf.last_traffic
    y = buf.combine(expert_out.to(device), res.handle, apply_probs=case.apply_probs, wire_dtype=case.wire_dtype)
    combine_traffic = buf.last_traffic
    again = buf.dispatch(x, scales=scales, handle=res.handle)
    reuse_equal = torch.equal(again.tokens.view(torch.uint8), res.tokens.view(torch.uint8))
    return {
        "tokens": res.tokens.cpu(),
        "scales": None if res.scales is None else res.scales.cpu(),
        "probs": res.probs.cpu(),
        "tokens_per_expert": res.tokens_per_expert.cpu(),
        "num_dropped": int(res.handle.num_dropped),
        "num_needed_rows": int(res.handle.num_needed_rows),
        "y": y.cpu(),
        "reuse_equal": reuse_equal,
        "traffic": (dispatch_traffic, combine_traffic),
        "data_path": res.handle.data_path,
    }


@dataclasses.dataclass
class Expected:
    """What the oracle says of a case: every rank's inputs, the dispatch oracle's run, and the
    experts' outputs the ranks combine (drawn here, one per rank)."""

    case: Case
    inputs: list[dict]
    run: object
    expert_outs: list[torch.Tensor]

    @classmethod
    def of(cls, case: Case) -> Expected:
        cfg = case.config
        inputs = make_rank_inputs(case)
        run = dispatch_oracle(cfg, [i["x"] for i in inputs], [i["topk_idx"] for i in inputs],
                              [i["topk_weights"] for i in inputs],
                              [i["scales"] for i in inputs] if case.dtype == FP8_DTYPE else None,
                              case.num_out_tokens)
        gen = torch.Generator().manual_seed(case.seed + 1)
        expert_outs = [torch.randn(r.tokens.shape[0], cfg.hidden_dim, generator=gen).to(case.combine_dtype)
                       for r in run.ranks]
        return cls(case, inputs, run, expert_outs)

    def check_call(self, results: list[dict], label: str = "") -> None:
        """Assert one call's results of every rank (in rank order) against the oracle."""
        case = self.case
        paths = {got["data_path"] for got in results}
        assert len(paths) == 1, f"{case}{label}: the ranks took different data paths {paths}"
        want_y = combine_hops_oracle(case.config, self.run, self.expert_outs, [i["topk_idx"] for i in self.inputs],
                                     case.apply_probs, case.wire_dtype, direct=paths == {"direct"})
        for r, got in enumerate(results):
            where = f"{case} rank {r}{label}"
            assert_dispatch_matches(got, self.run.ranks[r], where)
            assert got["num_needed_rows"] == self.run.ranks[r].num_needed_rows, f"{where}: num_needed_rows"
            assert got["reuse_equal"], f"{where}: dispatch with a reused handle gave different rows"
            assert_combine_within(got["y"], want_y[r], where)


def check_case(pool, case: Case, calls: int = 1) -> list[dict]:
    """Run `case` on the pool's ranks `calls` times, each rank on one buffer, and assert every
    call of every rank against the oracle; the last call's results, each with `call_paths`, the
    data path of every call."""
    want = Expected.of(case)
    per_rank = pool.run(run_case_on_rank, [(case, want.inputs[r], want.expert_outs[r], calls)
                                           for r in range(case.world_size)])
    for c in range(calls):
        want.check_call([got[c] for got in per_rank], f" call {c}" if calls > 1 else "")
    return [dict(got[-1], call_paths=[call["data_path"] for call in got]) for got in per_rank]


# -- autograd -----------------------------------------------------------------------------


def expert_fn(rows_RH: torch.Tensor, weights_EHH: torch.Tensor, expert_ids: list[int],
              counts: list[int]) -> torch.Tensor:
    """A different nonlinear function per expert, applied block by block; rows past the experts'
    counts (a static num_out_tokens larger than needed) stay zero."""
    used = sum(counts)
    blocks = torch.split(rows_RH[:used], counts)
    outs = [torch.tanh(b @ weights_EHH[e].to(b.dtype)) for b, e in zip(blocks, expert_ids)]
    return torch.cat(outs + [rows_RH.new_zeros(rows_RH.shape[0] - used, rows_RH.shape[1])])


def run_autograd_on_rank(case: Case, inputs: dict, weights_EHH: torch.Tensor, grad_y: torch.Tensor,
                         probs_in_expert: bool) -> dict:
    """Forward dispatch -> experts -> combine, backward; returns grads of x and routing weights."""
    from .. import autograd
    from ..buffer import HybridEPBuffer

    cfg = case.config
    buf = HybridEPBuffer(None, cfg.hidden_dim, cfg.max_tokens_per_rank, cfg.num_experts,
                         ranks_per_node=cfg.ranks_per_node, backend=case.backend,
                         pad_multiple=cfg.pad_multiple, min_rows_per_expert=cfg.min_rows_per_expert)
    x = inputs["x"].clone().requires_grad_(True)
    routing = _routing_kwargs(case, inputs)
    weight_key = "probs" if case.routing_map else "topk_weights"
    routing[weight_key] = routing[weight_key].clone().requires_grad_(True)
    res = autograd.dispatch(buf, x, num_out_tokens=case.num_out_tokens, **routing)
    L = cfg.experts_per_rank
    first = buf.rank * L
    out = expert_fn(res.tokens, weights_EHH, list(range(first, first + L)), res.tokens_per_expert.tolist())
    if probs_in_expert:
        out = out * res.probs[:, None].to(out.dtype)
    y = autograd.combine(buf, out, res.handle, apply_probs=not probs_in_expert)
    (y * grad_y.to(y.dtype)).sum().backward()
    return {"y": y.detach(), "grad_x": x.grad, "grad_weights": routing[weight_key].grad}


def dense_autograd_oracle(case: Case, inputs: list[dict], weights_EHH: torch.Tensor,
                          grad_ys: list[torch.Tensor], row_of_route: list[torch.Tensor]) -> list[dict]:
    """float64: y[t] = sum_k w[t,k] f_e(x[t]) over kept slots; grads by torch autograd."""
    out = []
    W64 = weights_EHH.double()
    for s, inp in enumerate(inputs):
        x = inp["x"].double().requires_grad_(True)
        w = inp["topk_weights"].double().requires_grad_(True)
        idx = inp["topk_idx"]
        kept = row_of_route[s] >= 0
        y = torch.zeros_like(x)
        for k in range(idx.shape[1]):
            for e in idx[:, k][kept[:, k]].unique().tolist():
                sel = (idx[:, k] == e) & kept[:, k]
                y = y.index_add(0, sel.nonzero()[:, 0], w[sel, k, None] * torch.tanh(x[sel] @ W64[e]))
        # The zero terms keep x and w in the graph when no slot of this rank is kept.
        ((y * grad_ys[s].double()).sum() + 0 * x.sum() + 0 * w.sum()).backward()
        out.append({"y": y.detach(), "grad_x": x.grad, "grad_weights": w.grad})
    return out
