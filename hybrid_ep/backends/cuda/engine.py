"""The call sequence of the cuda backend for the ranks one process drives.

Production drives one rank per process; the single-GPU emulation drives all W virtual
ranks of a group in one process. Both go through this class, and each kernel is one launch
covering every rank it drives, so the kernels are the same and only the launcher differs.

Per dispatch: the layout kernel (counts, send slots, ordinals, count exchange, offsets),
then, in dynamic mode only, one host read of the output size, then the dispatch kernel.
Static mode (num_out_tokens) never reads anything back, so it can be captured in a graph.

`ext` is hybrid_ep._C (the GPU) or hybrid_ep._model (the CPU model of the device layer, on
CPU tensors); both expose the same launchers, so nothing here depends on which it is.

Legend: T tokens, K routes per token, W ranks, L local experts, R output rows, H hidden.
"""

from __future__ import annotations

import dataclasses

import torch

from ...config import FP8_BLOCK, BufferConfig, timeout_seconds
from ...routing import Routing
from . import launch
from .layout import (
    CHUNK_SIGNAL_BYTES,
    CHUNK_TOKENS,
    LOCAL_STATE_BYTES,
    MAX_EXPERTS,
    MAX_RANKS,
    MAX_TOPK,
    META_ENTRY_BYTES,
    PEER_TENSORS_BYTES,
    TOKEN_META_BYTES,
    info_layout,
    rdma_layout,
    registered_layout,
)
from .registered import LoopbackRegions, NvshmemRegions

# What a kernel waited for when it gave up, by the name of its phase: the codes are csrc's
# (common/params.h, Phase), read from the loaded module as ext.PHASES {name: code};
# check_extension makes sure this table names every phase there but "none".
PHASE_TEXT = {
    "bad_routing": "routing check",
    "dispatch_flow": "dispatch flow control (waiting for the peer to finish reading the previous dispatch)",
    "counts": "dispatch count exchange",
    "dispatch_rows": "dispatch rows",
    "combine_flow": "combine flow control (waiting for the peer to finish reading the previous combine)",
    "combine_rows": "combine partial sums",
    "pipeline": "its shared-memory pipeline",
    "rdma_flow": "inter-node flow control (waiting for its rail peer on that node to finish reading the previous call)",
    "rdma_counts": "inter-node count exchange",
    "rdma_rows": "forwarding (waiting for the rail peer's rows from that node, by RDMA)",
    "node_partials": "the node partial sums (waiting for a rank of its own node to store its partials of a forwarded "
                     "chunk)",
    "rdma_partials": "combine node partials (waiting for the rail peer on that node, by RDMA)",
    "direct_tensors": "the direct path (waiting for the peer to publish its tensors of the call)",
    "direct_rows": "the direct path's dispatch (waiting for the peer to finish writing this rank's rows)",
    "direct_reads": "the direct path's combine (waiting for the peer to finish reading this rank's expert_out)",
}


class RoutingError(ValueError):
    pass


@dataclasses.dataclass(frozen=True)
class AbsentRanks:
    """Test hook (Engine.absent, set by hybrid_ep.testing.faults.ranks_absent): ranks whose
    kernels are launched with RankArgs.absent, so they never arrive, as a crashed peer would.
    `ranks` launch none of a call's kernels; `after_layout` launch a dispatch's layout kernel
    (their counts are exchanged) but not its dispatch kernel."""

    ranks: frozenset[int] = frozenset()
    after_layout: frozenset[int] = frozenset()


@dataclasses.dataclass(frozen=True, eq=False)
class CudaSendLayout:
    """What the source side of a dispatch computed on the device."""

    send_slot_TW: torch.Tensor  # int32 position of token t among the rows sent to d, -1 if none
    entry_ord_TK: torch.Tensor  # int32 ordinal of (t, k) among this rank's tokens of expert e
    topk_idx_TK: torch.Tensor | None = None  # direct path: the routing's experts (int64)
    route_rows_TK: torch.Tensor | None = None  # direct path: int32 output row of (t, k) at its expert's rank, -1 none

    @property
    def data_path(self) -> str:
        return "receive" if self.route_rows_TK is None else "direct"


