"""Launches past the 16 ranks a kernel's parameters hold (the single-GPU emulation of 18 ranks):
each launch copies the other ranks to a block of its own on its stream (cudaMallocAsync, freed
after the kernel on that stream), so calls on two streams each read their own; a CUDA graph
capture of such a launch is refused by name (the copy from host memory would not be replayed)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from harness.emulated import GroupCache, check_emulated, on_device
from harness.hierarchy_cases import hierarchy_case
from hybrid_ep.verify.cases import make_rank_inputs

pytestmark = pytest.mark.gpu

group_for = GroupCache("cuda")
TOKENS = (17, 0, 40, 1, 33, 64, 5, 9)


def _case(seed: int = 0, **kw):
    """2 domains of 9: 18 ranks in one launch, 2 past the inline 16."""
    tokens = tuple(TOKENS[r % len(TOKENS)] for r in range(18))
    return dataclasses.replace(hierarchy_case(2, 9, tokens=tokens, num_experts=36, topk=8, **kw), seed=seed)


def test_calls_on_two_streams_each_read_their_own_ranks():
    """Calls alternate between two streams, each ordered after the other's (wait_stream), each
    against the oracle: the ranks past 16 of a call on one stream are never those of the other's."""
    case = _case()
    group = group_for(case, num_sms_dispatch=1, num_sms_combine=1)
    streams = [torch.cuda.Stream(group.device), torch.cuda.Stream(group.device)]
    previous = torch.cuda.current_stream(group.device)
    for call in range(4):
        stream = streams[call % 2]
        stream.wait_stream(previous)
        with torch.cuda.stream(stream):
            check_emulated(group, dataclasses.replace(case, seed=call))
        previous = stream
    torch.cuda.current_stream(group.device).wait_stream(previous)


def test_capturing_a_launch_past_16_ranks_is_refused_by_name():
    case = _case(num_out_tokens=512)
    group = group_for(case, num_sms_dispatch=1, num_sms_combine=1)
    xs, idx, ws, _ = on_device(make_rank_inputs(case), group.device)
    side = torch.cuda.Stream(group.device)
    side.wait_stream(torch.cuda.current_stream(group.device))
    with torch.cuda.stream(side):
        group.dispatch(xs, idx, ws, num_out_tokens=case.num_out_tokens)  # warm-up outside the graph
    torch.cuda.current_stream(group.device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match=r"a launch of more than 16 ranks \(the single-GPU emulation of a larger "
                                           r"group\) cannot be captured in a CUDA graph"):
        with torch.cuda.graph(graph):
            group.dispatch(xs, idx, ws, num_out_tokens=case.num_out_tokens)
    group_for.clear()  # a capture that failed leaves the group's stream state to the next test
