"""How many kernel launches, calls into the extension's host path and host reads each call of
the cuda backend makes, on the CPU model, against the designed numbers (docs/dev/cuda_host.md,
"The host path per call"): a dispatch of known size (num_out_tokens, or a handle's) launches
its two kernels in one call and reads nothing back; a dynamic-size dispatch launches the count
kernel, reads the output sizes once, then launches the dispatch kernel; a combine is one call
and one kernel. With peer memory (ranks in separate processes) a call of known size that the
agreement's ledger holds launches both kernels and makes its blocks' tensors in one call, and
sets no agreement words; a dispatch that reads first sets each driven rank's words (no launch),
and a call of known size that the ledger does not hold takes the dynamic sequence (one read).

Counted: kernel launches by the extension's own table (ext.launches_made: what the HostPath
calls launched, per kernel), calls into ext.HostPath by a proxy, and host reads of tensor
values (Tensor.tolist and Tensor.numpy, and aten's _local_scalar_dense behind item(), int(),
bool()): on a GPU each such read is a host synchronisation with the device; here the tensors
are host tensors, so a read is counted where the code makes it."""

from __future__ import annotations

import collections
import contextlib

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hybrid_ep.backends.cuda.emulation import EmulatedGroup

pytestmark = pytest.mark.model

W, H, T, E, K = 2, 256, 16, 4, 2
STATIC = W * T * K
PATHS = ("receive", "direct", "peer")
KERNELS = {  # path -> (dispatch kernel, combine kernel)
    "receive": ("dispatch_receive", "combine_receive"), "direct": ("dispatch_direct", "combine_direct"),
    "peer": ("dispatch_direct", "combine_direct")}


def _group(path: str, world_size: int = W) -> EmulatedGroup:
    """The receive path; the direct path of ranks in one process (outputs from PyTorch's
    allocator), and of ranks in separate processes (peer memory)."""
    return EmulatedGroup(world_size, H, T, E, num_sms_dispatch=1, num_sms_combine=1, device="cpu",
                         data_path="receive" if path == "receive" else "direct",
                         separate_processes=path == "peer")


