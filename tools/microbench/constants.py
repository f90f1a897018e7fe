"""The hardware constants read from a run: which line and field give each one. The table in
docs/benchmarks/cuda.md ("Constants") has one row per name here and says what each implies
for the kernel design."""

from __future__ import annotations

from dataclasses import dataclass

from .records import Lines

# The M2 base point every bulk-copy sweep varies one setting of (csrc/microbench/sweep_copy.cuh).
_BASE = {"test": "tma", "copy_bytes": 16384, "pipelines": 1, "rows": "sequential", "source": "hbm"}


@dataclass(frozen=True)
class Constant:
    name: str
    m: str  # measurement id
    what: str
    unit: str
    where: dict  # the fields the line must have
    field: str  # the value
    also: tuple[str, str] | None = None  # a second field worth printing, and its unit


def _tma(name, what, **where):
    return Constant(name, "M2", what, "GB/s/SM", {**_BASE, "sweep": "sms", "stages": 8, **where}, "gbps_per_sm",
                    ("bytes_per_clk_per_sm", "B/clk"))


def _direct(name, what, threads, table, copy_bytes=16384):
    """The direct dispatch's store side: 1 load + 8 stores per stage on 12 stages, one group left
    reading per store thread (sweep "kernel"), rows of copy_bytes."""
    return Constant(name, "M2", what, "GB/s/SM",
                    {**_BASE, "sweep": "kernel", "mode": "mix", "fanout": 8, "sms": 1, "store_threads": threads,
                     "table": table, "copy_bytes": copy_bytes}, "gbps_per_sm", ("bytes_per_clk_per_sm", "B/clk"))


