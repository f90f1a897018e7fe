"""Launch configuration: SM counts, FIFO shape, chunk size, the co-residency check, and the
launch arguments of each kind of launch (LaunchSettings).

Everything here is plain arithmetic on the device's properties, so it is tested on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

from ...config import FP8_BLOCK
from .layout import CHUNK_TOKENS, compiled

# SMs per rank of a call that names none (num_sms None: the API's num_sms_dispatch /
# num_sms_combine unset); Engine.dispatch and Engine.combine apply them, nothing else does.
# Defaults until measured on the device (docs/benchmarks/cuda.md says which numbers exist).
DEFAULT_NUM_SMS_DISPATCH = 8
DEFAULT_NUM_SMS_COMBINE = 8
MAX_STAGES: int = compiled.MAX_STAGES  # slots of one pipeline's ring
MAX_STAGE_BYTES = 32 * 1024  # a row larger than this is moved in segments of this size
TARGET_STAGE_BYTES = 16 * 1024  # smaller rows are batched up to about this many bytes per stage
MAX_BATCH_ROWS = CHUNK_TOKENS  # whole rows in one stage: a chunk's
STATIC_SMEM_RESERVE: int = compiled.STATIC_SMEM_RESERVE  # the kernels' static shared memory (tables, barriers) at most
DISPATCH_PIPELINES = 2  # dispatch's send and expand FIFOs share the dynamic shared memory

# The dtypes the kernels move, by torch's name; their codes are csrc's (ext.DTYPE_CODES, checked
# against these names by engine.check_extension).
ELEM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclasses.dataclass(frozen=True)
class FifoShape:
    stages: int
    stage_bytes: int
    rows_per_stage: int  # whole rows one stage carries (1: a row fills a stage, or several)

    @property
    def smem_bytes(self) -> int:
        return self.stages * self.stage_bytes


def fifo_shape(row_bytes: int, smem_per_block: int, max_stages: int = 8,
               chunk_tokens: int = CHUNK_TOKENS, pipelines: int = 1, stage_multiple: int = 1) -> FifoShape:
    """Stages sized in bytes: rows of up to TARGET_STAGE_BYTES are batched, as many whole rows
    as fit (at most a chunk's, MAX_BATCH_ROWS), so small rows still move in large copies; a
    row up to MAX_STAGE_BYTES fills one stage; a larger row is cut into segments of
    MAX_STAGE_BYTES. As many stages as `pipelines` FIFOs of this shape leave in the shared
    memory, up to max_stages each (dispatch runs two: send and expand), a multiple of
    `stage_multiple` (the direct dispatch's store threads take the items in turn, and its
    launcher refuses another count)."""
    if row_bytes <= 0 or row_bytes % 16 != 0:
        raise ValueError(f"row bytes must be a positive multiple of 16, got {row_bytes}")
    if row_bytes > MAX_STAGE_BYTES:
        rows, stage = 1, MAX_STAGE_BYTES
    else:
        rows = max(1, min(MAX_BATCH_ROWS, chunk_tokens, TARGET_STAGE_BYTES // row_bytes))
        stage = rows * row_bytes
    budget = (smem_per_block - STATIC_SMEM_RESERVE) // pipelines
    stages = min(max_stages, MAX_STAGES, budget // stage) // stage_multiple * stage_multiple
    if stages < 2:
        raise ValueError(f"shared memory per block ({smem_per_block} B) holds fewer than 2 FIFO stages of {stage} B")
    return FifoShape(stages=stages, stage_bytes=stage, rows_per_stage=rows)


COMBINE_MAX_SEG_COLS: int = compiled.COMBINE_MAX_SEG_COLS  # columns a reducer group holds in registers
TARGET_COMBINE_SEGMENT_BYTES = 16 * 1024  # wider rows are cut into column segments of about this size
COMBINE_OUT_BYTES = 48 * 1024  # partials the expert host keeps in its output ring (at least 2 stages)


@dataclasses.dataclass(frozen=True)
class CombineShape:
    seg_cols: int  # columns per stage: the whole row when it fits, else a multiple of 8
    host_stages: int  # expert host: one route's expert-output segment each (in_bytes per column)
    out_stages: int  # expert host: one partial each, until its bulk store has read it (wire_bytes)
    src_stages: int  # source: one partial segment each (wire_bytes per column)
    host_stage_bytes: int
    src_stage_bytes: int  # also the bytes of an output stage

    @property
    def smem_bytes(self) -> int:
        return self.host_stages * self.host_stage_bytes + (self.out_stages + self.src_stages) * self.src_stage_bytes


def combine_shape(cols: int, in_bytes: int, wire_bytes: int, smem_per_block: int,
                  max_stages: int = MAX_STAGES) -> CombineShape:
    """Stages of one row segment each: the whole row up to COMBINE_MAX_SEG_COLS columns and
    TARGET_COMBINE_SEGMENT_BYTES, else segments of a multiple of 8 columns (16-byte aligned).
    The output ring gets about COMBINE_OUT_BYTES (the bulk stores read a partial within a few
    rows' time); the expert host's input ring and the source's ring share the rest equally,
    so small rows get deep rings (more copies in flight) and 16 KiB rows five stages each."""
    if cols <= 0 or cols % 4 != 0:
        raise ValueError(f"expert_out rows must have a positive multiple of 4 columns, got {cols}")
    widest = max(in_bytes, wire_bytes)
    seg = min(COMBINE_MAX_SEG_COLS, TARGET_COMBINE_SEGMENT_BYTES // widest)
    seg = cols if seg >= cols else max(8, seg // 8 * 8)
    host, wire = seg * in_bytes, seg * wire_bytes
    budget = smem_per_block - STATIC_SMEM_RESERVE
    out = min(max_stages, max(2, -(-COMBINE_OUT_BYTES // wire)))
    each = min(max_stages, (budget - out * wire) // (host + wire))
    if each < 2:
        raise ValueError(f"shared memory per block ({smem_per_block} B) holds fewer than 2 combine stages of "
                         f"{host} + {wire} B beside {out} output stages")
    return CombineShape(seg_cols=seg, host_stages=each, out_stages=out, src_stages=each, host_stage_bytes=host,
                        src_stage_bytes=wire)


DATA_PATH_ENV = "HYBRID_EP_DATA_PATH"
DATA_PATHS = ("direct", "receive")


def data_path(can_go_direct: bool, requested: str | None = None, environ=None) -> str:
    """Which data path a buffer's kernels take. "direct": sources store each route's row
    straight into its final row at the expert's rank and the direct combine reads each route's
    expert output straight from there (1 + K row moves per token; needs the ranks of each node
    to address each other's tensors: ranks sharing one process, or ranks in separate processes
    with peer memory, the path agreed per call (agreement.py); across nodes each token goes
    once per other node to the rail peer there, which writes its rows on that node and sends
    one node partial back). "receive": rows go through a bounded receive ring once per
    destination rank and are expanded there, partial sums are pushed back the same way
    (separate processes without peer memory, and any call the agreement sends there).
    HYBRID_EP_DATA_PATH picks one for measurements; unset, direct wherever it can run.
    `requested` (an argument, for tests and benchmarks) wins over the variable."""
    environ = os.environ if environ is None else environ
    name = "data_path" if requested is not None else DATA_PATH_ENV
    raw = requested if requested is not None else environ.get(DATA_PATH_ENV) or None
    if raw is not None and raw not in DATA_PATHS:
        raise ValueError(f"{name} must be one of {', '.join(DATA_PATHS)}, got {raw!r}")
    if raw == "direct" and not can_go_direct:
        raise ValueError(f"{name}=direct needs one node whose ranks address each other's tensors: ranks in one "
                         f"process, or ranks in separate processes with peer memory; this buffer's ranks can not")
    if raw is not None:
        return raw
    return "direct" if can_go_direct else "receive"


# One SM's bulk stores, measured by the microbenchmarks on an H200 on 2026-11-26
# (benchmarks/results/2026-11-26-h200/micro.txt): C_store, stores only, 16 KiB copies (the
# same from 1 to 4 issuing threads and from 1 to 7 groups left reading), and L_store_read, a
# 16 KiB store from its issue until wait_group.read 0 returns.
STORE_BYTES_PER_NS = 63.17
STORE_READ_NS = 317.4


def direct_store_groups(stages: int, stage_bytes: int, override: int | None = None) -> int:
    """Bulk-store groups each of the direct dispatch's two store threads lets still read
    their stages (each thread stores every other stage, once per route). Little's law: to
    keep an SM's stores going, the bytes in flight must cover the stores' read latency at
    their rate, STORE_BYTES_PER_NS x STORE_READ_NS (about 20 KB); a group is at least one
    stage's bytes (one route), and the two threads' groups are in flight together, so one
    group each covers it from 16 KiB stages on (at 2 or more routes per thread, several
    times). More groups only hold stages away from the loads: on 2026-11-26 (H200) 7 groups
    of 4 stores per thread left the loads 5 of the 13 stages, and the receive path's
    dispatch was 2.5-7 % faster with 1 group than with 4 (bench_receive*). The microbenchmarks
    reach the stores' full rate with 1 group left reading (stores only, and 1 load + 4 stores
    per stage) and lose a quarter with 0."""
    if stages < 2:
        raise ValueError(f"stages must be >= 2, got {stages}")
    if stage_bytes <= 0:
        raise ValueError(f"stage_bytes must be positive, got {stage_bytes}")
    if override is None:
        groups = max(1, math.ceil(STORE_BYTES_PER_NS * STORE_READ_NS / DIRECT_STORE_THREADS / stage_bytes))
    else:
        groups = override
    # The threads' newest groups together hold DIRECT_STORE_THREADS x groups stages; with the
    # stage being stored they must leave the loads one, or a load would wait for a release
    # that waits for a later load (the kernel clamps the same way).
    return min(groups, (stages - 1) // DIRECT_STORE_THREADS, MAX_STORE_GROUPS)


DIRECT_STORE_THREADS: int = compiled.DIRECT_STORE_THREADS  # the store threads of a direct dispatch block


def direct_fifo_shape(row_bytes: int, smem_per_block: int) -> FifoShape:
    """The direct dispatch's FIFO: fifo_shape's, its stages a multiple of DIRECT_STORE_THREADS.
    The store threads take alternate stages, so each stage has one consumer that waits on its
    rounds in order; with an odd count a thread could wait on the next round of a stage whose
    current one (the other thread's) had not landed, and a parity wait one phase ahead passes at
    once. The kernel's launcher refuses another count (launch_dispatch_direct in
    csrc/kernels/dispatch_direct.cuh)."""
    return fifo_shape(row_bytes, smem_per_block, max_stages=MAX_STAGES, stage_multiple=DIRECT_STORE_THREADS)


@dataclasses.dataclass(frozen=True)
class DirectCombineShape:
    seg_cols: int  # columns per stage (as combine_shape's)
    stages: int  # of each of the DIRECT_COMBINE_PIPELINES pipelines
    stage_bytes: int

    @property
    def smem_bytes(self) -> int:
        return DIRECT_COMBINE_PIPELINES * self.stages * self.stage_bytes


DIRECT_COMBINE_PIPELINES: int = compiled.DIRECT_COMBINE_PIPELINES  # pipelines of a combine_direct block


def direct_combine_shape(cols: int, in_bytes: int, smem_per_block: int,
                         max_stages: int = MAX_STAGES) -> DirectCombineShape:
    """The direct combine's rings: one expert-output segment per stage (the whole row up to
    COMBINE_MAX_SEG_COLS columns and TARGET_COMBINE_SEGMENT_BYTES), as many stages as the
    shared memory holds, split between its two pipelines."""
    if cols <= 0 or cols % 4 != 0:
        raise ValueError(f"expert_out rows must have a positive multiple of 4 columns, got {cols}")
    seg = min(COMBINE_MAX_SEG_COLS, TARGET_COMBINE_SEGMENT_BYTES // in_bytes)
    seg = cols if seg >= cols else max(8, seg // 8 * 8)
    stage = seg * in_bytes
    stages = min(max_stages, (smem_per_block - STATIC_SMEM_RESERVE) // (DIRECT_COMBINE_PIPELINES * stage))
    if stages < 2:
        raise ValueError(f"shared memory per block ({smem_per_block} B) holds fewer than 2 direct-combine stages "
                         f"of {stage} B per pipeline")
    return DirectCombineShape(seg_cols=seg, stages=stages, stage_bytes=stage)


STORE_GROUPS_ENV = "HYBRID_EP_STORE_GROUPS"
MAX_STORE_GROUPS: int = compiled.MAX_STORE_GROUPS  # cp.async.bulk.wait_group takes an immediate


def _env_raw(name: str, environ=None) -> str | None:
    """What a measurement variable holds; None when it is unset or empty."""
    raw = (os.environ if environ is None else environ).get(name)
    return raw or None


def _int_from_env(name: str, low: int, high: int, environ=None) -> int | None:
    """The integer a measurement variable holds, in [low, high]; None when it is unset or empty."""
    raw = _env_raw(name, environ)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ValueError(f"{name} must be an integer from {low} to {high}, got {raw!r}")
    return value


def store_groups_override(environ=None) -> int | None:
    """HYBRID_EP_STORE_GROUPS, for measuring the store queue's depth (docs/benchmarks/cuda.md);
    None when unset."""
    return _int_from_env(STORE_GROUPS_ENV, 0, MAX_STORE_GROUPS, environ)


DIRECT_COMBINE_STAGES_ENV = "HYBRID_EP_DIRECT_COMBINE_STAGES"
OLD_DIRECT_COMBINE_STAGES_ENV = "HYBRID_EP_PULL_STAGES"  # its old name: refused while set, never ignored


def direct_combine_stages_override(environ=None) -> int | None:
    """HYBRID_EP_DIRECT_COMBINE_STAGES: the direct combine's stages per pipeline, at most what
    the shared memory holds (direct_combine_shape); None when unset. For measuring how the
    combine's rate follows the bytes its loads have in flight, at the same stage size and reducer
    code (docs/benchmarks/cuda.md). The old name set raises, so a run meant to measure fewer
    stages does not measure the default."""
    if _env_raw(OLD_DIRECT_COMBINE_STAGES_ENV, environ) is not None:
        raise ValueError(f"{OLD_DIRECT_COMBINE_STAGES_ENV} was renamed {DIRECT_COMBINE_STAGES_ENV}: set "
                         f"{DIRECT_COMBINE_STAGES_ENV} instead and unset {OLD_DIRECT_COMBINE_STAGES_ENV}")
    return _int_from_env(DIRECT_COMBINE_STAGES_ENV, 2, MAX_STAGES, environ)


REDUCER_WAIT_ENV = "HYBRID_EP_REDUCER_WAIT"
# How a direct-combine reducer warp learns that a stage is full (csrc/common/params.h): lane 0
# waits and the warp agrees, then the other lanes observe the phase themselves ("observe", the
# default) or rely on the agreement's __syncwarp ("elect"); or every lane waits itself, the warp
# converged, and a vote gives the verdict ("converged"); or one thread of the reducer group waits
# and the group meets at a named barrier ("named", Hybrid-EP's hand-off).
REDUCER_WAIT_OBSERVE: int = compiled.REDUCER_WAIT_OBSERVE
REDUCER_WAIT_ELECT: int = compiled.REDUCER_WAIT_ELECT
REDUCER_WAIT_CONVERGED: int = compiled.REDUCER_WAIT_CONVERGED
REDUCER_WAIT_NAMED: int = compiled.REDUCER_WAIT_NAMED
REDUCER_WAITS = {"observe": REDUCER_WAIT_OBSERVE, "elect": REDUCER_WAIT_ELECT, "converged": REDUCER_WAIT_CONVERGED,
                 "named": REDUCER_WAIT_NAMED}
REDUCER_WAIT_DEFAULT = "observe"


def reducer_wait_override(environ=None) -> str | None:
    """HYBRID_EP_REDUCER_WAIT: "observe", "elect", "converged" or "named", for timing the direct
    combine's reducers with and without every lane's own observation of each stage, with every
    lane's own wait, and with one waiter per reducer group and a named barrier
    (docs/benchmarks/cuda.md); None when unset."""
    raw = _env_raw(REDUCER_WAIT_ENV, environ)
    if raw is not None and raw not in REDUCER_WAITS:
        raise ValueError(f"{REDUCER_WAIT_ENV} must be one of {', '.join(REDUCER_WAITS)}, got {raw!r}")
    return raw


REDUCER_WARPS_ENV = "HYBRID_EP_REDUCER_WARPS"
# Reducer warps per pipeline of the direct combine (csrc/common/params.h): the kernel is
# instantiated for each; 4 is the default until a GPU run's sweep decides.
REDUCER_WARPS_NARROW: int = compiled.REDUCER_WARPS_NARROW
REDUCER_WARPS_WIDE: int = compiled.REDUCER_WARPS_WIDE
REDUCER_WARPS = (REDUCER_WARPS_NARROW, REDUCER_WARPS_WIDE)


def reducer_warps_override(environ=None) -> int | None:
    """HYBRID_EP_REDUCER_WARPS: 4 or 8 reducer warps per pipeline of the direct combine, for
    timing a segment's parts added by twice the threads at half the vectors each
    (docs/benchmarks/cuda.md); None when unset."""
    raw = _env_raw(REDUCER_WARPS_ENV, environ)
    if raw is not None and raw not in {str(w) for w in REDUCER_WARPS}:
        raise ValueError(f"{REDUCER_WARPS_ENV} must be one of {', '.join(map(str, REDUCER_WARPS))}, got {raw!r}")
    return None if raw is None else int(raw)


COMBINE_STAGE_ENV = "HYBRID_EP_COMBINE_STAGE"
# What one stage of a direct-combine pipeline holds (csrc/common/params.h): one route's row
# segment ("route", the default until a GPU run's sweep decides), or every part of one token's
# column segment ("token": one hand-off per token segment, not per route row).
COMBINE_STAGES = {"route": compiled.COMBINE_STAGE_ROUTE, "token": compiled.COMBINE_STAGE_TOKEN}
COMBINE_STAGE_DEFAULT = "route"
# A token stage's bytes: top-8 bf16 parts of 2048 columns (4 segments of an 8192-column row), 3
# stages a pipeline in an H200's shared memory; the kernel sizes the segment from the call's top-k
# (combine_direct.cuh, token_segment_cols).
TOKEN_STAGE_BYTES = 32 * 1024


def combine_stage_override(environ=None) -> str | None:
    """HYBRID_EP_COMBINE_STAGE: "route" or "token", for timing the direct combine with a stage
    per route row against a stage per token segment (docs/benchmarks/cuda.md); None when unset."""
    raw = _env_raw(COMBINE_STAGE_ENV, environ)
    if raw is not None and raw not in COMBINE_STAGES:
        raise ValueError(f"{COMBINE_STAGE_ENV} must be one of {', '.join(COMBINE_STAGES)}, got {raw!r}")
    return raw


STORE_RUNS_ENV = "HYBRID_EP_STORE_RUNS"


def store_runs_override(environ=None) -> int | None:
    """HYBRID_EP_STORE_RUNS: 1 has the direct dispatch store a stage's consecutive rows that go
    to consecutive rows of one destination as one bulk store (fp8's 8 KiB rows, two to a stage:
    fewer, wider stores), 0 every row alone (the default until a GPU run's C_direct_2_fp8
    decides); None when unset (docs/benchmarks/cuda.md)."""
    return _int_from_env(STORE_RUNS_ENV, 0, 1, environ)


def token_stage_shape(cols: int, in_bytes: int, smem_per_block: int,
                      max_stages: int = MAX_STAGES) -> DirectCombineShape:
    """The direct combine's rings with token stages: stages of TOKEN_STAGE_BYTES, as many as the
    shared memory holds, split between its two pipelines. seg_cols stays the route stages' (the
    launchers check it whatever the stage; LaunchArgs::seg_cols); the kernel cuts each row into
    segments whose top-k parts fill a stage."""
    route = direct_combine_shape(cols, in_bytes, smem_per_block, max_stages)
    stages = min(max_stages, (smem_per_block - STATIC_SMEM_RESERVE) // (DIRECT_COMBINE_PIPELINES * TOKEN_STAGE_BYTES))
    if stages < 2:
        raise ValueError(f"shared memory per block ({smem_per_block} B) holds fewer than 2 direct-combine token "
                         f"stages of {TOKEN_STAGE_BYTES} B per pipeline ({COMBINE_STAGE_ENV}=token; route stages "
                         f"fit: unset it)")
    return DirectCombineShape(seg_cols=route.seg_cols, stages=stages, stage_bytes=TOKEN_STAGE_BYTES)


def store_groups(stages: int, override: int | None = None) -> int:
    """Bulk-store groups a store thread lets still read their stages when it releases the
    older ones. Each holds a stage the loads cannot refill: at the 5 or 6 stages of 16-32 KiB
    that rows of 8 KiB and more get, a queue of 4 let the loads run only one or two stages
    ahead of the stores. The default keeps at least three quarters of the stages for the
    loads."""
    if stages < 2:
        raise ValueError(f"stages must be >= 2, got {stages}")
    groups = max(1, stages // 4) if override is None else override
    return min(groups, stages - 1, MAX_STORE_GROUPS)


def combine_store_groups(out_stages: int, override: int | None = None) -> int:
    """Combine's expert host stores from a ring of its own, which no load refills: every
    stage but the one the reducers write may still be read by a store (the default)."""
    if out_stages < 2:
        raise ValueError(f"out_stages must be >= 2, got {out_stages}")
    groups = out_stages - 1 if override is None else override
    return min(groups, out_stages - 1, MAX_STORE_GROUPS)


def row_bytes_of(hidden: int, dtype_name: str) -> int:
    return hidden * ELEM_BYTES[dtype_name]


def check_row_bytes(name: str, hidden: int, dtype_name: str) -> int:
    nbytes = row_bytes_of(hidden, dtype_name)
    if nbytes % 16 != 0:
        raise ValueError(
            f"{name}: a row of {hidden} x {dtype_name} is {nbytes} bytes; the cuda backend moves rows in "
            f"16-byte units, so hidden_dim must be a multiple of {16 // ELEM_BYTES[dtype_name]} for {dtype_name}"
        )
    return nbytes


def check_coresident(name: str, sms_per_rank: int, ranks_in_launch: int, device_sms: int, blocks_per_sm: int) -> None:
    """Blocks wait on blocks of other (virtual) ranks, so all must be resident at once."""
    if sms_per_rank < 1:
        raise ValueError(f"{name} must be >= 1, got {sms_per_rank}")
    capacity = device_sms * max(blocks_per_sm, 0)
    need = sms_per_rank * ranks_in_launch
    if need > capacity:
        raise ValueError(
            f"{name}={sms_per_rank} x {ranks_in_launch} rank(s) in one launch needs {need} co-resident blocks, "
            f"but the device holds {capacity} ({device_sms} SMs x {blocks_per_sm} block(s) per SM)"
        )


# The launch settings of each kind of launch: its pipeline (a function that sets the kind's
# pipeline fields of a LaunchArgs for rows of row_elems values, from the device's shared memory
# per block and store-queue override, and returns the blocks per SM the kernel's shared memory
# leaves room for), the LaunchArgs field with its pipeline depth (launch_shapes) and its role:
# "dispatch" (fp8 rows carry their scales) or "combine", as the SM count's errors name it.


def _dispatch_receive_pipeline(s: "LaunchSettings", a, row_elems: int, dtype_name: str, wire_name: str | None) -> int:
    """The receive path's dispatch: a send and an expand FIFO of row stages."""
    fifo = fifo_shape(row_bytes_of(row_elems, dtype_name), s.smem_per_block,
                             pipelines=DISPATCH_PIPELINES)
    a.fifo_stages, a.stage_bytes, a.rows_per_stage = fifo.stages, fifo.stage_bytes, fifo.rows_per_stage
    a.store_groups = store_groups(fifo.stages, s.store_groups_override)
    smem = DISPATCH_PIPELINES * fifo.smem_bytes
    return s.ext.dispatch_receive_max_blocks_per_sm(smem)


