"""`hybrid-ep-traffic` (= `python -m hybrid_ep.traffic`): bytes per token over NVLink and RDMA for a
synthetic routing.

Prints, for the hierarchical scheme and for a flat all-to-all, what each rank sends per
token in dispatch and in combine, and how much RDMA the hierarchical scheme saves.
The numbers come from the traffic model (`model.py`); this module only builds the routing,
calls the model and aggregates over ranks. Computed, not measured. With --placement the
routes go through an expert placement of the balancer (one layer of its YAML: router ids to
slots by the replica choice, `placement.py`), and the line after the table compares its RDMA
bytes with those of the routing without one.

Legend: W ranks = N nodes x G ranks per node, E experts, K routes per token,
T tokens per rank, H hidden size.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys

import torch

from ..cli_parser import ArgumentParser
from ..config import FP8_BLOCK, BufferConfig
from ..dtypes import COMBINE_BY_NAME as COMBINE_DTYPES
from ..dtypes import DISPATCH_BY_NAME as DISPATCH_DTYPES
from ..fp8 import num_scale_blocks
from ..metadata import metadata
from ..paths import output_problem
from ..rows import row_bytes_rule
from ..synthetic import (
    DEFAULT_GROUP_LIMIT,
    ROUTINGS,
    default_group_limit,
    derived_seed,
    iter_rank_routings,
    sample_topk,
    seed_problem,
)
from ..wording import plural
from .summary import COLUMNS, summarize

HEADERS = ("hierarchical NVLink", "hierarchical RDMA", "flat NVLink", "flat RDMA")
PROG = "hybrid-ep-traffic"
UNITS = {"row_bytes": "bytes per row", "per_rank": "bytes each rank sends (computed by the traffic model)",
         "bytes_per_token": "bytes sent per token of the sending rank: mean and max over ranks",
         "rdma_saving_percent": "percent: 100 x (1 - hierarchical RDMA bytes / flat RDMA bytes), null without RDMA",
         "received_rows": "rows per rank", "tokens_per_rank": "tokens",
         "destinations_per_token": "ranks or nodes per token: mean and max",
         "world_size": "ranks", "num_nodes": "nodes", "ranks_per_node": "ranks", "hidden": "elements per row"}


def _flag(field: str) -> str:
    return "--" + field.replace("_", "-")


@dataclasses.dataclass(frozen=True)
class Scenario:
    """One synthetic configuration; field names are the CLI flags with '-' for '_'."""

    nodes: int = 8
    ranks_per_node: int = 8
    experts: int = 256
    topk: int = 8
    hidden: int = 7168
    tokens: int = 4096  # per rank
    routing: str = "uniform"
    zipf_exponent: float = 1.2
    group_limit: int | None = None  # None: DEFAULT_GROUP_LIMIT, capped at the node count
    dispatch_dtype: str = "bf16"
    combine_dtype: str = "bf16"
    seed: int = 0
    popularity: str = "routing"  # routing: the routing's own (uniform, or Zipf for zipf); zipf; stats
    stats: str | None = None  # statistics file whose layer's tokens per expert are the popularity
    layer: int | None = None  # layer number of --stats and --placement (None: their first layer)
    placement: str | None = None  # placement YAML (hybrid-ep-balance plan) the routes go through
    replica_choice: str = "locality"  # of a replicated expert's copy: locality or spread (slots.py)

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def topk_groups(self) -> int:
        """Nodes a group-limited token may reach (groups = nodes)."""
        return self.group_limit if self.group_limit is not None else default_group_limit(self.nodes)

    def validate(self) -> "Scenario":
        """Raise ValueError naming the flag and the rule."""
        for field in ("nodes", "ranks_per_node", "experts", "topk", "hidden", "tokens"):
            if getattr(self, field) < 1:
                raise ValueError(f"{_flag(field)} must be >= 1, got {getattr(self, field)}")
        if self.experts % self.world_size != 0:
            raise ValueError(
                f"--experts ({self.experts}) must be divisible by --nodes x --ranks-per-node "
                f"({self.nodes} x {self.ranks_per_node} = {self.world_size})"
            )
        if self.topk > self.experts:
            raise ValueError(f"--topk ({self.topk}) must be <= --experts ({self.experts})")
        if self.routing not in ROUTINGS:
            raise ValueError(f"--routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if not (math.isfinite(self.zipf_exponent) and self.zipf_exponent >= 0):
            raise ValueError(f"--zipf-exponent must be a finite number >= 0, got {self.zipf_exponent}")
        if self.group_limit is not None and not 1 <= self.group_limit <= self.nodes:
            raise ValueError(f"--group-limit must be in [1, --nodes = {self.nodes}], got {self.group_limit}")
        per_node = self.experts // self.nodes
        if self.routing == "group-limited" and self.topk > self.topk_groups * per_node:
            raise ValueError(
                f"--topk ({self.topk}) exceeds the experts in --group-limit {self.topk_groups} nodes "
                f"({self.topk_groups} x {per_node})"
            )
        if self.dispatch_dtype not in DISPATCH_DTYPES:
            raise ValueError(
                f"--dispatch-dtype must be one of {', '.join(DISPATCH_DTYPES)}, got {self.dispatch_dtype!r}")
        if self.combine_dtype not in COMBINE_DTYPES:
            raise ValueError(f"--combine-dtype must be one of {', '.join(COMBINE_DTYPES)}, got {self.combine_dtype!r}")
        if self.dispatch_dtype == "fp8" and self.hidden % FP8_BLOCK != 0:
            raise ValueError(f"--hidden ({self.hidden}) must be a multiple of {FP8_BLOCK} for --dispatch-dtype fp8")
        for flag, name, dtypes in (("--dispatch-dtype", self.dispatch_dtype, DISPATCH_DTYPES),
                                   ("--combine-dtype", self.combine_dtype, COMBINE_DTYPES)):
            rule = row_bytes_rule(self.hidden, dtypes[name])
            if rule:
                raise ValueError(f"--hidden ({self.hidden}) with {flag} {name}: {rule}")
        problem = seed_problem(self.seed)
        if problem:
            raise ValueError(f"--seed {problem}")
        if self.popularity not in POPULARITIES:
            raise ValueError(f"--popularity must be one of {', '.join(POPULARITIES)}, got {self.popularity!r}")
        if (self.popularity == "stats") != (self.stats is not None):
            raise ValueError("--popularity stats and --stats go together")
        if self.replica_choice not in ("locality", "spread"):
            raise ValueError(f"--replica-choice must be locality or spread, got {self.replica_choice!r}")
        return self

    def popularity_vector(self) -> torch.Tensor | None:
        """[E] float64 popularity where --popularity sets one (None: the routing's own)."""
        if self.popularity == "zipf":
            from ..synthetic import zipf_popularity

            return zipf_popularity(self.experts, self.zipf_exponent, torch.Generator().manual_seed(self.seed))
        if self.popularity == "stats":
            load = _layer_row(self.stats, self.layer, "--stats")
            if load.numel() != self.experts:
                raise ValueError(f"--stats: {self.stats} counts {load.numel()} experts, --experts is {self.experts}")
            return load / load.sum()
        return None

    def buffer_config(self) -> BufferConfig:
        return BufferConfig(hidden_dim=self.hidden, max_tokens_per_rank=self.tokens, num_experts=self.experts,
                            world_size=self.world_size, ranks_per_node=self.ranks_per_node).validate()

    def routings(self) -> list[torch.Tensor]:
        """[T, K] int64 topk_idx per rank. Zipf popularity is drawn once, shared by all ranks."""
        groups = dict(num_groups=self.nodes, topk_groups=self.topk_groups) if self.routing == "group-limited" else {}
        popularity = self.popularity_vector()
        if popularity is None:
            return list(iter_rank_routings(self.routing, [self.tokens] * self.world_size, self.experts, self.topk,
                                           self.seed, self.zipf_exponent, **groups))
        gen = torch.Generator().manual_seed(derived_seed(self.seed + 1))
        return [sample_topk(self.tokens, self.experts, self.topk, gen, popularity=popularity, **groups)
                for _ in range(self.world_size)]


POPULARITIES = ("routing", "zipf", "stats")


def _layer_row(path: str, layer: int | None, flag: str) -> torch.Tensor:
    """[E] float64 tokens per expert of one layer of a statistics file (its first without `layer`)."""
    from ..balancer.report import load_statistics

    try:
        stats = load_statistics(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{flag}: cannot read {path}: {e}") from None
    load = torch.as_tensor(stats["load"], dtype=torch.float64)
    numbers = [int(n) for n in stats.get("layer_numbers", range(1, load.shape[0] + 1))]
    index = 0 if layer is None else numbers.index(layer) if layer in numbers else None
    if index is None:
        raise ValueError(f"--layer {layer}: {path} holds layers {numbers}")
    if float(load[index].sum()) <= 0:
        raise ValueError(f"{flag}: layer {numbers[index]} of {path} has no tokens")
    return load[index]


def _placement_row(scenario: "Scenario") -> torch.Tensor:
    """[S] one layer of --placement, checked against the scenario's experts, ranks and nodes."""
    from ..balancer.placement_file import load_placement_yaml

    try:
        p = load_placement_yaml(scenario.placement)
    except (OSError, ValueError) as e:
        raise ValueError(f"--placement: {e}") from None
    want = (scenario.experts, scenario.world_size, scenario.nodes)
    got = (p.num_experts, p.num_ranks, p.num_nodes)
    if got != want:
        raise ValueError(f"--placement {scenario.placement} is for (experts, ranks, nodes) = {got}, the scenario has "
                         f"{want} (--experts, --nodes x --ranks-per-node, --nodes)")
    numbers = list(p.layer_numbers) if p.layer_numbers is not None else list(range(1, p.num_layers + 1))
    if scenario.layer is None:
        return p.slot_to_expert[0]
    if scenario.layer not in numbers:
        raise ValueError(f"--layer {scenario.layer}: {scenario.placement} holds layers {numbers}")
    return p.slot_to_expert[numbers.index(scenario.layer)]


def compute(scenario: Scenario) -> dict:
    """Validate the scenario, draw its routing and return `summarize`'s dict plus the scenario
    (as hybrid-ep-bench records it: zipf_exponent only with zipf routing and group_limit, the nodes a
    token may reach, only with group-limited routing; None otherwise)."""
    scenario.validate()
    routings = scenario.routings()
    dtypes = DISPATCH_DTYPES[scenario.dispatch_dtype], COMBINE_DTYPES[scenario.combine_dtype]
    if scenario.placement is None:
        report = summarize(routings, scenario.buffer_config(), *dtypes)
    else:
        from .placement import PlacementShape, placement_traffic

        row = _placement_row(scenario)
        shape = PlacementShape(scenario.world_size, scenario.ranks_per_node, row.numel(), scenario.hidden)
        report = placement_traffic(routings, row, shape, *dtypes, locality=scenario.replica_choice == "locality")
        without = summarize(routings, scenario.buffer_config(), *dtypes)
        report["without_placement"] = {"bytes_per_token": without["bytes_per_token"]}
    report["scenario"] = dataclasses.asdict(scenario) | {
        "zipf_exponent": scenario.zipf_exponent if "zipf" in (scenario.routing, scenario.popularity) else None,
        "group_limit": scenario.topk_groups if scenario.routing == "group-limited" else None}
    return report


def format_report(report: dict) -> str:
    s = report["scenario"]
    W, L = report["world_size"], s["experts"] // report["world_size"]
    routing = s["routing"]
    if routing == "zipf":
        routing += f" (exponent {s['zipf_exponent']})"
    elif routing == "group-limited":
        routing += f" (<= {s['group_limit']} of {plural(s['nodes'], 'node')} per token)"
    if s.get("popularity") == "zipf" and s["routing"] != "zipf":
        routing += f", Zipf popularity (exponent {s['zipf_exponent']})"
    elif s.get("popularity") == "stats":
        routing += f", popularity of {s['stats']}" + ("" if s["layer"] is None else f" layer {s['layer']}")
    rb = report["row_bytes"]
    lines = [
        f"hybrid-ep traffic model: {plural(s['nodes'], 'node')} x {plural(s['ranks_per_node'], 'rank')}/node "
        f"(W={W}), {plural(s['experts'], 'expert')} ({L}/rank), top-{s['topk']}, H={s['hidden']}, "
        f"{plural(s['tokens'], 'token')}/rank, "
        f"routing {routing}, seed {s['seed']}",
        f"row bytes: dispatch {rb['dispatch']} ({s['dispatch_dtype']}"
        + (f", {num_scale_blocks(s['hidden'])} fp32 scales" if s["dispatch_dtype"] == "fp8" else "")
        + f"), combine {rb['combine']} ({s['combine_dtype']}); routing metadata not counted",
        "",
        "bytes sent per token by a rank: mean over ranks [max over ranks]",
        f"{'':9}" + "".join(f"{h:>24}" for h in HEADERS),
    ]
    for op in ("dispatch", "combine"):
        cells = (report["bytes_per_token"][op][c] for c in COLUMNS)
        lines.append(f"{op:9}" + "".join(f"{c['mean']:>12,.0f} [{c['max']:>9,.0f}]" for c in cells))
    lines.append("")
    for op in ("dispatch", "combine"):
        pct = report["rdma_saving_percent"][op]
        text = "n/a (single node: no RDMA)" if pct is None else f"{pct:.1f} %"
        lines.append(f"RDMA saving of hierarchical over flat, {op}: {text}")
    d = report["destinations_per_token"]
    for what in ("rank", "node"):
        x = d[what + "s"]
        lines.append(f"destination {what}s per token: mean {x['mean']:.2f}, max {x['max']} (own {what} included)")
    if "without_placement" in report:
        mine = report["bytes_per_token"]["dispatch"]["hierarchical_rdma"]["mean"]
        base = report["without_placement"]["bytes_per_token"]["dispatch"]["hierarchical_rdma"]["mean"]
        layer = "first layer" if s["layer"] is None else f"layer {s['layer']}"
        lines.append(f"placement {s['placement']} ({layer}, replica choice {s['replica_choice']}): dispatch RDMA "
                     f"{mine:,.0f} bytes per token, {mine / base if base else float('nan'):.3f}x the {base:,.0f} "
                     "without a placement (expert e on rank e // (E / W))")
    return "\n".join(lines)


def json_document(report: dict) -> dict:
    """The --json file: the metadata block (config = the scenario), then every number."""
    numbers = {k: v for k, v in report.items() if k != "scenario"}
    return {"metadata": metadata(PROG, device_type="cpu", config=report["scenario"], units=UNITS), **numbers}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Bytes per token each rank sends over NVLink and RDMA, hierarchical scheme versus a flat "
                    "all-to-all, for a synthetic routing (traffic model: computed, not measured).")
    d = Scenario()
    p.add_argument("--nodes", type=int, default=d.nodes, help="NVLink domains (default %(default)s)")
    p.add_argument("--ranks-per-node", type=int, default=d.ranks_per_node, help="ranks per node (default %(default)s)")
    p.add_argument("--experts", type=int, default=d.experts, help="experts E (default %(default)s)")
    p.add_argument("--topk", type=int, default=d.topk, help="routes per token K (default %(default)s)")
    p.add_argument("--hidden", type=int, default=d.hidden, help="hidden size H (default %(default)s)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="tokens per rank T (default %(default)s)")
    p.add_argument("--routing", choices=ROUTINGS, default=d.routing, help="synthetic routing (default %(default)s)")
    p.add_argument("--zipf-exponent", type=float, default=d.zipf_exponent, help="zipf skew (default %(default)s)")
    p.add_argument("--group-limit", type=int, default=None,
                   help=f"nodes a token may reach with --routing group-limited (groups = nodes, as DeepSeek-V3's "
                        f"node-limited routing; default {DEFAULT_GROUP_LIMIT}, capped at --nodes)")
    p.add_argument("--dispatch-dtype", choices=tuple(DISPATCH_DTYPES), default=d.dispatch_dtype,
                   help="dispatch payload; fp8 adds one fp32 scale per 128 elements (default %(default)s)")
    p.add_argument("--combine-dtype", choices=tuple(COMBINE_DTYPES), default=d.combine_dtype,
                   help="combine payload (default %(default)s)")
    p.add_argument("--seed", type=int, default=d.seed, help="routing seed, in [0, 2^64 - 1] (default %(default)s)")
    p.add_argument("--popularity", choices=POPULARITIES, default=d.popularity,
                   help="expert popularity: the routing's own (uniform; Zipf for --routing zipf), zipf (also for "
                        "group-limited routing) or stats (a layer's tokens per expert from --stats)")
    p.add_argument("--stats", default=None, help="statistics file (.npz, hybrid-ep-balance's input) for "
                                                 "--popularity stats")
    p.add_argument("--layer", type=int, default=None,
                   help="layer number of --stats and --placement (default: their first layer)")
    p.add_argument("--placement", default=None,
                   help="placement YAML (hybrid-ep-balance plan --out) the routes go through, router ids to slots")
    p.add_argument("--replica-choice", choices=("locality", "spread"), default=d.replica_choice,
                   help="with --placement: a route to a replicated expert takes the copies on its own node, else "
                        "its primary node's (locality), or spreads over every copy (default %(default)s)")
    p.add_argument("--json", metavar="PATH", default=None, help="also write every number as JSON to PATH")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    json_path = vars(args).pop("json")
    scenario = Scenario(**vars(args))
    try:
        scenario.validate()
        scenario.popularity_vector()  # reads --stats: a bad file is a usage error too
        if scenario.placement is not None:
            _placement_row(scenario)
    except ValueError as e:
        parser.error(str(e))
    if json_path is not None:
        problem = output_problem(json_path, folder=False)
        if problem:
            parser.error(f"argument --json: {problem}")
    report = compute(scenario)
    print(format_report(report))
    if json_path is not None:
        try:
            os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
            with open(json_path, "w") as f:
                json.dump(json_document(report), f, indent=2)
                f.write("\n")
        except OSError as e:  # checked above; a disk that filled up or a folder removed since
            print(f"{PROG}: error: argument --json: cannot write {json_path}: {e.strerror or e}", file=sys.stderr)
            return 1
        print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