def _inputs(world_size: int = W, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    xs = [torch.randn(T, H, generator=gen) for _ in range(world_size)]
    idx = [torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous() for _ in range(world_size)]
    ws = [torch.rand(T, K, generator=gen) for _ in range(world_size)]
    return xs, idx, ws


class _Scalars(TorchDispatchMode):
    def __init__(self, reads: collections.Counter):
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket is torch.ops.aten._local_scalar_dense:
            self.reads[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


class _HostCalls:
    """A proxy of the engine's ext.HostPath that counts the calls into it by name."""

    def __init__(self, host, calls: collections.Counter):
        self.host, self.calls = host, calls

    def __getattr__(self, name):
        self.calls[name] += 1
        return getattr(self.host, name)


class Counted:
    launches: dict
    host_calls: dict
    reads: dict


@contextlib.contextmanager
def counting(engine, monkeypatch):
    """Counts what runs inside: kernel launches per kernel, HostPath calls per name, host reads."""
    ext, got = engine.ext, Counted()
    reads, calls = collections.Counter(), collections.Counter()
    for name in ("tolist", "numpy"):
        original = getattr(torch.Tensor, name)

        def read(self, *args, _name=name, _original=original, **kwargs):
            reads[_name] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)
    before = ext.launches_made()
    host = engine.host
    engine.host = _HostCalls(host, calls)
    try:
        with _Scalars(reads):
            yield got
    finally:
        engine.host = host
        monkeypatch.undo()
    after = ext.launches_made()
    got.launches = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    got.host_calls, got.reads = dict(calls), dict(reads)


def _known(path: str) -> dict:
    """calls into HostPath of a dispatch of known size that launches both kernels at once: with
    blocks of peer memory, their tensors in the same call; with peer memory no
    agreement words (the ledger holds the call, so no rank reads them)."""
    return {"dispatch_into" if path == "peer" else "dispatch": 1}


def _oracle(group, xs, ws, ys) -> None:
    group.synchronize()
    for r, y in enumerate(ys):
        torch.testing.assert_close(y, (ws[r][:, :, None] * xs[r][:, None, :]).sum(dim=1), rtol=1e-5, atol=1e-5)


def _redispatch_is_known(group, path, xs, res, monkeypatch) -> None:
    """A re-dispatch with the handles (their sizes known): as a static dispatch, the rows where
    the first dispatch put them."""
    with counting(group.engine, monkeypatch) as again:
        out = group.redispatch(xs, [r.handle for r in res])
    assert (again.launches, again.host_calls, again.reads) == \
        ({"count": 1, KERNELS[path][0]: 1}, _known(path), {})
    group.synchronize()
    for a, b in zip(out, res):
        assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("path", PATHS)
def test_static_dispatch_and_combine_launch_two_kernels_then_one_and_read_nothing(path, monkeypatch):
    group = _group(path)
    try:
        xs, idx, ws = _inputs()
        for _ in range(2):  # with peer memory: the first calls read (the ledger is empty) and grow
            res = group.dispatch(xs, idx, ws, num_out_tokens=STATIC)
            group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
        del res
        dispatch_kernel, combine_kernel = KERNELS[path]
        with counting(group.engine, monkeypatch) as dispatched:
            res = group.dispatch(xs, idx, ws, num_out_tokens=STATIC)
        assert res[0].handle.data_path == ("receive" if path == "receive" else "direct")
        assert dispatched.launches == {"count": 1, dispatch_kernel: 1}
        assert dispatched.host_calls == _known(path)
        assert dispatched.reads == {}
        with counting(group.engine, monkeypatch) as combined:
            ys = group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
        assert (combined.launches, combined.host_calls, combined.reads) == ({combine_kernel: 1}, {"combine": 1}, {})
        _oracle(group, xs, ws, ys)
        _redispatch_is_known(group, path, xs, res, monkeypatch)
    finally:
        group.close()


@pytest.mark.parametrize("path", PATHS)
def test_dynamic_dispatch_reads_once_between_its_two_launches(path, monkeypatch):
    group = _group(path)
    try:
        xs, idx, ws = _inputs()
        for _ in range(2):
            res = group.dispatch(xs, idx, ws)
            group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
        del res
        dispatch_kernel, combine_kernel = KERNELS[path]
        with counting(group.engine, monkeypatch) as dispatched:
            res = group.dispatch(xs, idx, ws)
        assert res[0].handle.data_path == ("receive" if path == "receive" else "direct")
        assert dispatched.launches == {"count": 1, dispatch_kernel: 1}
        calls = {"dispatch_count": 1, "dispatch_rows_into" if path == "peer" else "dispatch_rows": 1}
        assert dispatched.host_calls == ({"set_agree": W, **calls} if path == "peer" else calls)
        assert dispatched.reads == {"tolist": 1}  # the sizes (and the agreement's words) in one read
        with counting(group.engine, monkeypatch) as combined:
            ys = group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
        assert (combined.launches, combined.host_calls, combined.reads) == ({combine_kernel: 1}, {"combine": 1}, {})
        _oracle(group, xs, ws, ys)
        _redispatch_is_known(group, path, xs, res, monkeypatch)  # the backward of combine in training
    finally:
        group.close()


def test_a_static_call_the_ledger_does_not_hold_reads_once(monkeypatch):
    """Peer memory, a fresh buffer: its first static call has no ledger to decide from, so it
    launches the count kernel, reads the agreement's words, then the dispatch kernel (the
    receive path while the memory grows); the next calls go direct without reading."""
    group = _group("peer")
    try:
        xs, idx, ws = _inputs()
        seen = []
        for _ in range(3):
            with counting(group.engine, monkeypatch) as c:
                res = group.dispatch(xs, idx, ws, num_out_tokens=STATIC)
            seen.append((res[0].handle.data_path, c.launches, c.reads))
            ys = group.combine([r.tokens for r in res], [r.handle for r in res], apply_probs=True)
            _oracle(group, xs, ws, ys)
            del res
        assert seen == [("receive", {"count": 1, "dispatch_receive": 1}, {"tolist": 1}),
                        ("direct", {"count": 1, "dispatch_direct": 1}, {"tolist": 1}),
                        ("direct", {"count": 1, "dispatch_direct": 1}, {})]
    finally:
        group.close()


@pytest.mark.parametrize("path", ["receive", "direct", "peer"])
def test_buffer_pair_of_one_rank_per_process(path, monkeypatch):
    """HybridEPBuffer over the cuda backend, one rank per process (W = 1), through
    hybrid_ep.dispatch / combine with inputs asking for gradients (Megatron's forward): still two
    launches and one, no read."""
    import hybrid_ep as hep
    from hybrid_ep.bench.host import _single_rank_buffer, _world_of_one

    group = _group(path, world_size=1)
    try:
        with _world_of_one():
            buf = _single_rank_buffer(group)
            xs, idx, ws = _inputs(1)
            x, w = xs[0].clone().requires_grad_(), ws[0].clone().requires_grad_()
            for _ in range(2):
                res = hep.dispatch(buf, x, idx[0], w, num_out_tokens=T * K)
                hep.combine(buf, res.tokens, res.handle, apply_probs=True)
            del res
            dispatch_kernel, combine_kernel = KERNELS[path]
            with counting(buf._backend._engine, monkeypatch) as dispatched:
                res = hep.dispatch(buf, x, idx[0], w, num_out_tokens=T * K)
            with counting(buf._backend._engine, monkeypatch) as combined:
                y = hep.combine(buf, res.tokens, res.handle, apply_probs=True)
            assert res.handle.data_path == ("receive" if path == "receive" else "direct")
            assert (dispatched.launches, dispatched.host_calls, dispatched.reads) == \
                ({"count": 1, dispatch_kernel: 1}, _known(path), {})
            assert (combined.launches, combined.host_calls, combined.reads) == ({combine_kernel: 1}, {"combine": 1}, {})
            _oracle(group, [x.detach()], [w.detach()], [y.detach()])
    finally:
        group.close()
