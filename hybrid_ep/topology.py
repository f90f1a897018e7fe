"""Which ranks of an EP group share a node, an NVLink domain: the G of "rank r is on node r // G".

A node, for hybrid_ep, is an NVLink domain: the ranks whose GPUs address each other's memory.
On most machines that is one host. On a multi-node NVLink system (GB200 NVL36, NVL72) it is the
GPU fabric's clique: up to 72 GPUs on hosts of 4, whose memory crosses hosts as fabric handles
(CU_MEM_HANDLE_TYPE_FABRIC), which the driver grants only to a process with an IMEX channel.

When a buffer is made, the group's members exchange where each runs, once (one
all_gather_object): a Place, with the host (its name, and the launcher node below), the GPU
fabric's cluster UUID and clique id (NVML's GPU fabric info, through pynvml where it is
installed) and, in a clique, whether this process can export fabric memory (a probe
allocation). decide_domain, a pure function, turns the places into G:

- each member's domain is its clique where every member reports one and every member of a
  clique that spans hosts can export fabric memory; otherwise its host. A refused fabric
  handle (no IMEX channel, HYBRID_EP_HANDLE=ipc) or fabric information on some members only
  limits the domain to the host, said in one log line (Domain.note);
- left unset, G is the size of the members' domains: the members, in group order, must come
  domain by domain, the same count in each, at most MAX_DOMAIN_RANKS; a group that splits a
  domain unevenly (a domain's members not contiguous, domains of different sizes in the
  group, e.g. 36 ranks of one clique and 4 of another) is refused with the largest ranks_per_node
  that would work, rather than given a domain smaller than the hardware's without a word;
- a ranks_per_node given may split a domain (a multi-node test on one machine, or smaller
  domains on purpose) but never join two, and is at most MAX_DOMAIN_RANKS.

The launcher node: torchrun and srun's block distribution number processes node by node, so
global rank g runs on launcher node g // LOCAL_WORLD_SIZE. Two members share a host where both
their host names and their launcher nodes agree (a test may launch "nodes" on one machine). An
EP group is not always a contiguous run of global ranks: Megatron strides it by the expert
tensor-parallel size, so with ETP 2 on hosts of 8 GPUs an EP group of 8 spans two hosts, 4
ranks on each, and G is 4.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
from collections.abc import Sequence

import torch
import torch.distributed as dist

from .checks import is_int
from .logs import log_once

MAX_DOMAIN_RANKS = 72  # GB200 NVL72: the largest NVLink domain hybrid_ep lays out
TROUBLESHOOTING = "docs/troubleshooting.md#nvlink-domains-across-hosts-imex"
_log = logging.getLogger("hybrid_ep")


@dataclasses.dataclass(frozen=True)
class Place:
    """Where one member of the EP group runs."""

    host: str  # host name
    node: int | None = None  # launcher node (global rank // LOCAL_WORLD_SIZE), None without it
    cluster: str = ""  # the GPU fabric's cluster UUID (hex); "": no fabric information
    clique: int = 0  # the GPU's clique in that cluster
    fabric: str | None = None  # in a clique: why this process cannot export fabric memory, None: it can
    no_clique: str = ""  # why there is no fabric information (the debug line)

    @property
    def host_key(self) -> tuple[str, int | None]:
        return self.host, self.node

    @property
    def clique_key(self) -> tuple[str, int] | None:
        return (self.cluster, self.clique) if self.cluster else None


@dataclasses.dataclass(frozen=True)
class Domain:
    """The NVLink domain of an EP group's ranks, as decide_domain found it."""

    ranks_per_node: int  # G (a requested value BufferConfig refuses passes through as given)
    unit: str  # "clique" or "host": what each member's domain is
    spans_hosts: bool  # some domain of G ranks holds ranks of several hosts (fabric handles between them)
    note: str | None = None  # the line logged where the GPU fabric's clique was limited to the host


def contiguous_ranks_per_node(nodes: list) -> int | None:
    """G where the members come node by node, G on each node; None where they do not
    (a node's members split by another node's, or nodes holding different counts)."""
    runs: list[list] = []  # [node, members]
    for n in nodes:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    if len({n for n, _ in runs}) != len(runs) or len({count for _, count in runs}) != 1:
        return None
    return runs[0][1]


def _labels(keys: Sequence) -> list[int]:
    """Each key as a small number, in order of first appearance (what the messages show)."""
    seen: dict = {}
    return [seen.setdefault(k, len(seen)) for k in keys]


def _largest_fit(labels: list[int]) -> int:
    """The largest G <= MAX_DOMAIN_RANKS dividing the group whose every block of G lies in one domain."""
    W = len(labels)
    fits = [g for g in range(1, min(W, MAX_DOMAIN_RANKS) + 1)
            if W % g == 0 and all(len(set(labels[f:f + g])) == 1 for f in range(0, W, g))]
    return fits[-1]


