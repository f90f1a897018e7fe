"""The timing model of the kernels on the CPU model (tools.timing, csrc/device/model/timing.*).

The measured points it is calibrated on are data (tools/timing/points.json); they
must be exactly the GPU runs' numbers, each tied to the commit that was measured. The clocks
must give the exact time of kernels whose critical path is known (timing_selftest.cpp), the
same time for a seed every time and nearly the same for every seed, and timing must change
nothing the functional model does.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import numbers_without_units
from hybrid_ep.backends.cuda import launch
from tools.timing import cli as timing_cli
from tools.timing import constants, fit, points, predict, report

pytestmark = pytest.mark.model

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPU_RUNS = os.path.join(REPO, "benchmarks", "results")


def test_points_are_the_gpu_runs_numbers():
    runs, pts = points.load_points()
    # 2026-11-22: 12; 2026-11-24: 12 on one node, 6 on two; 2026-11-26, H200 and H100: 12 + 12 + 6 each;
    # 2026-11-27 H200: 12 direct, 6 + 4 across nodes, 12 receive, 4 fp8, 4 + 4 DeepSeek-V3-like;
    # 2026-11-28 H200 (the kernels after the house): 12 direct, 6 + 4 across nodes (direct), 4 fp8, 4 + 4
    assert len(pts) == 170
    for name, run in runs.items():
        with open(os.path.join(GPU_RUNS, name, "emulated.json")) as f:
            want_run, want = points.points_from_run(json.load(f), name, run.commit, run.commit_note)
        assert run == want_run
        assert [p for p in pts if p.run == name] == want
    keys = [(p.run, *p.key) for p in pts]
    assert len(set(keys)) == len(keys)
    combine_w2 = {p.run: p.ms for p in pts if p.key == (2, 1, 1, "combine")}
    assert combine_w2 == {"2026-11-22-h100/bench": pytest.approx(233.636, abs=1e-3),
                          "2026-11-24-h100/bench": pytest.approx(203.405, abs=1e-3),
                          "2026-11-26-h200/bench": pytest.approx(22.640, abs=1e-3),
                          "2026-11-26-h200/bench_receive": pytest.approx(45.465, abs=1e-3),
                          "2026-11-26-h100/bench": pytest.approx(10.375, abs=1e-3),
                          "2026-11-26-h100/bench_receive": pytest.approx(23.563, abs=1e-3),
                          "2026-11-27-h200/rerun/bench/bench": pytest.approx(11.816, abs=1e-3),
                          "2026-11-27-h200/first_call/bench_receive": pytest.approx(30.132, abs=1e-3),
                          "2026-11-28-h200-house/first_call/bench/bench": pytest.approx(10.644, abs=1e-3)}
    # each point says which kernels ran: the H100 runs of 2026-11-22 and -24 predate the direct path
    paths = {(p.run, p.data_path) for p in pts}
    assert paths == {("2026-11-22-h100/bench", "receive"), ("2026-11-24-h100/bench", "receive"),
                     ("2026-11-24-h100/bench_nodes", "receive"), ("2026-11-26-h200/bench", "direct"),
                     ("2026-11-26-h200/bench_receive", "receive"), ("2026-11-26-h200/bench_nodes", "receive"),
                     ("2026-11-26-h100/bench", "direct"), ("2026-11-26-h100/bench_receive", "receive"),
                     ("2026-11-26-h100/bench_nodes", "receive"), ("2026-11-27-h200/rerun/bench/bench", "direct"),
                     ("2026-11-27-h200/rerun/bench/bench_nodes", "receive"),
                     ("2026-11-27-h200/rerun/bench/bench_nodes4", "receive"),
                     ("2026-11-27-h200/first_call/bench_receive", "receive"),
                     ("2026-11-27-h200/first_call/bench_fp8", "direct"),
                     ("2026-11-27-h200/first_call/bench_dsv3_direct", "direct"),
                     ("2026-11-27-h200/first_call/bench_dsv3_receive", "receive"),
                     *((f"2026-11-28-h200-house/first_call/{r}", "direct")
                       for r in ("bench/bench", "bench/bench_nodes", "bench/bench_nodes4", "bench_fp8",
                                 "bench_dsv3_direct")),
                     ("2026-11-28-h200-house/first_call/bench_dsv3_receive", "receive")}
    assert {r.device for r in runs.values()} == {"NVIDIA H100 80GB HBM3", "NVIDIA H200"}


def test_every_run_names_a_commit_of_the_repository():
    runs, _ = points.load_points()
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                             text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("needs the repository's whole history")
    for run in runs.values():
        done = subprocess.run(["git", "cat-file", "-e", f"{run.commit}^{{commit}}"], cwd=REPO)
        assert done.returncode == 0, f"{run.name}: {run.commit} is not a commit"


# ---- the clocks -----------------------------------------------------------------------------

model = importlib.import_module("hybrid_ep._model")

# Distinct values, so that a formula that adds the wrong constant cannot match by chance.
COSTS = {"launch_ns": 1009.0, "barrier_ns": 31.0, "collective_ns": 23.0, "reconverge_ns": 59.0, "arrive_ns": 17.0,
         "try_wait_ns": 13.0,
         "wake_ns": 211.0, "poll_ns": 701.0, "flag_latency_ns": 997.0, "release_ns": 503.0, "atomic_ns": 601.0,
         "fence_gpu_ns": 307.0, "fence_sys_ns": 1013.0, "fence_proxy_ns": 29.0, "issue_ns": 37.0,
         "commit_ns": 11.0, "wait_group_ns": 19.0, "g2s_latency_ns": 709.0, "s2g_read_latency_ns": 401.0,
         "s2g_write_latency_ns": 1019.0, "engine_load_bytes_per_ns": 40.0, "engine_store_bytes_per_ns": 29.0,
         "request_ns": 0.0, "store_copy_ns": 0.0, "load_issue_interval_ns": 0.0, "store_issue_interval_ns": 0.0,
         "pair_instruction_ns": 0.5, "smem_load_ns": 41.0, "gmem_load_ns": 613.0, "l2_load_ns": 257.0,
         "g2s_l2_latency_ns": 83.0, "sm_clock_ghz": 2.0, "access_instructions": 4.0, "cvt_pair_instructions": 6.0,
         "shift_pair_instructions": 10.0, "pack_pair_instructions": 14.0, "count_tile_instructions": 101.0,
         "count_route_instructions": 7.0, "count_route_pair_instructions": 3.0, "count_dest_instructions": 5.0,
         "count_node_instructions": 11.0, "count_scan_column_instructions": 13.0, "spin_instructions": 0.0,
         "spin_period_ns": 53.0, "hbm_bytes_per_ns": 1e6, "l2_hit_written": 0.0, "l2_hit_reread": 0.0,
         "l2_hit_stream": 0.0, "nic_post_ns": 1511.0, "nic_bytes_per_ns": 4.0, "nic_latency_ns": 2003.0,
         "plain_code_cycles": 1.0, "bounded_vector_instructions": 3.0, "bounded_vector_ns": 43.0}
ACCESS_NS = COSTS["access_instructions"] / COSTS["sm_clock_ghz"]  # one access alone on its scheduler


def timed_selftest(name: str, blocks: int, n: int, nbytes: int, costs: dict = COSTS, threads: int = 64) -> dict:
    model.set_timing(costs)
    try:
        error = model.run_timing_selftest(name, blocks, n, nbytes, threads)
        reports = model.timing_reports()
    finally:
        model.set_timing(None)
    assert error is None, error
    assert len(reports) == 1
    return reports[0]


def engine_stream(starts: list[float], nbytes: int, c: dict, rate: str = "engine_load_bytes_per_ns") -> list[float]:
    """When each copy's last byte leaves the engine: copies issued at `starts` by one thread, one
    engine, each at the engine's `rate` (loads' or stores'; a store also takes its fixed
    store_copy_ns), each starting an issue interval after the thread's copy before it at the
    earliest."""
    store = rate == "engine_store_bytes_per_ns"
    fixed = c["store_copy_ns"] if store else 0.0
    interval = c["store_issue_interval_ns" if store else "load_issue_interval_ns"]
    done, free, earliest = [], 0.0, 0.0
    for s in starts:
        start = max(s, earliest)
        earliest = start + interval
        free = max(start, free) + fixed + nbytes / c[rate]
        done.append(free)
    return done


def test_every_constant_of_the_model_is_in_the_table():
    constants.check_against_model(constants.load_table(), model)
    constants.check_against_model(constants.load_table(constants.H200), model)
    assert set(COSTS) == {name for name, _ in model.timing_costs()}


MICRO_H200 = os.path.join(GPU_RUNS, "2026-11-27-h200", "first_call", "micro", "micro.json")
MICRO_H100 = os.path.join(GPU_RUNS, "2026-11-26-h100", "micro.json")


@pytest.mark.parametrize("path,micro_json,device,wake_ns", [
    (constants.H200, MICRO_H200, "NVIDIA H200", 87.51),
    (constants.H100, MICRO_H100, "NVIDIA H100 80GB HBM3", 87.6),
])
def test_each_table_takes_every_constant_its_gpus_microbenchmarks_measured(path, micro_json, device, wake_ns):
    """h200.json and h100.json: each constant their GPU's micro.json determines has its value and
    source from it, unless fitted (at most three fitted); every other one is an estimate, a fit
    or a count from SASS."""
    from tools.timing import micro

    table = constants.load_table(path)
    assert table.device == device
    with open(micro_json) as f:
        doc = json.load(f)
    label = os.path.relpath(micro_json, REPO)
    got = micro.measured(doc, table, label)
    assert {"wake_ns", "barrier_ns", "g2s_latency_ns", "s2g_read_latency_ns", "fence_sys_ns"} <= set(got)
    fitted = table.fitted()
    assert len(fitted) <= fit.MAX_FITTED
    for name, c in table.constants.items():
        if name in got and name not in fitted:
            assert (c.value, c.source) == got[name], name
        else:
            assert c.source.startswith(("est.", "fit", "SASS")), name
    assert got["wake_ns"][0] == pytest.approx(wake_ns, abs=0.01)  # H_project


def test_constants_derived_from_the_microbenchmarks_take_off_what_the_model_costs_apart():
    """A 16 KiB bulk load's issue -> landed is its bytes through the engine plus the load
    latency; a flag's one-way time includes the writer's release; the reduction's time per
    vector includes its loads and store: micro.measured leaves the constant alone."""
    from tools.timing import micro

    def row(name, value, ok=True, mhz=2000.0):
        return {"name": name, "value": value, "ok": ok, "clock_mhz": mhz}

    doc = {"device": {"name": "GPU", "max_clock_mhz_reported": 2000},
           "constants": [row("C_load", 64.0), row("L_load_hbm", 600.0), row("C_store", 32.0),
                         row("L_store_read", 700.0), row("L_store_write", 710.0), row("F_acquire", 900.0),
                         row("X_sys_0", 500.0), row("P_acquire", 300.0), row("H_project", 90.0),
                         row("R_1", 8.0), row("B_bar_sync4", 16.0, ok=False), row("L_load_l2", 300.0),
                         row("E_alone", 2000.0, mhz=None)]}
    table = constants.load_table(constants.H100).with_values(access_instructions=4.0, sm_clock_ghz=2.0,
                                                             smem_load_ns=25.0)
    got = {n: v for n, (v, _) in micro.measured(doc, table).items()}
    assert got["g2s_latency_ns"] == pytest.approx(600.0 - 16384 / 64.0)
    assert got["s2g_read_latency_ns"] == pytest.approx(700.0 - 16384 / 32.0)
    assert got["s2g_write_latency_ns"] == pytest.approx(10.0)
    assert got["flag_latency_ns"] == pytest.approx(400.0) and got["release_ns"] == pytest.approx(500.0)
    assert got["poll_ns"] == pytest.approx(150.0)  # 300 cycles at 2 GHz
    assert got["g2s_l2_latency_ns"] == pytest.approx(300.0 - 16384 / 64.0)
    assert got["sm_clock_ghz"] == pytest.approx(2.0) and got["hbm_bytes_per_ns"] == pytest.approx(4000.0)
    # R_1's loop has no SASS count: no cost per instruction of a pair comes from it
    assert "pair_instruction_ns" not in got
    assert "barrier_ns" not in got  # its line was not ok
    assert "collective_ns" not in got  # not measured
    # the engine's two directions, each at its rate alone
    assert got["engine_load_bytes_per_ns"] == 64.0 and got["engine_store_bytes_per_ns"] == 32.0


@pytest.mark.parametrize("n", [1, 2, 7])
def test_a_chain_of_handoffs_takes_n_arrivals_and_wake_ups(n):
    c = COSTS
    r = timed_selftest("handoff_chain", 1, n, 16)
    assert r["time_ns"] == pytest.approx(c["barrier_ns"] + n * (c["arrive_ns"] + c["wake_ns"]) + c["launch_ns"],
                                         rel=1e-12)
    path = dict(r["critical_path"])
    assert sum(path.values()) == pytest.approx(r["time_ns"] - c["launch_ns"], rel=1e-12)
    woken = sum(ns for what, ns in path.items() if what.startswith("mbarrier arrive"))
    assert woken == pytest.approx(n * c["wake_ns"], rel=1e-12)


@pytest.mark.parametrize("n,nbytes", [(6, 1024), (4, 256)])  # engine-bound, then issue-bound
def test_a_stream_of_bulk_loads_goes_through_the_engine_at_its_capacity(n, nbytes):
    c = COSTS
    issued = c["barrier_ns"] + c["arrive_ns"]
    starts = [issued + (i + 1) * c["issue_ns"] for i in range(n)]
    landed = engine_stream(starts, nbytes, c)[-1] + c["g2s_latency_ns"]
    want = max(starts[-1] + c["try_wait_ns"], landed + c["wake_ns"]) + c["launch_ns"]
    r = timed_selftest("load_stream", 1, n, nbytes)
    assert r["time_ns"] == pytest.approx(want, rel=1e-12)
    assert r["copies"] == n and r["copy_bytes"] == n * nbytes
    if nbytes / c["engine_load_bytes_per_ns"] > c["issue_ns"]:  # the engine never idles after the first copy
        assert r["engine_busy_ns"] == pytest.approx(n * nbytes / c["engine_load_bytes_per_ns"], rel=1e-12)
    # Each SM has its own engine: blocks side by side take the time of one.
    assert timed_selftest("load_stream", 3, n, nbytes)["time_ns"] == pytest.approx(want, rel=1e-12)


def test_the_engine_calendar_keeps_a_piece_placed_where_a_zero_length_one_starts():
    """A zero-length piece (a transfer's last part below the clock's resolution) and a piece
    placed from the same start: the engine is busy over the second, and a later transfer goes
    around it (the second piece was dropped once, the key being taken, and the engine looked
    free there)."""
    from hybrid_ep import _model as model

    end, pieces = model.calendar_fit([(5.0, 5.0), (5.0, 10.0)], 0.0, 8.0)
    assert (end, [tuple(p) for p in pieces]) == (13.0, [(0.0, 5.0), (10.0, 13.0)])
    # the same without the zero-length piece, and with it alone (it splits a free gap only)
    assert model.calendar_fit([(5.0, 10.0)], 0.0, 8.0)[0] == 13.0
    assert model.calendar_fit([(5.0, 5.0)], 0.0, 8.0) == (8.0, [(0.0, 5.0), (5.0, 8.0)])


@pytest.mark.parametrize("interval", [0.0, 400.0])
def test_one_threads_bulk_loads_start_an_issue_interval_apart(interval):
    """A thread's copies of 256 bytes: with an issue interval above their bytes' time each starts
    that interval after the one before (one thread's loads of 2-32 KiB each took about 211 ns on
    the H200), not at the engine's rate; with none, at its rate."""
    c, n, nbytes = {**COSTS, "load_issue_interval_ns": interval}, 4, 256
    issued = c["barrier_ns"] + c["arrive_ns"]
    starts = [issued + (i + 1) * c["issue_ns"] for i in range(n)]
    landed = engine_stream(starts, nbytes, c)[-1] + c["g2s_latency_ns"]
    want = max(starts[-1] + c["try_wait_ns"], landed + c["wake_ns"]) + c["launch_ns"]
    r = timed_selftest("load_stream", 1, n, nbytes, costs=c)
    assert r["time_ns"] == pytest.approx(want, rel=1e-12)
    if interval:
        assert landed == pytest.approx(starts[0] + (n - 1) * interval + nbytes / c["engine_load_bytes_per_ns"] +
                                       c["g2s_latency_ns"], rel=1e-12)


