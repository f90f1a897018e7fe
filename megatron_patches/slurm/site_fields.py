"""The fields a cluster user fills in for their site, and which of them a recipe leaves open.

A recipe can leave a site field unset (null: the job runs with the default named here) or
carry a placeholder, a value written as `<what goes here>`, that a user replaces before the
job can run. A dry run lists both on stderr (`report_lines`); `--submit` refuses a recipe
with placeholders (`placeholder_problems`, each naming its field), since sbatch would accept
the script and the job would fail after its wait in the queue. The rendered script's header
names them too, for a script submitted by hand.
"""

from __future__ import annotations

import re
import textwrap

# A value, or an entry of a list, written as <what goes here>.
_PLACEHOLDER = re.compile(r"<[^<>\n]*>")

# Site fields and what the job does when one is null.
UNSET_MEANS = {
    "cluster.partition": "the cluster's default partition",
    "cluster.account": "your default Slurm account",
    "cluster.qos": "the default QoS",
    "cluster.python": "`python` from the job's PATH (set the interpreter of the environment that has hybrid-ep)",
    "container.image": "no container: the nodes' own software environment",
    "network.nccl_ib_hca": "NCCL uses every InfiniBand HCA it finds",
    "network.nvshmem_hca_list": "NVSHMEM picks its HCAs itself (read by the cuda backend across nodes)",
    "network.socket_ifname": "NCCL and gloo pick the interface of their bootstrap themselves",
}
# Fields that may hold a placeholder besides the site fields (a null there is an error or a default).
_PLACEHOLDER_FIELDS = ("container.mounts", "container.workdir", "data.path", "data.blend", "data.tokenizer_model",
                       "checkpoint.save", "checkpoint.load", "megatron_lm_dir")

# Environment variables each network field exports (the bootstrap interface serves NCCL and gloo).
NETWORK_ENV = {"nccl_ib_hca": ("NCCL_IB_HCA",), "nvshmem_hca_list": ("NVSHMEM_HCA_LIST",),
               "socket_ifname": ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")}


def network_env(recipe) -> dict[str, str]:
    """The NIC variables of the network fields that are set."""
    net = recipe["network"]
    return {name: net[field] for field, names in NETWORK_ENV.items() if net[field] is not None for name in names}


def is_placeholder(value) -> bool:
    """A `<...>` value, or a list with such an entry."""
    if isinstance(value, list):
        return any(is_placeholder(v) for v in value)
    return isinstance(value, str) and _PLACEHOLDER.search(value) is not None


def unset_fields(recipe) -> list[str]:
    """Site fields left null, in UNSET_MEANS's order."""
    return [field for field in UNSET_MEANS if recipe.get(field) is None]


def placeholder_fields(recipe) -> list[str]:
    """Fields that still hold a `<...>` placeholder (the data fields only where data is read)."""
    out = []
    for field in (*UNSET_MEANS, *_PLACEHOLDER_FIELDS):
        if field.startswith("data.") and recipe.get("data.mock", True):
            continue
        if is_placeholder(recipe.get(field)):
            out.append(field)
    return out


def placeholder_problems(recipe) -> list[tuple[str, str]]:
    """(field, rule) for every placeholder: what `--submit` refuses."""
    return [(field, f"is a placeholder ({_shown(recipe.get(field))}): give your site's value, in the recipe or "
                    f"with --set {field}=...") for field in placeholder_fields(recipe)]


def report_lines(recipe) -> list[str]:
    """One line per unset site field (what runs instead) and per placeholder (to fill in)."""
    lines = [f"unset: {field}: {UNSET_MEANS[field]}" for field in unset_fields(recipe)]
    lines += [f"placeholder: {field} = {_shown(recipe.get(field))}: set it before --submit (--set {field}=...)"
              for field in placeholder_fields(recipe)]
    return lines


def header_lines(recipe) -> list[str]:
    """The rendered script's comments on the same fields."""
    text = []
    unset = unset_fields(recipe)
    if unset:
        text.append(f"Unset (site defaults apply): {', '.join(unset)}.")
    holders = placeholder_fields(recipe)
    if holders:
        text.append(f"PLACEHOLDERS to replace before sbatch (values written <...>): {', '.join(holders)}.")
    return [f"# {line}" for paragraph in text for line in textwrap.wrap(paragraph, 96, subsequent_indent="  ")]


def _shown(value) -> str:
    if isinstance(value, list):
        value = next(v for v in value if is_placeholder(v))
    return value if len(value) <= 60 else value[:57] + "..."
