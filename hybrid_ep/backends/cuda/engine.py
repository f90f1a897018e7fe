"""The call sequence of the cuda backend for the one rank a process drives.

Production drives one rank per process: Engine.inputs, Engine.dispatch and Engine.combine take
one rank's tensors and hand ext.HostPath one struct per call. The single-GPU emulation drives
all W virtual ranks of a group in one process and one launch (emulation.EmulatedEngine, a
subclass that takes lists of the ranks' tensors and hands HostPath a list of structs). Both run
the call sequence written here; only the per-rank steps (marshalling, outputs, results) differ.

Per dispatch: the count kernel (counts, send ordinals, entry ordinals, count exchange, offsets),
then, in dynamic mode only, one host read of the output size, then the dispatch kernel.
Static mode (num_out_tokens) never reads anything back, so it can be captured in a graph.

The host path per call: Python checks the arguments and allocates what the caller gets
(output rows, scales, probs: where paths.py puts them, blocks of peer memory on a direct call
of ranks in separate processes, else PyTorch's allocator; combine's y; a direct combine's
expert_out from outside peer memory is copied into the rank's expert-out block, expert_out_order.py) and
one workspace for the call's per-rank tables (CallWorkspace, reused once nothing refers to it);
one call into the extension (ext.HostPath, the rank's part a struct sequence, a named tuple, of
the extension's: ext.DispatchInputs, DispatchOutputs, CombineInputs) then fills the rank's
launch arguments and launches the kernel sequence: both dispatch kernels when the output size
and path are known, else the count kernel, the host read, then the dispatch kernel
(Engine.dispatch). Between that read and the dispatch launch (a GPU idles there) only what
needs the output sizes runs: the path, the peer memory blocks' ranges or the receive path's
outputs; the blocks' tensors (made by the extension, arena.py, as ext.OutputTensors: rows,
scales, probs, the one order of a dispatch's outputs) and the results are made after the
launch. The handle's tensors are views of the workspace made when read.

`ext` is hybrid_ep._C (the GPU) or hybrid_ep._model (the CPU model of the device layer, on
CPU tensors); both expose the same launchers, so nothing here depends on which it is.

The CPU model's declarations of each launch's tensors and the fault tests' absent ranks are
behind Engine.model (model_hooks.ModelHooks).

Legend: T tokens, K routes per token, W ranks, L local experts, R output rows, H hidden.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import torch

from ...config import FP8_BLOCK, BufferConfig, time_left, timeout_seconds
from ...limits import check_topk
from ...routing import Routing
from . import launch
from .agreement import Agreement, expert_out_width, peer_bases
from .arena import aligned
from .errors import PHASE_TEXT, PIPE_SITE_TEXT, KernelErrors, RoutingError, bad_route_error
from .expert_out_order import StreamOrder
from .layout import BAD_ROUTE_WORDS, COMPILED_CONSTANTS, MAX_TOPK, buffer_layouts, compiled, info_layout
from .model_hooks import ModelHooks, spans
from .paths import AllocatorOutputs, PeerOutputs
from .registered import LoopbackRegions, NvshmemRegions
from .workspace import CallWorkspace, CudaReceiveTable, CudaSendTable, EngineShape, RankDispatch, WorkspacePool

__all__ = ["CudaReceiveTable", "CudaSendTable", "Engine", "RankDispatch", "RoutingError", "check_extension"]


def check_extension(ext) -> None:
    """The loaded module and the one the layout plan took csrc's sizes from (layout.compiled)
    must agree (a module built from other sources is stale), and the Python tables keyed by
    the names of csrc's codes (dtypes, transports, phases) must name the same codes."""
    rebuild = "rebuild the extension (pip install --no-build-isolation -e .)"
    for name in SEAM:
        if not hasattr(ext, name):
            raise RuntimeError(f"{ext.__name__} has no {name}; {rebuild}")
    for name in COMPILED_CONSTANTS:
        value = getattr(compiled, name)
        if not hasattr(ext, name):
            raise RuntimeError(f"{ext.__name__} has no {name}; {rebuild}")
        if getattr(ext, name) != value:
            raise RuntimeError(f"{ext.__name__} has {name}={getattr(ext, name)} but the package expects {value}; "
                               f"{rebuild}")
    named = {"DTYPE_CODES": (set(launch.ELEM_BYTES), "launch.ELEM_BYTES"),
             "TRANSPORTS": ({LoopbackRegions.kind, NvshmemRegions.kind}, "the RDMA region kinds"),
             "PHASES": ({"none"} | set(PHASE_TEXT), "errors.PHASE_TEXT"),
             "PIPE_SITES": (set(PIPE_SITE_TEXT), "errors.PIPE_SITE_TEXT")}
    for name, (keys, where) in named.items():
        codes = getattr(ext, name, None)
        if codes is None:
            raise RuntimeError(f"{ext.__name__} has no {name}; {rebuild}")
        if set(codes) != keys:
            raise RuntimeError(f"{ext.__name__}.{name} names {sorted(codes)} but {where} names {sorted(keys)}; "
                               f"{rebuild}, or name the new code there")


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _fp32(t: torch.Tensor) -> torch.Tensor:
    """float32 and contiguous, for a kernel to read: a no-op (no detach either) for what
    already is; a conversion is made from the detached tensor, so it records no graph."""
    if t.dtype != torch.float32:
        return t.detach().float().contiguous()
    return t if t.is_contiguous() else t.detach().contiguous()


