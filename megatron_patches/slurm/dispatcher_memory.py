"""What the hybrid_ep dispatcher holds per GPU for a recipe, from the library's own memory plan.

The dispatcher builds one buffer per GPU for all its MoE layers (megatron_patches/buffers.py)
with the BufferConfig worked out here from the recipe, as the dispatcher works it out at run
time from Megatron's config and the --hybrid-ep-* flags of the recipe's argument list:

    hidden_dim           model.hidden_size
    max_tokens_per_rank  --hybrid-ep-max-tokens-per-rank, else a micro-batch's tokens on one
                         rank: seq_length x micro_batch_size / CP (/ TP with sequence parallelism)
    num_experts          (balancer slots per rank x EP with the balancer on, else the experts) x ETP
    world_size           EP x ETP (the dispatcher's group: EP, or ETP x EP)
    ranks_per_node       --hybrid-ep-ranks-per-node, else the group's members per NVLink domain:
                         Megatron numbers an ETP x EP group as consecutive ranks, srun fills
                         hosts in order, and each of the job's domains holds its segment's
                         hosts (domain.py; one host where cluster.nvlink_domain is unset)
    pad_multiple         --hybrid-ep-pad-multiple (the grouped GEMM's own alignment, added at run
                         time, changes the held bytes by rows of padding only)

The backend is the recipe's dispatcher.backend, or for `auto` the pick of its rule for one
node or several (hybrid_ep/backends/choice.py; the job runs on GPUs with the extension built).
The plan is the backend's memory_plan() for that BufferConfig, the function
HybridEPBuffer.memory_plan() returns, computed without a GPU or a process group; its
registered (held) bytes are what the launcher adds to the estimate. Not modelled: a drop-and-pad
run's min_rows_per_expert (rows of padding, per call).
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from hybrid_ep.config import BufferConfig
from hybrid_ep.memory import MemoryPlan

from .. import options as options_mod
from .domain import job_domain
from .megatron_args import megatron_args


@dataclasses.dataclass(frozen=True)
class DispatcherMemory:
    backend: str  # the backend that runs
    why: str  # "dispatcher.backend" or auto's rule, in a few words
    config: BufferConfig
    plan: MemoryPlan

    @property
    def held_bytes(self) -> int:
        """What the buffer holds for its life (MemoryPlan.held_bytes)."""
        return self.plan.held_bytes

    def regions(self) -> list[tuple[str, int]]:
        """(name, bytes) of each held region with bytes, in the plan's order."""
        return [(b.name, b.nbytes) for b in self.plan.buffers if b.registered and b.nbytes]


def _options(recipe) -> options_mod.HybridEPOptions:
    """The dispatcher's options from the recipe's argument list, as Megatron's parser reads them."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    options_mod.add_arguments(parser)
    known, _ = parser.parse_known_args(megatron_args(recipe))
    return options_mod.from_args(known)


def tokens_per_rank(recipe) -> int:
    """Tokens of one micro-batch on one rank where they enter the dispatcher."""
    p = recipe["parallelism"]
    tokens = recipe["model.seq_length"] * recipe["train.micro_batch_size"] // max(1, p["cp"])
    return tokens // max(1, p["tp"]) if p["sequence_parallel"] else tokens


def buffer_config(recipe, opts: options_mod.HybridEPOptions | None = None) -> BufferConfig:
    """The BufferConfig the dispatcher builds for this recipe (see the module docstring)."""
    from hybrid_ep.topology import resolve_ranks_per_node

    from ..balancer import slots_per_rank

    opts = opts or _options(recipe)
    ep, etp = recipe["parallelism.ep"], recipe["parallelism.etp"]
    experts = recipe["model.num_experts"]
    if opts.balancer_enabled:
        experts = slots_per_rank(opts, experts, ep) * ep
    world = ep * etp
    # The library's own decision, each launcher "node" one of the job's NVLink domains.
    ranks_per_node = resolve_ranks_per_node(list(range(world)), opts.ranks_per_node, job_domain(recipe).used)
    return BufferConfig(hidden_dim=recipe["model.hidden_size"],
                        max_tokens_per_rank=opts.max_tokens_per_rank or tokens_per_rank(recipe),
                        num_experts=experts * etp, world_size=world, ranks_per_node=ranks_per_node,
                        pad_multiple=opts.pad_multiple, ring_dtype=ring_dtype(recipe)).validate()


def ring_dtype(recipe) -> torch.dtype:
    """The rings' width the dispatcher picks for the recipe's hidden states (buffers.ring_dtype_for):
    bf16 under precision bf16 and fp8 (fp8 trains with --bf16), fp16 and fp32 as named."""
    from ..buffers import ring_dtype_for

    return ring_dtype_for({"fp16": torch.float16, "fp32": torch.float32}.get(recipe["precision"], torch.bfloat16))


def library_plan(backend: str, config: BufferConfig) -> MemoryPlan:
    """The memory plan a buffer of `backend` reports for `config` (HybridEPBuffer.memory_plan())."""
    if backend == "cuda":
        from hybrid_ep.backends.cuda.backend import memory_plan

        return memory_plan(config)
    from hybrid_ep.backends.reference import memory_plan as reference_plan

    return reference_plan(config, "cuda")  # a GPU job: NCCL's messages come from the allocator per call


def dispatcher_memory(recipe, backend: str | None = None) -> DispatcherMemory | None:
    """The dispatcher's memory for the recipe (None with another dispatcher.type); `backend`
    replaces the one the recipe runs (e.g. "cuda", to say what opting in would hold)."""
    if recipe["dispatcher.type"] != "hybrid_ep":
        return None
    from hybrid_ep.backends.choice import choose_auto, topology_of

    opts = _options(recipe)
    config = buffer_config(recipe, opts)
    asked = backend or opts.backend
    if asked == "auto":
        name = choose_auto(config.num_nodes, lambda: None).name
        why = f"auto's pick for {topology_of(config.num_nodes)}"
    else:
        name, why = asked, "asked for" if backend else "dispatcher.backend"
    return DispatcherMemory(name, why, config, library_plan(name, config))
