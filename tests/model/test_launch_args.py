"""The launch arguments of each kind of launch (launch.KIND_SETTINGS), field by field, on the
CPU model: what every kind sets, then the kind's pipeline as launch.py shapes it, and nothing
else (every other field keeps LaunchArgs' default)."""

from __future__ import annotations

import pytest

from hybrid_ep.backends.cuda import launch
from hybrid_ep.backends.cuda.emulation import EmulatedGroup
from hybrid_ep.backends.cuda.layout import CHUNK_TOKENS, compiled
from hybrid_ep.config import FP8_BLOCK

pytestmark = pytest.mark.model

W, T, E = 2, 16, 4
# Every value field of LaunchArgs as the loaded module binds it (geo is the group's geometry,
# get_rank / set_rank the per-rank part): a field added there is compared here too.
FIELDS = tuple(n for n in dir(compiled.LaunchArgs())
               if not n.startswith("_") and n not in ("geo", "get_rank", "set_rank"))


@pytest.fixture(scope="module")
def engine():
    group = EmulatedGroup(W, 7168, T, E, device="cpu", num_sms_dispatch=1, num_sms_combine=1)
    yield group.engine
    group.close()


def _expected(e, kind: str, num_sms: int, dtype_name: str, cols: int, wire_name, apply_probs: bool) -> dict:
    """The fields as launch.py's shapes give them for `kind`, on LaunchArgs' defaults."""
    blank = e.ext.LaunchArgs()
    want = {name: getattr(blank, name) for name in FIELDS}
    want.update(num_ranks=W, num_sms=num_sms, dtype=e.ext.DTYPE_CODES[dtype_name], row_elems=cols,
                kd=int(e.reg.meta_entries), chunk_tokens=CHUNK_TOKENS, apply_probs=int(apply_probs),
                timeout_ns=e.timeout_ns, abort_flag=e.abort.data_ptr(), error=e.error.device_ptr,
                bad_route=e.bad_route.device_ptr)
    smem, row_bytes = e.smem_per_block, launch.row_bytes_of(cols, dtype_name)
    if kind.startswith("dispatch") and dtype_name == "float8_e4m3fn":
        want["scale_cols"] = cols // FP8_BLOCK
    if kind == "dispatch_receive":
        fifo = launch.fifo_shape(row_bytes, smem, pipelines=launch.DISPATCH_PIPELINES)
        want.update(fifo_stages=fifo.stages, stage_bytes=fifo.stage_bytes, rows_per_stage=fifo.rows_per_stage,
                    store_groups=launch.store_groups(fifo.stages))
    elif kind == "dispatch_direct":
        fifo = launch.direct_fifo_shape(row_bytes, smem)
        want.update(fifo_stages=fifo.stages, stage_bytes=fifo.stage_bytes, rows_per_stage=fifo.rows_per_stage,
                    store_groups=launch.direct_store_groups(fifo.stages, fifo.stage_bytes))
    elif kind == "combine_direct":  # one node: a stage holds expert outputs only, whatever the wire dtype
        shape = launch.direct_combine_shape(cols, launch.ELEM_BYTES[dtype_name], smem)
        want.update(wire_dtype=e.ext.DTYPE_CODES[wire_name or dtype_name], seg_cols=shape.seg_cols,
                    src_stages=shape.stages, src_stage_bytes=shape.stage_bytes)
    else:
        shape = launch.combine_shape(cols, launch.ELEM_BYTES[dtype_name], launch.ELEM_BYTES[wire_name], smem)
        want.update(wire_dtype=e.ext.DTYPE_CODES[wire_name], seg_cols=shape.seg_cols, host_stages=shape.host_stages,
                    src_stages=shape.src_stages, host_out_stages=shape.out_stages,
                    host_stage_bytes=shape.host_stage_bytes, src_stage_bytes=shape.src_stage_bytes,
                    store_groups=launch.combine_store_groups(shape.out_stages))
    return want