def _units(places: Sequence[Place]) -> tuple[list, str, str | None]:
    """Each member's domain (a key), what kind it is ("clique" or "host"), and the line that says
    why the GPU fabric's clique was limited to the host (None where nothing was lost)."""
    hosts = [p.host_key for p in places]
    cliques = [p.clique_key for p in places]
    spanning = {c for c in set(cliques) if c is not None and len({h for h, k in zip(hosts, cliques) if k == c}) > 1}
    if not spanning:  # every clique (if any) within one host: cliques and hosts agree where it matters
        return (cliques, "clique", None) if all(cliques) else (hosts, "host", None)
    missing = [r for r, c in enumerate(cliques) if c is None]
    if missing:
        return hosts, "host", (f"ranks {_some(missing)} report no GPU fabric information "
                               f"({places[missing[0]].no_clique or 'none'}), others a clique across hosts: the NVLink "
                               "domain is limited to the host")
    refused = [r for r, p in enumerate(places) if p.clique_key in spanning and p.fabric]
    if refused:
        r = refused[0]
        size = cliques.count(cliques[r])
        return hosts, "host", (f"fabric handles are refused on rank {r} (host {places[r].host}: {places[r].fabric}"
                               f"{f'; and on ranks {_some(refused[1:])}' if refused[1:] else ''}): the NVLink domain "
                               f"is limited to the host, not the GPU fabric's clique ({size} ranks of this group)")
    return cliques, "clique", None


def _some(ranks: list[int], shown: int = 8) -> str:
    return str(ranks) if len(ranks) <= shown else f"[{', '.join(map(str, ranks[:shown]))}, ...] ({len(ranks)})"


def _what(unit: str, places: Sequence[Place], local_world_size: int | None) -> str:
    """What the messages' list of domains shows."""
    if unit == "clique":
        return "GPU fabric clique of each, in group order"
    by_node = all(p.node is not None for p in places)
    if by_node and len({p.host for p in places}) == 1:
        return f"launcher node of each, in group order, from LOCAL_WORLD_SIZE={local_world_size}"
    if by_node:
        return f"host of each (host name and launcher node from LOCAL_WORLD_SIZE={local_world_size}), in group order"
    return "host of each, in group order"


def decide_domain(places: Sequence[Place], requested=None, *, local_world_size: int | None = None) -> Domain:
    """G for an EP group whose members, in group order, run at `places` (module docstring).

    requested None: the members' domains. A requested G may split a domain, never join two.
    Values that are not a positive divisor of the group size pass through for BufferConfig to
    refuse by name. local_world_size: what the messages say the launcher nodes came from."""
    W = len(places)
    keys, unit, note = _units(places)
    labels = _labels(keys)
    what = _what(unit, places, local_world_size)
    why = f" ({note})" if note else ""
    if requested is None:
        G = contiguous_ranks_per_node(labels)
        if G is None:
            sizes = sorted({labels.count(u) for u in set(labels)}, reverse=True)
            uneven = f", domains of {' and '.join(map(str, sizes))} ranks" if len(sizes) > 1 else ""
            raise ValueError(
                f"ranks_per_node: the EP group's {W} ranks do not come node by node (NVLink domains{uneven}; {what}: "
                f"{_some(labels, 80)}){why}; pass ranks_per_node explicitly (this group: {_largest_fit(labels)}; 1 "
                "treats every rank as a node of its own) or build the group node by node")
        if G > MAX_DOMAIN_RANKS:
            raise ValueError(
                f"ranks_per_node: the EP group's NVLink domains hold {G} ranks each ({what}), more than the "
                f"{MAX_DOMAIN_RANKS} hybrid_ep lays out; pass ranks_per_node={_largest_fit(labels)} or another "
                f"divisor of {G} up to {MAX_DOMAIN_RANKS}")
    else:
        if not is_int(requested, 1):
            return Domain(requested, unit, False, note)
        if requested > MAX_DOMAIN_RANKS:
            raise ValueError(f"ranks_per_node={requested}: an NVLink domain holds at most {MAX_DOMAIN_RANKS} ranks "
                             f"(GB200 NVL72); this group: {_largest_fit(labels)}")
        if W % requested:
            return Domain(requested, unit, False, note)
        for first in range(0, W, requested):
            block = labels[first:first + requested]
            if len(set(block)) > 1:
                raise ValueError(
                    f"ranks_per_node={requested} puts EP ranks {first}..{first + requested - 1} in one NVLink domain, "
                    f"but they are in different ones ({what}: {block}){why}; ranks of different domains cannot "
                    f"share NVLink. Leave ranks_per_node unset (this group: {_largest_fit(labels)}) or use a "
                    "divisor of it")
        G = requested
    spans = any(len({p.host_key for p in places[f:f + G]}) > 1 for f in range(0, W, G))
    return Domain(G, unit, spans, note)


# -- where this process runs --------------------------------------------------------------