CONSTANTS = (
    _tma("C_load", "bulk loads only, 16 KiB, 8 stages, 1 SM", mode="load", sms=1),
    _tma("C_store", "bulk stores only, 16 KiB, 4 groups reading, 1 SM", mode="store", sms=1),
    _tma("C_mix1", "1 load + 1 store per stage (send, r = 1), 1 SM", mode="mix", fanout=1, sms=1),
    _tma("C_mix2", "1 load + 2 stores per stage, 1 SM", mode="mix", fanout=2, sms=1),
    _tma("C_mix4", "1 load + 4 stores per stage, 1 SM", mode="mix", fanout=4, sms=1),
    _tma("C_mix8", "1 load + 8 stores per stage, 1 SM", mode="mix", fanout=8, sms=1),
    _tma("C_mix1_32sm", "1 load + 1 store per stage, each of 32 SMs", mode="mix", fanout=1, sms=32),
    Constant("C_load_8k", "M2", "bulk loads only, 8 KiB copies, 8 stages, 1 SM: one thread's copy time below 16 KiB",
             "GB/s/SM", {**_BASE, "sweep": "copy_bytes", "mode": "load", "copy_bytes": 8192, "stages": 8},
             "gbps_per_sm", ("bytes_per_clk_per_sm", "B/clk")),
    Constant("C_store_8k", "M2", "bulk stores only, 8 KiB copies, 8 stages, 1 SM: one thread's store time at 8 KiB",
             "GB/s/SM", {**_BASE, "sweep": "copy_bytes", "mode": "store", "copy_bytes": 8192, "stages": 8},
             "gbps_per_sm", ("bytes_per_clk_per_sm", "B/clk")),
    Constant("C_load_4p", "M2",
             "bulk loads only, 4 pipelines of 3 stages (16 KiB), 1 SM: the SM's loads from 4 threads",
             "GB/s/SM", {**_BASE, "sweep": "pipelines", "mode": "load", "pipelines": 4, "stages": 3}, "gbps_per_sm",
             ("bytes_per_clk_per_sm", "B/clk")),
    Constant("C_gather_1", "M2", "the token stage's loads: 8 parts of 4 KiB per 32 KiB stage under one arrival, "
             "issued by 1 lane; 2 pipelines of 3 stages, 1 SM", "GB/s/SM",
             {"test": "tma", "sweep": "gather", "mode": "load", "parts": 8, "part_lanes": 1}, "gbps_per_sm",
             ("bytes_per_clk_per_sm", "B/clk")),
    Constant("C_gather_8", "M2", "the same, part k issued by lane k (8 lanes)", "GB/s/SM",
             {"test": "tma", "sweep": "gather", "mode": "load", "parts": 8, "part_lanes": 8}, "gbps_per_sm",
             ("bytes_per_clk_per_sm", "B/clk")),
    _direct("C_direct_1", "1 load + 8 stores per stage, 12 stages, 1 group reading, 1 store thread", 1, False),
    _direct("C_direct_2", "the same, 2 store threads taking alternate stages", 2, False),
    _direct("C_direct_1_table", "1 store thread, destinations from a route table in shared memory", 1, True),
    _direct("C_direct_2_table", "2 store threads and the route table: the direct dispatch's store side", 2, True),
    _direct("C_direct_1_fp8", "1 store thread and the route table, fp8 rows (8 KiB copies)", 1, True, 8192),
    _direct("C_direct_2_fp8", "2 store threads and the route table, fp8 rows: fp8's dispatch's store side", 2, True,
            8192),
    Constant("L_load_l2", "M3", "16 KiB bulk load, issue to mbarrier complete, L2-hot (median)", "ns",
             {"copy": "load", "copy_bytes": 16384, "source": "l2", "queue": "none"}, "complete_ns_median"),
    Constant("L_load_hbm", "M3", "16 KiB bulk load from HBM (median)", "ns",
             {"copy": "load", "copy_bytes": 16384, "source": "hbm", "queue": "none"}, "complete_ns_median"),
    Constant("L_load_behind_stores", "M3", "16 KiB bulk load from HBM behind 8 queued 16 KiB stores", "ns",
             {"copy": "load", "copy_bytes": 16384, "source": "hbm", "queue": "stores"}, "complete_ns_median"),
    Constant("L_store_read", "M3", "16 KiB bulk store, issue to wait_group.read 0 (median)", "ns",
             {"copy": "store", "copy_bytes": 16384, "queue": "none"}, "read_ns_median"),
    Constant("L_store_write", "M3", "16 KiB bulk store, issue to wait_group 0 (median)", "ns",
             {"copy": "store", "copy_bytes": 16384, "queue": "none"}, "write_ns_median"),
    Constant("H_bare", "M1", "mbarrier hand-off one way, lane 0 spins on try_wait, no other warps", "ns",
             {"test": "handoff", "wait": "bare", "agree": "lane", "spinners": 0}, "one_way_ns"),
    Constant("H_hint", "M1", "the same with try_wait's suspend hint of 1 us", "ns",
             {"test": "handoff", "wait": "hint", "hint_ns": 1000, "agree": "lane", "spinners": 0}, "one_way_ns"),
    Constant("H_project", "M1", "the same with the kernels' mbar_wait (abort flag + timer every 64 turns)", "ns",
             {"test": "handoff", "wait": "project", "agree": "lane", "spinners": 0}, "one_way_ns"),
    Constant("H_project_8", "M1", "mbar_wait with 8 other warps spinning the same way", "ns",
             {"test": "handoff", "wait": "project", "agree": "lane", "spinners": 8}, "one_way_ns"),
    Constant("H_hint_8", "M1", "hinted try_wait with 8 other warps waiting the same way", "ns",
             {"test": "handoff", "wait": "hint", "hint_ns": 1000, "agree": "lane", "spinners": 8}, "one_way_ns"),
    Constant("H_warp_uniform", "M1", "whole warps: mbar_wait, warp_uniform, 31 lanes observe (today's stage wait)",
             "ns", {"test": "handoff", "wait": "project", "agree": "warp_uniform", "spinners": 0}, "one_way_ns"),
    Constant("H_elect", "M1", "whole warps: elected lane waits (bare), __syncwarp", "ns",
             {"test": "handoff", "wait": "bare", "agree": "elect", "spinners": 0}, "one_way_ns"),
    Constant("H_converged", "M1", "whole warps: every lane waits (mbar_wait), converged, then a vote", "ns",
             {"test": "handoff", "wait": "project", "agree": "converged", "spinners": 0}, "one_way_ns"),
    Constant("H_named", "M1", "4 warps: an elected lane waits (mbar_wait), then bar.sync among the 4 (Hybrid-EP's)",
             "ns", {"test": "handoff", "wait": "project", "agree": "named", "spinners": 0}, "one_way_ns"),
    Constant("B_bar_sync4", "M1", "bar.sync among 4 warps", "ns", {"test": "bar.sync", "warps": 4}, "ns"),
    Constant("F_acquire", "M4", "flag between 2 SMs one way: st.release.sys, ld.acquire.sys polls", "ns",
             {"test": "flag", "poll": "ld.acquire.sys", "signal": "st.release.sys", "backoff_ns": 0}, "one_way_ns"),
    Constant("F_relaxed", "M4", "the same polled with ld.relaxed.sys, one fence.acq_rel.sys after", "ns",
             {"test": "flag", "poll": "ld.relaxed.sys+fence.acq_rel.sys", "signal": "st.release.sys",
              "backoff_ns": 0}, "one_way_ns"),
    Constant("P_acquire", "M4", "one ld.acquire.sys poll of an unchanged flag", "cycles",
             {"test": "poll", "poll": "ld.acquire.sys"}, "cycles"),
    Constant("P_relaxed", "M4", "one ld.relaxed.sys poll of an unchanged flag", "cycles",
             {"test": "poll", "poll": "ld.relaxed.sys"}, "cycles"),
    Constant("X_sys_256", "M5", "__threadfence_system with 256 stores outstanding", "ns",
             {"fence": "__threadfence_system", "stores_before": 256}, "ns"),
    Constant("X_sys_0", "M5", "__threadfence_system with no store outstanding", "ns",
             {"fence": "__threadfence_system", "stores_before": 0}, "ns"),
    Constant("X_acq_rel", "M5", "fence.acq_rel.sys", "ns", {"fence": "fence.acq_rel.sys"}, "ns"),
    Constant("X_proxy", "M5", "fence.proxy.async after a shared store, 4 warps at once", "ns",
             {"fence": "fence.proxy.async", "threads": 128}, "ns"),
    Constant("X_wait_group", "M5", "wait_group 0 after 8 x 16 KiB bulk stores", "ns",
             {"fence": "wait_group 0 after 8 bulk stores"}, "ns"),
    Constant("R_1", "M6", "1 warp summing 8 bf16 rows of 16 KiB (16-byte loads, unrolled): input read", "GB/s",
             {"vec_bytes": 16, "loop": "unrolled", "rows": 8, "warps": 1}, "input_gbps",
             ("ns_per_row", "ns/row")),
    Constant("R_4", "M6", "the same with 4 warps", "GB/s", {"vec_bytes": 16, "loop": "unrolled", "rows": 8, "warps": 4},
             "input_gbps", ("ns_per_row", "ns/row")),
    Constant("R_8", "M6", "the same with 8 warps", "GB/s", {"vec_bytes": 16, "loop": "unrolled", "rows": 8, "warps": 8},
             "input_gbps", ("ns_per_row", "ns/row")),
    Constant("T_gap", "M9", "%globaltimer: smallest change seen", "ns", {"test": "globaltimer"}, "gap_min_ns",
             ("read_ns", "ns/read")),
    Constant("E_alone", "M10", "copy engine, 256 MiB device to device, alone (bytes copied / time)", "GB/s",
             {"neighbour": "none"}, "copy_gbps"),
    Constant("E_compute", "M10", "the same beside a kernel holding every SM (arithmetic)", "GB/s",
             {"neighbour": "compute"}, "copy_gbps"),
    Constant("E_memory", "M10", "the same beside a kernel copying memory on every SM", "GB/s",
             {"neighbour": "memory"}, "copy_gbps"),
)


