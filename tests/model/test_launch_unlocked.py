"""A kernel launch gives up the GIL while it runs: a launch can block until a peer's kernel runs
(a full launch queue, CUDA_LAUNCH_BLOCKING, the CPU model running the kernel in the call), and
that peer may first need a Python thread of this process (peer memory's chunk server) to answer
it. On the CPU model the launch runs the kernel, so a thread of this process must make progress
while one dispatch runs."""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch

from hybrid_ep.backends.cuda.emulation import EmulatedGroup

pytestmark = pytest.mark.model

W, H, T, E, K = 8, 2048, 1024, 16, 4


def test_a_python_thread_runs_while_a_kernel_launch_runs():
    group = EmulatedGroup(W, H, T, E, num_sms_dispatch=1, num_sms_combine=1, device="cpu", data_path="direct")
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=gen) for _ in range(W)]
    idx = [torch.argsort(torch.rand(T, E, generator=gen), dim=1)[:, :K].contiguous() for _ in range(W)]
    try:
        group.dispatch(xs, idx)  # warm: the first call's set-up is not the launch
        ticks: list[float] = []
        stop = threading.Event()

        def tick():
            while not stop.is_set():
                ticks.append(time.monotonic())
                time.sleep(1e-3)

        thread = threading.Thread(target=tick)
        thread.start()
        while not ticks:
            time.sleep(1e-3)
        launches = []
        real = group.engine.host.dispatch_rows

        def timed(*args):  # the dispatch kernel's launch, timed from Python
            start = time.monotonic()
            try:
                return real(*args)
            finally:
                launches.append((start, time.monotonic()))

        group.engine.host = _Timed(group.engine.host, dispatch_rows=timed)
        group.dispatch(xs, idx)
        stop.set()
        thread.join()
    finally:
        group.close()
    [(start, end)] = launches
    # Margins of two switch intervals (5 ms each) at both ends: outside the C call the thread
    # may get the GIL; inside it only if the launch gave it up.
    margin = 2 * sys.getswitchinterval()
    assert end - start > 4 * margin, "the launch is too short to tell"
    inside = [t for t in ticks if start + margin < t < end - margin]
    assert len(inside) >= 5, f"{len(inside)} ticks of the thread during a {end - start:.2f} s launch"


class _Timed:
    """The host path with some of its methods replaced."""

    def __init__(self, host, **methods):
        self._host, self._methods = host, methods

    def __getattr__(self, name):
        return self._methods.get(name) or getattr(self._host, name)
