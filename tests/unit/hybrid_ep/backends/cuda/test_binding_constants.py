"""The codes csrc defines once (common/params.h: dtypes, transports, error phases, pipeline
sites) reach Python only through the bindings (csrc/bindings/common.h: DTYPE_CODES, TRANSPORTS,
PHASES, PIPE_SITES, as {name: code}). Both modules export the same tables, the Python tables
keyed by those names (launch.ELEM_BYTES, the RDMA region kinds, errors.PHASE_TEXT,
errors.PIPE_SITE_TEXT) name the same codes, and check_extension refuses a module whose tables
differ."""

from __future__ import annotations

import ctypes
import importlib
import re
import types

import pytest

from hybrid_ep.backends.cuda import launch
from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.backends.cuda.engine import SEAM, check_extension
from hybrid_ep.backends.cuda.errors import PHASE_TEXT, PIPE_SITE_TEXT, RoutingError
from hybrid_ep.backends.cuda.registered import LoopbackRegions, NvshmemRegions

pytestmark = pytest.mark.unit

TABLES = ("DTYPE_CODES", "TRANSPORTS", "PHASES", "PIPE_SITES")


def _module(name: str):
    """hybrid_ep._model is built in every install; hybrid_ep._C where it is importable."""
    try:
        return importlib.import_module(name)
    except ImportError as err:
        if name == "hybrid_ep._model":
            raise
        pytest.skip(f"{name} is not built here: {err}")


@pytest.mark.parametrize("name", ["hybrid_ep._model", "hybrid_ep._C"])
def test_the_exports_are_the_python_view(name):
    ext = _module(name)
    check_extension(ext)
    assert set(ext.DTYPE_CODES) == set(launch.ELEM_BYTES)
    assert set(ext.TRANSPORTS) == {LoopbackRegions.kind, NvshmemRegions.kind}
    assert set(ext.PHASES) == {"none", *PHASE_TEXT}
    assert set(ext.PIPE_SITES) == set(PIPE_SITE_TEXT)
    for table in TABLES:  # each code named once, 0 .. n-1 (params.h checks it at compile time)
        assert sorted(getattr(ext, table).values()) == list(range(len(getattr(ext, table)))), table
    assert ext.PHASES["none"] == 0  # the error record's "no error"
    assert ext.PIPE_SITES["none"] == 0  # a record of a wait that is not a ring's


def test_both_modules_export_the_same_codes():
    model, gpu = _module("hybrid_ep._model"), _module("hybrid_ep._C")
    for table in TABLES:
        assert getattr(gpu, table) == getattr(model, table), table


def _copy_of(ext, **changes):
    fake = types.SimpleNamespace(**{n: getattr(ext, n) for n in dir(ext) if n.isupper() or n in SEAM})
    fake.__name__ = "hybrid_ep._fake"
    for name, value in changes.items():
        if value is None:
            delattr(fake, name)
        else:
            setattr(fake, name, value)
    return fake


def test_check_extension_refuses_codes_python_does_not_name():
    model = _module("hybrid_ep._model")
    check_extension(_copy_of(model))
    with pytest.raises(RuntimeError, match=r"hybrid_ep\._fake\.PHASES names .*'new_wait'.* but errors\.PHASE_TEXT "
                                           r"names .*; rebuild the extension .*, or name the new code there"):
        check_extension(_copy_of(model, PHASES={**model.PHASES, "new_wait": len(model.PHASES)}))
    with pytest.raises(RuntimeError, match=r"hybrid_ep\._fake\.PIPE_SITES names .*'new_ring'.* but "
                                           r"errors\.PIPE_SITE_TEXT names"):
        check_extension(_copy_of(model, PIPE_SITES={**model.PIPE_SITES, "new_ring": len(model.PIPE_SITES)}))
    with pytest.raises(RuntimeError, match=r"hybrid_ep\._fake\.DTYPE_CODES names .* but launch\.ELEM_BYTES"):
        check_extension(_copy_of(model, DTYPE_CODES={"float32": 0}))
    with pytest.raises(RuntimeError, match=r"hybrid_ep\._fake has no TRANSPORTS; rebuild the extension"):
        check_extension(_copy_of(model, TRANSPORTS=None))