def _matches(record: dict, where: dict) -> bool:
    return all(record.get(k) == v for k, v in where.items())


def pick(lines: Lines, c: Constant) -> dict | None:
    """The first line of c's measurement with c's fields, or None."""
    return next((r for r in lines.records.get(c.m, []) if _matches(r, c.where)), None)


def table(lines: Lines) -> list[dict]:
    """One row per constant: its value (None when the run has no such line), the SM clock of
    its line, whether that line's kernel ran to the end."""
    rows = []
    for c in CONSTANTS:
        r = pick(lines, c)
        rows.append({
            "name": c.name, "m": c.m, "what": c.what, "unit": c.unit,
            "value": None if r is None else r.get(c.field),
            "also": None if r is None or c.also is None else r.get(c.also[0]),
            "also_unit": None if c.also is None else c.also[1],
            "clock_mhz": None if r is None else r.get("clock_mhz"),
            "ok": None if r is None else r.get("ok"),
        })
    return rows


def best_tma(lines: Lines, sms: int = 1) -> dict | None:
    """The M2 line with the most bytes per second per SM among those on `sms` SMs."""
    rs = [r for r in lines.records.get("M2", []) if r.get("sms") == sms and r.get("ok") is not False
          and r.get("test") == "tma" and isinstance(r.get("gbps_per_sm"), (int, float))]
    return max(rs, key=lambda r: r["gbps_per_sm"], default=None)