CASES = [
    ("dispatch_receive", 1, "bfloat16", 7168, None, False),
    ("dispatch_receive", 2, "float8_e4m3fn", 7168, None, False),
    ("dispatch_direct", 1, "bfloat16", 7168, None, False),
    ("dispatch_direct", 3, "float8_e4m3fn", 1024, None, False),
    ("dispatch_direct", 1, "float32", 256, None, False),
    ("combine_receive", 1, "bfloat16", 7168, "bfloat16", False),
    ("combine_receive", 2, "bfloat16", 7168, "float32", True),
    ("combine_receive", 1, "float32", 64, "float32", False),
    ("combine_direct", 1, "bfloat16", 7168, "bfloat16", True),
    ("combine_direct", 2, "float32", 1024, "float32", False),
]


@pytest.mark.parametrize("kind,num_sms,dtype_name,cols,wire_name,apply_probs", CASES)
def test_each_kind_sets_its_pipeline_and_nothing_else(engine, kind, num_sms, dtype_name, cols, wire_name,
                                                     apply_probs):
    args = engine._launch_args(num_sms, dtype_name, cols, kind, wire_name, apply_probs)
    assert len(FIELDS) >= 24 and "num_sms" in FIELDS
    got = {name: getattr(args, name) for name in FIELDS}
    assert got == _expected(engine, kind, num_sms, dtype_name, cols, wire_name, apply_probs)
    assert (args.geo.world_size, args.geo.hidden) == (W, 7168)
    # Built once per key; the pipeline depth launch_shapes reports is the kind's own field.
    assert engine._launch_args(num_sms, dtype_name, cols, kind, wire_name, apply_probs) is args
    stages = {"dispatch_receive": args.fifo_stages, "dispatch_direct": args.fifo_stages,
              "combine_receive": args.host_out_stages,
              "combine_direct": args.src_stages}[kind]
    assert engine.launch_shapes(num_sms)[kind]["stages"] == stages > 1


def test_a_combine_with_and_without_probs_launches_with_its_own_flag(engine):
    """apply_probs is part of the launch arguments' key: a combine never sees the flag of the
    combine before it."""
    on = engine._launch_args(1, "bfloat16", 512, "combine_receive", "bfloat16", True)
    off = engine._launch_args(1, "bfloat16", 512, "combine_receive", "bfloat16", False)
    assert (on.apply_probs, off.apply_probs) == (1, 0)


def test_the_sm_count_error_names_the_role(engine):
    with pytest.raises(ValueError, match=r"^num_sms \(combine\) must be >= 1, got 0$"):
        engine._launch_args(0, "bfloat16", 512, "combine_direct", "bfloat16")
    with pytest.raises(ValueError, match=r"^num_sms \(dispatch\) must be >= 1, got 0$"):
        engine._launch_args(0, "bfloat16", 512, "dispatch_direct")


def test_a_direct_combine_on_several_nodes_sizes_its_stages_for_the_wire_dtype():
    """On several nodes a direct-combine stage also holds a node partial in the wire dtype: an fp32
    wire for bf16 rows takes stages of fp32 segments, a bf16 wire those of the rows."""
    group = EmulatedGroup(4, 7168, T, 8, device="cpu", ranks_per_node=2, num_sms_dispatch=1, num_sms_combine=1)
    try:
        e = group.engine
        for wire in ("float32", "bfloat16"):
            args = e._launch_args(1, "bfloat16", 7168, "combine_direct", wire, False)
            shape = launch.direct_combine_shape(7168, launch.ELEM_BYTES[wire], e.smem_per_block)
            assert (args.wire_dtype, args.seg_cols, args.src_stages, args.src_stage_bytes) == (
                e.ext.DTYPE_CODES[wire], shape.seg_cols, shape.stages, shape.stage_bytes)
        smem = e.smem_per_block
        assert launch.direct_combine_shape(7168, 4, smem) != launch.direct_combine_shape(7168, 2, smem)
    finally:
        group.close()