def launcher_local_world_size() -> int | None:
    """LOCAL_WORLD_SIZE as a positive int, or None where the launcher did not set it."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    return int(raw) if raw is not None and raw.isdigit() and int(raw) > 0 else None


def this_host() -> str:
    """The host name members compare (tests give processes of one machine several)."""
    return socket.gethostname()


def _nvml_fabric_info(pynvml, handle):
    """NVML's GPU fabric info of a device: the versioned call where this pynvml has it."""
    import ctypes

    if hasattr(pynvml, "nvmlDeviceGetGpuFabricInfoV") and hasattr(pynvml, "c_nvmlGpuFabricInfoV_t"):
        info = pynvml.c_nvmlGpuFabricInfoV_t()
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        return info
    info = pynvml.c_nvmlGpuFabricInfo_t()
    pynvml.nvmlDeviceGetGpuFabricInfo(handle, ctypes.byref(info))
    return info


def fabric_clique(device_index: int | None) -> tuple[str, int, str]:
    """(cluster UUID as hex, clique id, "") of the GPU in its NVLink fabric, or ("", 0, why not):
    no CUDA device, no pynvml, a GPU outside a multi-node NVLink fabric, or one whose fabric
    registration has not completed."""
    if device_index is None:
        return "", 0, "no CUDA device"
    try:
        import pynvml
    except ImportError:
        return "", 0, "pynvml (nvidia-ml-py) is not installed"
    if not hasattr(pynvml, "nvmlDeviceGetGpuFabricInfo") and not hasattr(pynvml, "nvmlDeviceGetGpuFabricInfoV"):
        return "", 0, "this pynvml has no GPU fabric info"
    try:
        pynvml.nvmlInit()
        try:
            uuid = f"GPU-{torch.cuda.get_device_properties(device_index).uuid}"
            info = _nvml_fabric_info(pynvml, pynvml.nvmlDeviceGetHandleByUUID(uuid))
        finally:
            pynvml.nvmlShutdown()
    except Exception as e:  # NVMLError_NotSupported on GPUs without a fabric, a driver without the call
        return "", 0, f"NVML: {e}"
    completed = getattr(pynvml, "NVML_GPU_FABRIC_STATE_COMPLETED", 3)
    if info.state != completed or info.status != getattr(pynvml, "NVML_SUCCESS", 0):
        return "", 0, f"fabric state {info.state}, status {info.status}"
    cluster = bytes(info.clusterUuid)
    if not any(cluster):
        return "", 0, "no fabric cluster"
    return cluster.hex(), int(info.cliqueId), ""


def fabric_refusal(device_index: int) -> str | None:
    """Why this process cannot export fabric memory (None: a probe allocation was created and
    exported): HYBRID_EP_HANDLE=ipc, no cuda extension, or the driver's refusal (no IMEX channel)."""
    if os.environ.get("HYBRID_EP_HANDLE") == "ipc":
        return "HYBRID_EP_HANDLE=ipc"
    try:
        from .backends.cuda import load_extension

        ext = load_extension("cuda")
    except ImportError as e:
        return f"the cuda extension is not built ({e})"
    return ext.fabric_probe(device_index) or None


def local_host(global_rank: int) -> tuple[str, int | None]:
    """This process's host as members compare it (Place.host_key): host name and launcher node."""
    lws = launcher_local_world_size()
    return this_host(), global_rank // lws if lws else None


def local_place(global_rank: int) -> Place:
    """Where this process runs; the GPU fabric is looked at only with a CUDA device (the current one)."""
    device = torch.cuda.current_device() if torch.cuda.is_available() else None
    cluster, clique, no_clique = fabric_clique(device)
    fabric = fabric_refusal(device) if cluster and device is not None else None
    return Place(*local_host(global_rank), cluster, clique, fabric, no_clique)


def group_domain(group, requested=None) -> Domain:
    """The NVLink domain of a process group's members (None: the world): one all_gather_object of
    their places, then decide_domain. The group's rank 0 logs a clique that was limited to the
    host once, at WARNING, and the domain it found, once, at INFO."""
    group = dist.group.WORLD if group is None else group
    places: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(places, local_place(dist.get_rank()), group=group)
    domain = decide_domain(places, requested, local_world_size=launcher_local_world_size())
    if dist.get_rank(group) == 0:
        if domain.note:
            log_once(_log, logging.WARNING, f"hybrid_ep: {domain.note} ({TROUBLESHOOTING})")
        if domain.spans_hosts:
            log_once(_log, logging.INFO, f"hybrid_ep: NVLink domains of {domain.ranks_per_node} ranks across hosts "
                                         "(the GPU fabric's clique): peer memory between hosts as fabric handles")
    return domain


def group_ranks_per_node(group, requested=None) -> int:
    """G of a process group (None: the world): group_domain's."""
    return group_domain(group, requested).ranks_per_node


def resolve_ranks_per_node(global_ranks: list[int], requested, local_world_size: int | None) -> int:
    """G from the launcher's layout alone (no fabric information, one host name): members with
    these global ranks, launcher nodes of local_world_size processes (None: all on one)."""
    places = [Place("", g // local_world_size if local_world_size else None) for g in global_ranks]
    return decide_domain(places, requested, local_world_size=local_world_size).ranks_per_node


__all__ = ["MAX_DOMAIN_RANKS", "Domain", "Place", "contiguous_ranks_per_node", "decide_domain", "group_domain",
           "group_ranks_per_node", "local_host", "local_place", "resolve_ranks_per_node"]
