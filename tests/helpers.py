"""What several test files share: where the checkout is, and the environment of a child Python
that must import this checkout's packages (a test may start it from another folder)."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The direct combine's knob combinations the GPU lease times (scripts/gpu_short_lease.sh, its
# combine variants), each checked against the oracle on the CPU model (tests/model) and on the GPU
# (tests/gpu) before it is timed: (HYBRID_EP_COMBINE_STAGE, HYBRID_EP_REDUCER_WAIT,
# HYBRID_EP_REDUCER_WARPS), None the default (route, observe, 4). The first is CI's.
LEASE_COMBINE_VARIANTS = (("token", "named", "8"), ("route", "converged", "8"), ("route", "elect", "8"),
                          ("route", "named", None), ("route", "named", "8"), ("token", None, None),
                          ("token", "converged", None), ("token", "converged", "8"), ("token", "elect", None),
                          ("token", "elect", "8"), ("token", "named", None))


def checkout_env(**extra: str) -> dict[str, str]:
    """os.environ with this checkout and its tests/ (the harnesses) first on PYTHONPATH, and
    `extra` on top."""
    path = os.pathsep.join([REPO, os.path.join(REPO, "tests")] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return dict(os.environ, PYTHONPATH=path, **extra)


def built_cuda_extension():
    """hybrid_ep._C where this install built it. setup.py builds it where a GPU is visible (or
    with HYBRID_EP_FORCE_CUDA_BUILD=1, scripts/env.sh); elsewhere the tests that need it skip,
    and scripts/compile_csrc.sh still compiles its sources. Missing beside a GPU is a failure."""
    import importlib

    import pytest
    import torch

    try:
        return importlib.import_module("hybrid_ep._C")
    except ImportError as err:
        if torch.cuda.is_available():
            pytest.fail(f"hybrid_ep._C must be built wherever a GPU is visible: {err}")
        pytest.skip("hybrid_ep._C is not built here (no GPU; HYBRID_EP_FORCE_CUDA_BUILD=1 builds it)")


def static_reference_round_trip(window):
    """The reference backend's static-size dispatch + combine (num_out_tokens, as Megatron's
    moe_expert_rank_capacity_factor gives it) on this rank of the default group, twice: the
    first call sets up the communicator, pinned host memory and the cached maps; `window()` is
    the context around the second (set_sync_debug_mode on a GPU, a recorder on the CPU).
    Returns (backend, output rows, rows dropped, whether combine gave 2 x: both routes summed)."""
    import torch
    import torch.distributed as dist

    import hybrid_ep as hep

    T, H, E = 16, 256, 4
    buf = hep.HybridEPBuffer(None, H, T, E, backend="reference")
    dev = buf.device
    t = torch.arange(T)
    idx = torch.stack([t % E, (t + 1 + dist.get_rank()) % E], dim=1).to(dev)
    w = torch.rand(T, 2, device=dev)
    x = torch.randn(T, H, device=dev, dtype=torch.bfloat16)

    def round_trip():
        res = buf.dispatch(x, idx, w, num_out_tokens=2 * T + 8)
        return res, buf.combine(res.tokens, res.handle)

    round_trip()
    with window():
        res, y = round_trip()
    return buf.backend, res.tokens.shape[0], int(res.handle.num_dropped), torch.equal(y, 2 * x)


def assert_migration_kept_output(before, after, bf16: bool) -> None:
    """A layer's output just before and after a balancer migration (the same input): equal
    up to rounding. Not bit for bit: a migration changes how many rows an expert's batch
    has and where a token's row sits in it, so fp32 sums come out in another order (1e-6),
    and in bf16 an expert's output moves by one ulp now and then (PyTorch's CPU elementwise
    kernels compute an element in the vectorised body of the loop or in its scalar tail,
    whose GELU can differ in the last bit; GPU GEMMs tile by the batch likewise). A wrong or
    stale weight or optimizer state moves outputs by far more than these bounds."""
    import torch

    if bf16:
        ulp = 2.0**-7  # bf16's 8 significant bits: an ulp is at most 2**-7 of the value
        torch.testing.assert_close(after, before, rtol=ulp, atol=ulp * float(before.abs().max()))
    else:
        torch.testing.assert_close(after, before, rtol=0, atol=1e-6)


def numbers_without_units(doc: dict) -> set[str]:
    """Keys of the number fields outside `metadata` that no key on their path has a unit for."""
    units, missing = doc["metadata"]["units"], set()

    def walk(value, path):
        if isinstance(value, dict):
            for key, item in value.items():
                if key != "metadata":
                    walk(item, path + (key,))
        elif isinstance(value, list):
            for item in value:
                walk(item, path)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            if not any(key in units for key in path):
                missing.add(path[-1])

    walk(doc, ())
    return missing
