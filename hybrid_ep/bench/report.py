"""Text tables and results.json from the results document the CLI assembles.

The document: {"metadata" (hybrid_ep.metadata: device, versions, date, config, units),
"label", "machine" (hosts, logical nodes, launcher), "runs": [run, ...], "skipped" ({baseline:
why it did not run}), "files"}; a run is
metrics.build_run's dict (one backend at one SM count, one entry per rank).
"""

from __future__ import annotations

import json
import os

from ..wording import plural
from .metrics import OPS

# Units of the number fields of a run (the metadata block's "units").
_GBPS = "GB/s (1e9 bytes/s)"
UNITS = {
    "median_ms": "ms (median of one rank's timed calls)", "min_ms": "ms (fastest timed call of the rank)",
    "max_ms": "ms (per rank: slowest timed call; summary: slowest rank's median)",
    "samples_ms": "ms (each timed call)", "row_bytes": "bytes",
    "rows": "rows the rank receives in dispatch (one per token and destination rank, itself included; combine "
            "sends as many back)",
    "rank": "rank index", "node": "node index (rank // ranks per node)",
    "local_index": "index in the node (rank % ranks per node)", "num_sms": "SMs per call (null: the backend's default)",
    "algorithm_bytes": "bytes",
    "nvlink_bytes": "bytes", "rdma_bytes": "bytes", "flat_nvlink_bytes": "bytes", "flat_rdma_bytes": "bytes",
    "algbw_gbps": _GBPS, "nvlink_gbps": _GBPS, "rdma_gbps": _GBPS,
    "mean_algbw_gbps": _GBPS, "mean_nvlink_gbps": _GBPS, "mean_rdma_gbps": _GBPS,
}
_OP_COLS = (("ms", "median_ms", 10), ("algbw GB/s", "algbw_gbps", 12),
            ("NVLink GB/s", "nvlink_gbps", 13), ("RDMA GB/s", "rdma_gbps", 11))
_SUMMARY_KEYS = {"median_ms": "max_ms", "algbw_gbps": "mean_algbw_gbps",
                 "nvlink_gbps": "mean_nvlink_gbps", "rdma_gbps": "mean_rdma_gbps"}
_LEFT = 11  # width of the rank / node columns


def run_title(run: dict) -> str:
    if run["num_sms"] is None:
        return f"{run['backend']} ({run['sms_note']})"
    return f"{run['backend']} ({run['num_sms']} SMs)"


def config_line(doc: dict) -> str:
    c, m = doc["metadata"]["config"], doc["machine"]
    nodes = f"{plural(c['nodes'], 'node')} x {plural(c['ranks_per_node'], 'rank')}"
    if m["logical_nodes"]:
        nodes += f", logical nodes on {plural(len(m['hosts']), 'host')}"
    routing = c["routing"]
    if routing == "zipf":
        routing += f" (exponent {c['zipf_exponent']})"
    elif routing == "group-limited":
        routing += f" (<= {plural(c['group_limit'], 'node')} per token)"
    dtype = c["dtype"] + (" (combine bf16)" if c["dtype"] == "fp8" else "")
    return (f"W={c['world_size']} ({nodes}), H={c['hidden']}, T={c['tokens_per_rank']} tokens/rank, "
            f"K={c['topk']}, E={c['experts']} ({c['experts_per_rank']}/rank), {dtype}, {routing} routing, "
            f"seed {c['seed']}")


def format_table(doc: dict, run: dict) -> str:
    meta = doc["metadata"]
    c = meta["config"]
    op_width = sum(w for _, _, w in _OP_COLS)
    head1 = " " * _LEFT + "".join(f"  {('-- ' + op + ' ').ljust(op_width - 1, '-')}" for op in OPS)
    head2 = f"{'rank':>5}{'node':>6}" + "".join(
        "  " + "".join(f"{name:>{w}}" for name, _, w in _OP_COLS) for _ in OPS)
    lines = [
        f"== {run_title(run)} | {doc['label']}",
        config_line(doc),
        f"{meta['device']} | torch {meta['versions']['torch']} | {meta['date']}",
        f"median of {plural(c['iters'], 'timed call')} per rank after {c['warmup']} warm-up; timing: {run['timing']}",
        head1,
        head2,
    ]
    for r in run["ranks"]:
        cells = "".join("  " + "".join(f"{r[op][key]:>{w}.3f}" for _, key, w in _OP_COLS) for op in OPS)
        lines.append(f"{r['rank']:>5}{r['node']:>6}{cells}")
    s = run["summary"]
    cells = "".join("  " + "".join(f"{s[op][_SUMMARY_KEYS[key]]:>{w}.3f}" for _, key, w in _OP_COLS)
                    for op in OPS)
    lines.append(f"{'max/mean':>{_LEFT}}{cells}")
    return "\n".join(lines)


LEGEND = (
    "ms: median time of the call on that rank; summary: slowest rank (max), bandwidths averaged over ranks (mean).\n"
    "algbw: rows the rank receives in dispatch (one per token and destination rank, itself included) x row bytes\n"
    "  (fp8: with its scales) / time; combine sends the same rows back at the combine dtype.\n"
    "NVLink / RDMA: bytes the rank sends on that link under the hierarchical scheme / time (GB/s = 1e9 B/s)."
)


def links_note(doc: dict) -> str | None:
    """Say when the NVLink / RDMA columns name links that the bytes did not actually take."""
    config = doc["metadata"]["config"]
    transport = config["transport"]
    if config["device"] == "cpu":
        return ("On CPU there is no NVLink or RDMA: the NVLink / RDMA figures are the bytes the hierarchical scheme "
                f"assigns to each link over the measured time; all bytes went through {transport}.")
    if doc["machine"]["logical_nodes"]:
        return ("Nodes are logical (fewer hosts than nodes): the RDMA column is the bytes the hierarchical scheme "
                f"sends between nodes over the measured time; they went through {transport} inside a host.")
    return None


def format_report(doc: dict) -> str:
    parts = [format_table(doc, run) for run in doc["runs"]]
    parts += [f"== {name}: not run: {why}" for name, why in doc.get("skipped", {}).items()]
    notes = [LEGEND]
    note = links_note(doc)
    if note:
        notes.append(note)
    return "\n\n".join(parts + ["\n".join(notes)])


def write_json(doc: dict, path: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")
    return path