def _dispatch_direct_pipeline(s: "LaunchSettings", a, row_elems: int, dtype_name: str, wire_name: str | None) -> int:
    """The direct path's dispatch: one FIFO of row stages, each stored once per route."""
    fifo = direct_fifo_shape(row_bytes_of(row_elems, dtype_name), s.smem_per_block)
    a.fifo_stages, a.stage_bytes, a.rows_per_stage = fifo.stages, fifo.stage_bytes, fifo.rows_per_stage
    a.store_groups = direct_store_groups(fifo.stages, fifo.stage_bytes, s.store_groups_override)
    a.store_runs = s.store_runs_override or 0
    return s.ext.dispatch_direct_max_blocks_per_sm(fifo.smem_bytes)


def _combine_receive_pipeline(s: "LaunchSettings", a, row_elems: int, dtype_name: str, wire_name: str | None) -> int:
    """The receive path's combine: the expert host's input and output rings, the source's ring,
    partial sums of wire_name on the wire."""
    shape = combine_shape(row_elems, ELEM_BYTES[dtype_name], ELEM_BYTES[wire_name],
                                 s.smem_per_block)
    a.wire_dtype = s.ext.DTYPE_CODES[wire_name]
    a.seg_cols, a.host_stages, a.src_stages = shape.seg_cols, shape.host_stages, shape.src_stages
    a.host_out_stages = shape.out_stages
    a.host_stage_bytes, a.src_stage_bytes = shape.host_stage_bytes, shape.src_stage_bytes
    a.store_groups = combine_store_groups(shape.out_stages, s.store_groups_override)
    return s.ext.combine_receive_max_blocks_per_sm(shape.smem_bytes)


