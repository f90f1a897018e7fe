"""Which compiled module runs the kernels for a device, and the error where it is not built:
the CPU model (hybrid_ep._model) is in a development build only, so an install without it is
told how to build it, not a bare ModuleNotFoundError."""

from __future__ import annotations

import sys

import pytest

from hybrid_ep.backends.cuda import load_extension

pytestmark = pytest.mark.unit


def test_an_install_without_the_cpu_model_is_told_how_to_build_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "hybrid_ep._model", None)  # import fails as where it was never built
    with pytest.raises(ImportError, match=r"development build only: HYBRID_EP_BUILD_MODEL=1 pip install"):
        load_extension("cpu")


def test_a_device_with_no_kernels_is_refused_by_name():
    with pytest.raises(ValueError, match="not on 'meta'"):
        load_extension("meta")
