"""Rank-side functions of the GPU tests of the direct path with one process per rank (several
processes on one GPU, CUDA IPC between them): a rank whose peer memory is full sends every rank
of the group to the receive path for that call (the agreement), and the results stay the
oracle's."""

from __future__ import annotations

import gc

import torch

from hybrid_ep.verify.cases import Case, _routing_kwargs


def run_uneven_arena_on_rank(case: Case, inputs: dict, expert_out: torch.Tensor, hold: bool) -> dict:
    """Peer memory pre-sized for one call of case.num_out_tokens rows and its expert-out block.
    A first dispatch goes direct on every rank; a rank with `hold` keeps its output, so its
    memory can not hold the second dispatch (where the rounding to peer_memory.CHUNK leaves less
    than a call), which therefore takes the receive path on every rank; the second dispatch and
    its combine are returned for the oracle check, with both calls' paths."""
    from hybrid_ep.backends.cuda.agreement import expert_out_block_bytes
    from hybrid_ep.backends.cuda.arena import call_bytes
    from hybrid_ep.buffer import HybridEPBuffer

    cfg = case.config
    one_call = call_bytes(case.num_out_tokens, cfg.hidden_dim, case.dtype, fp8=False)
    block = expert_out_block_bytes(case.num_out_tokens, cfg.hidden_dim, case.dtype)
    buf = HybridEPBuffer(None, cfg.hidden_dim, cfg.max_tokens_per_rank, cfg.num_experts,
                         ranks_per_node=cfg.ranks_per_node, backend="cuda", peer_memory_bytes=one_call + block)
    device = buf.device
    x = inputs["x"].to(device)
    routing = {k: v.to(device) for k, v in _routing_kwargs(case, inputs).items()}
    first = buf.dispatch(x, num_out_tokens=case.num_out_tokens, **routing)
    first_path = first.handle.data_path
    held = first if hold else None
    del first
    gc.collect()
    res = buf.dispatch(x, num_out_tokens=case.num_out_tokens, **routing)
    y = buf.combine(expert_out.to(device), res.handle)
    torch.cuda.synchronize()
    out = {"paths": (first_path, res.handle.data_path), "tokens": res.tokens.cpu(), "scales": None,
           "probs": res.probs.cpu(), "tokens_per_expert": res.tokens_per_expert.cpu(),
           "num_dropped": int(res.handle.num_dropped), "y": y.cpu()}
    del held
    return out
