"""The kernels' hazards on a GPU that the CPU model shows once it is no stronger than the
hardware (docs/dev/cpu_model.md, "Weakened"): each test here failed on the kernels before their
fix under the weakened model, and passes after it.

- The receive path's combine sends its last node-partial credits over RDMA at the end of its
  source load warp: without a quiet they may land after the next call's credit in the same slot
  (the loopback transport's ops land late and out of order on the model), and the forwarder of
  the next call waits until the timeout.
- The direct dispatch's two store threads take the FIFO's items in turn: with an odd stage count
  a thread's mbarrier wait may pass on the phase it consumed two rounds before (the model reports
  a stale parity). The plan keeps the count even and the launcher refuses another.
- The ring tags hold the call in the high 32 bits: a buffer past 2^32 calls takes stale words for
  this call's.
"""

from __future__ import annotations

import ctypes
import dataclasses
import importlib

import pytest
import torch

from harness.emulated import GroupCache, check_emulated
from harness.hierarchy_cases import hierarchy_case
from hybrid_ep.backends.cuda import launch
from hybrid_ep.backends.cuda.layout import rdma_layout, registered_layout
from hybrid_ep.verify.cases import Case

pytestmark = pytest.mark.model

model = importlib.import_module("hybrid_ep._model")

RING = 2  # chunk slots per ring: every call below wraps each ring several times
_cached = GroupCache("cpu")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_combines_last_credits_land_before_the_next_call(seed):
    """Two nodes of one rank, 5 chunks per source through 2-slot rings, 5 calls: the credits the
    source sends for its last chunks, if still in flight when the kernel ends, land in a later
    call (seed 0 failed here before the source load warp quieted them: rank 0's forwarder gave up
    waiting in the combine's node-partial ring, having seen the credit of call 3 after call 4's)."""
    first = hierarchy_case(2, 1, tokens=(130, 130), topk=2)
    group = _cached(first, num_sms_dispatch=1, num_sms_combine=1, data_path="receive", ring_chunks=RING)
    before = model.stats()
    try:
        for call in range(5):
            model.set_seed(seed * 100 + call)
            check_emulated(group, dataclasses.replace(first, seed=call))
    except Exception:
        _cached.clear()
        raise
    after = model.stats()
    assert after["remote_ops"] > before["remote_ops"]  # the transport's ops were queued
    # none outlived its launch: every kernel quiets what it sent (ring releases, done signals)
    assert after["remote_carried"] == before["remote_carried"]


def test_the_direct_dispatch_keeps_an_even_stage_count(monkeypatch):
    """At most 3 stages fit (MAX_STAGES patched): the plan takes 2, as the launcher requires;
    with 3 the model stopped the launch ("waits a second time ... a stale parity") on seeds 0
    and 2. 160 and 97 rows of 16 KiB, one per stage, through one block per rank."""
    monkeypatch.setattr(launch, "MAX_STAGES", 3)
    row = launch.row_bytes_of(4096, "float32")
    assert launch.direct_fifo_shape(row, 232448).stages == 2
    for seed in (0, 2):
        case = Case(world_size=2, ranks_per_node=2, num_experts=4, hidden=4096, topk=2, dtype=torch.float32,
                    tokens=(160, 97), backend="cuda", seed=seed)
        group = _cached(case, num_sms_dispatch=1, num_sms_combine=1, data_path="direct")
        model.set_seed(seed)
        check_emulated(group, case)
    _cached.clear()  # its plans were made with the patched MAX_STAGES


def _start_calls_at(group, calls: int) -> None:
    """Makes every rank's buffer look as if it had served `calls` dispatches and combines: the
    counters the kernels take their call numbers from, and the words the next call waits on for the
    previous one (done_dispatch, done_combine, here and in the RDMA regions)."""
    reg, rdma = registered_layout(group.config), rdma_layout(group.config)
    W, N = group.world_size, group.config.world_size // group.config.ranks_per_node

    def set_u64(address: int, value: int) -> None:
        ctypes.c_uint64.from_address(address).value = value

    for r in range(W):
        base = group.buffers._owned[r][0]
        set_u64(base + reg.state, calls)  # LocalState.dispatch_calls
        set_u64(base + reg.state + 8, calls)  # LocalState.combine_calls
        for s in range(W):
            set_u64(base + reg.done_dispatch + 8 * s, calls)
            set_u64(base + reg.done_combine + 8 * s, calls)
        if group.rdma is not None:
            region = group.rdma._owned[r][0]
            for n in range(N):
                set_u64(region + rdma.done_dispatch + 8 * n, calls)
                set_u64(region + rdma.done_combine + 8 * n, calls)


def test_calls_past_the_tags_wrap_point_match_the_oracle():
    """A buffer that served 2^32 - 2 calls: its next calls are 2^32 - 1, 2^32 and 2^32 + 1. With
    the call in the tag's low 32 bits (call << 32 | chunk + 1) the tags of call 2^32 were those
    of call 0, below every word the previous calls left, so the credit and signal waits passed at
    once on stale slots; PeerRing::tag keeps 40 bits of call (common/params.h,
    kRingTagChunkBits), so the calls past that point match the oracle."""
    case = Case(world_size=2, ranks_per_node=2, num_experts=4, hidden=128, topk=2, dtype=torch.bfloat16,
                tokens=(256, 256), backend="cuda")
    group = _cached(case, num_sms_dispatch=1, num_sms_combine=1, data_path="receive", ring_chunks=RING)
    try:
        _start_calls_at(group, 2**32 - 2)
        for call in range(3):
            model.set_seed(call)
            check_emulated(group, dataclasses.replace(case, seed=call))
    finally:
        _cached.clear()