def _combine_direct_pipeline(s: "LaunchSettings", a, row_elems: int, dtype_name: str, wire_name: str | None) -> int:
    """The direct path's combine: each route's expert-output segments loaded into two rings
    (several nodes: a stage holds a node partial in the wire dtype too)."""
    wire_bytes = ELEM_BYTES[wire_name] if wire_name and s.num_nodes > 1 else 0
    a.wire_dtype = s.ext.DTYPE_CODES[wire_name or dtype_name]
    stage = s.combine_stage_override or COMBINE_STAGE_DEFAULT
    shaped = token_stage_shape if stage == "token" else direct_combine_shape
    shape = shaped(row_elems, max(ELEM_BYTES[dtype_name], wire_bytes), s.smem_per_block,
                   max_stages=s.direct_combine_stages_override or MAX_STAGES)
    a.seg_cols, a.src_stages, a.src_stage_bytes = shape.seg_cols, shape.stages, shape.stage_bytes
    a.combine_stage = COMBINE_STAGES[stage]
    a.reducer_wait = REDUCER_WAITS[s.reducer_wait_override or REDUCER_WAIT_DEFAULT]
    a.reducer_warps = s.reducer_warps_override or REDUCER_WARPS_NARROW
    return s.ext.combine_direct_max_blocks_per_sm(shape.smem_bytes, a.reducer_warps)