def _aligned(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Contiguous, starting on a 16-byte boundary (the kernels move 16-byte vectors), and its
    address."""
    if not t.is_contiguous():
        t = t.contiguous()
    ptr = t.data_ptr()
    if ptr % 16 != 0:
        t = t.clone()
        ptr = t.data_ptr()
    return t, ptr


def input_tensors(kept: InputTensors) -> list[torch.Tensor]:
    """A rank's dispatch inputs that are tensors (x_scales: fp8 only)."""
    return [t for t in (kept.x, kept.x_scales, kept.topk_idx, kept.topk_weights) if t is not None]


def _stream_getter(device: torch.device):
    """A function returning the device's current stream as an integer: torch's raw getter
    where this torch has it (well under a microsecond), else the Stream object's handle."""
    if device.type != "cuda":
        return lambda: 0  # the CPU model runs each launch to completion in the call
    index = device.index if device.index is not None else torch.cuda.current_device()
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is not None:
        return lambda: raw(index)
    return lambda: torch.cuda.current_stream(index).cuda_stream


# What crosses into the extension per call and rank are its struct sequences, the C API's named
# tuples (csrc/bindings/seam.h): ext.DispatchInputs, ext.DispatchOutputs and ext.CombineInputs,
# each built by field name (ext.DispatchInputs(num_tokens=T, topk=K, x=..., ...), one C call;
# the extension reads them by name too, so no order is shared), and back from it
# ext.OutputTensors (rows, scales, probs). One struct per call in production, a list of one per
# rank in the emulation. Each is read by name (.rows) at a tuple item's cost. check_extension
# refuses a module without them.
SEAM = ("DispatchInputs", "DispatchOutputs", "CombineInputs", "OutputTensors")


class InputTensors(NamedTuple):
    """One rank's dispatch inputs as tensors: ext.DispatchInputs' fields, the tensors behind its
    addresses, kept until the next dispatch's launch."""

    num_tokens: int
    topk: int
    x: torch.Tensor
    x_scales: torch.Tensor | None  # fp8 only
    topk_idx: torch.Tensor
    topk_weights: torch.Tensor


class DispatchCall(NamedTuple):
    """A dispatch's inputs as Engine.inputs checked and marshalled them (the emulation's
    EmulatedEngine.inputs_of_ranks: `inputs` and `tensors` are lists of one per rank)."""

    dtype: torch.dtype
    dtype_name: str
    fp8: bool
    topk: int  # the most routes per token of any driven rank, which sizes the workspace's tables
    inputs: object  # ext.DispatchInputs
    tensors: object  # InputTensors: the tensors behind those addresses


class Engine:
    """Kernels of one buffer for the one rank this process drives (`ranks`: [that rank], with
    its table; emulation.EmulatedEngine drives several)."""

    def __init__(self, ext, config: BufferConfig, ranks: list[int], tables: list[torch.Tensor],
                 device: torch.device, rdma=None, data_path: str | None = None, peer: Agreement | None = None):
        """rdma: the inter-node transport's regions (registered.LoopbackRegions, or NVSHMEM's),
        for groups of several nodes. data_path: "direct" or "receive" (launch.data_path; None:
        HYBRID_EP_DATA_PATH, else direct wherever it can run). peer: ranks in separate processes
        (or their emulation): their growable peer memory and the agreement on each call's path
        (agreement.Agreement); None where this process drives every rank of the group."""
        self.ext, self.config, self.ranks, self.tables, self.device = ext, config, ranks, tables, device
        if config.num_nodes > 1 and rdma is None:
            raise ValueError(f"a group of {config.num_nodes} nodes needs an inter-node transport (rdma)")
        self.rdma = rdma
        check_extension(ext)
        layouts = buffer_layouts(config, ext)  # built by this module, so its Geometry takes them
        self.reg, self.rdma_layout = layouts.reg, layouts.rdma
        self.info = info_layout(config)
        self.geo = self._geometry()
        self.timeout_s = timeout_seconds()  # HYBRID_EP_TIMEOUT_S, read once per buffer
        self.timeout_ns = int(self.timeout_s * 1e9)
        self.errors = KernelErrors(ext, self.timeout_ns, config.ranks_per_node, config.num_nodes,
                                   config.max_tokens_per_rank)
        self.abort = torch.zeros(1, dtype=torch.int32, device=device)
        self.device_sms, self.smem_per_block = ext.device_properties(device.index or 0)
        # The direct path writes a rank's outputs and reads its expert_out from every rank of
        # the node, and every rank must choose the same path per call. Ranks that share this
        # process (the single-GPU emulation) address each other's tensors as they are
        # (paths.AllocatorOutputs); ranks in separate processes reach a rank's tensors only in
        # its peer memory, with the path agreed per call (paths.PeerOutputs). Published tensors
        # are offsets from each rank's table of peer memory bases (all 0 in one process).
        in_process = len(ranks) == config.world_size and peer is None
        self.data_path = launch.data_path((config.num_nodes == 1 or rdma is not None)
                                          and (in_process or peer is not None), data_path)
        self.peer = peer if self.data_path == "direct" else None
        if self.peer is not None:
            self.outputs = PeerOutputs(self.peer, ext, config, ranks, device,
                                       self.info.dropped - self.info.agreement)
            self.bases_tables = [torch.tensor(peer_bases(self.peer, r), dtype=torch.int64, device=device)
                                 for r in ranks]
        else:
            self.outputs = AllocatorOutputs(self.data_path == "direct")
            self.bases_tables = [torch.zeros(config.world_size, dtype=torch.int64, device=device)] * len(ranks)
        self.expert_out_order = StreamOrder(device)  # users of the expert-out blocks (expert_out_order.py)
        self.expert_out_copies = 0  # combines that copied into an expert-out block (tests)
        self.expert_out_copied_bytes = 0  # the bytes those copies moved
        # per driven rank: (tensor, block) addresses of the expert_out_view lent for its next combine
        self._lent_views: list[tuple[int, int] | None] = [None] * len(ranks)
        # Launch arguments per (kind, SMs, dtype, width, wire dtype, apply_probs): built and checked
        # once, then only the per-rank part changes (the launchers copy the struct when they launch).
        self.launches = launch.LaunchSettings(ext, self.geo, len(ranks), int(self.reg.meta_entries), config.num_nodes,
                                              self.device_sms, self.smem_per_block, self.timeout_ns,
                                              self.abort.data_ptr(), self.errors.error.device_ptr,
                                              self.errors.bad_route.device_ptr)
        self._launch_cache = self.launches.cache
        self._launch_args = self.launches.args
        # Tensors the last launch of each kind read that the caller may not hold (contiguous
        # or aligned copies, fp32 casts): kept until the next call of that kind, so they
        # outlive the kernels also when the caller moves on to another stream.
        self._in_flight: dict[str, list[torch.Tensor]] = {}
        # The per-call host path: what stays fixed per rank is set once here.
        fixed = []
        for i, r in enumerate(ranks):
            ra = ext.RankArgs()
            ra.rank, ra.peers, ra.peer_bases = r, tables[i].data_ptr(), self.bases_tables[i].data_ptr()
            self._set_transport(ra, i)
            fixed.append(ra)
        self.host = self._host_path(fixed)
        self.model = ModelHooks(ext, ranks, self.host, tables, rdma, self.abort)
        self._stream = _stream_getter(device)
        self._shape = EngineShape(W=config.world_size, N=config.num_nodes, G=config.ranks_per_node,
                                  L=config.experts_per_rank, max_tokens=config.max_tokens_per_rank,
                                  max_chunks=int(self.reg.max_chunks), kd=int(self.reg.meta_entries), info=self.info)
        self.workspaces = WorkspacePool(ext, self.geo, self._shape.kd, len(ranks), device)
        self._workspaces = self.workspaces.kept
        # (dtype, columns) -> dtype name, for row widths already checked (_check_rows)
        self._row_dtypes: dict[tuple[torch.dtype, int], str] = {}
        self._widths: dict[tuple[torch.dtype, bool], int] = {}  # expert_out_width per (dtype, fp8), once
        self._ones: torch.Tensor | None = None  # _unit_weights

    def _geometry(self):
        c, g = self.config, self.ext.Geometry()
        g.world_size, g.ranks_per_node, g.num_nodes = c.world_size, c.ranks_per_node, c.num_nodes
        g.num_experts, g.local_experts = c.num_experts, c.experts_per_rank
        g.max_tokens, g.hidden = c.max_tokens_per_rank, c.hidden_dim
        g.pad_multiple = c.pad_multiple
        g.min_rows_per_expert = c.min_rows_per_expert
        g.reg, g.rdma = self.reg, self.rdma_layout
        for name, value in dataclasses.asdict(self.info).items():
            setattr(g.info, name, value)
        g.transport = self.ext.TRANSPORTS[self.rdma.kind if self.rdma is not None else "loopback"]
        return g

    def _host_path(self, fixed: list):
        """ext.HostPath of the one rank: one struct per call."""
        if len(fixed) != 1:
            raise ValueError(f"an Engine drives one rank, got {len(fixed)} (emulation.EmulatedEngine drives several)")
        return self.ext.HostPath(fixed[0])

    def _set_transport(self, ra, i: int) -> None:
        if self.rdma is not None:
            ra.rdma_regions, ra.rdma_base, ra.rdma_pes = self.rdma.rank_args(i)

    # -- errors --------------------------------------------------------------------------

    def _reported(self) -> bool:
        return self.errors.reported()

    def raise_if_failed(self) -> None:
        self.errors.raise_if_failed()

    def release_in_flight(self) -> None:
        """Drop what the last launches read (_in_flight): call it once the device has finished
        them (a device-wide synchronize) or when the buffer closes. Until then the last combine's
        expert_out stays alive: at the DeepSeek-V3 layer on EP=8 in one process, 4.26 GB (H200)."""
        self._in_flight.clear()

    @property
    def failure(self) -> str | None:
        """The first failure a kernel recorded, once the host read it (errors.KernelErrors)."""
        return self.errors.failure

    @property
    def error(self):
        return self.errors.error

    @property
    def bad_route(self):
        return self.errors.bad_route

    def _describe(self, rec: dict) -> str:
        return self.errors.describe(rec)

    # -- launch arguments ------------------------------------------------------------------

    def launch_shapes(self, num_sms: int) -> dict:
        """launch.LaunchSettings.shapes: the pipeline shape of each kernel at num_sms SMs per rank."""
        return self.launches.shapes(num_sms)

    def _workspace(self, topk: int, direct: bool, receive: bool, stream: int) -> CallWorkspace:
        return self.workspaces.get(topk, direct, receive, stream)

    def _check_rows(self, name: str, cols: int, dtype: torch.dtype) -> str:
        """dtype's name, once rows of `cols` values of it are known to move in 16-byte units
        (launch.check_row_bytes, raising with `name` otherwise); remembered per (dtype, cols)."""
        dtype_name = _dtype_name(dtype)
        launch.check_row_bytes(name, cols, dtype_name)
        self._row_dtypes[(dtype, cols)] = dtype_name
        return dtype_name

    # -- dispatch --------------------------------------------------------------------------

    @property
    def arenas(self) -> list:
        """Each driven rank's allocator over its peer memory (arena.Arena); none in one process."""
        return self.outputs.arenas if self.peer is not None else []

    def _results(self, given: DispatchCall, call: CallWorkspace, rows: list[int], direct: bool, made,
                 bounds: list[int] | None) -> RankDispatch:
        """The rank's outputs (made: ext.OutputTensors) and its tables in the call's workspace."""
        self._in_flight["dispatch"] = given.tensors
        return self._rank_result(given, call, 0, rows[0], given.tensors, made, direct, bounds)

    def _rank_result(self, given: DispatchCall, call: CallWorkspace, i: int, R: int, kept: InputTensors, out,
                     direct: bool, bounds: list[int] | None) -> RankDispatch:
        """Driven rank i's RankDispatch: its outputs and its part of the call's workspace."""
        width = self._widths.get((given.dtype, given.fp8))
        if width is None:
            width = self._widths[(given.dtype, given.fp8)] = expert_out_width(given.dtype, given.fp8)
        return RankDispatch(out.rows, out.scales, out.probs,
                            CudaSendTable(call, i, kept.num_tokens, kept.topk, self._shape.W,
                                          kept.topk_idx if direct else None, width),
                            CudaReceiveTable(call, i, self._shape, R, bounds))

    def inputs(self, x: torch.Tensor, scales: torch.Tensor | None, routing: Routing) -> DispatchCall:
        """The rank's dispatch inputs, checked and marshalled for dispatch (_rank_inputs)."""
        H = self.config.hidden_dim
        dtype = x.dtype
        dtype_name = self._row_dtypes.get((dtype, H)) or self._check_rows("x", H, dtype)
        fp8 = dtype_name == "float8_e4m3fn"
        inputs, kept = self._rank_inputs(self.ranks[0], x, scales, routing, fp8)
        return DispatchCall(dtype, dtype_name, fp8, kept.topk, inputs, kept)

    def refuse(self, code: int, num_out_tokens: int | None, num_sms: int | None, known_rows: int | None = None,
               known_bounds: list[int] | None = None) -> None:
        """The one rank this engine drives refused its input (code: refusals.code_of): it makes the
        dispatch its peers make (the same kind of size, so every rank's agreement keeps the same
        ledger), with no tokens and the refusal in its count row, so theirs end at once with the
        same refusals.InputRefused: at their count read, or, for a static size, at their next call.
        Raises what the count exchange told (its own refusal, or a lower rank's bad route or
        refusal) where the call reads; returns where it does not."""
        dev = self.device
        routing = Routing(torch.empty(0, 1, dtype=torch.int64, device=dev))
        given = self.inputs(torch.empty(0, self.config.hidden_dim, dtype=torch.bfloat16, device=dev), None, routing)
        self.host.set_refused(0, code)
        try:
            self.dispatch(given, num_out_tokens, num_sms, known_rows, known_bounds)
        finally:
            self.host.set_refused(0, 0)

    @staticmethod
    def _per_rank(known_rows: int) -> list[int]:
        """A handle's rows as the rows per driven rank that paths.py and the workspace take."""
        return [known_rows]

    def _rank_inputs(self, r: int, x: torch.Tensor, sc: torch.Tensor | None, routing: Routing,
                     fp8: bool) -> tuple:
        """Rank r's inputs as the kernels read them (K <= MAX_TOPK, fp8 scales of the right shape;
        contiguous, 16-byte aligned, fp32 scales and weights): (ext.DispatchInputs, InputTensors)."""
        H = self.config.hidden_dim
        idx = routing.topk_idx_TK
        T, K = idx.shape
        if K > MAX_TOPK:
            check_topk("topk_idx", K)  # normalize_routing checked it already: a Routing made elsewhere
        sc_ptr = 0
        if fp8:
            if sc is None:
                raise ValueError(f"scales: fp8 x on rank {r} needs its float32 scales [num_tokens, "
                                 f"hidden_dim / {FP8_BLOCK}] (a re-dispatch with a reused handle too)")
            if tuple(sc.shape) != (x.shape[0], H // FP8_BLOCK):
                raise ValueError(f"scales on rank {r} must have shape [{x.shape[0]}, {H // FP8_BLOCK}], "
                                 f"got {list(sc.shape)}")
            sc = _fp32(sc)
            sc_ptr = sc.data_ptr()
        if not idx.is_contiguous():
            idx = idx.contiguous()
        w = routing.given_weights_TK  # unrouted slots are never read
        if w is None:  # 1.0 per route: the first T * K of the engine's ones, no tensor op
            w = self._unit_weights(T * K)
        elif w.dtype != torch.float32 or not w.is_contiguous():
            w = _fp32(w)
        if not x.is_contiguous():
            x = x.contiguous()
        x_ptr = x.data_ptr()
        if x_ptr % 16:
            x, x_ptr = _aligned(x)
        return (self.ext.DispatchInputs(num_tokens=T, topk=K, x=x_ptr, x_scales=sc_ptr, topk_idx=idx.data_ptr(),
                                        topk_weights=w.data_ptr()),
                InputTensors(T, K, x, sc, idx, w))

    def _unit_weights(self, count: int) -> torch.Tensor:
        """float32 ones, at least `count` (a dispatch whose caller gave no routing weights reads
        its T x K from the start), made once and grown to the largest call's: no tensor
        operation per call, which on a GPU is a kernel launch and a cast per rank."""
        ones = self._ones
        if ones is None or ones.numel() < count:
            ones = self._ones = torch.ones(max(count, 1), dtype=torch.float32, device=self.device)
        return ones

    def dispatch(self, given: DispatchCall, num_out_tokens: int | None, num_sms: int | None,
                 known_rows: int | None = None, known_bounds: list[int] | None = None) -> RankDispatch:
        """The kernels of a dispatch of the inputs (`inputs`), the rank's RankDispatch, on the path
        the engine's outputs (paths.py) decide. known_rows: a handle's output rows; known_bounds:
        every rank's rows the agreement sized the handle's call for (CudaReceiveTable.bounds). A call
        whose sizes are known before the count kernel (static_rows >= 0: num_out_tokens, or a
        handle's known_rows) and whose path is decided without a read launches both kernels in
        one call (_dispatch_known). Any other call launches the count kernel (with the agreement
        words, where ranks are in separate processes), reads the sizes, a bad route and those
        words in the one host read, decides, then launches the dispatch kernel. From that read to
        the dispatch launch the GPU idles: only what needs the sizes runs there (the path, the
        output blocks' ranges); the blocks' tensors and the results are made after the launch.
        num_sms: SMs per rank (None: launch.DEFAULT_NUM_SMS_DISPATCH)."""
        if self._reported():
            self.raise_if_failed()
        if num_sms is None:
            num_sms = launch.DEFAULT_NUM_SMS_DISPATCH
        static_rows = num_out_tokens if num_out_tokens is not None else -1
        place = self.outputs
        stream = self._stream()
        if static_rows >= 0 or known_rows is not None:
            decision = place.decide_known(static_rows, known_bounds, given.dtype, given.fp8)
            if decision is not None:
                rows = [static_rows] * len(self.ranks) if static_rows >= 0 else self._per_rank(known_rows)
                call, made = self._dispatch_known(given, rows, static_rows, num_sms, decision, stream)
                return self._results(given, call, rows, decision.direct, made,
                                     place.bounds(static_rows, known_bounds, None))
        H = self.config.hidden_dim
        deadline = time.monotonic() + self.timeout_s  # the call's: every wait below draws on it
        place.before_count(self.host, stream, deadline)
        prefer = self.data_path == "direct"
        call = self._workspace(given.topk, prefer, True, stream)
        args = self._launch_args(num_sms, given.dtype_name, H, "dispatch_direct" if prefer else "dispatch_receive")
        try:
            # the count kernel's waits and the host's read of its counts: what the call has left
            args.timeout_ns = int(time_left(deadline, self.timeout_s) * 1e9)
            return self._dispatch_read(given, args, call, place, stream, static_rows, num_sms, known_rows,
                                       known_bounds, prefer)
        finally:
            args.timeout_ns = self.timeout_ns

    def _dispatch_read(self, given: DispatchCall, args, call: CallWorkspace, place, stream: int, static_rows: int,
                       num_sms: int, known_rows, known_bounds: list[int] | None,
                       prefer: bool):
        """A dispatch whose output size or path needs the count kernel's read (Engine.dispatch):
        the count kernel, the one host read, the decision, the dispatch kernel."""
        dtype, dtype_name, fp8 = given.dtype, given.dtype_name, given.fp8
        H = self.config.hidden_dim
        first = call.layout.info // 8 + self.info.needed  # needed, bad_route, then the agreement words: one read
        sizes = call.i64[:, first:first + 1 + BAD_ROUTE_WORDS + place.words]
        declared = None
        model = self.model
        if model.declaring():  # the outputs are added after the read
            declared = (spans(self._dispatch_tensors(given.tensors)) + [(call.ptr, call.i64.numel() * 8)] +
                        model.fixed_spans())
            model.note(declared)
        self.host.dispatch_count(args, stream, call.ptr, call.layout, static_rows, given.inputs, True)
        read = sizes.cpu().tolist()  # the one host sync
        self.raise_if_failed()
        if read[0][1] >= 0:  # every rank holds the lowest bad rank's route or refusal; no dispatch kernel follows
            c = self.config
            raise bad_route_error(c.num_experts, c.max_tokens_per_rank, *read[0][1:1 + BAD_ROUTE_WORDS])
        if static_rows >= 0:
            rows = [static_rows] * len(self.ranks)
        else:
            rows = self._per_rank(known_rows) if known_rows is not None else [r[0] for r in read]
        words = read[0][1 + BAD_ROUTE_WORDS:]
        decision = place.decide_read(words, static_rows, dtype, fp8)
        taken = place.take(rows, dtype, fp8, stream, decision)
        if prefer and not decision.direct:  # the count kernel's per-rank arguments, for the receive kernel
            args = self.launches.receive_args(args, num_sms, dtype_name, H)
        if taken is not None:  # the launch, then the blocks' tensors, in one call
            if declared is not None:
                model.note(declared + self._output_spans(self._block_outputs(rows, taken), dtype))
            made = self.host.dispatch_rows_into(args, stream, call.ptr, call.layout, taken)
        else:
            outputs, made = self._outputs(rows, dtype, fp8)
            if declared is not None:
                model.note(declared + self._output_spans(outputs, dtype))
            self.host.dispatch_rows(args, decision.direct, stream, call.ptr, call.layout, outputs)
        return self._results(given, call, rows, decision.direct, made, place.bounds(static_rows, known_bounds, words))

    def _dispatch_known(self, given: DispatchCall, rows: list[int], static_rows: int, num_sms: int,
                        decision, stream: int) -> tuple:
        """Both kernels in one call into the extension, the output size known (rows per rank;
        static_rows: num_out_tokens, or -1 for a handle's sizes) and the path decided:
        (workspace, ext.OutputTensors per rank). A direct call's blocks in peer memory
        (arena.arena_take) have their tensors made by the same call, else the outputs come from
        PyTorch's allocator."""
        dtype, dtype_name, fp8 = given.dtype, given.dtype_name, given.fp8
        direct = decision.direct
        taken = self.outputs.take(rows, dtype, fp8, stream, decision)
        call = self._workspace(given.topk, direct, not direct, stream)
        kind = "dispatch_direct" if direct else "dispatch_receive"
        H = self.config.hidden_dim
        args = (self._launch_cache.get((kind, num_sms, dtype_name, H, None, False))
                or self._launch_args(num_sms, dtype_name, H, kind))
        if taken is None:
            outputs, made = self._outputs(rows, dtype, fp8)
        if self.model.declaring():
            self.model.declare(self._dispatch_tensors(given.tensors), [(call.ptr, call.i64.numel() * 8)] +
                               self._output_spans(outputs if taken is None else self._block_outputs(rows, taken),
                                                  dtype))
        if taken is not None:  # the launch and the blocks' tensors in one call
            made = self.host.dispatch_into(args, stream, call.ptr, call.layout, static_rows, given.inputs, taken)
        else:
            self.host.dispatch(args, direct, stream, call.ptr, call.layout, static_rows, given.inputs, outputs)
        return call, made

    def _outputs(self, rows: list[int], dtype: torch.dtype, fp8: bool) -> tuple:
        """The rank's new output tensors from PyTorch's allocator: (ext.DispatchOutputs, their
        addresses for the launch; ext.OutputTensors)."""
        return self._new_outputs(rows[0], dtype, fp8)

    def _new_outputs(self, R: int, dtype: torch.dtype, fp8: bool) -> tuple:
        """Output tensors of R rows: (ext.DispatchOutputs, ext.OutputTensors)."""
        H, dev = self.config.hidden_dim, self.device
        out = torch.empty(R, H, dtype=dtype, device=dev)
        sc = torch.empty(R, H // FP8_BLOCK, dtype=torch.float32, device=dev) if fp8 else None
        probs = torch.empty(R, dtype=torch.float32, device=dev)
        return (self.ext.DispatchOutputs(num_rows=R, rows=out.data_ptr(), scales=sc.data_ptr() if sc is not None else 0,
                                         probs=probs.data_ptr()),
                self.ext.OutputTensors(rows=out, scales=sc, probs=probs))

    def _block_outputs(self, rows: list[int], taken) -> list:
        """ext.DispatchOutputs per driven rank of the blocks `taken` holds (the CPU model's
        declarations; the extension reads the blocks' addresses itself)."""
        make = self.ext.DispatchOutputs
        return [make(num_rows=R, rows=at[0], scales=at[1], probs=at[2]) for R, at in zip(rows, taken.addresses())]

    def _dispatch_tensors(self, kept: InputTensors) -> list[torch.Tensor]:
        """The tensors a dispatch's launches read (the CPU model's declarations)."""
        return input_tensors(kept) + list(self.bases_tables)

    def _output_spans(self, outputs, dtype: torch.dtype) -> list[tuple[int, int]]:
        """(address, bytes) of the outputs of a dispatch, from its ext.DispatchOutputs (one, or a
        list of one per driven rank)."""
        H = self.config.hidden_dim
        regions = []
        for o in (outputs if isinstance(outputs, list) else [outputs]):
            R = o.num_rows
            if R > 0:
                regions += [(o.rows, R * H * dtype.itemsize), (o.probs, R * 4)]
                if o.scales:
                    regions.append((o.scales, R * (H // FP8_BLOCK) * 4))
        return regions

    # -- combine ---------------------------------------------------------------------------

    def combine(self, rows: torch.Tensor, send: CudaSendTable, recv: CudaReceiveTable, probs: torch.Tensor,
                apply_probs: bool, num_sms: int | None, wire_dtype: torch.dtype | None = None) -> torch.Tensor:
        """The rank's combine: the call's dtype, width and launch arguments (_combine_args), its
        inputs marshalled (_rank_combine), then the kernel in one call into the extension.
        num_sms: SMs (None: launch.DEFAULT_NUM_SMS_COMBINE); wire_dtype: of the partial sums
        between ranks (None: the dtype of the rows)."""
        args, direct, stream = self._combine_start(rows, send, num_sms, wire_dtype, apply_probs)
        inputs, y, keep, in_peer, copied = self._rank_combine(0, rows, send, recv, probs, apply_probs, direct, stream,
                                                              False)
        self._launch_combine(args, direct, stream, inputs, [y], [send], keep, in_peer, copied)
        return y

    def _launch_combine(self, args, direct: bool, stream: int, inputs, outs: list[torch.Tensor],
                        sends: list[CudaSendTable], keep: list, in_peer: list, copied: bool) -> None:
        """The combine kernel on marshalled inputs (one ext.CombineInputs, or a list of one per
        driven rank); keep: tensors to hold until the next combine, in_peer: those in peer memory,
        copied: whether an expert_out was copied into an expert-out block."""
        self._in_flight["combine"] = keep
        if self.model.declaring():
            self.model.declare(keep + in_peer + outs + list(self.bases_tables) + [s.topk_idx_TK for s in sends],
                               [(s.call.part(s.part), s.call.layout.bytes) for s in sends])
        self.host.combine(args, direct, stream, inputs)
        if copied:
            self.expert_out_order.after(stream)
            self.expert_out_copies += 1

    def _combine_start(self, first: torch.Tensor, send: CudaSendTable, num_sms: int | None,
                       wire_dtype: torch.dtype | None, apply_probs: bool) -> tuple:
        """A combine's start, from its (first rank's) rows and send table: a failure a kernel
        recorded raised; (launch arguments, direct, stream)."""
        if self._reported():
            self.raise_if_failed()
        if num_sms is None:
            num_sms = launch.DEFAULT_NUM_SMS_COMBINE
        direct = send.topk_idx_TK is not None  # the path of the dispatch that made the handle (data_path)
        return self._combine_args(first, direct, num_sms, wire_dtype, apply_probs), direct, self._stream()

    def _combine_args(self, first: torch.Tensor, direct: bool, num_sms: int, wire_dtype: torch.dtype | None,
                      apply_probs: bool):
        """The launch arguments of a combine whose (first rank's) rows are `first` (they set the
        call's dtype and width), checked: a wire dtype of the rows or fp32, rows that move in
        16-byte units and fit the buffer's hidden size."""
        dtype = first.dtype
        dtype_name = _DTYPE_NAMES.get(dtype) or _dtype_name(dtype)
        wire_name = dtype_name if wire_dtype is None or wire_dtype == dtype else _dtype_name(wire_dtype)
        if wire_name not in (dtype_name, "float32"):
            raise ValueError(f"wire_dtype must be the dtype of expert_out ({dtype_name}) or float32, got {wire_name}")
        C = first.shape[1]
        if (dtype, C) not in self._row_dtypes:
            self._check_rows("expert_out", C, dtype)
        if C > self.config.hidden_dim:
            raise ValueError(f"expert_out rows have {C} columns; the buffer holds {self.config.hidden_dim}")
        kind = "combine_direct" if direct else "combine_receive"
        return (self._launch_cache.get((kind, num_sms, dtype_name, C, wire_name, apply_probs))
                or self._launch_args(num_sms, dtype_name, C, kind, wire_name, apply_probs))

    def _rank_combine(self, i: int, x: torch.Tensor, send: CudaSendTable, recv: CudaReceiveTable, p: torch.Tensor,
                      apply_probs: bool, direct: bool, stream: int, copied: bool) -> tuple:
        """Validation and marshalling of driven rank i's combine: its expert_out and probs as the
        kernels read them (contiguous, 16-byte aligned, fp32 probs), on the direct path with peer
        memory copied into the rank's expert-out block where they lie outside peer memory; its y.
        copied: whether an earlier rank of the call copied. Returns (ext.CombineInputs, y, tensors
        to keep until the next combine, tensors in peer memory, whether something was copied)."""
        r = self.ranks[i]
        C = x.shape[1]
        x_ptr = x.data_ptr()
        if x_ptr % 16 or not x.is_contiguous():
            x, x_ptr = _aligned(x)
        if p.dtype is not torch.float32 or not p.is_contiguous():
            p = _fp32(p)
        lent, self._lent_views[i] = self._lent_views[i], None
        if lent is not None and lent[0] == x_ptr and self.outputs.expert_out_blocks[i] is not None \
                and lent[1] != self.outputs.expert_out_blocks[i].data_ptr():
            raise ValueError(f"expert_out on rank {r} is an expert_out_view of an expert-out block that a later "
                             f"dispatch replaced (a larger call): take the view after the last dispatch before "
                             f"its combine")
        keep, in_peer = [], []
        if direct and self.peer is not None:
            # Peer memory tensors stay out of _in_flight: the arena reuses a block only on the
            # stream it was used on, and one kept here would split it until the next combine.
            # What lies outside peer memory is copied into the rank's expert-out block.
            arena = self.outputs.arenas[i]
            x_out = not arena.contains(x)
            p_out = apply_probs and not arena.contains(p)  # probs are read only then
            if x_out and C * x.element_size() > self.config.hidden_dim * send.expert_out_width:
                raise ValueError(f"expert_out on rank {r} is {x.dtype} [{C} columns], outside peer memory, and "
                                 f"its dispatch sized the expert-out block it is copied into for "
                                 f"{send.expert_out_width}-byte values of {self.config.hidden_dim} columns (the "
                                 f"dispatch's dtype, bf16 for fp8 rows): combine rows of that dtype, or write "
                                 f"them into HybridEPBuffer.expert_out_view(handle)")
            if x_out or p_out:
                keep = [t for t, out in ((x, x_out), (p, p_out)) if out]
                if not copied:
                    self.expert_out_order.before(stream)
                    copied = True
                x, p = self._into_expert_out_block(i, x, p, x_out, p_out)
                x_ptr = x.data_ptr()
            in_peer = [x, p]
        else:
            keep = [x, p]
        T = send.num_tokens
        y = torch.empty(T, C, dtype=x.dtype, device=self.device)
        call = send.call
        inputs = self.ext.CombineInputs(num_tokens=T, topk=send.topk, part=call.part(send.part), layout=call.layout,
                                        topk_idx=send.topk_idx_TK.data_ptr() if direct else 0, expert_out=x_ptr,
                                        probs=p.data_ptr(), y=y.data_ptr(), num_rows=recv.num_rows)
        return inputs, y, keep, in_peer, copied

    def expert_out_view(self, i: int, shape, dtype: torch.dtype, like: torch.Tensor | None = None):
        """A tensor of `shape` in driven rank i's expert-out block, where the experts can leave
        their output so that a direct combine reads it in place (peer memory only; one such
        tensor at a time per rank: the next combine's expert_out); `like` copied in. None where
        the rank has no expert-out block that large."""
        block = self.outputs.expert_out_blocks[i] if self.peer is not None else None
        nbytes = dtype.itemsize
        for n in shape:
            nbytes *= n
        if block is None or nbytes > block.numel():
            return like
        t = block[:nbytes].view(dtype).view(tuple(shape))
        self._lent_views[i] = (t.data_ptr(), block.data_ptr())
        return t.copy_(like) if like is not None else t

    def _into_expert_out_block(self, i: int, x: torch.Tensor, p: torch.Tensor, copy_x: bool, copy_p: bool):
        """(x, p), each copied into driven rank i's expert-out block in peer memory where asked
        (x at its start, p after it)."""
        block = self.outputs.expert_out_blocks[i]
        x_bytes = x.numel() * x.element_size()
        if copy_x and block is not None and x.data_ptr() == block.data_ptr():
            copy_x = False  # the experts wrote it into the block (expert_out_view)
        if block is None:
            raise ValueError(f"expert_out on rank {self.ranks[i]} lies outside the buffer's peer memory and the "
                             f"buffer stages no combines (stage_combines=False): write it into "
                             f"HybridEPBuffer.expert_out_view(handle), or leave stage_combines on")
        # probs after x where x is (or goes) in the block
        at = aligned(x_bytes) if copy_x or x.data_ptr() == block.data_ptr() else 0
        need = max(x_bytes if copy_x else 0, at + p.numel() * 4 if copy_p else 0)
        if need > block.numel():
            raise ValueError(f"expert_out on rank {self.ranks[i]} ({x.dtype}, {x_bytes} bytes, and its probs: "
                             f"{p.numel() * 4 if copy_p else 0} bytes) does not fit the rank's expert-out block "
                             f"of {block.numel()} bytes, sized at the dispatch for rows of the dispatch's dtype "
                             f"(bf16 for fp8 rows): combine rows of that dtype, or write them into "
                             f"HybridEPBuffer.expert_out_view(handle)")
        if copy_x:
            x = block[:x_bytes].view(x.dtype).view(x.shape).copy_(x)
        if copy_p:
            p = block[at:at + p.numel() * 4].view(torch.float32).copy_(p)
        self.expert_out_copied_bytes += (x_bytes if copy_x else 0) + (p.numel() * 4 if copy_p else 0)
        return x, p
