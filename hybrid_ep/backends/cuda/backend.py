"""CudaBackend: HybridEPBuffer's `cuda` backend, one rank per process: NVLink peers inside a
node, NVSHMEM between nodes (when the build has it)."""

from __future__ import annotations

import torch

from ...config import BufferConfig, KernelConfig
from ...handle import DispatchHandle
from ...memory import BufferSpec, MemoryPlan
from ...routing import max_output_rows
from ..base import Backend
from . import arena, load_extension, staging
from .agreement import PathVote
from .engine import Engine
from .layout import MAX_TOPK, check_geometry, rdma_layout, registered_layout, registered_regions
from .nvshmem import heap_spec
from .registered import NvshmemRegions, RegisteredBuffers


def memory_plan(config: BufferConfig, name: str = "cuda") -> MemoryPlan:
    """Bytes each rank holds for the buffer's life (registered regions, the NVSHMEM heap, an
    opt-in arena), known before allocation; the outputs of a call come from PyTorch's
    allocator at the call's size (the per-call line: the worst case)."""
    # the registered buffer's regions as csrc builds them (layout.registered_regions)
    specs = [BufferSpec(r.name, r.bytes, True, r.purpose) for r in registered_regions(config)]
    if config.num_nodes > 1:
        specs.append(heap_spec(rdma_layout(config).total))  # NVSHMEM_SYMMETRIC_SIZE, set before init
    one_node = config.num_nodes == 1
    specs.append(BufferSpec("combine_staging", staging.staging_bytes(config) if one_node else 0, True,
                            "with an arena (opt-in): where a direct combine copies an expert_out from outside "
                            "the arena, fp32 rows as many as a bf16 call in the arena"))
    specs.append(BufferSpec("arena", arena.arena_bytes(config) if one_node else 0, True,
                            "opt-in (BufferConfig.arena_bytes): dispatch outputs peers in other processes write, "
                            "each kept output taking arena.call_bytes"))
    worst_rows = max_output_rows(config, min(config.experts_per_rank, MAX_TOPK))
    specs.append(BufferSpec("dispatch_out", worst_rows * config.hidden_dim * 4, False,
                            "expert-major output from PyTorch's allocator, fp32 worst case"))
    return MemoryPlan(name, tuple(specs))


class CudaBackend(Backend):
    name = "cuda"
    checks_routing_on_device = True
    reports_dynamic_routing = True  # the layout kernel's bad route, read with `needed` (engine.dispatch)

    def __init__(self, config, group, rank, owner):
        super().__init__(config, group, rank, owner)
        ext = load_extension("cuda")
        several_nodes = config.num_nodes > 1
        check_geometry(config, inter_node=several_nodes and ext.has_nvshmem())
        self._device = torch.device("cuda", torch.cuda.current_device())
        arena_bytes = staging.direct_region_bytes(config)
        self._buffers = RegisteredBuffers.exchanged(ext, registered_layout(config).total, group, rank, self._device,
                                                    config.ranks_per_node, arena_bytes)
        self._rdma = (NvshmemRegions(ext, rdma_layout(config).total, group, self._device) if several_nodes
                      else None)
        # One process per rank: the ranks agree on each dispatch's path (agreement.PathVote).
        self._vote = PathVote.create(group, rank) if arena_bytes else None
        self._engine = Engine(ext, config, [rank], self._buffers.tables, self._device, self._rdma,
                              arenas=self._buffers, vote=self._vote)

    @classmethod
    def on_engine(cls, config: BufferConfig, rank: int, owner: int, engine: Engine) -> "CudaBackend":
        """This backend over an engine built elsewhere, e.g. an EmulatedGroup's of one rank on
        the CPU model: the host-time bench (hybrid_ep.bench.host) times the one-rank-per-process
        API path with it, where no GPU and no peer processes are at hand."""
        self = cls.__new__(cls)
        Backend.__init__(self, config, None, rank, owner)
        self._device, self._buffers, self._rdma, self._engine = engine.device, None, None, engine
        return self

    @property
    def device(self) -> torch.device:
        return self._device

    def memory_plan(self) -> MemoryPlan:
        return memory_plan(self.config)

    def dispatch(self, x_TH, scales_TB, routing, handle, num_out_tokens, kernel_config: KernelConfig):
        known = None
        if handle is not None:
            routing, num_out_tokens = handle.routing, handle.num_out_tokens
            known = [handle.num_rows]
        [res] = self._engine.dispatch([x_TH], [scales_TB], [routing], num_out_tokens,
                                      kernel_config.num_sms_dispatch, known)
        # owner, config, rank, routing, source, dest, probs_R, num_out_tokens; the count tables
        # are views of the call's workspace, read from dest when asked for.
        new = DispatchHandle(self.owner, self.config, self.rank, routing, res.send, res.recv, res.probs_R,
                             num_out_tokens)
        return res.rows_RH, res.scales_RB, new

    def combine(self, rows_RH, handle, apply_probs, kernel_config: KernelConfig):
        [y] = self._engine.combine([rows_RH], [handle.source], [handle.dest], [handle.probs_R], apply_probs,
                                   kernel_config.num_sms_combine, kernel_config.wire_dtype_for(rows_RH.dtype))
        return y

    def return_row_values(self, values_R, handle):
        [out] = self._engine.return_row_values([values_R], [handle.routing], [handle.source], [handle.dest])
        return out