@dataclasses.dataclass(frozen=True, eq=False)
class CudaRecvLayout:
    """The device-side layout of a dispatch output; field names follow routing.DestLayout."""

    info: torch.Tensor  # int64, offsets in csrc InfoLayout / layout.InfoLayout
    row_pos: torch.Tensor | None  # int32 [W, Tmax, kd] output row of each entry of a received row (receive path)
    recv_spans: torch.Tensor | None  # int32 [W, max_chunks, 2] receive slots (first, rows) of each chunk (receive path)
    fwd_slots: torch.Tensor | None  # int32 [N, max_chunks * 32, G] several nodes: forwarded rows' slots
    fwd_rows: torch.Tensor | None  # int32 [N, max_chunks] rows of each forwarded chunk
    kd: int
    num_rows: int  # R
    tokens_per_expert_L: torch.Tensor
    num_needed_rows: torch.Tensor
    num_dropped: torch.Tensor
    expert_start_L: torch.Tensor
    expert_rows_L: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class RankDispatch:
    rows_RH: torch.Tensor
    scales_RB: torch.Tensor | None
    probs_R: torch.Tensor
    send: CudaSendLayout
    recv: CudaRecvLayout
    recv_counts_W: torch.Tensor
    count_matrix_WW: torch.Tensor
    node_counts_WN: torch.Tensor


def check_extension(ext) -> None:
    """The Python layout plan and the compiled structs must agree, and the Python tables keyed
    by the names of csrc's codes (dtypes, transports, phases) must name the same codes."""
    expected = {"LOCAL_STATE_BYTES": LOCAL_STATE_BYTES, "META_ENTRY_BYTES": META_ENTRY_BYTES,
                "MAX_TOPK": MAX_TOPK, "MAX_RANKS": MAX_RANKS, "MAX_EXPERTS": MAX_EXPERTS, "CHUNK_TOKENS": CHUNK_TOKENS,
                "CHUNK_SIGNAL_BYTES": CHUNK_SIGNAL_BYTES, "TOKEN_META_BYTES": TOKEN_META_BYTES,
                "COMBINE_MAX_SEG_COLS": launch.COMBINE_MAX_SEG_COLS, "PEER_TENSORS_BYTES": PEER_TENSORS_BYTES,
                "MAX_STAGES": launch.MAX_STAGES, "MAX_STORE_GROUPS": launch.MAX_STORE_GROUPS,
                "PULL_PIPELINES": launch.PULL_PIPELINES}
    rebuild = "rebuild the extension (pip install --no-build-isolation -e .)"
    for name, value in expected.items():
        if not hasattr(ext, name):
            raise RuntimeError(f"{ext.__name__} has no {name}; {rebuild}")
        if getattr(ext, name) != value:
            raise RuntimeError(f"{ext.__name__} has {name}={getattr(ext, name)} but the package expects {value}; "
                               f"{rebuild}")
    named = {"DTYPE_CODES": (set(launch.ELEM_BYTES), "launch.ELEM_BYTES"),
             "TRANSPORTS": ({LoopbackRegions.kind, NvshmemRegions.kind}, "the RDMA region kinds"),
             "PHASES": ({"none"} | set(PHASE_TEXT), "engine.PHASE_TEXT")}
    for name, (keys, where) in named.items():
        codes = getattr(ext, name, None)
        if codes is None:
            raise RuntimeError(f"{ext.__name__} has no {name}; {rebuild}")
        if set(codes) != keys:
            raise RuntimeError(f"{ext.__name__}.{name} names {sorted(codes)} but {where} names {sorted(keys)}; "
                               f"{rebuild}, or name the new code there")


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """Detached, float32 and contiguous: a no-op for what already is."""
    t = t.detach()
    if t.dtype != torch.float32:
        t = t.float()
    return t if t.is_contiguous() else t.contiguous()


