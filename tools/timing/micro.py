"""The timing constants the GPU microbenchmarks measure, read from their micro.json.

The microbenchmarks (csrc/microbench, `hybrid_ep_microbench all`) time copies, hand-offs,
flags, fences and a reduction on one SM. Some of their numbers are one of the model's
constants (a bar.sync, a fence); others time a constant together with what the model costs
apart (a bulk load's issue -> landed is its bytes through the engine plus the load latency),
and the constant is what is left when the model's other part is taken off. `measured` gives
every constant micro.json determines, with its value and a source that says which numbers
it came from and how; `with_measured` puts them into a table. Constants micro.json does not
measure keep their estimates or fits.
"""

from __future__ import annotations

import json

from tools.microbench.constants import table as micro_table
from tools.microbench.records import Lines

from . import constants

ROW_BYTES = 16384  # the microbenchmarks' copies and reduced rows: 16 KiB
HALF_ROW_BYTES = 8192  # the copy-size sweep's copies below one thread's issue interval (C_load_8k, C_store_8k)
REQUEST_BYTES = 32  # a write request on the L1TEX-to-crossbar path: one sector


def _values(doc: dict) -> tuple[dict, dict]:
    """({name: value}, {name: clock MHz}) of micro.json's constants that ran and are ok. A
    constant named after the file was written (tools/microbench/constants.py) is read from its
    lines, where the file holds them."""
    rows = [c for c in doc["constants"] if c.get("ok") and c.get("value") is not None]
    named = {c["name"] for c in doc["constants"]}
    if isinstance(doc.get("measurements"), dict):
        lines = Lines(doc["device"], doc["measurements"])
        rows += [c for c in micro_table(lines)
                 if c["name"] not in named and c.get("ok") and c.get("value") is not None]
    return {c["name"]: float(c["value"]) for c in rows}, {c["name"]: c.get("clock_mhz") for c in rows}


