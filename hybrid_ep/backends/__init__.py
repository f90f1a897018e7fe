"""Backend selection: the one place that maps a backend name to an implementation, and the
one list of those names (BACKENDS, BACKEND_NAMES): HybridEPBuffer, the benchmark's --backends,
Megatron's --hybrid-ep-backend and the recipe validator all take theirs from here."""

from __future__ import annotations

import importlib
import logging

import torch
import torch.distributed as dist

from . import evidence
from .base import Backend
from .choice import AUTO_RULES, BackendChoice, choose_auto, log_choice
from .reference import ReferenceBackend

# The implementations, and every name a buffer may be asked for: "auto" picks one (AUTO_RULES).
BACKENDS = ("cuda", "reference")
BACKEND_NAMES = ("auto", *BACKENDS)


def cuda_unavailable_reason(group, explicit: bool = False) -> str | None:
    """Why the cuda backend cannot run here, or None when it can.

    `auto` takes a non-NCCL group as a sign that the ranks live on the CPU. Asked for by
    name, the backend runs over any group: it uses the group only for object collectives
    (handles, the NVSHMEM unique id), which gloo carries too, and several processes on one
    GPU (NVSHMEM's several-PEs-per-GPU mode) cannot form an NCCL group."""
    try:
        importlib.import_module("hybrid_ep._C")
    except ImportError as err:
        return f"the compiled extension hybrid_ep._C is not installed ({err})"
    if not torch.cuda.is_available():
        return "no CUDA device is visible"
    if not explicit and "nccl" not in str(dist.get_backend(group)).lower():
        return "the EP group is not an NCCL group"
    return None


def _cuda_geometry_reason(config, group) -> str | None:
    """Why the cuda backend cannot run this group's shape here (None when it can): one NVLink
    domain, or several nodes with a build that has the NVSHMEM transport."""
    reason = cuda_unavailable_reason(group)
    if reason is not None:
        return reason
    from .cuda import load_extension
    from .cuda.layout import check_geometry

    try:
        check_geometry(config, inter_node=config.num_nodes > 1 and load_extension("cuda").has_nvshmem())
    except ValueError as err:
        return str(err)
    return None


_warned: set[str] = set()


def _auto_evidence(config, group):
    """The user's measurement for this group (evidence.py), or None; what was ignored in the
    evidence file is logged once per process."""
    on_gpu = torch.cuda.is_available() and "nccl" in str(dist.get_backend(group)).lower()
    shape = {"hidden": config.hidden_dim, "tokens_per_rank": config.max_tokens_per_rank,
             "experts": config.num_experts}
    found, warnings = evidence.find(config.num_nodes, config.ranks_per_node,
                                    evidence.identity_here("cuda" if on_gpu else "cpu"), shape=shape)
    for line in warnings:
        if line not in _warned:
            _warned.add(line)
            logging.getLogger("hybrid_ep").warning("hybrid_ep: auto's evidence %s", line)
    return found


def _agreed(choice: BackendChoice, group) -> BackendChoice:
    """auto's choice where every rank of the group made the same one (they read their own
    evidence files), else reference, which runs anywhere."""
    if dist.get_world_size(group) == 1:
        return choice
    names: list[str | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, choice.name, group=group)
    if len(set(names)) == 1:
        return choice
    picks = ", ".join(f"rank {r}: {n}" for r, n in enumerate(names))
    return BackendChoice("reference", "auto", f"the ranks' evidence disagrees ({picks}); {evidence.ENV} should "
                                              "name one file that every rank reads")


def choose_backend(name: str, config, group) -> BackendChoice:
    """The backend a buffer of `config` on `group` runs for the name asked (auto: the user's
    measurement where there is one, else AUTO_RULES)."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"backend must be one of {', '.join(BACKEND_NAMES)}, got {name!r}")
    if name == "auto":
        choice = choose_auto(config.num_nodes, lambda: _cuda_geometry_reason(config, group),
                             _auto_evidence(config, group))
        return _agreed(choice, group)
    return BackendChoice(name, name, "asked for by name")


def _members(group) -> list[int] | None:
    """The group's global ranks, for the log line (None for a group torch.distributed does not know)."""
    try:
        return dist.get_process_group_ranks(group)
    except (RuntimeError, ValueError, AttributeError):
        return None


def create_backend(name: str, config, group, rank: int, owner: int, choice: BackendChoice | None = None) -> Backend:
    """The backend for `name` (or an already made `choice`), its choice logged once on rank 0."""
    if choice is None:
        choice = choose_backend(name, config, group)
    log_choice(choice, rank, config.num_nodes, config.ranks_per_node, _members(group))
    name = choice.name
    if name == "reference":
        return ReferenceBackend(config, group, rank, owner)
    reason = cuda_unavailable_reason(group, explicit=True)
    if reason is not None:
        raise RuntimeError(f"backend='cuda' is not available: {reason}")
    from .cuda.backend import CudaBackend

    return CudaBackend(config, group, rank, owner)


def available_backends(group) -> list[str]:
    names = ["reference"]
    if cuda_unavailable_reason(group) is None:
        names.insert(0, "cuda")
    return names


__all__ = ["AUTO_RULES", "BACKENDS", "BACKEND_NAMES", "Backend", "BackendChoice", "ReferenceBackend",
           "available_backends", "choose_backend", "create_backend"]