@pytest.mark.parametrize("interval", [0.0, 300.0])
def test_one_threads_bulk_stores_start_an_issue_interval_apart(interval):
    """The same for a thread's stores (one of 8 KiB or less took an H200's thread 147.6 ns)."""
    c, n, nbytes = {**COSTS, "store_issue_interval_ns": interval}, 5, 2048
    starts = [c["barrier_ns"] + i * (c["issue_ns"] + c["commit_ns"]) + c["issue_ns"] for i in range(n)]
    through = engine_stream(starts, nbytes, c, "engine_store_bytes_per_ns")[-1]
    t = c["barrier_ns"] + n * (c["issue_ns"] + c["commit_ns"])
    t = max(t + c["wait_group_ns"], through + c["s2g_read_latency_ns"])
    t = max(t + c["wait_group_ns"], through + c["s2g_read_latency_ns"] + c["s2g_write_latency_ns"])
    r = timed_selftest("store_stream", 1, n, nbytes, costs=c)
    assert r["time_ns"] == pytest.approx(t + c["launch_ns"], rel=1e-12)
    if interval:
        assert through == pytest.approx(starts[0] + (n - 1) * interval + nbytes / c["engine_store_bytes_per_ns"],
                                        rel=1e-12)


@pytest.mark.parametrize("n", [2, 6])
def test_bulk_loads_and_stores_go_through_the_engine_side_by_side(n):
    """n bulk loads and n bulk stores from one thread, a load then a store: each direction of
    the engine takes its own copies at its own rate, so the loads' bytes hide behind the
    stores' (one calendar for both would add them: the H200's microbenchmarks of one load + 2-8
    stores measured the former)."""
    c, nbytes = COSTS, 2048
    both = timed_selftest("load_and_store", 1, n, nbytes)
    stores = timed_selftest("store_stream", 1, n, nbytes)
    loads_ns, stores_ns = n * nbytes / c["engine_load_bytes_per_ns"], n * nbytes / c["engine_store_bytes_per_ns"]
    assert both["engine_busy_ns"] == pytest.approx(max(loads_ns, stores_ns), rel=1e-12)  # the busier direction
    assert both["copies"] == 2 * n
    # Each store starts at its issue, a load's issue later than in the stream of stores alone;
    # the wait for the loads' mbarrier comes first and ends before the stores are written.
    # One calendar would put every load's bytes between the stores: about loads_ns more.
    issue_shift = n * c["issue_ns"] + c["arrive_ns"]
    assert both["time_ns"] <= stores["time_ns"] + issue_shift + c["try_wait_ns"] + c["wait_group_ns"]
    assert both["time_ns"] < stores["time_ns"] + loads_ns


