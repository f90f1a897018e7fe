"""What several test files share: where the checkout is, and the environment of a child Python
that must import this checkout's packages (a test may start it from another folder)."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_env(**extra: str) -> dict[str, str]:
    """os.environ with this checkout first on PYTHONPATH, and `extra` on top."""
    path = os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])
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
