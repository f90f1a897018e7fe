"""Dense single-process oracle of dispatch and combine for all ranks at once.

Written straight from docs/architecture.md (Semantics) and independent of hybrid_ep.routing, so every
backend is checked against the contract, not against its own metadata code. Combine is
computed in float64. Both run on `device` (default: the CPU); on a GPU the big shapes of the
GPU tests take seconds instead of minutes.

Legend: W ranks, L experts per rank, T_s tokens of rank s, K routes per token, H hidden,
R_r output rows of rank r.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import BufferConfig
from ..rows import as_byte_rows, from_byte_rows
from .rounding import Fp32Sum, Interval


@dataclasses.dataclass
class OracleDispatch:
    """Expected dispatch result of one rank."""

    tokens: torch.Tensor  # [R, H] dtype of x
    scales: torch.Tensor | None  # [R, H/128] float32, or MXFP8's [R, H/32] E8M0 bytes
    probs: torch.Tensor  # [R] float32
    tokens_per_expert: torch.Tensor  # [L] int64
    num_dropped: int
    num_needed_rows: int


@dataclasses.dataclass
class OracleRun:
    ranks: list[OracleDispatch]
    # row_of_route[s][t, k]: output row (on rank topk_idx[s][t, k] // L) of that route, -1 if none
    row_of_route: list[torch.Tensor]


def _copy_rows(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Row gather that works for every dtype, fp8 included (by bytes)."""
    return from_byte_rows(as_byte_rows(src)[index], src.dtype)