@pytest.mark.parametrize("name", SEAM)
def test_check_extension_refuses_a_module_without_the_per_call_structs(name):
    """The structs that cross into the host path per call (bindings/seam.h): a module built
    before them is stale."""
    with pytest.raises(RuntimeError, match=rf"hybrid_ep\._fake has no {name}; rebuild the extension"):
        check_extension(_copy_of(_module("hybrid_ep._model"), **{name: None}))


@pytest.mark.parametrize("name, python_value", [("MAX_STAGES", launch.MAX_STAGES),
                                                 ("MAX_STORE_GROUPS", launch.MAX_STORE_GROUPS),
                                                 ("DIRECT_COMBINE_PIPELINES", launch.DIRECT_COMBINE_PIPELINES)])
def test_the_launch_limits_are_the_bindings(name, python_value):
    """launch.py sizes the FIFOs by these on CPU without a module; check_extension holds them to csrc's."""
    model = _module("hybrid_ep._model")
    assert getattr(model, name) == python_value
    with pytest.raises(RuntimeError, match=rf"hybrid_ep\._fake has {name}={python_value + 1} but the package "
                                           rf"expects {python_value}; rebuild the extension"):
        check_extension(_copy_of(model, **{name: python_value + 1}))
    with pytest.raises(RuntimeError, match=rf"hybrid_ep\._fake has no {name}; rebuild the extension"):
        check_extension(_copy_of(model, **{name: None}))  # a module built before the name was exported


class ErrorRecordFields(ctypes.Structure):
    """common/params.h ErrorRecord, as the host maps it."""

    _fields_ = [("phase", ctypes.c_int32), ("rank", ctypes.c_int32), ("peer", ctypes.c_int32),
                ("site", ctypes.c_int32), ("call", ctypes.c_uint64), ("expected", ctypes.c_uint64),
                ("observed", ctypes.c_uint64)]


def test_the_engine_describes_each_phase_by_the_modules_code():
    """A timeout message names the phase the record's code stands for in the loaded module."""
    group = EmulatedGroup(2, 256, 8, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu")
    try:
        for name, code in group.ext.PHASES.items():
            if name in ("none", "bad_routing"):
                continue
            message = group.engine._describe({"phase": code, "rank": 0, "peer": 1, "call": 3, "expected": 3,
                                              "observed": 2})
            assert f"waiting for peer rank 1 in {PHASE_TEXT[name]} (call 3, expected 3, saw 2)" in message
        # a bad route is not a failure: its own record, raised once by the next call, by the module's code
        record = ErrorRecordFields.from_address(group.engine.bad_route.host_ptr)
        record.phase, record.rank, record.peer, record.expected, record.observed = (
            group.ext.PHASES["bad_routing"], 1, 5, 4, 9)
        record.call = 1  # written last, as the count kernel does
        with pytest.raises(RoutingError, match=re.escape("topk_idx values must be in [-1, 3] (num_experts=4), got 9 "
                                                         "at token 5 on rank 1")):
            group.engine.raise_if_failed()
        group.engine.raise_if_failed()  # raised once: the buffer works on
        assert group.engine.failure is None
    finally:
        group.close()


def test_a_bad_route_record_being_written_is_left_to_the_next_call():
    """The host reads the record without waiting: a record whose call word is still 0 (a
    count kernel between its writes) raises nothing now and the whole route later."""
    group = EmulatedGroup(2, 256, 8, 4, num_sms_dispatch=1, num_sms_combine=1, device="cpu")
    try:
        record = ErrorRecordFields.from_address(group.engine.bad_route.host_ptr)
        group.engine.errors.bad_route_raised = 7  # a route was raised before; the kernel zeroed the call word
        record.phase, record.rank, record.peer, record.expected, record.observed = (
            group.ext.PHASES["bad_routing"], 0, 2, 4, 4)
        group.engine.raise_if_failed()  # returns: nothing complete to raise
        record.call = 8
        with pytest.raises(RoutingError, match=re.escape("got 4 at token 2 on rank 0")):
            group.engine.raise_if_failed()
    finally:
        group.close()