@pytest.mark.parametrize("store_copy_ns", [0.0, 150.0])
def test_bulk_store_groups_are_read_then_written(store_copy_ns):
    """Five stores in a stream: each through the engine at its rate, after its fixed time (the
    per-store reading of docs/dev/request_path.md), then read, then written."""
    c, n, nbytes = {**COSTS, "store_copy_ns": store_copy_ns}, 5, 2048
    starts = [c["barrier_ns"] + i * (c["issue_ns"] + c["commit_ns"]) + c["issue_ns"] for i in range(n)]
    through = engine_stream(starts, nbytes, c, "engine_store_bytes_per_ns")[-1]  # a store's rate, not a load's
    t = c["barrier_ns"] + n * (c["issue_ns"] + c["commit_ns"])
    t = max(t + c["wait_group_ns"], through + c["s2g_read_latency_ns"])
    t = max(t + c["wait_group_ns"], through + c["s2g_read_latency_ns"] + c["s2g_write_latency_ns"])
    r = timed_selftest("store_stream", 1, n, nbytes, costs=c)
    assert r["time_ns"] == pytest.approx(t + c["launch_ns"], rel=1e-12)


@pytest.mark.parametrize("n", [1, 6])
def test_a_flag_passed_between_blocks_takes_the_release_and_its_latency(n):
    c = COSTS
    r = timed_selftest("flag_chain", 2, n, 16)
    assert r["time_ns"] == pytest.approx(c["barrier_ns"] + n * (c["release_ns"] + c["flag_latency_ns"]) +
                                         c["launch_ns"], rel=1e-12)


@pytest.mark.parametrize("n,nbytes,costs", [
    (3, 4096, COSTS),  # each put's bytes through the NIC before the next is posted: bound by the posts
    (4, 8192, dict(COSTS, nic_post_ns=101.0, nic_bytes_per_ns=2.0)),  # bound by the NIC
])
def test_posted_puts_take_the_post_the_nic_and_the_network_latency(n, nbytes, costs):
    """A cluster's put (set_posted_puts): the warp pays the post, the bytes go through the NIC at
    its rate from the post on, one after another, and the signal is seen the network latency after
    the last byte; the quiet waits for the acknowledgement, another latency."""
    c = costs
    model.set_posted_puts(True)
    try:
        r = timed_selftest("nic_puts", 2, n, nbytes, costs=c)
    finally:
        model.set_posted_puts(False)
    t = free = c["barrier_ns"]
    for _ in range(n):
        t += c["nic_post_ns"]
        free = max(t, free) + nbytes / c["nic_bytes_per_ns"]
    seen = free + c["nic_latency_ns"]
    assert r["block_end_ns"][0] == pytest.approx(seen + c["nic_latency_ns"], rel=1e-12)  # the quiet
    assert r["block_end_ns"][1] == pytest.approx(seen + c["flag_latency_ns"], rel=1e-12)  # the poll of the signal
    assert r["time_ns"] == pytest.approx(seen + c["nic_latency_ns"] + c["launch_ns"], rel=1e-12)
    assert r["nic_bytes"] == n * nbytes
    assert any(what.startswith("nic put") for what, _ in r["critical_path"])


def test_puts_are_posted_only_when_asked():
    assert not model.posted_puts()
    model.set_timing(COSTS)
    try:
        assert "needs posted puts" in model.run_timing_selftest("nic_puts", 2, 1, 16, 64)
    finally:
        model.set_timing(None)


def test_a_named_barrier_waits_for_its_latest_arrival_and_costs_a_barrier():
    """The launch's __syncthreads, thread 0's fences, the named barrier (bar.sync: its latest
    arrival plus barrier_ns, micro M1's B_bar_sync4), then thread 32's fences."""
    c, n = COSTS, 5
    r = timed_selftest("named_barrier", 1, n, 16)
    assert r["time_ns"] == pytest.approx(2 * c["barrier_ns"] + 2 * n * c["fence_gpu_ns"] + c["launch_ns"], rel=1e-12)


def test_plain_code_is_counted_by_the_pairs_it_converts():
    """Each pair costs its kind's instructions: on the issue slots and, per instruction, its
    dependent latency (COSTS: a widening of 6 instructions costs three times a narrowing of 2)."""
    c, n = COSTS, 9
    r = timed_selftest("plain_pairs", 1, n, 4)
    instructions = n * (c["cvt_pair_instructions"] + c["pack_pair_instructions"])
    issue = instructions / c["sm_clock_ghz"]
    want = c["barrier_ns"] + instructions * c["pair_instruction_ns"] + issue + c["launch_ns"]
    assert r["time_ns"] == pytest.approx(want, rel=1e-12)
    assert r["instructions"] == n * (c["cvt_pair_instructions"] + c["pack_pair_instructions"])


@pytest.mark.parametrize("n", [1, 5])
def test_plain_accesses_are_counted_by_memory_class_and_costed_by_batch(n):
    """n int4 copied global -> shared (a store waits for the load before it: n global round
    trips), then loaded back from shared memory as one batch ended by dev::chain()."""
    c = COSTS
    r = timed_selftest("plain_accesses", 1, n, 16)
    want = c["barrier_ns"] + n * (2 * ACCESS_NS + c["gmem_load_ns"]) + n * ACCESS_NS + c["smem_load_ns"]
    assert r["time_ns"] == pytest.approx(want + c["launch_ns"], rel=1e-12)
    assert r["plain"] == {"global": {"loads": n, "stores": 0, "load_bytes": 16 * n, "store_bytes": 0},
                          "shared": {"loads": n, "stores": n, "load_bytes": 16 * n, "store_bytes": 16 * n}}
    assert r["chains"] == 1


@pytest.mark.parametrize("n", [16, 64])
def test_a_lanes_plain_global_stores_take_the_request_path_ahead_of_its_bulk_store(n):
    """n plain global stores, then a bulk store from the same thread: the stores' n write
    requests (request_ns each) go through the SM's copy engine as one piece from the bulk
    store's issue on (settled there), so the bulk store's bytes start after them, not after its
    own issue; with request_ns 0 the stores take no engine time."""
    c = COSTS
    nbytes = 512
    quiet = timed_selftest("requests_then_store", 1, n, nbytes)
    costs = {**COSTS, "request_ns": 7.0}
    busy = timed_selftest("requests_then_store", 1, n, nbytes, costs=costs)
    assert busy["time_ns"] - quiet["time_ns"] == pytest.approx(n * 7.0 - c["issue_ns"], rel=1e-9)
    assert busy["plain"]["global"]["stores"] == n and busy["copies"] == quiet["copies"] == 1
    assert busy["engine_busy_ns"] - quiet["engine_busy_ns"] == pytest.approx(n * 7.0, rel=1e-9)


def test_plain_accesses_cost_nothing_and_count_nothing_with_timing_off():
    model.set_seed(7)
    before = model.stats()
    assert model.run_timing_selftest("plain_accesses", 1, 3, 16) is None
    assert model.timing_reports() == []
    quiet = {k: model.stats()[k] - before[k] for k in ("launches", "rounds", "switches", "copies")}
    model.set_seed(7)
    before = model.stats()
    timed_selftest("plain_accesses", 1, 3, 16)
    timed = {k: model.stats()[k] - before[k] for k in ("launches", "rounds", "switches", "copies")}
    assert quiet == timed  # the accessors never give way to the scheduler


# ---- shared resources: issue slots, device memory, L2 ---------------------------------------

# Work starts at t = 0 (no barrier cost), on a bucket's edge, so the issue calendar is exact.
ISSUE = {**COSTS, "barrier_ns": 0.0, "collective_ns": 0.0, "reconverge_ns": 0.0, "pair_instruction_ns": 0.0}


