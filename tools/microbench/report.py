"""micro.json (the metadata block, the device, every line by measurement, the constants) and
the text table of the constants."""

from __future__ import annotations

import json
import os

from hybrid_ep import metadata

from .constants import best_tma, table
from .records import Lines

TOOL = "hybrid_ep_microbench"

# Units of the number fields of the lines (the metadata block's "units").
UNITS = {
    "clock_mhz": "MHz, SM cycles per microsecond over the line's span (clock64 against %globaltimer)",
    "clock_span_us": "us, the span the clock was measured over",
    "ms": "ms, first block start to last block end (%globaltimer)", "event_ms": "ms, CUDA events",
    "gbps": "GB/s (1e9 bytes/s), bytes loaded + stored by all blocks", "gbps_per_sm": "GB/s per SM",
    "load_gbps_per_sm": "GB/s per SM", "store_gbps_per_sm": "GB/s per SM",
    "bytes_per_clk_per_sm": "bytes per SM cycle", "copy_bytes": "bytes", "store_bytes": "bytes",
    "one_way_ns": "ns", "one_way_cycles": "SM cycles", "one_way_min_cycles": "SM cycles",
    "round_trip_ns": "ns (%globaltimer)", "round_trip_cycles": "SM cycles", "ns": "ns", "cycles": "SM cycles",
    "hint_ns": "ns", "backoff_ns": "ns", "issue_cycles": "SM cycles",
    "complete_ns_*, read_ns_*, write_ns_*": "ns (median, 10th and 90th percentile, minimum of the samples)",
    "ns_per_row": "ns per output row", "cycles_per_row": "SM cycles per output row",
    "input_gbps": "GB/s of bf16 input read from shared memory", "input_bytes_per_clk": "bytes per SM cycle",
    "read_ns": "ns per %globaltimer read", "read_cycles": "SM cycles per read", "gap_*_ns": "ns",
    "copy_ms": "ms (CUDA events)", "copy_gbps": "GB/s, bytes copied / time",
    "copy_rw_gbps": "GB/s, bytes read + written / time", "copy_end_ms": "ms after the run's first event",
    "neighbour_end_ms": "ms after the run's first event", "bytes": "bytes",
}


def build(lines: Lines, *, command: str, commit: str | None) -> dict:
    """The micro.json document."""
    d = lines.device
    config = {"command": command, "commit": commit, "quick": d.get("quick"), "timeout_s": d.get("timeout_s"),
              "sms": d.get("sms"), "cc": d.get("cc"), "l2_bytes": d.get("l2_bytes"),
              "smem_per_block_optin": d.get("smem_per_block_optin"),
              "max_clock_mhz_reported": d.get("max_clock_mhz_reported"),
              "cuda_driver_api": d.get("driver"), "cuda_runtime": d.get("runtime")}
    best = best_tma(lines)
    return {
        "metadata": metadata.metadata(TOOL, device_type="cuda", device=str(d.get("name")), config=config,
                                      units=UNITS),
        "device": d,
        "constants": table(lines),
        "best_tma_1sm": best,
        "failed": len(lines.failed()),
        "missing": lines.missing(),
        "measurements": lines.records,
    }


def _number(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.0f}"


def text(doc: dict) -> str:
    """The constants, one line each, then what is missing or failed."""
    d = doc["device"]
    out = [f"{d.get('name')} ({d.get('sms')} SMs), {doc['metadata']['date']}, {doc['metadata']['config']['command']}",
           f"{'constant':<22} {'value':>10} {'unit':<8} {'second':>10} {'unit':<7} {'MHz':>6}  what"]
    for row in doc["constants"]:
        flag = "" if row["ok"] in (True, None) else "  (FAILED: a wait ran out or a wrong result)"
        out.append(f"{row['name']:<22} {_number(row['value']):>10} {row['unit']:<8} {_number(row['also']):>10} "
                   f"{row['also_unit'] or '':<7} {_number(row['clock_mhz']):>6}  {row['what']}{flag}")
    best = doc["best_tma_1sm"]
    if best is not None:
        out.append(f"most bytes per SM on 1 SM: {_number(best['gbps_per_sm'])} GB/s/SM "
                   f"({_number(best.get('bytes_per_clk_per_sm'))} B/clk) with {best['mode']} k={best['fanout']}, "
                   f"{best['copy_bytes']} B copies, {best['stages']} stages, "
                   f"{'-' if best['depth'] < 0 else best['depth']} groups reading, "
                   f"{best['pipelines']} pipeline(s), {best['rows']} rows from {best['source']}")
    if doc["missing"]:
        out.append("no lines for: " + ", ".join(doc["missing"]))
    out.append(f"lines with ok false: {doc['failed']}")
    return "\n".join(out) + "\n"


def write(doc: dict, out_dir: str) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    paths = [os.path.join(out_dir, "micro.json"), os.path.join(out_dir, "micro.txt")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(text(doc))
    return paths
