"""The kernels' limits every backend enforces alike, one rule and one error text each.

The numbers are csrc's (common/params.h defines each once; both compiled modules export them,
csrc/bindings/common.h), read here from `compiled` and written nowhere else in Python. The
reference backend could route more experts per token or hold larger groups; refusing what the
cuda kernels refuse means code that runs on the CPU also runs on a GPU (the rule rows.py keeps
for row sizes). The cuda backend's own limits (an emulated launch's ranks, the inter-node
transport) stay in hybrid_ep/backends/cuda/layout.py.
"""

from __future__ import annotations

import importlib


def _compiled():
    """hybrid_ep._model (built by every install, loads without a GPU), else hybrid_ep._C: both
    bind csrc/common/params.h's constants and struct sizes under the same names."""
    errors = []
    for name in ("hybrid_ep._model", "hybrid_ep._C"):
        try:
            return importlib.import_module(name)
        except ImportError as err:
            errors.append(f"{name}: {err}")
    raise ImportError("hybrid_ep takes its kernels' limits and struct sizes from a compiled module, and neither is "
                      "installed (" + "; ".join(errors) + ")")


compiled = _compiled()
MAX_TOPK: int = compiled.MAX_TOPK  # routes per token
MAX_RANKS: int = compiled.MAX_RANKS  # ranks of an EP group
MAX_DOMAIN_RANKS: int = compiled.MAX_DOMAIN_RANKS  # ranks of one node, an NVLink domain (ranks_per_node)
MAX_NODES: int = compiled.MAX_NODES  # nodes of an EP group (world_size / ranks_per_node)
MAX_EXPERTS: int = compiled.MAX_EXPERTS


def check_group(world_size: int, ranks_per_node: int, num_experts: int) -> None:
    """The EP group's limits (a BufferConfig's fields, validated), each a ValueError naming the
    argument."""
    if world_size > MAX_RANKS:
        raise ValueError(f"world_size: hybrid_ep supports EP groups of up to {MAX_RANKS} ranks, got {world_size}")
    if ranks_per_node > MAX_DOMAIN_RANKS:
        raise ValueError(f"ranks_per_node must be <= {MAX_DOMAIN_RANKS} (the ranks of one NVLink domain, GB200 "
                         f"NVL72), got {ranks_per_node}")
    nodes = world_size // ranks_per_node
    if nodes > MAX_NODES:
        raise ValueError(f"ranks_per_node={ranks_per_node} makes {nodes} nodes of the {world_size} ranks; hybrid_ep "
                         f"supports up to {MAX_NODES}: pass a larger ranks_per_node")
    if num_experts > MAX_EXPERTS:
        raise ValueError(f"num_experts must be <= {MAX_EXPERTS}, got {num_experts}")


def check_topk(name: str, routes: int, token: int | None = None) -> None:
    """A token's routes (the K of topk_idx [T, K]; with `token`, that token's experts in a
    routing_map) within MAX_TOPK, else a ValueError naming the argument."""
    if routes <= MAX_TOPK:
        return
    if token is None:
        raise ValueError(f"{name} has {routes} routes per token; a token may have at most {MAX_TOPK}")
    raise ValueError(f"{name} routes token {token} to {routes} experts; a token may have at most {MAX_TOPK}")