def measured(doc: dict, table: constants.Table, label: str = "micro.json") -> dict[str, tuple[float, str]]:
    """{constant: (value, source)} for each timing constant micro.json `doc` (named `label` in
    the sources) determines. `table` is the one they go into (none of today's derivations needs
    its other costs: the rates they take off are micro.json's own)."""
    v, mhz = _values(doc)
    clock = mhz.get("H_project") or doc["device"].get("max_clock_mhz_reported")
    where = f"{label} ({doc['device']['name']}, SM clock {clock:.0f} MHz)"
    out: dict[str, tuple[float, str]] = {}

    def put(name: str, value: float, how: str, *needs: str) -> None:
        if all(n in v for n in needs):
            out[name] = (round(value, 2), f"{where}: {how}")

    g = v.get
    named = (f". The model's named hand-off (an elected lane's wait, then bar.sync: H_project + this) gives "
             f"{g('H_project', 0) + g('B_bar_sync4', 0):.1f} against H_named {g('H_named', 0):.1f}"
             if "H_named" in v and "H_project" in v else "")
    put("barrier_ns", g("B_bar_sync4", 0), f"B_bar_sync4, bar.sync among 4 warps{named}", "B_bar_sync4")
    put("collective_ns", g("H_converged", 0) - g("H_project", 0),
        f"H_converged {g('H_converged', 0):.1f} (a whole warp's hand-off: every lane waits with mbar_wait, the "
        f"warp converged, then a vote) less H_project {g('H_project', 0):.1f} (a lane's wait alone): the vote of "
        "lanes that arrive together", "H_converged", "H_project")
    put("wake_ns", g("H_project", 0),
        f"H_project, an mbarrier hand-off one way with the kernels' mbar_wait, lane 0 (bare try_wait "
        f"{g('H_bare', 0):.1f}, hinted {g('H_hint', 0):.1f}). A whole warp's stage wait (mbar_wait, warp_uniform, "
        f"31 lanes observe) is H_warp_uniform {g('H_warp_uniform', 0):.1f}: in the model this wake-up, the warp "
        f"collective and the lanes' try_wait", "H_project")
    reconverge = g("H_elect", 0) - g("H_bare", 0)
    put("reconverge_ns", reconverge,
        f"H_elect {g('H_elect', 0):.1f} (a whole warp's hand-off: an elected lane waits, bare try_wait, then "
        f"__syncwarp) less H_bare {g('H_bare', 0):.1f} (the lane alone): the divergence of a lane's wait loop "
        f"ended at a collective. The model's stage wait of a warp whose other lanes then observe the phase "
        f"(two such collectives a stage) gives H_project + 2 x this, {g('H_project', 0) + 2 * reconverge:.1f}, "
        f"against H_warp_uniform {g('H_warp_uniform', 0):.1f}", "H_elect", "H_bare")
    if "P_acquire" in v and mhz.get("P_acquire"):
        put("poll_ns", v["P_acquire"] * 1000.0 / mhz["P_acquire"],
            f"P_acquire, one ld.acquire.sys poll, {v['P_acquire']:.1f} cycles at {mhz['P_acquire']:.0f} MHz")
    put("fence_sys_ns", g("X_sys_0", 0), "X_sys_0, __threadfence_system with no store outstanding", "X_sys_0")
    put("release_ns", g("X_sys_0", 0),
        "X_sys_0: a release at system scope carries a system fence (__threadfence_system "
        f"{g('X_sys_0', 0):.1f}, fence.acq_rel.sys {g('X_acq_rel', 0):.1f})", "X_sys_0")
    put("flag_latency_ns", g("F_acquire", 0) - g("X_sys_0", 0),
        f"F_acquire {g('F_acquire', 0):.1f} (st.release.sys -> ld.acquire.sys polls between 2 SMs, one way) less "
        f"the release it includes (release_ns, X_sys_0 {g('X_sys_0', 0):.1f})", "F_acquire", "X_sys_0")
    put("fence_proxy_ns", g("X_proxy", 0), "X_proxy, fence.proxy.async after a shared store", "X_proxy")
    # The SM's load rate: C_load_4p, four threads' loads (one thread's are bound by its copies'
    # issue interval, C_load_8k: a copy of 2-32 KiB took it as long); before that constant, C_load.
    load_rate, load_rate_name = (v["C_load_4p"], "C_load_4p") if "C_load_4p" in v else (v.get("C_load"), "C_load")
    if load_rate:
        put("g2s_latency_ns", g("L_load_hbm", 0) - ROW_BYTES / load_rate,
            f"L_load_hbm {g('L_load_hbm', 0):.1f} (a 16 KiB bulk load from HBM, issue -> mbarrier complete) less its "
            f"bytes through the engine at {load_rate_name} {load_rate:.2f} bytes/ns", "L_load_hbm")
    if "C_store" in v:
        put("s2g_read_latency_ns", g("L_store_read", 0) - ROW_BYTES / v["C_store"],
            f"L_store_read {g('L_store_read', 0):.1f} (a 16 KiB bulk store, issue -> wait_group.read 0) less its "
            f"bytes at C_store {v['C_store']:.2f} bytes/ns (stores alone)", "L_store_read")
    if load_rate:
        put("g2s_l2_latency_ns", g("L_load_l2", 0) - ROW_BYTES / load_rate,
            f"L_load_l2 {g('L_load_l2', 0):.1f} (a 16 KiB bulk load, L2-hot) less its bytes through the engine at "
            f"{load_rate_name} {load_rate:.2f} bytes/ns", "L_load_l2")
    # The engine's two directions run side by side (timing.h, "bulk copies"): each at its rate
    # alone. One load + 2, 4, 8 stores per stage (C_mix2/4/8, bytes loaded and stored) then take
    # the stores' time at C_store, 3-13 % under the measured; one calendar for both would be
    # 7-24 % over it (the 2026-11-27 H200 run).
    if "C_load_4p" in v:
        put("engine_load_bytes_per_ns", g("C_load_4p", 0),
            f"C_load_4p {g('C_load_4p', 0):.2f} GB/s, bulk loads alone from 4 threads (4 pipelines of 3 stages of "
            f"16 KiB, one SM): the engine's load direction, at least (one thread's loads, C_load {g('C_load', 0):.2f}, "
            "are bound by its issue interval)", "C_load_4p")
    else:
        put("engine_load_bytes_per_ns", g("C_load", 0),
            f"C_load {g('C_load', 0):.2f} GB/s, bulk loads alone (16 KiB, 8 stages, one SM): the engine's load "
            "direction", "C_load")
    put("load_issue_interval_ns", HALF_ROW_BYTES / g("C_load_8k", 1),
        f"C_load_8k {g('C_load_8k', 0):.2f} GB/s: one thread's bulk loads of 8 KiB (8 stages, one SM), "
        f"{HALF_ROW_BYTES / g('C_load_8k', 1):.1f} ns each, as its copies of 2 to 32 KiB (the copy-size sweep) and "
        f"of 16 KiB (C_load {g('C_load', 0):.2f}: {ROW_BYTES / g('C_load', 1):.1f} ns): a time per copy of the "
        "issuing thread, not of the engine (two threads' 16 KiB loads, 2 pipelines, moved twice one's bytes)",
        "C_load_8k", "C_load")
    put("store_issue_interval_ns", HALF_ROW_BYTES / g("C_store_8k", 1),
        f"C_store_8k {g('C_store_8k', 0):.2f} GB/s: one thread's bulk stores of 8 KiB (4 groups reading, one SM), "
        f"{HALF_ROW_BYTES / g('C_store_8k', 1):.1f} ns each, as its stores of 2 and 4 KiB; taken per issuing thread, "
        "as the loads' (whether two store threads share it is C_direct_2_fp8's to say)", "C_store_8k")
    put("engine_store_bytes_per_ns", g("C_store", 0),
        f"C_store {g('C_store', 0):.2f} GB/s, bulk stores alone (16 KiB, 4 groups reading, one SM): the engine's "
        "store direction, which plain store requests take too", "C_store")
    if "C_store" in v:
        put("request_ns", REQUEST_BYTES / v["C_store"],
            f"a write request's share of C_store {v['C_store']:.2f} bytes/ns (stores alone, one SM): the stores "
            f"move one {REQUEST_BYTES}-byte sector per request cycle of the L1TEX-to-crossbar path (ncu: that path "
            "busy 96.5 % of the store-only run's cycles at 31.9 bytes per SM cycle), which a lane's plain global "
            "store takes whole", "C_store")
    put("sm_clock_ghz", clock / 1000.0,
        "the clock of its lines (clock64 against %globaltimer); the bench ran at it, ncu at 1.50")
    put("hbm_bytes_per_ns", 2 * g("E_alone", 0),
        f"E_alone {g('E_alone', 0):.1f} GB/s copied device to device by the copy engine, bytes read + written",
        "E_alone")
    put("s2g_write_latency_ns", g("L_store_write", 0) - g("L_store_read", 0),
        f"L_store_write {g('L_store_write', 0):.1f} less L_store_read {g('L_store_read', 0):.1f} (wait_group 0 "
        "against wait_group.read 0 of one 16 KiB store)", "L_store_write", "L_store_read")
    # R_1 (one warp summing 8 bf16 rows) times a reduction loop whose SASS is not counted, so
    # it gives no cost per instruction of a converted pair (pair_instruction_ns): that one is fitted.
    return out


def with_measured(table: constants.Table, path: str, label: str | None = None) -> constants.Table:
    """`table` with every constant micro.json at `path` determines replaced, its source saying so
    (naming the file `label`, default its path)."""
    with open(path) as f:
        doc = json.load(f)
    out = table
    for name, (value, source) in measured(doc, table, label or path).items():
        out = constants.with_sources(out, {name: value}, source)
    return constants.Table(doc["device"]["name"], out.constants)
