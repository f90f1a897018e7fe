"""The SM count goes by one name, num_sms, from the API to the launch: HybridEPBuffer's
num_sms_dispatch / num_sms_combine (per call: num_sms), KernelConfig's fields, the engine's
num_sms and the launch arguments' num_sms (csrc LaunchArgs::num_sms, one block per SM);
a call that names none gets launch.DEFAULT_NUM_SMS_*, applied in the engine alone. On the CPU
model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from helpers import REPO
from hybrid_ep.backends.cuda import launch
from hybrid_ep.backends.cuda.emulation import EmulatedGroup

pytestmark = pytest.mark.model

H, T, E, K = 128, 8, 4, 2


def _inputs(W: int):
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=gen) for _ in range(W)]
    idx = [torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous() for _ in range(W)]
    return xs, idx


def _launched(engine) -> dict[str, set[int]]:
    """SMs per rank of every launch the engine prepared, by kernel, as the launch arguments hold them."""
    got: dict[str, set[int]] = {}
    for (kind, num_sms, *_), args in engine._launch_cache.items():
        assert args.num_sms == num_sms
        got.setdefault(kind, set()).add(args.num_sms)
    return got


def test_the_buffers_counts_reach_the_launch(single_rank_group):
    from hybrid_ep.backends.cuda.backend import CudaBackend
    from hybrid_ep.buffer import HybridEPBuffer

    g = EmulatedGroup(1, H, T, E, device="cpu", data_path="receive")
    try:
        buf = HybridEPBuffer(None, H, T, E, backend="reference", num_sms_dispatch=3, num_sms_combine=2)
        buf._backend = CudaBackend.on_group(buf.config, buf.rank, buf._owner, g)
        (x,), (idx,) = _inputs(1)
        res = buf.dispatch(x, idx)
        buf.combine(res.tokens, res.handle)
        assert _launched(buf._backend._engine) == {"dispatch_receive": {3}, "combine_receive": {2}}
        res = buf.dispatch(x, idx, num_sms=1)  # per call, the same name
        buf.combine(res.tokens, res.handle, num_sms=4)
        assert _launched(buf._backend._engine) == {"dispatch_receive": {3, 1}, "combine_receive": {2, 4}}
        # A bad per-call count is named as the caller passed it, not as the buffer's setting.
        with pytest.raises(ValueError, match=r"^num_sms must be >= 1, got 0$"):
            buf.dispatch(x, idx, num_sms=0)
        with pytest.raises(ValueError, match=r"^num_sms must be >= 1, got -1$"):
            buf.combine(res.tokens, res.handle, num_sms=-1)
    finally:
        g.close()


def test_a_call_without_a_count_gets_the_one_default():
    g = EmulatedGroup(2, H, T, E, device="cpu", data_path="receive")
    try:
        assert g.kernel_config.num_sms_dispatch is None and g.kernel_config.num_sms_combine is None
        xs, idx = _inputs(2)
        res = g.dispatch(xs, idx)
        g.combine([r.tokens for r in res], [r.handle for r in res])
        assert _launched(g.engine) == {"dispatch_receive": {launch.DEFAULT_NUM_SMS_DISPATCH},
                                       "combine_receive": {launch.DEFAULT_NUM_SMS_COMBINE}}
        res = g.dispatch(xs, idx, num_sms=2)
        assert _launched(g.engine)["dispatch_receive"] == {launch.DEFAULT_NUM_SMS_DISPATCH, 2}
        assert set(g.engine.launch_shapes(2)) == {"dispatch_receive"}
        g.synchronize()
    finally:
        g.close()


def test_no_other_name_or_default_in_the_cuda_backend():
    """The names the count went by on its way (sms, blocks_per_rank, a KernelConfig called
    `kernel`) and a second default are gone from backends/cuda/*.py."""
    cuda = Path(REPO) / "hybrid_ep" / "backends" / "cuda"
    old_names = re.compile(r"\bsms\b|\bblocks_per_rank\b|\bkernel: KernelConfig|DEFAULT_SMS_")
    defaults = re.compile(r"DEFAULT_NUM_SMS_(DISPATCH|COMBINE)\b")
    found, uses = [], []
    for path in sorted(cuda.glob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if old_names.search(line):
                found.append(f"{path.name}:{n}: {line.strip()}")
            if defaults.search(line) and not line.lstrip().startswith("#"):
                uses.append(path.name)
    assert found == []
    assert sorted(set(uses)) == ["engine.py", "launch.py"]  # defined in launch.py, applied in the engine