def dispatch_oracle(
    config: BufferConfig,
    xs: list[torch.Tensor],
    topk_idx: list[torch.Tensor],
    topk_weights: list[torch.Tensor] | None = None,
    scales: list[torch.Tensor] | None = None,
    num_out_tokens: int | None = None,
    device: torch.device | str = "cpu",
) -> OracleRun:
    W, L, H = config.world_size, config.experts_per_rank, config.hidden_dim
    pad, min_rows = config.pad_multiple, config.min_rows_per_expert
    dev = torch.device(device)
    xs = [x.to(dev) for x in xs]
    topk_idx = [i.to(dev) for i in topk_idx]
    if topk_weights is None:
        topk_weights = [(i >= 0).to(torch.float32) for i in topk_idx]
    topk_weights = [w.to(dev) for w in topk_weights]
    scales = None if scales is None else [sc.to(dev) for sc in scales]
    row_of_route = [torch.full(i.shape, -1, dtype=torch.int64, device=dev) for i in topk_idx]
    ranks = []
    for r in range(W):
        pieces, scale_pieces, prob_pieces, counts = [], [], [], []
        pos = 0
        for j in range(L):
            expert = r * L + j
            start = pos
            for s in range(W):
                hit_TK = topk_idx[s] == expert
                tokens = hit_TK.any(dim=1).nonzero()[:, 0]
                slots = hit_TK.to(torch.int8).argmax(dim=1)[tokens]
                n = tokens.numel()
                pieces.append(_copy_rows(xs[s], tokens))
                if scales is not None:
                    scale_pieces.append(scales[s][tokens])
                prob_pieces.append(topk_weights[s].float()[tokens, slots])
                row_of_route[s][tokens, slots] = torch.arange(pos, pos + n, device=dev)
                pos += n
            # At least min_rows rows per expert (zero rows past the real ones), then up to a
            # multiple of pad.
            real = pos - start
            block = max(real, min_rows)
            block += (-block) % pad
            extra = block - real
            pieces.append(torch.zeros(extra, H, dtype=xs[0].dtype, device=dev))
            if scales is not None:
                scale_pieces.append(scales[0].new_zeros((extra,) + scales[0].shape[1:]))  # either format
            prob_pieces.append(torch.zeros(extra, dtype=torch.float32, device=dev))
            pos += extra
            counts.append(pos - start)
        tokens_RH = torch.cat(pieces) if pieces else torch.zeros(0, H, dtype=xs[0].dtype, device=dev)
        scales_R = torch.cat(scale_pieces) if scales is not None else None
        probs_R = torch.cat(prob_pieces) if prob_pieces else torch.zeros(0, device=dev)
        needed = pos
        ends = torch.tensor(counts, dtype=torch.int64).cumsum(0)
        starts = ends - torch.tensor(counts, dtype=torch.int64)
        dropped = 0
        if num_out_tokens is not None:
            R = num_out_tokens
            for s in range(W):
                on_r = (topk_idx[s] >= 0) & (topk_idx[s] // L == r)
                lost = on_r & (row_of_route[s] >= R)
                dropped += int(lost.sum())
                row_of_route[s][lost] = -1
            if needed >= R:
                tokens_RH, probs_R = tokens_RH[:R], probs_R[:R]
                scales_R = scales_R[:R] if scales_R is not None else None
            else:
                grow = R - needed
                tokens_RH = torch.cat([tokens_RH, torch.zeros(grow, H, dtype=tokens_RH.dtype, device=dev)])
                probs_R = torch.cat([probs_R, torch.zeros(grow, device=dev)])
                if scales_R is not None:
                    scales_R = torch.cat([scales_R, scales_R.new_zeros((grow,) + scales_R.shape[1:])])
            counts_L = ends.clamp(max=R) - starts.clamp(max=R)
        else:
            counts_L = ends - starts
        ranks.append(OracleDispatch(tokens_RH, scales_R, probs_R, counts_L, dropped, needed))
    return OracleRun(ranks, row_of_route)


def combine_oracle(
    config: BufferConfig,
    run: OracleRun,
    expert_outs: list[torch.Tensor],
    topk_idx: list[torch.Tensor],
    apply_probs: bool = False,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Per source rank: the float64 sum [T, H], and the sum of |terms| (for rounding bounds).

    Computed on the device of run (the dispatch oracle's)."""
    L = config.experts_per_rank
    dev = run.row_of_route[0].device if run.row_of_route else torch.device("cpu")
    outs = [e.to(dev) for e in expert_outs]  # in their dtype: float64 only the rows a route gathers
    sums, magnitudes = [], []
    for s, idx in enumerate(topk_idx):
        idx = idx.to(dev)
        T, H = idx.shape[0], config.hidden_dim
        y = torch.zeros(T, H, dtype=torch.float64, device=dev)
        mag = torch.zeros(T, H, dtype=torch.float64, device=dev)
        for r in range(config.world_size):
            for sel, term in _rank_terms(run, s, r, idx, outs[r], L, apply_probs):
                y[sel] += term
                mag[sel] += term.abs()
        sums.append(y)
        magnitudes.append(mag)
    return sums, magnitudes


def _rank_terms(run: OracleRun, s: int, d: int, idx: torch.Tensor, out: torch.Tensor, L: int, apply_probs: bool):
    """Rank d's expert outputs for the tokens of source s, one route k at a time:
    (tokens [T] bool, their rows [n, H] float64, times the routing weight with apply_probs).
    Only the gathered rows become float64 (exactly): a float64 copy of every rank's expert_out
    took 17 GB at the seed shape (W = 8, 4096 x 8192), past an 80 GB GPU beside the buffers."""
    for k in range(idx.shape[1]):
        rows = run.row_of_route[s][:, k]
        sel = (rows >= 0) & (idx[:, k] // L == d)
        if not bool(sel.any()):
            continue
        term = out[rows[sel]].double()
        if apply_probs:
            term = term * run.ranks[d].probs.double()[rows[sel], None]
        yield sel, term


@dataclasses.dataclass
class CombineBounds:
    """Expected combine result of one source rank under the hop model, per element [T, H].

    `value` is the result when every fp32 sum happens to be exact; the fp32 sum the source
    casts to the output dtype lies in [lo, hi] whatever order each hop sums in (float64).
    hops[t]: roundings to the wire on the longest path of token t's contributions (0: none
    arrive, or none is rounded on its way (the direct path), 1: only from the source's node,
    2: some from a remote node)."""

    value: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    hops: torch.Tensor  # [T] int64


def combine_hops_oracle(
    config: BufferConfig,
    run: OracleRun,
    expert_outs: list[torch.Tensor],
    topk_idx: list[torch.Tensor],
    apply_probs: bool = False,
    wire_dtype: torch.dtype | None = None,
    direct: bool = False,
) -> list[CombineBounds]:
    """Per source rank: what a hierarchical combine over `wire_dtype` may return.

    The hops as the hierarchical path makes them: every rank d sums its local experts' rows
    of a token in fp32 (times the routing weight with apply_probs) into one partial and
    rounds it to the wire dtype; partials from the source's node go to the source; those of a
    remote node are summed in fp32 by that node's forwarder and rounded to the wire once
    more; the source sums what it receives in fp32. With one node (or one rank per node)
    every contribution is rounded once. wire_dtype None: the dtype of expert_outs.

    direct: the direct path's combine, where the source reads every route's row on its node
    itself and sums them in fp32 (nothing rounded to the wire: hops 0); with several nodes the
    rail peer on each other node does the same for that node's routes, and its sum crosses
    rounded once to the wire (hops 1)."""
    L, G, N = config.experts_per_rank, config.ranks_per_node, config.num_nodes
    dev = run.row_of_route[0].device if run.row_of_route else torch.device("cpu")
    wire = expert_outs[0].dtype if wire_dtype is None else wire_dtype
    outs = [e.to(dev) for e in expert_outs]
    bounds = []
    for s, idx in enumerate(topk_idx):
        idx = idx.to(dev)
        shape = (idx.shape[0], config.hidden_dim)
        source_sum = Fp32Sum(shape, dev)
        hops = torch.zeros(shape[0], dtype=torch.int64, device=dev)
        if direct:
            for n in [s // G] + [m for m in range(N) if m != s // G]:  # the source's node first
                remote = n != s // G
                node_sum = Fp32Sum(shape, dev) if remote else source_sum
                node_present = torch.zeros(shape[0], dtype=torch.bool, device=dev)
                for d in range(n * G, (n + 1) * G):
                    for sel, rows in _rank_terms(run, s, d, idx, outs[d], L, apply_probs):
                        term = torch.zeros(shape, dtype=torch.float64, device=dev)
                        term[sel] = rows
                        node_sum.add(Interval.point(term), sel[:, None])
                        node_present |= sel
                if remote and bool(node_present.any()):
                    source_sum.add(node_sum.result().rounded(wire), node_present[:, None])
                    hops = torch.where(node_present, torch.clamp(hops, min=1), hops)
            total = source_sum.result()
            bounds.append(CombineBounds(total.value, total.lo, total.hi, hops))
            continue
        for n in range(N):
            remote = n != s // G
            node_sum = Fp32Sum(shape, dev) if remote else source_sum
            node_present = torch.zeros(shape[0], dtype=torch.bool, device=dev)
            for d in range(n * G, (n + 1) * G):
                partial, present = _rank_partial(run, s, d, idx, outs[d], L, apply_probs, shape)
                if partial is None:
                    continue
                node_sum.add(partial.result().rounded(wire), present[:, None])
                node_present |= present
            if remote and bool(node_present.any()):
                source_sum.add(node_sum.result().rounded(wire), node_present[:, None])
            hops = torch.where(node_present, torch.clamp(hops, min=2 if remote else 1), hops)
        total = source_sum.result()
        bounds.append(CombineBounds(total.value, total.lo, total.hi, hops))
    return bounds


def _rank_partial(run: OracleRun, s: int, d: int, idx: torch.Tensor, out: torch.Tensor, L: int,
                  apply_probs: bool, shape: tuple[int, int]) -> tuple[Fp32Sum | None, torch.Tensor]:
    """Rank d's fp32 sum of its experts' rows for every token of source s (None: no token)."""
    partial, present = None, torch.zeros(shape[0], dtype=torch.bool, device=idx.device)
    for sel, rows in _rank_terms(run, s, d, idx, out, L, apply_probs):
        term = torch.zeros(shape, dtype=torch.float64, device=idx.device)
        term[sel] = rows
        if partial is None:
            partial = Fp32Sum(shape, idx.device)
        partial.add(Interval.point(term), sel[:, None])
        present |= sel
    return partial, present