@dataclasses.dataclass(frozen=True)
class KindSettings:
    pipeline: Callable[..., int]  # (engine, args, row_elems, dtype_name, wire_name) -> blocks per SM
    stages: str  # the LaunchArgs field with the pipeline's depth
    role: str  # "dispatch" or "combine"


KIND_SETTINGS = {
    "dispatch_receive": KindSettings(_dispatch_receive_pipeline, "fifo_stages", "dispatch"),
    "dispatch_direct": KindSettings(_dispatch_direct_pipeline, "fifo_stages", "dispatch"),
    "combine_receive": KindSettings(_combine_receive_pipeline, "host_out_stages", "combine"),
    "combine_direct": KindSettings(_combine_direct_pipeline, "src_stages", "combine"),
}


class LaunchSettings:
    """The LaunchArgs of one engine per kind of launch (KIND_SETTINGS), SMs per rank, dtype, row
    width, wire dtype and apply_probs: built and checked once per key, then only the per-rank
    part changes (the launchers copy the struct when they launch)."""

    def __init__(self, ext, geo, num_ranks: int, kd: int, num_nodes: int, device_sms: int, smem_per_block: int,
                 timeout_ns: int, abort_flag: int, error: int, bad_route: int):
        self.ext, self.geo, self.num_ranks, self.kd, self.num_nodes = ext, geo, num_ranks, kd, num_nodes
        self.device_sms, self.smem_per_block = device_sms, smem_per_block
        self.timeout_ns, self.abort_flag, self.error, self.bad_route = timeout_ns, abort_flag, error, bad_route
        self.store_groups_override = store_groups_override()  # HYBRID_EP_STORE_GROUPS, read once per buffer
        self.direct_combine_stages_override = direct_combine_stages_override()  # HYBRID_EP_DIRECT_COMBINE_STAGES
        self.reducer_wait_override = reducer_wait_override()  # HYBRID_EP_REDUCER_WAIT, the same
        self.reducer_warps_override = reducer_warps_override()  # HYBRID_EP_REDUCER_WARPS, the same
        self.combine_stage_override = combine_stage_override()  # HYBRID_EP_COMBINE_STAGE, the same
        self.store_runs_override = store_runs_override()  # HYBRID_EP_STORE_RUNS, the same
        self.cache: dict[tuple, object] = {}

    def shapes(self, num_sms: int) -> dict:
        """The pipeline shape each kernel launched with at num_sms SMs per rank ({kind: {stages,
        store_groups}}), for benchmark records: the store queue is chosen per launch."""
        shapes = {}
        for (kind, launched_sms, *_), a in self.cache.items():
            if launched_sms == num_sms:
                stages = getattr(a, KIND_SETTINGS[kind].stages)
                shapes[kind] = {"stages": int(stages), "store_groups": int(a.store_groups)}
        return shapes

    def args(self, num_sms: int, dtype_name: str, row_elems: int, kind: str, wire_name: str | None = None,
             apply_probs: bool = False):
        """The LaunchArgs of a kind of launch at num_sms SMs per rank, rows of row_elems values of
        dtype_name (combine: partial sums of wire_name between ranks, apply_probs): what every
        kind sets, then the kind's pipeline; the callers look the key up in `cache` first."""
        key = (kind, num_sms, dtype_name, row_elems, wire_name, apply_probs)
        cached = self.cache.get(key)
        if cached is not None:
            return cached
        settings = KIND_SETTINGS[kind]
        a = self.ext.LaunchArgs()
        a.geo = self.geo
        a.num_ranks = self.num_ranks
        a.num_sms = num_sms
        a.dtype = self.ext.DTYPE_CODES[dtype_name]
        a.row_elems = row_elems
        a.kd = self.kd
        a.chunk_tokens = CHUNK_TOKENS
        if settings.role == "dispatch" and dtype_name == "float8_e4m3fn":
            a.scale_cols = row_elems // FP8_BLOCK  # fp8 rows carry their scales
        a.apply_probs = int(apply_probs)
        a.timeout_ns = self.timeout_ns
        a.abort_flag = self.abort_flag
        a.error = self.error
        a.bad_route = self.bad_route
        per_sm = settings.pipeline(self, a, row_elems, dtype_name, wire_name)
        check_coresident(f"num_sms ({settings.role})", num_sms, self.num_ranks, self.device_sms, per_sm)
        self.cache[key] = a
        return a

    def receive_args(self, laid, num_sms: int, dtype_name: str, H: int):
        """The receive kernel's launch arguments with the per-rank part the count kernel ran with."""
        args = self.args(num_sms, dtype_name, H, "dispatch_receive")
        for i in range(laid.num_ranks):
            args.set_rank(i, laid.get_rank(i))
        args.num_ranks = laid.num_ranks
        args.scale_cols = laid.scale_cols
        return args