@pytest.mark.parametrize("warps", [1, 4, 5, 8])
def test_warps_bound_by_issue_share_their_schedulers(warps):
    """Every lane of `warps` warps widens m pairs (shift_pair_instructions each); warp w issues
    on scheduler w % 4, one instruction a cycle: the busiest scheduler's warps take their turns."""
    c, m = ISSUE, 50
    r = timed_selftest("issue_warps", 1, m, warps, ISSUE, threads=256)
    per_warp = m * c["shift_pair_instructions"]
    busiest = -(-warps // 4)  # warps on scheduler 0
    assert r["time_ns"] == pytest.approx(busiest * per_warp / c["sm_clock_ghz"] + c["launch_ns"], rel=1e-12)
    assert r["instructions"] == warps * per_warp  # a warp's lanes issue together: counted once


@pytest.mark.parametrize("warps,n", [(1, 7), (5, 6)])
def test_a_bounded_loops_vectors_cost_their_branches_latency_and_issue_slots(warps, n):
    """Every lane of `warps` warps names n vectors of a bounded loop (dev::PlainCode::kBoundedVector):
    each costs bounded_vector_ns on the thread, then its bounded_vector_instructions on the issue
    slots, a warp's lanes once; warps 0 and 4 share scheduler 0 and take their turns there."""
    c = ISSUE
    r = timed_selftest("bounded_vectors", 1, n, warps, c, threads=256)
    per_warp = n * c["bounded_vector_instructions"] / c["sm_clock_ghz"]
    busiest = -(-warps // 4)  # warps on scheduler 0
    if busiest == 1:
        want = n * (c["bounded_vector_ns"] + c["bounded_vector_instructions"] / c["sm_clock_ghz"])
        assert r["time_ns"] == pytest.approx(want + c["launch_ns"], rel=1e-12)
    else:  # the other warp's vectors take the same slots: later by at most all of its instructions
        alone = n * (c["bounded_vector_ns"] + c["bounded_vector_instructions"] / c["sm_clock_ghz"])
        assert alone <= r["time_ns"] - c["launch_ns"] <= alone + per_warp + 1e-9
    assert r["instructions"] == pytest.approx(warps * n * c["bounded_vector_instructions"], rel=1e-12)
    # without the constants a bounded loop's vectors cost nothing beyond their accesses and pairs
    none = {**c, "bounded_vector_ns": 0.0, "bounded_vector_instructions": 0.0}
    assert timed_selftest("bounded_vectors", 1, n, warps, none, threads=256)["time_ns"] == c["launch_ns"]


@pytest.mark.parametrize("m", [1, 2, 10, 50])
def test_a_lane_behind_its_warp_waits_for_the_warps_issue_not_for_its_latency_again(m):
    """Every lane of one warp widens m pairs, each pair its dependent latency (pair_instruction_ns
    per instruction) and then its issue slots: the lanes run side by side, m times one pair's
    latency and issue. A lane the schedule runs after the leading one waits for the warp's issue
    of each instruction, not for the leading lane's latency as well (it was 1.65 times that)."""
    c = {**ISSUE, "pair_instruction_ns": 1.0}
    r = timed_selftest("issue_warps", 1, m, 1, c, threads=256)
    per_pair = c["shift_pair_instructions"] * (c["pair_instruction_ns"] + 1 / c["sm_clock_ghz"])
    assert r["time_ns"] == pytest.approx(m * per_pair + c["launch_ns"], rel=1e-12)
    assert r["instructions"] == m * c["shift_pair_instructions"]


def _worker_end(spinner_thread: int, seed: int, costs: dict) -> float:
    model.set_seed(seed)
    r = timed_selftest("spin_beside", 2, 64, spinner_thread, costs, threads=256)
    return r["roles"][0]["end_ns"] * r["blocks"]  # block 1's warp 0 ends at 0


@pytest.mark.parametrize("seed", [0, 3])
def test_a_spinning_warp_slows_the_working_warp_of_its_scheduler_only(seed):
    """Warp 0 of block 0 widens 64 pairs; warp 4 (its scheduler) or warp 4 of block 1 polls a
    flag meanwhile, one turn of spin_instructions per poll_ns: half the scheduler."""
    c = {**ISSUE, "spin_instructions": 8.0, "poll_ns": 2.0}
    alone = 64 * c["shift_pair_instructions"] / c["sm_clock_ghz"] + c["release_ns"]  # then it releases the flag
    assert _worker_end(0, seed, c) == pytest.approx(alone, rel=1e-12)
    assert _worker_end(256 + 128, seed, c) == pytest.approx(alone, rel=1e-12)  # another SM
    beside = _worker_end(128, seed, c)
    pairs = alone - c["release_ns"]
    assert 1.25 * pairs < beside - c["release_ns"] <= 2 * pairs + 1e-9  # at most half the slots go to the spinner
    quiet = {**c, "spin_instructions": 0.0}
    assert _worker_end(128, seed, quiet) == pytest.approx(alone, rel=1e-12)


@pytest.mark.parametrize("n", [0, 3])
def test_a_diverged_warp_is_reported_by_its_paths_and_sampled_alike(n):
    """Thread 0 fences n times and arrives; lane 0 of warp 1 waits for that phase on the
    mbarrier, the warp's other 31 lanes at the __syncwarp after it, where the warp reconverges
    (reconverge_ns: one lane comes from a wait, the others not). The report groups warp 1's
    lanes by the sites they passed into those two paths, each with its exact times; ncu's warp
    sampling (shares.SAMPLED) counts the two paths alike, the busiest lane (shares.BUSIEST) only
    lane 0's mbarrier wait."""
    from tools.timing import shares

    c = COSTS
    r = timed_selftest("diverged_wait", 1, n, 16)
    arrived = c["barrier_ns"] + n * c["fence_gpu_ns"] + c["arrive_ns"]
    woken = arrived + c["wake_ns"]
    assert r["time_ns"] == pytest.approx(woken + c["reconverge_ns"] + c["launch_ns"], rel=1e-12)
    warp0, warp1 = r["roles"]
    assert [p["lanes"] for p in warp0["paths"]] == [32]  # one path: lane 0 works, the others are done
    assert warp0["paths"][0]["busy_ns"] == pytest.approx(arrived, rel=1e-12)
    paths = {p["lanes"]: p for p in warp1["paths"]}
    assert sorted(paths) == [1, 31] and all(p["blocks"] == 1 for p in paths.values())
    spinner, others = paths[1], paths[31]
    mbar_wait = woken - c["barrier_ns"] - c["try_wait_ns"]
    assert spinner["busy_ns"] == pytest.approx(c["barrier_ns"] + c["try_wait_ns"] + c["reconverge_ns"], rel=1e-12)
    assert [w.split(" (")[0] for w, _ in spinner["waits"]] == ["mbarrier wait"]
    assert spinner["waits"][0][1] == pytest.approx(mbar_wait, rel=1e-12)
    assert others["busy_ns"] == pytest.approx(c["barrier_ns"] + c["reconverge_ns"], rel=1e-12)
    assert [w.split(" (")[0] for w, _ in others["waits"]] == ["__syncwarp"]
    assert others["waits"][0][1] == pytest.approx(woken - c["barrier_ns"], rel=1e-12)
    for p in paths.values():
        assert p["end_ns"] == pytest.approx(woken + c["reconverge_ns"], rel=1e-12)
    assert warp1["waits"] == spinner["waits"]  # the warp's busiest lane is lane 0

    total = 2 * r["time_ns"]
    sampled = shares.model_shares(r, shares.SAMPLED)
    assert sampled == pytest.approx({
        "busy": (arrived + c["barrier_ns"] + c["reconverge_ns"] + c["try_wait_ns"] / 2) / total,
        shares.MBARRIER: mbar_wait / 2 / total, shares.SYNCWARP: (woken - c["barrier_ns"]) / 2 / total}, rel=1e-12)
    busiest = shares.model_shares(r, shares.BUSIEST)
    assert busiest == pytest.approx({"busy": (arrived + spinner["busy_ns"]) / total,
                                     shares.MBARRIER: mbar_wait / total}, rel=1e-12)


@pytest.mark.parametrize("n", [0, 3])
def test_a_warp_whose_every_lane_waits_meets_at_a_plain_collective(n):
    """The same phase waited for by every lane of warp 1 itself, then __syncwarp: the lanes come
    from the same wait, so the collective costs collective_ns, not reconverge_ns, and the warp is
    one path."""
    c = COSTS
    r = timed_selftest("converged_wait", 1, n, 16)
    woken = c["barrier_ns"] + n * c["fence_gpu_ns"] + c["arrive_ns"] + c["wake_ns"]
    assert r["time_ns"] == pytest.approx(woken + c["collective_ns"] + c["launch_ns"], rel=1e-12)
    diverged = timed_selftest("diverged_wait", 1, n, 16)
    assert diverged["time_ns"] - r["time_ns"] == pytest.approx(c["reconverge_ns"] - c["collective_ns"], rel=1e-9)
    warp1 = r["roles"][1]
    assert [p["lanes"] for p in warp1["paths"]] == [32]


@pytest.mark.parametrize("blocks", [1, 4])
def test_copies_from_many_sms_share_device_memory(blocks):
    """Each block's thread 0 bulk-loads n copies (issued at t = 0; the engines far faster than
    device memory): all bytes of all blocks through device memory take bytes / bandwidth."""
    n, nbytes = 4, 1024
    c = {**ISSUE, "arrive_ns": 0.0, "issue_ns": 0.0, "engine_load_bytes_per_ns": 1e6, "hbm_bytes_per_ns": 2.0}
    r = timed_selftest("load_stream", blocks, n, nbytes, c)
    total = blocks * n * nbytes
    want = total / c["hbm_bytes_per_ns"] + c["g2s_latency_ns"] + c["wake_ns"] + c["launch_ns"]
    assert r["time_ns"] == pytest.approx(want, rel=1e-12)
    assert r["hbm_bytes"] == total
    # All blocks read the same rows: the first block's stream in, the others' are re-reads.
    assert r["reads"]["stream"]["bytes"] == n * nbytes
    assert r["reads"]["reread"]["bytes"] == (blocks - 1) * n * nbytes
    # Re-reads served from L2: only the first block's bytes through device memory.
    hits = timed_selftest("load_stream", blocks, n, nbytes, {**c, "l2_hit_reread": 1.0})
    assert hits["hbm_bytes"] == n * nbytes
    assert hits["reads"]["reread"]["l2_bytes"] == (blocks - 1) * n * nbytes


def test_plain_loads_cost_the_latency_of_their_traffic_class():
    """n int4 loaded from global memory one at a time: the first of each 64-byte unit (the
    classes' grain) streams from device memory (gmem_load_ns), the others re-read a unit just
    read (l2_load_ns)."""
    c, n = {**COSTS, "l2_hit_reread": 1.0}, 9
    r = timed_selftest("plain_accesses", 1, n, 16, c)
    firsts = len(range(0, n, 4))
    loads = firsts * c["gmem_load_ns"] + (n - firsts) * c["l2_load_ns"]
    want = c["barrier_ns"] + 2 * n * ACCESS_NS + loads + n * ACCESS_NS + c["smem_load_ns"]
    assert r["time_ns"] == pytest.approx(want + c["launch_ns"], rel=1e-12)
    assert r["reads"]["stream"]["bytes"] == 16 * firsts and r["reads"]["reread"]["l2_bytes"] == 16 * (n - firsts)


def test_bad_cost_tables_are_refused_by_name():
    with pytest.raises(ValueError, match="timing constant wake_ns is missing"):
        model.set_timing({k: v for k, v in COSTS.items() if k != "wake_ns"})
    with pytest.raises(ValueError, match="unknown timing constant wake"):
        model.set_timing({**COSTS, "wake": 1.0})
    with pytest.raises(ValueError, match="engine_store_bytes_per_ns must be finite and > 0"):
        model.set_timing({**COSTS, "engine_store_bytes_per_ns": 0.0})
    model.set_timing(None)


# ---- the kernels, timed ---------------------------------------------------------------------

SMALL = dict(world_size=2, hidden=4096, tokens=128, topk=4, experts=8)


def _call_pair(group, xs, idxs, seed: int):
    """dispatch + combine at model seed `seed`: (outputs, the model's counts of the pair)."""
    model.set_seed(seed)
    before = model.stats()
    res = group.dispatch(xs, idxs, num_sms=2)
    outs = [r.tokens.float().mul(0.5).to(r.tokens.dtype) for r in res]
    ys = group.combine(outs, [r.handle for r in res], num_sms=2)
    group.synchronize()
    after = model.stats()
    counts = {k: after[k] - before[k] for k in ("launches", "rounds", "switches", "copies", "idle_rounds")}
    return [r.tokens for r in res] + [r.probs for r in res] + ys, counts


@pytest.fixture(scope="module")
def small_group():
    from hybrid_ep.backends.cuda.emulation import EmulatedGroup
    from hybrid_ep.synthetic import iter_rank_routings

    W, T, H = SMALL["world_size"], SMALL["tokens"], SMALL["hidden"]
    # The receive path: the kernels of the calibration points (emulation's default is direct).
    group = EmulatedGroup(W, H, T, SMALL["experts"], device=torch.device("cpu"), data_path="receive")
    idxs = list(iter_rank_routings("uniform", [T] * W, SMALL["experts"], SMALL["topk"], 0))
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(T, H, generator=gen).to(torch.bfloat16) for _ in range(W)]
    yield group, xs, idxs
    group.close()


def test_timing_changes_nothing_the_model_does(small_group):
    """Timing runs the model unweakened (scheduler.cpp: the times are the GPU's behaviour, which
    the weakenings only sample), so the plain pair it is compared with runs unweakened too."""
    group, xs, idxs = small_group
    weakenings = model.weakenings()
    try:
        for name in weakenings:
            model.set_weakening(name, False)
        plain, plain_counts = _call_pair(group, xs, idxs, seed=5)
    finally:
        for name, on in weakenings.items():
            model.set_weakening(name, on)
    model.set_timing([constants.load_table().costs(), COSTS])
    try:
        timed, timed_counts = _call_pair(group, xs, idxs, seed=5)
        reports = model.timing_reports()
    finally:
        model.set_timing(None)
    assert timed_counts == plain_counts  # the same schedule, round for round
    for a, b in zip(plain, timed):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert [r["table"] for r in reports] == [0, 1] * 3  # count, dispatch, combine: a report per table
    assert model.timing_reports() == []
    # The hot loops' accessors, counted alike under both tables: the source side of combine
    # writes every token's row of y (bf16) to global memory through them, the expert host's and
    # the source's reducers read their stages from shared memory.
    W, T, H = SMALL["world_size"], SMALL["tokens"], SMALL["hidden"]
    combine = reports[4]
    assert combine["plain"] == reports[5]["plain"]
    assert combine["plain"]["global"]["store_bytes"] == W * T * H * 2
    assert combine["plain"]["shared"]["load_bytes"] > 0 and combine["plain"]["shared"]["loads"] > 0


def _kernel_times(group, xs, idxs, seed: int, costs: dict) -> list[float]:
    model.set_timing(costs)
    try:
        _call_pair(group, xs, idxs, seed)
        return [r["time_ns"] for r in model.timing_reports()]
    finally:
        model.set_timing(None)


@pytest.mark.slow  # the full tier (scripts/test.sh --full): every seed of a timed job
def test_clocks_are_the_same_per_seed_and_nearly_the_same_for_every_seed(small_group):
    """Which phase, flag value, bulk group or earlier atomic ends each wait is the kernels'
    program order, not the schedule's; only an SM's copy engine places a copy among the ones
    it knows of when the copy's time is needed, which the schedule decides (timing.h). So the
    times are equal for every seed when the engine is too fast to queue on, and otherwise
    within 5 % at this small shape (at most 3.3 % measured over seeds 0-3 with the tables
    tried on 2026-11-25; 1.0 % at the calibration shape W=2, H=8192, T=512, 1-4 SMs per rank)."""
    group, xs, idxs = small_group
    costs = constants.load_table().costs()
    by_seed = [_kernel_times(group, xs, idxs, seed, costs) for seed in (0, 1, 2, 3)]
    assert _kernel_times(group, xs, idxs, 0, costs) == by_seed[0]
    for kernel in range(3):
        times = [t[kernel] for t in by_seed]
        assert max(times) <= 1.05 * min(times), times
    # Nothing queues (no engine, no issue slots, no spinning) and every traffic class alike.
    unqueued = {**costs, "engine_load_bytes_per_ns": 1e9, "engine_store_bytes_per_ns": 1e9, "hbm_bytes_per_ns": 1e12,
                "access_instructions": 0.0,
                "cvt_pair_instructions": 0.0, "shift_pair_instructions": 0.0, "pack_pair_instructions": 0.0,
                "spin_instructions": 0.0, "l2_hit_written": 0.0, "l2_hit_reread": 0.0, "request_ns": 0.0}
    assert len({tuple(_kernel_times(group, xs, idxs, seed, unqueued)) for seed in (0, 1, 2, 3)}) == 1


def test_each_report_accounts_for_every_nanosecond(small_group):
    """A thread's clock is its busy time plus its waits; the critical path runs from the
    launch's start to the last thread's end; so both add up to the kernel's time."""
    group, xs, idxs = small_group
    costs = constants.load_table().costs()
    model.set_timing(costs)
    try:
        _call_pair(group, xs, idxs, seed=1)
        reports = model.timing_reports()
    finally:
        model.set_timing(None)
    for r in reports:
        assert sum(ns for _, ns in r["critical_path"]) == pytest.approx(r["time_ns"] - costs["launch_ns"], rel=1e-9)
        assert max(r["block_end_ns"]) == pytest.approx(r["time_ns"] - costs["launch_ns"], rel=1e-9)
        for role in r["roles"]:
            assert role["busy_ns"] + sum(ns for _, ns in role["waits"]) == pytest.approx(role["end_ns"], rel=1e-9)
            # every lane in one path of its warp, each path's time accounted for alike
            assert sum(p["lanes"] for p in role["paths"]) == 32 * r["blocks"]
            for p in role["paths"]:
                assert p["busy_ns"] + sum(ns for _, ns in p["waits"]) == pytest.approx(p["end_ns"], rel=1e-9)
    dispatch, combine = reports[1], reports[2]
    assert dispatch["copies"] > 0 and 0 < dispatch["engine_busy_ns"] < dispatch["time_ns"]
    assert len(combine["roles"]) == combine["threads"] // 32
    sites = {w for role in combine["roles"] for w, _ in role["waits"]}
    assert any(w.startswith("__syncthreads (skeleton.cuh:") for w in sites), sites  # the warps' end (roles_done)


# ---- predictions at the bench's points ------------------------------------------------------


def test_a_prediction_is_the_line_through_the_model_runs():
    assert predict.extrapolate(512, 10.0, 1024, 18.0, 4096) == pytest.approx(66.0)
    assert predict.extrapolate(512, 10.0, 512, 10.0, 4096) == 10.0


@pytest.mark.parametrize("concurrent", [False, True])
def test_predict_reads_each_table_off_the_line_through_its_runs(concurrent):
    """The runs at the two token counts, made one after the other or at once, give per table
    and point the value on the line through them."""
    def run_job(job):
        t = job["tokens"]
        return {"runs": [{"sms": s, **{k: {"launches": [{"table": i, "time_ns": (i + 1) * t / s + (k == "combine")}
                                                         for i in range(len(job["costs"]))]}
                                       for k in predict.KERNELS}} for s in job["sms"]]}

    shape = predict.Shape(2, 1, 64, 4096, 2, 4)
    ns = predict.predict(run_job, shape, [1, 2], [{}, {}], (512, 1024), concurrent=concurrent)
    assert ns[(1, "dispatch")] == pytest.approx([4096.0, 8192.0])
    assert ns[(2, "combine")] == pytest.approx([2049.0, 4097.0])


def test_the_count_kernel_from_a_run_at_the_benchs_tokens_replaces_the_lines():
    """--count-run: one dispatch call at the bench's tokens (one SM per rank, dispatch only) gives
    the count kernel's time per table; it replaces the line's in every SM count, and each dispatch
    call's time moves by the difference."""
    jobs = []

    def run_job(job):
        jobs.append(job)
        return {"runs": [{"sms": 1, "dispatch": {"launches": [
            {"kernel": "count", "table": i, "time_ns": 100.0 + i} for i in range(len(job["costs"]))] + [
            {"kernel": "dispatch_direct", "table": i, "time_ns": 5e6} for i in range(len(job["costs"]))]}}]}

    shape = predict.Shape(8, 1, 7168, 4096, 8, 256)
    count = predict.count_run(run_job, shape, [{}, {}], payload=False)
    assert count == [100.0, 101.0]
    assert jobs[0]["tokens"] == 4096 and jobs[0]["sms"] == [1] and jobs[0]["dispatch_only"] is True
    assert jobs[0]["payload"] is False
    line = {(s, "dispatch"): [90.0 + 1000 * s, 95.0 + 1000 * s] for s in (1, 2)}
    line |= {(s, "dispatch", "count"): [90.0, 95.0] for s in (1, 2)}
    line |= {(s, "dispatch", "dispatch_direct"): [1000.0 * s] * 2 for s in (1, 2)}
    line |= {(s, "combine"): [7.0, 7.0] for s in (1, 2)}
    got = predict.with_count(line, count)
    assert got[(2, "dispatch", "count")] == [100.0, 101.0]
    assert got[(2, "dispatch")] == pytest.approx([2100.0, 2101.0])
    assert got[(1, "dispatch", "dispatch_direct")] == [1000.0, 1000.0] and got[(1, "combine")] == [7.0, 7.0]


def test_builds_name_what_a_commits_kernels_ran_in_the_commits_own_text(tmp_path):
    """An annotation replaces its text where a tree holds it once, and names what it applied;
    a tree without it is left as it is; a text found twice is an error, not a guess."""
    from tools.timing import builds

    a = builds.Annotation("x load", "k/a.cuh", "v = p[i];", "v = dev::ld(&p[i]);", ("0000000",))
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "a.cuh").write_text("int f() {\n  v = p[i];\n}\n")
    assert builds.annotate(str(tmp_path), (a,)) == ["x load"]
    assert (tmp_path / "k" / "a.cuh").read_text() == "int f() {\n  v = dev::ld(&p[i]);\n}\n"
    assert builds.annotate(str(tmp_path), (a,)) == []  # named already: nothing left to name
    (tmp_path / "k" / "a.cuh").write_text("v = p[i]; v = p[i];")
    with pytest.raises(ValueError, match="2 times"):
        builds.annotate(str(tmp_path), (a,))