class Engine:
    """Kernels of one buffer for the ranks this process drives (`ranks`, with their tables)."""

    def __init__(self, ext, config: BufferConfig, ranks: list[int], tables: list[torch.Tensor],
                 device: torch.device, rdma=None, data_path: str | None = None):
        """rdma: the inter-node transport's regions (registered.LoopbackRegions, or NVSHMEM's),
        for groups of several nodes. data_path: "direct" or "receive" (launch.data_path; None:
        HYBRID_EP_DATA_PATH, else direct wherever it can run)."""
        self.ext, self.config, self.ranks, self.tables, self.device = ext, config, ranks, tables, device
        if config.num_nodes > 1 and rdma is None:
            raise ValueError(f"a group of {config.num_nodes} nodes needs an inter-node transport (rdma)")
        self.rdma = rdma
        self.reg = registered_layout(config)
        self.rdma_layout = rdma_layout(config)
        self.info = info_layout(config)
        check_extension(ext)
        self.geo = self._geometry()
        self.error = ext.ErrorRecord()
        self._phase_names = {code: name for name, code in ext.PHASES.items()}
        self.abort = torch.zeros(1, dtype=torch.int32, device=device)
        self.device_sms, self.smem_per_block = ext.device_properties(device.index or 0)
        self.failure: str | None = None
        self.absent = AbsentRanks()  # every rank arrives, unless a test says otherwise
        self.timeout_ns = int(timeout_seconds() * 1e9)  # HYBRID_EP_TIMEOUT_S, read once per buffer
        self.store_groups_override = launch.store_groups_override()  # HYBRID_EP_STORE_GROUPS, likewise
        # The direct path needs every rank's tensors addressable here: all ranks of one node in
        # this process (HYBRID_EP_DATA_PATH, likewise). Offsets of published tensors are from
        # each rank's arena base, 0 in one process.
        self.data_path = launch.data_path(len(ranks) == config.world_size and config.num_nodes == 1, data_path)
        self.arena_bases = torch.zeros(config.world_size, dtype=torch.int64, device=device)
        # Launch arguments per (kind, SMs, dtypes, width): built and checked once, then only the
        # per-rank part changes (the launchers copy the struct when they launch).
        self._launch_cache: dict[tuple, object] = {}
        # Tensors the last launch of each kind read that the caller may not hold (contiguous
        # or aligned copies, fp32 casts): kept until the next call of that kind, so they
        # outlive the kernels also when the caller moves on to another stream.
        self._in_flight: dict[str, list[torch.Tensor]] = {}
        # The CPU model checks every bulk copy against the tensors of the launch; on a GPU
        # that is compute-sanitizer's job and the call is skipped.
        self._declares_tensors = bool(getattr(ext, "IS_MODEL", False))

    def _geometry(self):
        c, g = self.config, self.ext.Geometry()
        g.world_size, g.ranks_per_node, g.num_nodes = c.world_size, c.ranks_per_node, c.num_nodes
        g.num_experts, g.local_experts = c.num_experts, c.experts_per_rank
        g.max_tokens, g.hidden = c.max_tokens_per_rank, c.hidden_dim
        g.pad_multiple = c.pad_multiple
        g.min_rows_per_expert = c.min_rows_per_expert
        for name, value in dataclasses.asdict(self.reg).items():
            setattr(g.reg, name, value)
        for name, value in dataclasses.asdict(self.info).items():
            setattr(g.info, name, value)
        for name, value in dataclasses.asdict(self.rdma_layout).items():
            setattr(g.rdma, name, value)
        g.transport = self.ext.TRANSPORTS[self.rdma.kind if self.rdma is not None else "loopback"]
        return g

    def _set_transport(self, ra, i: int) -> None:
        if self.rdma is not None:
            ra.rdma_regions, ra.rdma_base, ra.rdma_pes = self.rdma.rank_args(i)

    # -- errors --------------------------------------------------------------------------

    def raise_if_failed(self) -> None:
        """Raise the first failure a kernel recorded (reads pinned host memory; no sync)."""
        if self.failure is None:
            record = self.error.read()
            if record is None:
                return
            self.failure = self._describe(record)
        if self.failure.startswith("topk_idx"):
            raise RoutingError(self.failure)
        raise RuntimeError(self.failure)

    def _describe(self, rec: dict) -> str:
        code = rec["phase"]
        phase = self._phase_names.get(code)
        what = PHASE_TEXT.get(phase, f"phase {code}")
        if phase == "bad_routing":
            return (f"topk_idx on rank {rec['rank']}: token {rec['peer']} routes to expert {rec['observed']} "
                    f"out of [-1, {rec['expected'] - 1}] or twice (num_experts={rec['expected']}); "
                    f"this buffer can not be used after the error, create a new one")
        if rec["peer"] < 0:  # a wait on this rank's own pipeline, no peer involved
            return (f"hybrid_ep cuda backend: rank {rec['rank']} gave up after {self.timeout_ns / 1e9:g} s "
                    f"(HYBRID_EP_TIMEOUT_S) waiting in {what} "
                    f"(call {rec['epoch']}): a bulk copy never completed. The buffer can not be used after "
                    f"this error; create a new one.")
        where = f" on node {rec['peer'] // self.config.ranks_per_node}" if self.config.num_nodes > 1 else ""
        return (f"hybrid_ep cuda backend: rank {rec['rank']} gave up after {self.timeout_ns / 1e9:g} s "
                f"(HYBRID_EP_TIMEOUT_S) waiting for peer rank {rec['peer']}{where} in "
                f"{what} (call {rec['epoch']}, expected {rec['expected']}, "
                f"saw {rec['observed']}): a peer did not make the same call. The buffer can not be used "
                f"after this error; create a new one.")

    # -- launch arguments ------------------------------------------------------------------

    def launch_shapes(self, sms: int) -> dict:
        """The pipeline shape each kernel launched with at sms blocks per rank ({kind: {stages,
        store_groups}}), for benchmark records: the store queue is chosen per launch."""
        shapes = {}
        for (kind, blocks, *_), a in self._launch_cache.items():
            if blocks == sms:
                stages = {"dispatch": a.fifo_stages, "dispatch_direct": a.fifo_stages, "combine": a.host_out_stages,
                          "combine_pull": a.src_stages}[kind]
                shapes[kind] = {"stages": int(stages), "store_groups": int(a.store_groups)}
        return shapes

    def _launch_args(self, sms: int, dtype_name: str, row_elems: int, kind: str, wire_name: str | None = None):
        key = (kind, sms, dtype_name, row_elems, wire_name)
        cached = self._launch_cache.get(key)
        if cached is not None:
            return cached
        a = self.ext.LaunchArgs()
        a.geo = self.geo
        a.num_ranks = len(self.ranks)
        a.blocks_per_rank = sms
        a.dtype = self.ext.DTYPE_CODES[dtype_name]
        a.row_elems = row_elems
        a.kd = int(self.reg.meta_entries)
        a.chunk_tokens = CHUNK_TOKENS
        a.timeout_ns = self.timeout_ns
        a.abort_flag = self.abort.data_ptr()
        a.error = self.error.device_ptr
        if kind == "dispatch":
            fifo = launch.fifo_shape(launch.row_bytes_of(row_elems, dtype_name), self.smem_per_block,
                                     pipelines=launch.DISPATCH_PIPELINES)
            a.fifo_stages, a.stage_bytes, a.rows_per_stage = fifo.stages, fifo.stage_bytes, fifo.rows_per_stage
            a.store_groups = launch.store_groups(fifo.stages, self.store_groups_override)
            smem = launch.DISPATCH_PIPELINES * fifo.smem_bytes
            per_sm = self.ext.dispatch_max_blocks_per_sm(smem)
        elif kind == "dispatch_direct":
            fifo = launch.fifo_shape(launch.row_bytes_of(row_elems, dtype_name), self.smem_per_block,
                                     max_stages=launch.MAX_STAGES)
            a.fifo_stages, a.stage_bytes, a.rows_per_stage = fifo.stages, fifo.stage_bytes, fifo.rows_per_stage
            a.store_groups = launch.direct_store_groups(fifo.stages, self.store_groups_override)
            per_sm = self.ext.dispatch_direct_max_blocks_per_sm(fifo.smem_bytes)
        elif kind == "combine_pull":
            pull = launch.pull_shape(row_elems, launch.ELEM_BYTES[dtype_name], self.smem_per_block)
            a.seg_cols, a.src_stages, a.src_stage_bytes = pull.seg_cols, pull.stages, pull.stage_bytes
            per_sm = self.ext.combine_pull_max_blocks_per_sm(pull.smem_bytes)
        else:
            shape = launch.combine_shape(row_elems, launch.ELEM_BYTES[dtype_name], launch.ELEM_BYTES[wire_name],
                                         self.smem_per_block)
            a.wire_dtype = self.ext.DTYPE_CODES[wire_name]
            a.seg_cols, a.host_stages, a.src_stages = shape.seg_cols, shape.host_stages, shape.src_stages
            a.host_out_stages = shape.out_stages
            a.host_stage_bytes, a.src_stage_bytes = shape.host_stage_bytes, shape.src_stage_bytes
            a.store_groups = launch.combine_store_groups(shape.out_stages, self.store_groups_override)
            per_sm = self.ext.combine_max_blocks_per_sm(shape.smem_bytes)
        launch.check_coresident(f"num_sms ({kind.split('_')[0]})", sms, len(self.ranks), self.device_sms, per_sm)
        self._launch_cache[key] = a
        return a

    def _stream(self) -> int:
        if self.device.type != "cuda":
            return 0  # the CPU model runs each launch to completion in the call
        return torch.cuda.current_stream(self.device).cuda_stream

    def _declare(self, tensors) -> None:
        if self._declares_tensors:
            self.ext.note_launch_tensors([(t.data_ptr(), t.numel() * t.element_size()) for t in tensors
                                          if t is not None and t.numel() > 0] +
                                         [(t.data_ptr(), t.numel() * t.element_size()) for t in self.tables] +
                                         (self.rdma.declared() if self.rdma is not None else []) +
                                         [(self.abort.data_ptr(), 4)])

    def _aligned(self, t: torch.Tensor) -> torch.Tensor:
        """Contiguous, starting on a 16-byte boundary (the kernels move 16-byte vectors)."""
        t = t.contiguous()
        if t.data_ptr() % 16 != 0:
            t = t.clone()
        return t

    # -- dispatch --------------------------------------------------------------------------

    def dispatch(self, xs: list[torch.Tensor], scales: list[torch.Tensor | None], routings: list[Routing],
                 num_out_tokens: int | None, sms: int, known_rows: list[int] | None = None) -> list[RankDispatch]:
        self.raise_if_failed()
        absent, absent_after_layout = self.absent.ranks, self.absent.after_layout
        c = self.config
        W, L, H = c.world_size, c.experts_per_rank, c.hidden_dim
        dtype_name = _dtype_name(xs[0].dtype)
        launch.check_row_bytes("x", H, dtype_name)
        fp8 = dtype_name == "float8_e4m3fn"
        for r, routing, x, sc in zip(self.ranks, routings, xs, scales):
            if routing.topk_idx_TK.shape[1] > MAX_TOPK:
                raise ValueError(f"topk_idx has {routing.topk_idx_TK.shape[1]} routes per token on rank {r}; "
                                 f"the cuda backend supports up to {MAX_TOPK}")
            if x.dtype != xs[0].dtype:
                raise TypeError(f"x on rank {r} is {x.dtype} but rank {self.ranks[0]}'s is {xs[0].dtype}; "
                                f"one call moves one dtype")
            if fp8 and sc is None:
                raise ValueError(f"scales: fp8 x on rank {r} needs its float32 scales [num_tokens, "
                                 f"hidden_dim / {FP8_BLOCK}] (a re-dispatch with a reused handle too)")
            if fp8 and tuple(sc.shape) != (x.shape[0], H // FP8_BLOCK):
                raise ValueError(f"scales on rank {r} must have shape [{x.shape[0]}, {H // FP8_BLOCK}], "
                                 f"got {list(sc.shape)}")
        direct = self.data_path == "direct"
        args = self._launch_args(sms, dtype_name, H, "dispatch_direct" if direct else "dispatch")
        args.scale_cols = H // FP8_BLOCK if fp8 else 0
        kd = args.kd
        dev = self.device
        rank_args, keep = [], []
        for i, (r, x, sc, routing) in enumerate(zip(self.ranks, xs, scales, routings)):
            idx = routing.topk_idx_TK.contiguous()
            w = _fp32(routing.topk_weights_TK)
            T, K = idx.shape
            ra = self.ext.RankArgs()
            ra.rank, ra.absent, ra.num_tokens, ra.topk = r, int(r in absent), T, K
            ra.peers = self.tables[i].data_ptr()
            self._set_transport(ra, i)
            x = self._aligned(x)
            ra.x = x.data_ptr()
            if fp8:
                sc = _fp32(sc)
                ra.x_scales = sc.data_ptr()
            ra.topk_idx, ra.topk_weights = idx.data_ptr(), w.data_ptr()
            send_slot = torch.empty(T, W, dtype=torch.int32, device=dev)
            entry_ord = torch.empty(T, K, dtype=torch.int32, device=dev)
            info = torch.empty(self.info.total, dtype=torch.int64, device=dev)  # the layout kernel fills it
            ra.send_slot, ra.entry_ord, ra.info = send_slot.data_ptr(), entry_ord.data_ptr(), info.data_ptr()
            ra.num_out_rows = -1 if num_out_tokens is None else num_out_tokens
            rank_args.append(ra)
            keep.append((x, sc, idx, w, send_slot, entry_ord, info))
        for i, ra in enumerate(rank_args):
            args.set_rank(i, ra)
        self._declare([t for k in keep for t in k])
        self.ext.launch_layout(args, self._stream())

        if num_out_tokens is not None:
            rows = [num_out_tokens] * len(self.ranks)
        elif known_rows is not None:
            rows = list(known_rows)
        else:
            needed = torch.stack([k[6][self.info.needed] for k in keep]).cpu()  # the one host sync
            self.raise_if_failed()
            rows = [int(v) for v in needed]

        results = []
        for i, (ra, R) in enumerate(zip(rank_args, rows)):
            x, sc, idx, w, send_slot, entry_ord, info = keep[i]
            out = torch.empty(R, H, dtype=x.dtype, device=dev)
            out_scales = torch.empty(R, H // FP8_BLOCK, dtype=torch.float32, device=dev) if fp8 else None
            out_probs = torch.empty(R, dtype=torch.float32, device=dev)
            row_pos = recv_spans = route_rows = None
            if direct:  # where each route's row went, for combine to pull it from there
                route_rows = torch.empty(idx.shape, dtype=torch.int32, device=dev)
                ra.route_rows, ra.arena_bases = route_rows.data_ptr(), self.arena_bases.data_ptr()
            else:
                row_pos = torch.empty(W, c.max_tokens_per_rank, kd, dtype=torch.int32, device=dev)
                recv_spans = torch.empty(W, self.reg.max_chunks, 2, dtype=torch.int32, device=dev)
                ra.row_pos, ra.recv_spans = row_pos.data_ptr(), recv_spans.data_ptr()
            fwd_slots = fwd_rows = None
            if c.num_nodes > 1:  # what this rank forwards, for the combine's node partial sums
                fwd_slots = torch.empty(c.num_nodes, self.reg.max_chunks * CHUNK_TOKENS, c.ranks_per_node,
                                        dtype=torch.int32, device=dev)
                fwd_rows = torch.empty(c.num_nodes, self.reg.max_chunks, dtype=torch.int32, device=dev)
                ra.fwd_slots, ra.fwd_rows = fwd_slots.data_ptr(), fwd_rows.data_ptr()
            ra.out, ra.out_probs = out.data_ptr(), out_probs.data_ptr()
            ra.out_scales = out_scales.data_ptr() if fp8 else 0
            ra.num_out_rows = R
            ra.absent = int(self.ranks[i] in absent or self.ranks[i] in absent_after_layout)
            args.set_rank(i, ra)
            il = self.info
            recv = CudaRecvLayout(
                info=info, row_pos=row_pos, recv_spans=recv_spans, fwd_slots=fwd_slots, fwd_rows=fwd_rows, kd=kd,
                num_rows=R,
                tokens_per_expert_L=info[il.tokens_per_expert:il.tokens_per_expert + L],
                num_needed_rows=info[il.needed], num_dropped=info[il.dropped],
                expert_start_L=info[il.expert_start:il.expert_start + L],
                expert_rows_L=info[il.expert_rows:il.expert_rows + L],
            )
            results.append(RankDispatch(
                rows_RH=out, scales_RB=out_scales, probs_R=out_probs,
                send=CudaSendLayout(send_slot, entry_ord, idx if direct else None, route_rows), recv=recv,
                recv_counts_W=info[il.recv_count:il.recv_count + W],
                count_matrix_WW=info[il.count_matrix:il.count_matrix + W * W].view(W, W),
                node_counts_WN=info[il.node_counts:il.node_counts + W * c.num_nodes].view(W, c.num_nodes),
            ))
        self._in_flight["dispatch"] = [t for k in keep for t in k if t is not None]
        self._declare(self._in_flight["dispatch"] + [self.arena_bases] + [t for r in results for t in (
            r.rows_RH, r.scales_RB, r.probs_R, r.recv.row_pos, r.recv.recv_spans, r.recv.fwd_slots,
            r.recv.fwd_rows, r.send.route_rows_TK)])
        if direct:
            self.ext.launch_dispatch_direct(args, self._stream())
        else:
            self.ext.launch_dispatch(args, self._stream())
        return results

    # -- combine ---------------------------------------------------------------------------

    def combine(self, rows: list[torch.Tensor], sends: list[CudaSendLayout], recvs: list[CudaRecvLayout],
                probs: list[torch.Tensor], apply_probs: bool, sms: int,
                wire_dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """wire_dtype: of the partial sums between ranks (None: the dtype of the rows)."""
        self.raise_if_failed()
        absent = self.absent.ranks
        dtype_name = _dtype_name(rows[0].dtype)
        wire_name = dtype_name if wire_dtype is None else _dtype_name(wire_dtype)
        if wire_name not in (dtype_name, "float32"):
            raise ValueError(f"wire_dtype must be the dtype of expert_out ({dtype_name}) or float32, got {wire_name}")
        C = rows[0].shape[1]
        launch.check_row_bytes("expert_out", C, dtype_name)
        if C > self.config.hidden_dim:
            raise ValueError(f"expert_out rows have {C} columns; the buffer holds {self.config.hidden_dim}")
        direct = sends[0].data_path == "direct"  # the path of the dispatch that made the handles
        args = self._launch_args(sms, dtype_name, C, "combine_pull" if direct else "combine", wire_name)
        args.apply_probs = int(apply_probs)
        outs = []
        for i, (r, x, send, recv, p) in enumerate(zip(self.ranks, rows, sends, recvs, probs)):
            if x.dtype != rows[0].dtype or x.shape[1] != C:
                raise ValueError(f"expert_out on rank {r} is {x.dtype} [{x.shape[1]} columns] but rank "
                                 f"{self.ranks[0]}'s is {rows[0].dtype} [{C}]; one call moves one dtype and width")
            x = self._aligned(x)
            p = _fp32(p)
            T = send.send_slot_TW.shape[0]
            y = torch.empty(T, C, dtype=x.dtype, device=self.device)
            ra = self.ext.RankArgs()
            ra.rank, ra.absent, ra.num_tokens, ra.topk = r, int(r in absent), T, send.entry_ord_TK.shape[1]
            ra.peers = self.tables[i].data_ptr()
            ra.send_slot, ra.info = send.send_slot_TW.data_ptr(), recv.info.data_ptr()
            if direct:
                ra.topk_idx, ra.route_rows = send.topk_idx_TK.data_ptr(), send.route_rows_TK.data_ptr()
                ra.arena_bases = self.arena_bases.data_ptr()
            else:
                ra.row_pos, ra.recv_spans = recv.row_pos.data_ptr(), recv.recv_spans.data_ptr()
            if recv.fwd_slots is not None:
                ra.fwd_slots, ra.fwd_rows = recv.fwd_slots.data_ptr(), recv.fwd_rows.data_ptr()
            self._set_transport(ra, i)
            ra.expert_out, ra.probs, ra.y = x.data_ptr(), p.data_ptr(), y.data_ptr()
            ra.num_out_rows = recv.num_rows
            args.set_rank(i, ra)
            outs.append((y, x, p))
        self._in_flight["combine"] = [t for _, x, p in outs for t in (x, p)]
        self._declare([t for y, x, p in outs for t in (y, x, p)] + [self.arena_bases] +
                      [t for s, r in zip(sends, recvs) for t in (s.send_slot_TW, r.info, r.row_pos, r.recv_spans,
                                                                 r.fwd_slots, r.fwd_rows, s.topk_idx_TK,
                                                                 s.route_rows_TK)])
        if direct:
            self.ext.launch_combine_pull(args, self._stream())
        else:
            self.ext.launch_combine(args, self._stream())
        return [y for y, _, _ in outs]

    # -- backward of the probs -------------------------------------------------------------

    def return_row_values(self, values: list[torch.Tensor], routings: list[Routing],
                          sends: list[CudaSendLayout], recvs: list[CudaRecvLayout], sms: int) -> list[torch.Tensor]:
        """One fp32 value per output row back to its routing slot, [T, K] per rank.

        Each row's value is placed in the column of its global expert, so a combine over
        expert columns brings every value back unsummed; columns are sent in slices of at
        most hidden_dim so the registered partial buffers suffice.
        """
        c = self.config
        E, L = c.num_experts, c.experts_per_rank
        width_all = (E + 3) // 4 * 4
        step = c.hidden_dim // 4 * 4
        mats, cols_of = [], []
        for r, v, recv in zip(self.ranks, values, recvs):
            R = recv.num_rows
            pos = torch.arange(R, device=self.device)
            j = torch.searchsorted(recv.expert_start_L, pos, right=True) - 1
            j = j.clamp(min=0)
            real = (pos - recv.expert_start_L[j]) < recv.expert_rows_L[j]
            mats.append(torch.where(real, v.detach().to(torch.float32), 0.0))
            cols_of.append(r * L + j)
        full = [torch.zeros(s.send_slot_TW.shape[0], width_all, dtype=torch.float32, device=self.device) for s in sends]
        ones = [torch.ones(recv.num_rows, dtype=torch.float32, device=self.device) for recv in recvs]
        for c0 in range(0, width_all, step):
            width = min(step, width_all - c0)
            slices = []
            for vals, cols in zip(mats, cols_of):
                m = torch.zeros(vals.shape[0], width, dtype=torch.float32, device=self.device)
                inside = (cols >= c0) & (cols < c0 + width)
                m.scatter_(1, (cols - c0).clamp(0, width - 1)[:, None], torch.where(inside, vals, 0.0)[:, None])
                slices.append(m)
            got = self.combine(slices, sends, recvs, ones, False, sms, torch.float32)
            for f, g in zip(full, got):
                f[:, c0:c0 + width] = g
        out = []
        for f, routing in zip(full, routings):
            idx = routing.topk_idx_TK
            vals = f.gather(1, idx.clamp(min=0))
            out.append(torch.where(idx >= 0, vals, 0.0))
        return out
