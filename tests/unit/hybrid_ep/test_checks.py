"""hybrid_ep.checks: the one rule for integer and number arguments (an int, numpy's too, but not
a bool; numbers finite where asked), and the callers that word their errors with it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from hybrid_ep.balancer.placement import check_sizes
from hybrid_ep.checks import is_int, is_real, require_int
from hybrid_ep.config import BufferConfig
from megatron_patches.options import HybridEPOptions

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("value, lo, hi, ok", [
    (3, None, None, True), (np.int64(3), 1, None, True), (0, 1, None, False), (9, 2, 8, False), (8, 2, 8, True),
    (True, None, None, False), (np.bool_(True), None, None, False), (3.0, None, None, False),
    (None, None, None, False), ("3", None, None, False),
])
def test_is_int(value, lo, hi, ok):
    assert is_int(value, lo, hi) is ok


@pytest.mark.parametrize("value, finite, ok", [
    (1, False, True), (1.5, True, True), (np.float32(2), True, True), (math.inf, False, True),
    (math.inf, True, False), (math.nan, True, False), (False, False, False), ("1", False, False),
])
def test_is_real(value, finite, ok):
    assert is_real(value, finite=finite) is ok


def test_require_int_names_the_argument():
    assert require_int("count", 5, 1) == 5
    with pytest.raises(TypeError, match=r"^count must be an int, got bool$"):
        require_int("count", True, 1)
    with pytest.raises(TypeError, match=r"^nbytes must be an int number of bytes, got float$"):
        require_int("nbytes", 1.0, 0, what="an int number of bytes")
    with pytest.raises(ValueError, match=r"^count must be >= 1, got 0$"):
        require_int("count", 0, 1)


def test_every_caller_refuses_a_bool_by_name():
    with pytest.raises(TypeError, match="world_size must be an int, got bool"):
        BufferConfig(128, 16, 8, True, 1).validate()
    with pytest.raises(ValueError, match="hybrid_ep option pad_multiple must be an int >= 1, got True"):
        HybridEPOptions(pad_multiple=True).validate()
    with pytest.raises(ValueError, match="num_ranks must be a positive integer, got True"):
        check_sizes(4, 8, True, 1)