def test_each_annotation_names_the_text_of_the_commits_it_was_written_for():
    """Each annotation's text is, once, in the file of every commit it names (8568e22: the kernels
    the 2026-11-27 H200 run measured; 1ab8f84: the bounded loop as the kernels have it since
    ee97d05), so a build of those commits prices what they ran."""
    from tools.timing import builds

    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                             text=True)
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("needs the repository's whole history")
    assert {a.name for a in builds.ANNOTATIONS} >= {"fp8 scale loads", "bounded loop's vectors"}
    for a in builds.ANNOTATIONS:
        for commit in a.seen_in:
            text = subprocess.run(["git", "show", f"{commit}:{a.path}"], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout
            assert text.count(a.old) == 1, (a.name, commit)
            assert a.new.count("dev::") > a.old.count("dev::"), a.name  # it names, through the device layer


def test_a_prediction_says_each_kernel_and_validate_scores_each():
    """A call's time is its launches'; each kernel's part is kept under the bench's kernel names,
    and validate scores the dispatch kernel alone where the measured row has kernels_ms."""
    result = {"runs": [{"sms": 2, "dispatch": {"launches": [
                            {"table": 0, "kernel": "count", "time_ns": 3e5},
                            {"table": 0, "kernel": "dispatch_receive", "time_ns": 5e6}]},
                        "combine": {"launches": [{"table": 0, "kernel": "combine_receive", "time_ns": 7e6}]}}]}
    ns = predict.call_times(result, 1)
    assert ns[(2, "dispatch")] == [5.3e6] and ns[(2, "dispatch", "count")] == [3e5]
    kernels = report.kernels_ms(ns, 2)
    assert kernels == {"combine": {"combine_receive_kernel": 7.0},
                       "dispatch": {"dispatch_receive_kernel": 5.0, "count_kernel": 0.3}}
    row = {"world_size": 8, "nodes": 1, "sms_per_rank": 2, "data_path": "receive", "dispatch_ms": 5.3,
           "combine_ms": 7.0, "kernels_ms": kernels}
    measured = {"metadata": {"config": {"nodes": 1}},
                "runs": [{"world_size": 8, "nodes": 1, "sms_per_rank": 2, "dispatch_ms": 10.6, "combine_ms": 7.0,
                          "kernels_ms": {"dispatch": {"count_kernel": 0.6, "dispatch_receive_kernel": 5.0}}}]}
    rows = report.compare({"metadata": {"config": {"nodes": 1}}, "runs": [row]}, measured)
    ratios = {r["kernel"]: r["ratio"] for r in rows}
    assert ratios == {"dispatch": pytest.approx(0.5), "combine": 1.0, "dispatch_receive_kernel": 1.0,
                      "count_kernel": pytest.approx(0.5)}
    count_only = {k: v for k, v in row.items() if k not in ("dispatch_ms", "combine_ms")}  # timing_layout.py's rows
    rows = report.compare({"metadata": {"config": {"nodes": 1}}, "runs": [count_only]}, measured)
    assert [r["kernel"] for r in rows] == ["count_kernel", "dispatch_receive_kernel"]


def _count_instructions(t: dict, K: int, W: int, N: int, tokens: int, blocks: int) -> float:
    """The count kernel's warp instructions, `tokens` tokens on each block: per tile of the tally
    warps (COUNT_TALLY_WARPS, 32 tokens each) every warp that holds a token issues the tile's
    blocks of plain code (dev::plain_code) with the table's counts, and the scan one pass (its
    E + W + N columns, at most 32, on lanes of warp 0)."""
    per_warp = (t["count_tile_instructions"] + K * t["count_route_instructions"]
                + K * (K - 1) // 2 * t["count_route_pair_instructions"] + W * t["count_dest_instructions"]
                + N * t["count_node_instructions"])
    tile = 32 * model.COUNT_TALLY_WARPS
    starts = range(0, tokens, tile)
    warps = sum(min(model.COUNT_TALLY_WARPS, -(-(tokens - start) // 32)) for start in starts)
    return blocks * (warps * per_warp + len(starts) * t["count_scan_column_instructions"])


def test_a_dispatch_only_job_times_the_count_kernel_as_the_full_job_does():
    """scripts/timing_layout.py's one dispatch: the count launch takes the time it takes in the
    measured dispatch of a full job (its flow control waits for nothing the model costs; the
    waits by site follow the schedule, which differs), and it counts the tile loop's
    instructions: the counts of the SASS in the table, and the table's whatever they are (a
    second table with other counts, in the same run)."""
    from tools.timing import driver

    shape = predict.Shape(world_size=2, nodes=1, hidden=256, tokens=96, topk=4, experts=8)
    table = constants.load_table(constants.H200).costs()
    other = {**table, "count_tile_instructions": 1000.0, "count_route_instructions": 10.0,
             "count_route_pair_instructions": 1.0, "count_dest_instructions": 100.0,
             "count_node_instructions": 10000.0, "count_scan_column_instructions": 7.0}
    full = driver.run_job(predict.job(shape, shape.tokens, [1], [table], payload=False))
    only = driver.run_job({**predict.job(shape, shape.tokens, [1], [table, other], payload=False),
                           "dispatch_only": True})
    (run,) = only["runs"]
    assert set(run) == {"sms", "dispatch", "peak_rss_mb"}
    count, count_other = sorted((x for x in run["dispatch"]["launches"] if x["kernel"] == "count"),
                                key=lambda x: x["table"])
    (want,) = [x for x in full["runs"][0]["dispatch"]["launches"] if x["kernel"] == "count"]
    assert (count["time_ns"], count["instructions"]) == (want["time_ns"], want["instructions"])
    # one tile (96 tokens: 3 of the tally warps hold tokens) on each of 2 blocks, K = 4, W = 2, N = 1:
    # with the SASS counts 477 + 104 K + 5 K (K - 1) / 2 + 31 W + 9 N per warp, and 131 for the scan's pass
    assert [table[f"count_{n}_instructions"] for n in ("tile", "route", "route_pair", "dest", "node", "scan_column")] \
        == [477, 104, 5, 31, 9, 131]
    assert count["instructions"] == _count_instructions(table, 4, 2, 1, 96, blocks=2) == 2 * (3 * 994 + 131)
    assert count_other["instructions"] == _count_instructions(other, 4, 2, 1, 96, blocks=2) == 2 * (3 * 11246 + 7)


def test_predict_then_validate(tmp_path, capsys):
    out = tmp_path / "pred"
    assert timing_cli.main(["predict", "--emulate", "2", "--hidden", "1024", "--tokens", "256", "--topk", "2",
                            "--experts", "4", "--sms", "1", "--model-tokens", "32", "64", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("PREDICTED by the timing model")
    with open(out / "predicted.json") as f:
        doc = json.load(f)
    assert doc["predicted"] is True and doc["metadata"]["tool"] == "python -m tools.timing predict"
    assert all("predicted" in doc["metadata"]["units"][k] for k in ("dispatch_ms", "combine_ms"))
    assert numbers_without_units(doc) == set()
    (row,) = doc["runs"]
    assert row["model_tokens"] == [32, 64] and row["recv_rows"] > 0 and row["dispatch_ms"] > 0
    assert row["data_path"] == doc["metadata"]["config"]["data_path"] == "direct"  # the bench's on one node
    # the direct path writes one row per route: the table's store rate x rows received / routes bounds it
    store = doc["constants"]["engine_store_bytes_per_ns"]["value"]
    assert row["dispatch_write_ceiling_gbps_per_sm"] == pytest.approx(store * row["recv_rows"] / row["out_rows"])
    assert row["dispatch_written_gbps_per_sm"] == pytest.approx(
        row["dispatch_dest_gbps_per_sm"] * row["out_rows"] / row["recv_rows"])
    assert printed.splitlines()[1].split()[8] == "ceiling"
    assert float(printed.splitlines()[2].split()[6]) == pytest.approx(row["dispatch_write_ceiling_gbps_per_sm"],
                                                                      abs=0.05)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert doc["metadata"]["config"]["commit"] == (head or None)
    assert doc["constants"]["wake_ns"]["source"] == constants.load_table().constants["wake_ns"].source
    shape = {k: doc["metadata"]["config"][k] for k in ("hidden", "tokens_per_rank", "topk", "experts", "dtype",
                                                        "routing", "reducer_warps")}  # the variant run
    measured = {"metadata": {"config": {"nodes": 1, **shape}},
                "runs": [{"world_size": 2, "nodes": 1, "sms_per_rank": 1, "dispatch_ms": row["dispatch_ms"] * 2,
                          "combine_ms": row["combine_ms"] / 4}]}
    # a measured row that names no data path ran the receive path's kernels: not this prediction's
    (tmp_path / "emulated.json").write_text(json.dumps(measured))
    assert timing_cli.main(["validate", str(out / "predicted.json"), str(tmp_path / "emulated.json")]) == 2
    assert "no point of" in capsys.readouterr().err
    measured["runs"][0]["data_path"] = "direct"
    (tmp_path / "emulated.json").write_text(json.dumps(measured))
    assert timing_cli.main(["validate", str(out / "predicted.json"), str(tmp_path / "emulated.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1].startswith("worst: combine at W=2, 1 node(s), 1 SMs/rank, direct path: predicted / measured 4.00")
    assert lines[2].split()[-1] == "0.50" and lines[2].split()[3] == "direct"  # dispatch at half the measured time
    # measured numbers are never taken for predictions, nor the other way round; nor other shapes compared
    assert timing_cli.main(["validate", str(tmp_path / "emulated.json"), str(out / "predicted.json")]) == 2
    measured["metadata"]["config"]["hidden"] = 8192
    (tmp_path / "emulated.json").write_text(json.dumps(measured))
    assert timing_cli.main(["validate", str(out / "predicted.json"), str(tmp_path / "emulated.json")]) == 2
    assert "hidden 1024 against 8192" in capsys.readouterr().err
    # nor a run of another variant of the kernels (HYBRID_EP_REDUCER_WARPS); a variant named as
    # the default is the default
    made = shape["reducer_warps"] or launch.REDUCER_WARPS_NARROW  # None: the default
    other = next(w for w in launch.REDUCER_WARPS if w != made)
    measured["metadata"]["config"].update(hidden=1024, reducer_warps=other)
    (tmp_path / "emulated.json").write_text(json.dumps(measured))
    assert timing_cli.main(["validate", str(out / "predicted.json"), str(tmp_path / "emulated.json")]) == 2
    assert f"reducer_warps {made} against {other}" in capsys.readouterr().err
    measured["metadata"]["config"].update(reducer_warps=made, reducer_wait="observe")
    (tmp_path / "emulated.json").write_text(json.dumps(measured))
    assert timing_cli.main(["validate", str(out / "predicted.json"), str(tmp_path / "emulated.json")]) == 0


def _committed_predictions():
    """(name, path) of every predicted JSON under benchmarks/results/predicted-*/ (one per variant and shape)."""
    root = os.path.join(REPO, "benchmarks", "results")
    for folder in sorted(os.listdir(root)):
        if folder.startswith("predicted-"):
            for name in sorted(os.listdir(os.path.join(root, folder))):
                if name.endswith(".json"):
                    yield f"{folder}/{name}", os.path.join(root, folder, name)


def test_no_committed_prediction_passes_the_ceiling_its_writes_put_on_the_dispatch():
    """A dispatch writes every row it hands out through its SMs' store path: at the table's
    store rate, rows received / rows written bounds its GB/s per SM whatever its schedule. A
    model that predicts past it prices a store below what the microbenchmarks measured."""
    from hybrid_ep.traffic.model import dispatch_rows_written, write_ceiling_gbps_per_sm

    checked = 0
    for name, path in _committed_predictions():
        with open(path) as f:
            doc = json.load(f)
        if not doc.get("predicted") or "engine_store_bytes_per_ns" not in doc.get("constants", {}):
            continue
        store = doc["constants"]["engine_store_bytes_per_ns"]["value"]
        for row in doc["runs"]:
            data_path = row.get("data_path", doc["metadata"]["config"].get("data_path", report.RECEIVE))
            written = dispatch_rows_written(data_path, row["recv_rows"], row["out_rows"], row.get("rdma_rows") or 0)
            ceiling = write_ceiling_gbps_per_sm(store, row["recv_rows"], written)
            assert row["dispatch_dest_gbps_per_sm"] < ceiling, (name, row["sms_per_rank"], ceiling)
            checked += 1
    assert checked >= 68  # the points of every committed prediction (predicted-8dc6462: 20 files of 2)


def test_the_table_names_the_model_tokens_given_or_the_default_rule():
    config = {"nodes": 1, "constants_file": "h100.json", "world_sizes": [2, 8], "device_modelled": "H100",
              "hidden": 8192, "tokens_per_rank": 4096, "topk": 8, "experts": 16, "dtype": "bf16",
              "routing": "uniform", "data_path": "receive"}
    for given, shown in (([256, 512], "T = 256/512 per rank"),
                         ("256/512 for W > 4, else 512/1024", "T = 256/512 for W > 4, else 512/1024 per rank")):
        first = report.format_predicted({"metadata": {"config": {**config, "model_tokens": given}}, "runs": []})
        assert shown in first.splitlines()[0] and first.splitlines()[0].endswith("| receive path")


def test_predict_runs_the_direct_path_across_nodes_by_default(tmp_path):
    """Across nodes the bench takes the direct path (rail peers forward over NVLink into final
    rows): the model predicts that path's kernels, and the receive path's on request."""
    shape = ["--emulate", "4", "--emulate-nodes", "2", "--hidden", "256", "--tokens", "128", "--topk", "2",
             "--experts", "8", "--sms", "1", "--model-tokens", "32", "64"]
    kernels = {}
    for path in ("direct", "receive"):
        out = tmp_path / path
        assert timing_cli.main(["predict", *shape, "--out", str(out)] +
                               (["--data-path", path] if path == "receive" else [])) == 0
        doc = json.loads((out / "predicted.json").read_text())
        assert (doc["metadata"]["config"]["data_path"], doc["metadata"]["config"]["nodes"]) == (path, 2)
        (run,) = doc["runs"]
        assert run["data_path"] == path and run["dispatch_ms"] > 0 and run["combine_ms"] > 0
        assert run["rdma_rows"] > 0 and numbers_without_units(doc) == set()  # the rows crossing nodes too
        kernels[path] = set(run["kernels_ms"]["dispatch"]) | set(run["kernels_ms"]["combine"])
    assert kernels["direct"] == {"count_kernel", "dispatch_direct_kernel", "combine_direct_kernel"}
    assert {"dispatch_receive_kernel", "combine_receive_kernel"} <= kernels["receive"]


def test_predict_with_posted_puts_is_a_clusters_prediction(tmp_path, capsys):
    """--posted-puts prices the puts between nodes as NICs do: the rows carry the RDMA rows and
    their GB/s per SM, and no emulated run (whose lanes copy the puts) scores it."""
    shape = ["--emulate", "4", "--hidden", "256", "--tokens", "128", "--topk", "2", "--experts", "8", "--sms", "1",
             "--model-tokens", "32", "64", "--posted-puts"]
    assert timing_cli.main(["predict", *shape, "--out", str(tmp_path / "one")]) == 2
    assert "--emulate-nodes > 1" in capsys.readouterr().err
    out = tmp_path / "two"
    assert timing_cli.main(["predict", *shape, "--emulate-nodes", "2", "--out", str(out)]) == 0
    assert "puts posted as a cluster's NIC" in capsys.readouterr().out
    doc = json.loads((out / "predicted.json").read_text())
    assert doc["metadata"]["config"]["posted_puts"] is True
    (run,) = doc["runs"]
    assert run["rdma_rows"] > 0
    assert run["dispatch_rdma_gbps_per_sm"] == pytest.approx(
        run["rdma_rows"] * 2 * 256 / (run["dispatch_ms"] * 1e-3) / 4 / 1e9)
    measured = {"metadata": {"config": dict(doc["metadata"]["config"])}, "runs": [dict(run)]}
    (tmp_path / "emulated.json").write_text(json.dumps(measured))
    assert timing_cli.main(["validate", str(out / "predicted.json"), str(tmp_path / "emulated.json")]) == 2
    assert "predicts a cluster" in capsys.readouterr().err


def test_profile_refuses_posted_puts_without_nodes():
    script = os.path.join(REPO, "scripts", "timing_calibration.py")
    done = subprocess.run([sys.executable, script, "profile", "HEAD", "--posted-puts"], capture_output=True,
                          text=True, cwd=REPO)
    assert done.returncode == 2 and "--nodes > 1" in done.stderr


def test_the_fit_finds_the_constants_of_a_linear_model():
    """Predicted times are piecewise linear in the constants; on a linear stand-in for the
    model the fit must come back to the values that made the measurements."""
    truth = {"wake_ns": 900.0, "pair_instruction_ns": 12.0}

    def evaluate(tables):
        return [{(1, "combine"): 5.0 + 0.02 * t["wake_ns"] + 1.5 * t["pair_instruction_ns"],
                 (1, "dispatch"): 2.0 + 0.01 * t["wake_ns"] + 0.1 * t["pair_instruction_ns"],
                 (2, "combine"): 3.0 + 0.01 * t["wake_ns"] + 0.8 * t["pair_instruction_ns"]} for t in tables]

    measured = evaluate([truth])[0]
    start = {"wake_ns": 400.0, "pair_instruction_ns": 10.0}
    result = fit.fit(evaluate, ("wake_ns", "pair_instruction_ns"), start, measured)
    assert result.values["wake_ns"] == pytest.approx(900.0, rel=0.05)
    assert result.values["pair_instruction_ns"] == pytest.approx(12.0, rel=0.05)
    assert result.score < 0.01


# ---- the warps' time beside ncu's stall samples ----------------------------------------------

NCU_LINES = """ncu_source_lines.tmp samples 1000
   60.0%  k.cuh:12  if (sh.abort) return;  [barrier 100%]
   15.0%  state.cuh:7  if (dev::mbar_try_wait(bar, parity)) return true;  [long_sb 85%]
    5.0%  state.cuh:3  if ((spin & 63) == 0) {  [branch_resolving 68%]
    4.0%  sm_30_intrinsics.hpp:110  return __nvvm_bar_warp_sync(mask);  [branch_resolving 85%]
    3.0%  k.cuh:11  __syncthreads();  [branch_resolving 80%]
    2.0%  state.cuh:1  return dev::ld_volatile(flag) != 0;  [long_sb 47%]
    1.0%  k.cuh:5  __syncthreads();  [branch_resolving 80%]
"""
STATE_CUH = """__device__ bool aborted(const int* flag) {
}
__device__ inline bool wait_at_least(const int* f) {
  spin;
}
__device__ inline bool mbar_wait(uint64_t* bar) {
  if (dev::mbar_try_wait(bar, parity)) return true;
}
"""


def test_ncu_lines_are_put_in_the_categories_of_their_functions():
    """Each line goes to the wait loop it is in at the measured commit (not to its text: the two
    loops' lines read alike), the parked warps' line and the last __syncthreads to one category,
    an earlier __syncthreads and what the top lines leave out to `other`."""
    from tools.timing import shares

    lines = shares.read_ncu_lines(NCU_LINES)
    assert lines[1] == (0.15, "state.cuh", 7, "if (dev::mbar_try_wait(bar, parity)) return true;", "long_sb 85%")
    got = shares.ncu_shares(lines, lambda base: STATE_CUH if base == "state.cuh" else None)
    assert got == pytest.approx({shares.AFTER_LAST: 0.63, shares.MBARRIER: 0.15, shares.FLAG: 0.05,
                                 shares.SYNCWARP: 0.04, shares.ABORT: 0.02, shares.OTHER: 0.11})
    with pytest.raises(ValueError, match="no stall-sample lines"):
        shares.read_ncu_lines("nothing here\n")


def test_model_shares_beside_ncu_differ_by_points():
    """A launch's report of 2 warp roles x 100 ns: the longest-waited __syncthreads is the
    parked warps' share; the comparison gives both shares per category and their sum of the
    waits on other warps (a report without paths: each warp by its busiest lane)."""
    from tools.timing import shares

    report = {"time_ns": 100.0, "roles": [
        {"busy_ns": 20.0, "waits": [("__syncthreads (k.cuh:11)", 70.0), ("mbarrier wait (s.cuh:7)", 10.0)]},
        {"busy_ns": 30.0, "waits": [("__syncthreads (k.cuh:5)", 5.0), ("mbarrier wait (s.cuh:9)", 40.0),
                                    ("__syncwarp (s.cuh:2)", 25.0)]}]}
    model = shares.model_shares(report)
    assert model == pytest.approx({"busy": 0.25, shares.AFTER_LAST: 0.35, "__syncthreads (other)": 0.025,
                                   shares.MBARRIER: 0.25, shares.SYNCWARP: 0.125})
    ncu = {shares.AFTER_LAST: 0.30, shares.MBARRIER: 0.10, shares.FLAG: 0.0, shares.SYNCWARP: 0.05,
           shares.ABORT: 0.05, shares.OTHER: 0.5}
    rows = shares.compare(model, ncu)
    assert [r[0] for r in rows] == [shares.AFTER_LAST, shares.MBARRIER, shares.FLAG, shares.SYNCWARP,
                                    shares.WAITING_ON_WARPS]
    assert rows[1][1:] == pytest.approx((0.25, 0.10)) and rows[4][1:] == pytest.approx((0.375, 0.20))
    text = shares.format_comparison("k", rows)
    assert "+15.0  over 10 points" in text and "+5.0\n" in text


def test_a_warp_of_several_paths_counts_each_path_of_each_block_alike():
    """Two warp roles x 100 ns. Role 0's lanes took two paths in both blocks (lane 0 waiting on
    an mbarrier, 31 lanes at a __syncwarp), and a third in one block only: each (block, path)
    pair counts alike, 2 + 2 + 1 of 5. Role 1 has one path: its busiest lane, as before."""
    from tools.timing import shares

    parked = [("__syncthreads (k.cuh:11)", 50.0)]
    report = {"time_ns": 100.0, "roles": [
        {"busy_ns": 10.0, "waits": [("mbarrier wait (s.cuh:7)", 80.0)], "paths": [
            {"lanes": 2, "blocks": 2, "busy_ns": 10.0, "end_ns": 90.0, "waits": [("mbarrier wait (s.cuh:7)", 80.0)]},
            {"lanes": 61, "blocks": 2, "busy_ns": 5.0, "end_ns": 90.0, "waits": [("__syncwarp (s.cuh:2)", 85.0)]},
            {"lanes": 1, "blocks": 1, "busy_ns": 90.0, "end_ns": 90.0, "waits": []}]},
        {"busy_ns": 40.0, "waits": parked, "paths": [
            {"lanes": 64, "blocks": 2, "busy_ns": 40.0, "end_ns": 90.0, "waits": parked}]}]}
    got = shares.model_shares(report)
    assert got == pytest.approx({"busy": (0.4 * 10 + 0.4 * 5 + 0.2 * 90 + 40) / 200, shares.AFTER_LAST: 50 / 200,
                                 shares.MBARRIER: 0.4 * 80 / 200, shares.SYNCWARP: 0.4 * 85 / 200})
    assert shares.model_shares(report, shares.BUSIEST) == pytest.approx(
        {"busy": 50 / 200, shares.AFTER_LAST: 50 / 200, shares.MBARRIER: 80 / 200})
    without = {"time_ns": 100.0, "roles": [{k: v for k, v in role.items() if k != "paths"} for role in report["roles"]]}
    assert shares.model_shares(without) == shares.model_shares(report, shares.BUSIEST)  # older reports
    with pytest.raises(ValueError, match="count is"):
        shares.model_shares(report, "lane 0")


def test_the_lines_through_a_grid_give_a_linear_models_values_between_its_tables():
    """fit-grid and score-grid read predictions off per-point lines through a grid of tables:
    on a linear stand-in they are exact, with no residual, and the fit's minimum is the truth."""
    import itertools

    names = ("wake_ns", "gmem_load_ns")

    def model(t):
        return {(1, "combine"): 5.0 + 0.02 * t["wake_ns"] + 0.003 * t["gmem_load_ns"],
                (1, "dispatch"): 2.0 + 0.01 * t["wake_ns"] + 0.001 * t["gmem_load_ns"]}

    grid = [{"wake_ns": 1000.0 * 2.0 ** i, "gmem_load_ns": 500.0 * 2.0 ** j}
            for i, j in itertools.product((-1, 0, 1), repeat=2)]
    results = [model(t) for t in grid]
    coef, worst = fit.linear_surrogate(grid, results, names, results[0])
    assert worst < 1e-9
    at = {"wake_ns": 700.0, "gmem_load_ns": 300.0}
    assert fit.surrogate_at(coef, names, at) == pytest.approx(model(at))
    values, score = fit.surrogate_minimum(grid, results, model(at), names, 4.0)
    assert score < 0.01 and values["wake_ns"] == pytest.approx(700.0, rel=0.1)


def test_the_lines_through_a_grid_take_the_engine_rate_as_its_inverse():
    """A copy takes bytes / engine_load_bytes_per_ns: a time with such a term is on a line in the
    rate's inverse, so the lines through a grid give it exactly between and beyond the tables."""
    import itertools

    names = ("wake_ns", "engine_load_bytes_per_ns")

    def model(t):
        return {(1, "dispatch"): 1.0 + 0.01 * t["wake_ns"] + 600.0 / t["engine_load_bytes_per_ns"]}

    grid = [{"wake_ns": 1000.0 * 2.0 ** i, "engine_load_bytes_per_ns": 40.0 * 2.0 ** j}
            for i, j in itertools.product((-1, 0, 1), repeat=2)]
    coef, worst = fit.linear_surrogate(grid, [model(t) for t in grid], names, [(1, "dispatch")])
    assert worst < 1e-9
    at = {"wake_ns": 900.0, "engine_load_bytes_per_ns": 55.0}
    assert fit.surrogate_at(coef, names, at)[(1, "dispatch")] == pytest.approx(model(at)[(1, "dispatch")])


def test_fit_grid_fits_the_grids_of_two_data_paths_as_one(tmp_path):
    """scripts/timing_calibration.py fit-grid with one saved grid per data path: the points of
    both are fitted together, each named by its path; grids of other tables are refused."""
    import itertools

    truth = {"wake_ns": 300.0, "pair_instruction_ns": 20.0}

    def direct(t):  # a combine that only the reduction moves, a dispatch only the wake-up
        return {"1 combine": 1.0 + 0.5 * t["pair_instruction_ns"], "1 dispatch": 2.0 + 0.01 * t["wake_ns"]}

    def receive(t):
        return {"1 combine": 3.0 + 0.2 * t["pair_instruction_ns"] + 0.002 * t["wake_ns"]}

    grid = [{"wake_ns": 300.0 * 2.0 ** i, "pair_instruction_ns": 20.0 * 2.0 ** j}
            for i, j in itertools.product((-1, 0, 1), repeat=2)]
    files = []
    for path, f in (("direct", direct), ("receive", receive)):
        saved = {"run": f"r/{path}", "commit": "abc", "world_size": 2, "nodes": 1, "data_path": path,
                 "model_tokens": [128, 256], "tables": grid, "predicted_ms": [f(t) for t in grid],
                 "measured_ms": f(truth)}
        files.append(tmp_path / f"{path}.json")
        files[-1].write_text(json.dumps(saved))
    script = os.path.join(REPO, "scripts", "timing_calibration.py")
    cmd = [sys.executable, script, "--constants", constants.H200, "fit-grid", *map(str, files),
           "--names", "wake_ns", "pair_instruction_ns"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    head = done.stdout.splitlines()[0]
    assert "wake_ns = 300" in head and "pair_instruction_ns = 20" in head, head
    assert "direct:1" in done.stdout and "receive:1" in done.stdout
    other = json.loads(files[1].read_text())
    other["tables"] = [{k: 2 * v for k, v in t.items()} for t in grid]
    files[1].write_text(json.dumps(other))
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
    assert done.returncode != 0 and "its tables differ" in done.stderr


def test_predict_takes_the_world_sizes_one_emulated_launch_holds(tmp_path, capsys):
    """Up to MAX_LAUNCH_RANKS (an NVLink domain of 72 on one GPU), as hybrid-ep-bench --emulate;
    past it, or a size the nodes do not divide, refused naming the flag before any model run."""
    from hybrid_ep.backends.cuda.layout import MAX_LAUNCH_RANKS

    shape = ["--hidden", "256", "--tokens", "64", "--topk", "2", "--sms", "1", "--model-tokens", "32", "64"]
    over = MAX_LAUNCH_RANKS + 1
    assert timing_cli.main(["predict", "--emulate", str(over), *shape, "--experts", str(over),
                            "--out", str(tmp_path / "over")]) == 2
    assert f"world sizes in [1, {MAX_LAUNCH_RANKS}] (the ranks one emulated launch holds)" in capsys.readouterr().err
    out = tmp_path / "eighteen"
    assert timing_cli.main(["predict", "--emulate", "18", *shape, "--experts", "36", "--out", str(out)]) == 0
    (run,) = json.loads((out / "predicted.json").read_text())["runs"]
    assert run["world_size"] == 18 and run["dispatch_ms"] > 0 and run["combine_ms"] > 0
