"""`python -m hybrid_ep.bench --emulate W [W ...]`: the cuda kernels of W virtual ranks on one GPU.

Per world size and SM count: dispatch and combine time (CUDA events, L2 flushed, median),
destination bytes per SM per second, and all bytes the kernels read and write as a fraction
of a large device-to-device copy measured in the same run (docs/benchmarks/cuda.md). Per world size
also: host time per dispatch + combine pair in static-size mode, and the same data movement
written with index_select / index_add_ on the one GPU. With --emulate-nodes N the ranks form
N nodes joined by the loopback transport (the cluster's NVSHMEM path): each row then also
gives the rows the forwarders received by RDMA, which must equal the traffic model's count,
and those bytes per SM per second. Writes emulated.json and emulated_per_sm.png; progress
goes to stderr, one line per measurement.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

from ..backends.cuda import launch
from ..backends.cuda.backend import memory_plan
from ..backends.cuda.layout import MAX_LAUNCH_RANKS
from ..dtypes import DISPATCH_BY_NAME
from ..fp8 import FP8_DTYPE, quantize_fp8
from ..metadata import gpu_sm_clock_mhz, metadata
from ..synthetic import default_group_limit, derived_seed, iter_rank_routings
from ..traffic.model import count_tables, dispatch_rows_written, row_counts
from ..wording import plural
from .host_profile import profile_pairs
from .kernel_times import profiled_kernels
from .spec import L2_FLUSH_BYTES, BenchArgError, BenchSpec

DEFAULT_SMS = (1, 2, 4, 8, 16)
# Shape and timing when a flag is not given (the seed benchmark's GPU shape).
DEFAULTS = dict(hidden=8192, tokens=4096, warmup=10, iters=30, topk=8)
COPY_BYTES = 1 << 30
KERNEL_CALLS = 5  # profiled calls per op and point, after the timed ones
UNITS = {"world_size": "ranks", "nodes": "nodes", "sms_per_rank": "SMs", "total_sms": "SMs (all ranks of the launch)",
         "device_sms": "SMs", "ranks": "ranks per launch",
         "recv_rows": "rows all ranks received in the dispatch (one per token and destination rank)",
         "out_rows": "rows all ranks hand to their experts (one per token and routed expert)",
         "dispatch_ms": "ms (median)", "combine_ms": "ms (median)", "copy_gbps": "GB/s (1e9 bytes/s, read + written)",
         "dispatch_rw_gbps": "GB/s (1e9 bytes/s): bytes the kernels read + write / time",
         "combine_rw_gbps": "GB/s (1e9 bytes/s): bytes the kernels read + write / time",
         "pipelines": "per kernel: pipeline stages and store groups of its launch (counts)",
         "dispatch_dest_gbps_per_sm": "GB/s per SM (destination bytes)",
         "combine_dest_gbps_per_sm": "GB/s per SM (destination bytes)",
         "dispatch_moved_gbps_per_sm": "GB/s per SM (1e9 bytes/s): bytes the kernels read + write / time / SMs, "
                                       "the data path's row moves per destination row x the destination bytes",
         "combine_moved_gbps_per_sm": "GB/s per SM (1e9 bytes/s): bytes the kernels read + write / time / SMs",
         "dispatch_written_gbps_per_sm": "GB/s per SM (1e9 bytes/s): rows the dispatch writes "
                                         "(traffic.model.dispatch_rows_written) x row bytes / time / SMs: what the "
                                         "SMs' store path carried, against the microbenchmarks' C_store",
         "data_path": "direct (each route's row straight to and from its final row; outputs from PyTorch's "
                      "allocator) or receive (through bounded receive rings, partial sums pushed back); "
                      "direct+receive: some timed dispatches took the receive path",
         "held_bytes_per_rank": "bytes each rank's buffer holds for its life (memory_plan().held_bytes; one GPU "
                                "each in production, all W on the one GPU here)",
         "held_by_region": "bytes per rank by region (memory_plan().held_by_region())",
         "kernels_ms": "ms per call: GPU time of each hybrid_ep kernel in a timed call, per op (torch.profiler's "
                       "CUDA activity, mean of KERNEL_CALLS calls after the timed ones; null: no profiler data)",
         "dispatch_outside_kernels_ms": "ms: dispatch_ms minus its kernels' time (host work between the count "
                                        "and dispatch kernels of a dynamic-size call, launch gaps)",
         "combine_outside_kernels_ms": "ms: combine_ms minus its kernel's time",
         "dispatch_other_kernels_ms": "ms per call: GPU time of the call's other kernels (torch's own, memsets, "
                                      "copies; the L2 flush left out), part of dispatch_outside_kernels_ms",
         "combine_other_kernels_ms": "ms per call: the same for combine",
         "dispatch_other_launches": "launches per call of those other kernels",
         "combine_other_launches": "launches per call of those other kernels",
         "sm_clock_mhz": "MHz: the SM clock nvidia-smi reported right after the point's timed calls (null without it)",
         "dispatch_copy_fraction": "fraction of the device copy's bytes/s",
         "combine_copy_fraction": "fraction of the device copy's bytes/s",
         "median_us": "microseconds (host time per dispatch + combine pair, all W ranks of the launch)",
         "median_us_per_rank": "microseconds (median_us / W: host time per pair per rank)",
         "target_us_per_rank": "microseconds (the target per rank)", "elapsed_s": "s",
         "profile": "host time by function: cProfile over 20 more pairs after the timed ones, the top 15 by own "
                    "time: calls_per_pair (count), own_us_per_pair and cumulative_us_per_pair (microseconds per "
                    "pair, all W ranks, cProfile's overhead included)",
         "rdma_rows": "rows all forwarders received by RDMA in the dispatch (as many go back in the combine)",
         "dispatch_rdma_gbps_per_sm": "GB/s per SM (RDMA bytes: rows x row bytes)",
         "combine_rdma_gbps_per_sm": "GB/s per SM (RDMA bytes: node partials x row bytes)"}
HOST_TARGET_US = 30  # host time per dispatch + combine pair per rank (issue target)


def rdma_rows(results, idxs, config) -> tuple[int, int]:
    """(rows the forwarders received by RDMA in the dispatch, as their handles keep them for the
    combine; the traffic model's count for the same routing). Equal when the kernels forward
    exactly one row per (token, remote node); 0 and 0 on one node."""
    if config.num_nodes == 1:
        return 0, 0
    from ..backends.cuda.layout import CHUNK_TOKENS

    G = config.ranks_per_node
    got = 0
    for f, res in enumerate(results):
        fwd_rows = res.handle.dest.fwd_rows.cpu()  # [source node, chunk]: the chunks of this call only
        for n in range(config.num_nodes):
            if n != f // G:
                chunks = -(-int(idxs[n * G + f % G].shape[0]) // CHUNK_TOKENS)  # of f's rail peer on node n
                got += int(fwd_rows[n, :chunks].sum())
    count_WW, node_counts_WN = count_tables([i.cpu() for i in idxs], config)
    return got, int(row_counts(count_WW, node_counts_WN, G).combine_rdma.sum())


def _note(msg: str) -> None:
    print(f"[bench --emulate] {msg}", file=sys.stderr, flush=True)


def _median_ms(fn, warmup: int, iters: int, flush: torch.Tensor) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def copy_bandwidth(device, warmup: int, iters: int, flush: torch.Tensor) -> float:
    """Device-to-device copy, bytes read + written per second (the ceiling of a data mover)."""
    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = _median_ms(lambda: dst.copy_(src), warmup, iters, flush)
    return 2 * COPY_BYTES / (ms * 1e-3)


def torch_movement(xs, idxs, L: int):
    """The same movement with index_select / index_add_ on one GPU: (dispatch fn, combine fn, rows)."""
    W, T = len(xs), xs[0].shape[0]
    x_all = torch.cat(xs)
    idx = torch.cat(idxs)
    g = torch.arange(idx.shape[0], device=idx.device)[:, None].expand_as(idx)
    valid = idx >= 0
    e, g = idx[valid], g[valid]
    order = torch.argsort(e * (W * T) + g)  # expert-major, then source rank, then token
    src = g[order].contiguous()
    rows = x_all.index_select(0, src)
    y = torch.zeros(x_all.shape, dtype=torch.float32, device=x_all.device)

    def dispatch():
        torch.index_select(x_all, 0, src, out=rows)

    def combine():
        y.zero_()
        y.index_add_(0, src, rows.float())
        return y.to(x_all.dtype)

    return dispatch, combine, rows


def _inputs(W, T, H, E, K, dtype, routing, seed, dev, zipf_exponent=1.2, nodes=1, group_limit=None):
    """The routing draws what hybrid-ep-bench's ranks draw for the same flags (worker.py):
    the Zipf exponent, and for group-limited routing the nodes as groups."""
    groups = (dict(num_groups=nodes, topk_groups=default_group_limit(nodes) if group_limit is None else group_limit)
              if routing == "group-limited" else {})
    idxs = [i.to(dev) for i in iter_rank_routings(routing, [T] * W, E, K, seed, zipf_exponent, **groups)]
    gen = torch.Generator(device=dev).manual_seed(seed)  # in [0, 2^64 - 1]: settings checked it
    x32 = [torch.randn(T, H, device=dev, generator=gen) for _ in range(W)]
    if dtype == FP8_DTYPE:
        pairs = [quantize_fp8(x) for x in x32]
        return idxs, [p[0] for p in pairs], [p[1] for p in pairs]
    return idxs, [x.to(dtype) for x in x32], [None] * W


def measurement_row(W, nodes, sms, d_ms, c_ms, recv_rows, out_rows, rdma, row_bytes, comb_bytes, dispatch_rw,
                    combine_rw, copy_bps, written_rows) -> dict:
    """One row of emulated.json's runs (every number field has its entry in UNITS): W ranks on
    `nodes` nodes at `sms` SMs per rank, median times in ms, rows, bytes per row, bytes the
    kernels read + write per call, against a device copy of copy_bps bytes/s, and the rows the
    dispatch writes (dispatch_rows_written)."""
    row = {"world_size": W, "nodes": nodes, "sms_per_rank": sms, "total_sms": sms * W, "dispatch_ms": d_ms,
           "combine_ms": c_ms, "recv_rows": recv_rows, "out_rows": out_rows, "rdma_rows": rdma}
    for op, ms, dest, rw in (("dispatch", d_ms, recv_rows * row_bytes, dispatch_rw),
                             ("combine", c_ms, recv_rows * comb_bytes, combine_rw)):
        row[f"{op}_dest_gbps_per_sm"] = dest / (ms * 1e-3) / (W * sms) / 1e9
        row[f"{op}_rw_gbps"] = rw / (ms * 1e-3) / 1e9
        row[f"{op}_moved_gbps_per_sm"] = row[f"{op}_rw_gbps"] / (W * sms)
        row[f"{op}_copy_fraction"] = rw / (ms * 1e-3) / copy_bps
    row["dispatch_written_gbps_per_sm"] = written_rows * row_bytes / (d_ms * 1e-3) / (W * sms) / 1e9
    if nodes > 1:
        row.update(rdma_fields(W, sms, d_ms, c_ms, rdma, row_bytes, comb_bytes))
    return row


def rdma_fields(W, sms, d_ms, c_ms, rdma, row_bytes, comb_bytes) -> dict:
    """GB/s per SM of the rows crossing nodes (`rdma` per direction): a row's bytes each in the
    dispatch, a node partial's in the combine."""
    return {"dispatch_rdma_gbps_per_sm": rdma * row_bytes / (d_ms * 1e-3) / (W * sms) / 1e9,
            "combine_rdma_gbps_per_sm": rdma * comb_bytes / (c_ms * 1e-3) / (W * sms) / 1e9}


def kernel_rows(calls: dict, d_ms: float, c_ms: float) -> dict:
    """A row's per-kernel fields from {op: kernel_times.CallKernels or None}: `kernels_ms` ({op:
    {kernel: GPU ms per call}}, an op None where the profiler saw no CUDA activity) and, per op,
    the call's time outside its kernels (the host's work between them, launch gaps, other
    kernels) with the other kernels' launches and GPU time inside it."""
    out = {"kernels_ms": {op: None if c is None else c.ours for op, c in calls.items()}}
    for op, ms in (("dispatch", d_ms), ("combine", c_ms)):
        got = calls.get(op)
        if got is not None and got.ours:
            out[f"{op}_outside_kernels_ms"] = ms - sum(got.ours.values())
            out[f"{op}_other_kernels_ms"] = got.other_ms
            out[f"{op}_other_launches"] = got.other_launches
    return out


def kernel_summary(row: dict) -> str:
    """One line of a row's per-kernel times: "count_kernel 0.412 + dispatch_direct_kernel ...
    ms, outside 1.5 ms" per op."""
    parts = []
    for op in ("dispatch", "combine"):
        got = row.get("kernels_ms", {}).get(op)
        if not got:
            parts.append(f"{op}: no profiler data")
            continue
        inner = " + ".join(f"{k} {v:.3f}" for k, v in got.items())
        parts.append(f"{op}: {inner} ms, outside {row[f'{op}_outside_kernels_ms']:.3f} ms (other kernels "
                     f"{row[f'{op}_other_kernels_ms']:.3f} ms in {row[f'{op}_other_launches']:.0f} launches)")
    return "; ".join(parts)


def _sweep_one_world(W, args, H, T, E, K, dtype, sms_list, warmup, iters, flush, copy_bps, dev, props, nodes=1):
    """Timed calls of one emulated group: (rows of the table, host time, plain-PyTorch baseline)."""
    from ..backends.cuda.emulation import EmulatedGroup

    # the engine picks the path (HYBRID_EP_DATA_PATH, else direct: one process, and across nodes
    # the loopback transport)
    group = EmulatedGroup(W, H, T, E, ranks_per_node=W // nodes)
    plan = memory_plan(group.config)
    _note(f"W={W}: {plan.summary()}")
    idxs, xs, scales = _inputs(W, T, H, E, K, dtype, args.routing, args.seed, dev, args.zipf_exponent, nodes,
                               args.group_limit)
    first = group.dispatch(xs, idxs, scales=scales)
    group.synchronize()
    rdma, rdma_model = rdma_rows(first, idxs, group.config)
    if rdma != rdma_model:
        raise RuntimeError(f"W={W} on {nodes} nodes: the forwarders received {rdma} rows by RDMA, the traffic model "
                           f"says {rdma_model}: the kernels forward other rows than the hierarchy plans")
    if nodes > 1:
        _note(f"W={W} on {nodes} nodes: {rdma} rows by RDMA per direction, as the traffic model counts")
    row_bytes = H * xs[0].element_size() + (H // 128 * 4 if dtype == FP8_DTYPE else 0)
    comb_dtype = torch.bfloat16 if dtype == FP8_DTYPE else dtype
    comb_bytes = H * torch.empty(0, dtype=comb_dtype).element_size()
    recv_rows = sum(int(r.handle.recv_counts_W.sum()) for r in first)  # one per (token, dest rank)
    out_rows = sum(int((r.probs != 0).sum()) for r in first)  # routed (row, expert) entries
    total_rows = sum(r.tokens.shape[0] for r in first)
    gen = torch.Generator(device=dev).manual_seed(derived_seed(args.seed + 1))
    # With separate processes emulated, expert_out lies in the expert-out block, as an expert
    # computation allocating there leaves it (else combine copies it in first); else where it is.
    expert_outs = [group.in_peer_memory(i, torch.randn(r.tokens.shape[0], H, device=dev, generator=gen).to(comb_dtype))
                   for i, r in enumerate(first)]
    handles = [r.handle for r in first]
    # Bytes the kernels touch. Receive path: dispatch reads each token once and writes each
    # sent row, then reads each received row and writes each output row; combine mirrors it,
    # its partials in the wire dtype (the combine dtype: the default). Direct path: each
    # token read once and written once per route; combine reads each route's row and writes
    # each token's.
    path = handles[0].data_path  # every rank's is the same
    written_rows = dispatch_rows_written(path, recv_rows, out_rows, rdma)
    if path == "direct":
        dispatch_rw = (W * T + out_rows) * row_bytes
        combine_rw = (out_rows + W * T) * comb_bytes
    else:
        dispatch_rw = (W * T + recv_rows) * row_bytes + (recv_rows + out_rows) * row_bytes
        combine_rw = out_rows * comb_bytes + 2 * recv_rows * comb_bytes + W * T * comb_bytes

    rows = []
    for sms in sms_list:
        if sms * W > props.multi_processor_count:
            _note(f"W={W}: {plural(sms, 'SM')} x {plural(W, 'rank')} > {props.multi_processor_count} SMs: skipped "
                  f"(blocks must be co-resident)")
            continue
        paths = {path}  # a timed dispatch that took the receive path: reported
        d_ms = _median_ms(lambda: paths.add(group.dispatch(xs, idxs, scales=scales, num_sms=sms)[0].handle.data_path),
                          warmup, iters, flush)
        c_ms = _median_ms(lambda: group.combine(expert_outs, handles, num_sms=sms), warmup, iters, flush)
        group.synchronize()
        row = measurement_row(W, nodes, sms, d_ms, c_ms, recv_rows, out_rows, rdma, row_bytes, comb_bytes,
                              dispatch_rw, combine_rw, copy_bps, written_rows)
        flush_l2 = None if flush is None else flush.zero_
        kernels = {"dispatch": profiled_kernels(lambda: group.dispatch(xs, idxs, scales=scales, num_sms=sms),
                                                KERNEL_CALLS, flush_l2),
                   "combine": profiled_kernels(lambda: group.combine(expert_outs, handles, num_sms=sms),
                                               KERNEL_CALLS, flush_l2)}
        row.update(kernel_rows(kernels, d_ms, c_ms))
        row["pipelines"] = group.engine.launch_shapes(sms)
        row["data_path"] = "+".join(sorted(paths))
        row["held_bytes_per_rank"] = plan.held_bytes
        row["held_by_region"] = plan.held_by_region()
        row["sm_clock_mhz"] = gpu_sm_clock_mhz()  # right after the point's timed calls
        rows.append(row)
        _note(f"W={W}, SMs/rank {sms}: dispatch {d_ms:.3f} ms ({row['dispatch_dest_gbps_per_sm']:.1f} GB/s/SM, "
              f"{row['dispatch_copy_fraction']:.1%} of copy), combine {c_ms:.3f} ms "
              f"({row['combine_dest_gbps_per_sm']:.1f} GB/s/SM, {row['combine_copy_fraction']:.1%} of copy); "
              f"kernels {kernel_summary(row)}")

    # Host time per dispatch + combine pair, static size (no host sync inside the pair). The
    # timed points' first call and expert_outs die first: with peer memory they hold its blocks.
    first = handles = expert_outs = None
    static = max(total_rows // W, 1) * 2
    for _ in range(5):  # each call's outputs die before the next
        res = group.dispatch(xs, idxs, scales=scales, num_out_tokens=static)
        group.combine([torch.zeros_like(r.tokens, dtype=comb_dtype) for r in res], [r.handle for r in res])
        res = None
    group.synchronize()
    outs = [group.in_peer_memory(i, torch.zeros(static, H, dtype=comb_dtype, device=dev)) for i in range(W)]
    samples, host_paths = [], set()
    res = None  # each pair's outputs die before the next pair
    for _ in range(50):
        t0 = time.perf_counter()
        res = group.dispatch(xs, idxs, scales=scales, num_out_tokens=static)
        group.combine(outs, [r.handle for r in res])
        samples.append((time.perf_counter() - t0) * 1e6)
        host_paths.add(res[0].handle.data_path)
        res = None
    group.synchronize()
    median = statistics.median(samples)

    def pair():  # as timed above; its outputs die before the next pair
        got = group.dispatch(xs, idxs, scales=scales, num_out_tokens=static)
        group.combine(outs, [r.handle for r in got])

    profile = profile_pairs(pair)
    group.synchronize()
    host = {"ranks": W, "median_us": median, "median_us_per_rank": median / W,
            "target_us_per_rank": HOST_TARGET_US, "meets_target": median / W <= HOST_TARGET_US,
            "data_path": "+".join(sorted(host_paths)), "profile": profile}
    _note(f"W={W}: host time per dispatch+combine pair ({W} rank(s) per call): {median:.1f} us, "
          f"{median / W:.1f} us per rank (target <= {HOST_TARGET_US} us)")
    _note(f"W={W}: host time by function (cProfile, us per pair, own time): "
          + "; ".join(f"{p['function']} {p['own_us_per_pair']:.1f}" for p in profile[:5]))

    plain_d, plain_c, _ = torch_movement(xs, idxs, E // W)
    plain = {"world_size": W, "dispatch_ms": _median_ms(plain_d, warmup, iters, flush),
             "combine_ms": _median_ms(plain_c, warmup, iters, flush)}
    _note(f"W={W}: index_select / index_add_: dispatch {plain['dispatch_ms']:.3f} ms, "
          f"combine {plain['combine_ms']:.3f} ms")
    group.close()
    return rows, host, plain


def settings(args) -> dict:
    """The flags of an --emulate run with their defaults, checked: {worlds, nodes, hidden, tokens,
    experts, topk, sms, warmup, iters}. Raises BenchArgError naming the flag; needs no GPU.

    A flag given as 0 stays 0 (and is then checked), it does not mean the default. What is not
    particular to emulation (sizes, top-k against the experts a group-limited token may reach,
    dtype and row bytes, Zipf exponent, group limit, SMs, seed) is hybrid-ep-bench's own check,
    BenchSpec.validate, for the group of each emulated world size."""
    worlds = list(args.emulate)
    nodes = getattr(args, "emulate_nodes", 1)
    nodes = 1 if nodes is None else nodes
    # the virtual ranks one launch holds (EmulatedGroup's limit): one NVLink domain of up to 72
    # (GB200 NVL72) on one node
    bad = [w for w in worlds if not 1 <= w <= MAX_LAUNCH_RANKS]
    if bad:
        raise BenchArgError("--emulate", f"world sizes must be in [1, {MAX_LAUNCH_RANKS}], got {bad}")
    if nodes < 1 or any(w % nodes for w in worlds):
        raise BenchArgError("--emulate-nodes",
                            f"{nodes} must be >= 1 and divide every emulated world size, got {worlds}")

    def given(name: str, default: int) -> int:
        value = getattr(args, name, None)
        return default if value is None else value

    experts = given("experts", 2 * max(worlds))
    reference_iters = given("reference_iters", 0)
    if reference_iters < 0:
        raise BenchArgError("--reference-iters", f"must be >= 0, got {reference_iters}")
    if experts >= 1 and any(experts % w for w in worlds):
        raise BenchArgError("--experts", f"{experts} must be a multiple of every emulated world size {worlds}")
    s = dict(worlds=worlds, nodes=nodes, hidden=given("hidden", DEFAULTS["hidden"]),
             tokens=given("tokens", DEFAULTS["tokens"]), experts=experts,
             topk=given("topk", min(DEFAULTS["topk"], experts)),
             sms=[n for chunk in (getattr(args, "sms", None) or []) for n in chunk] or list(DEFAULT_SMS),
             warmup=given("warmup", DEFAULTS["warmup"]), iters=given("iters", DEFAULTS["iters"]))
    for W in worlds:
        bench_spec(args, s, W).validate()
    return s


def bench_spec(args, s: dict, W: int, **fields) -> BenchSpec:
    """The hybrid-ep-bench run of the emulated group of W ranks (W / nodes per node, the settings
    `s`' shape, the flags' routing and seed); `fields` replace the rest (the reference run's
    backend, device and iterations). Not validated."""
    spec = dict(world_size=W, ranks_per_node=W // s["nodes"], hidden=s["hidden"], tokens=s["tokens"],
                topk=s["topk"], experts=s["experts"], dtype=args.dtype, routing=args.routing, sms=tuple(s["sms"]),
                backends=("cuda",), warmup=s["warmup"], iters=s["iters"], seed=args.seed, device="cuda",
                zipf_exponent=args.zipf_exponent, group_limit=getattr(args, "group_limit", None))
    return BenchSpec(**(spec | fields))


def run_config(args, s: dict) -> dict:
    """emulated.json's metadata config: the settings `s`, routing and seed (zipf_exponent and
    group_limit as hybrid-ep-bench records them: null unless that routing uses them)."""
    spec = bench_spec(args, s, s["worlds"][0])
    return {"world_sizes": s["worlds"], "nodes": s["nodes"], "hidden": s["hidden"], "tokens_per_rank": s["tokens"],
            "topk": s["topk"], "experts": s["experts"], "dtype": args.dtype, "routing": args.routing,
            "zipf_exponent": args.zipf_exponent if args.routing == "zipf" else None,
            "group_limit": spec.topk_groups if args.routing == "group-limited" else None,
            "seed": args.seed, "sms_per_rank": s["sms"], "warmup": s["warmup"], "iters": s["iters"],
            "store_groups": launch.store_groups_override(),  # None: the default (each run's pipelines)
            # None: as many stages as the shared memory holds
            "direct_combine_stages": launch.direct_combine_stages_override(),
            "reducer_wait": launch.reducer_wait_override(),  # None: "observe"
            "reducer_warps": launch.reducer_warps_override(),  # None: 4
            "combine_stage": launch.combine_stage_override(),  # None: "route"
            "store_runs": launch.store_runs_override(),  # None: 0
            "data_path_override": os.environ.get(launch.DATA_PATH_ENV) or None}  # None: direct where it runs


def run(args) -> int:
    try:
        s = settings(args)
    except BenchArgError as err:
        _note(str(err))
        return 2
    if not torch.cuda.is_available():
        _note("needs a CUDA device")
        return 2
    worlds, nodes = s["worlds"], s["nodes"]
    H, T, E, K = s["hidden"], s["tokens"], s["experts"], s["topk"]
    dev = torch.device("cuda", torch.cuda.current_device())
    dtype = DISPATCH_BY_NAME[args.dtype]
    sms_list = s["sms"]
    warmup, iters = s["warmup"], s["iters"]
    out_dir = args.out
    os.makedirs(out_dir, exist_ok=True)
    started = time.monotonic()
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device=dev)
    props = torch.cuda.get_device_properties(dev)
    _note(f"{props.name}, {props.multi_processor_count} SMs; W={worlds} H={H} T={T} K={K} E={E} {args.dtype}")

    copy_bps = copy_bandwidth(dev, 3, 10, flush)
    _note(f"device-to-device copy: {copy_bps / 1e9:.0f} GB/s (read + written)")

    rows, host, plain = [], {}, []
    for W in worlds:
        w_rows, w_host, w_plain = _sweep_one_world(W, args, H, T, E, K, dtype, sms_list, warmup, iters, flush,
                                                   copy_bps, dev, props, nodes)
        rows += w_rows
        host[f"W={W}"] = w_host
        plain.append(w_plain)

    config = run_config(args, s)
    doc = {
        "metadata": metadata("hybrid-ep-bench --emulate", device_type="cuda", config=config, units=UNITS,
                             backends=["cuda"], device=props.name),
        "device_sms": props.multi_processor_count, "command": " ".join(sys.argv),
        "copy_gbps": copy_bps / 1e9,
        "runs": rows, "host_time": host, "index_select_index_add": plain,
        "elapsed_s": time.monotonic() - started,
    }
    path = os.path.join(out_dir, "emulated.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
    _plot(doc, os.path.join(out_dir, "emulated_per_sm.png"))
    print(format_table(doc))
    print(f"\nresults: {path}")
    return 0


def format_table(doc: dict) -> str:
    meta = doc["metadata"]
    c = meta["config"]
    worlds = ", ".join(str(w) for w in c["world_sizes"])
    nodes = c.get("nodes", 1)
    where = "" if nodes == 1 else f" as {nodes} nodes (loopback transport between them)"
    lines = [f"cuda kernels, W = {worlds} virtual ranks{where} on one {meta['device']} "
             f"({doc.get('device_sms', '?')} SMs) | H={c['hidden']} T={c['tokens_per_rank']} K={c['topk']} "
             f"E={c['experts']} {c['dtype']} {c['routing']} | copy {doc['copy_gbps']:.0f} GB/s"
             + ("" if c.get("store_groups") is None else f" | HYBRID_EP_STORE_GROUPS={c['store_groups']}")
             + ("" if c.get("direct_combine_stages") is None
                else f" | HYBRID_EP_DIRECT_COMBINE_STAGES={c['direct_combine_stages']}")
             + ("" if c.get("reducer_wait") is None else f" | HYBRID_EP_REDUCER_WAIT={c['reducer_wait']}")
             + ("" if c.get("reducer_warps") is None else f" | HYBRID_EP_REDUCER_WARPS={c['reducer_warps']}")
             + ("" if c.get("combine_stage") is None else f" | HYBRID_EP_COMBINE_STAGE={c['combine_stage']}")
             + ("" if c.get("store_runs") is None else f" | HYBRID_EP_STORE_RUNS={c['store_runs']}")
             + ("" if c.get("data_path_override") is None else f" | HYBRID_EP_DATA_PATH={c['data_path_override']}"),
             f"{'W':>3} {'path':>7} {'SMs/rank':>8} {'SMs':>5} {'disp ms':>9} {'GB/s/SM':>8} {'moved/SM':>8} "
             f"{'of copy':>8} {'comb ms':>9} {'GB/s/SM':>8} {'moved/SM':>8} {'of copy':>8} {'held GiB':>8}"
             + ("" if nodes == 1 else f" {'RDMA rows':>10} {'disp RDMA/SM':>12} {'comb RDMA/SM':>12}")]
    for r in doc["runs"]:
        line = (f"{r['world_size']:>3} {r.get('data_path', '-'):>7} {r['sms_per_rank']:>8} {r['total_sms']:>5} "
                f"{r['dispatch_ms']:>9.3f} {r['dispatch_dest_gbps_per_sm']:>8.1f} "
                f"{r.get('dispatch_moved_gbps_per_sm', float('nan')):>8.1f} {r['dispatch_copy_fraction']:>8.1%} "
                f"{r['combine_ms']:>9.3f} {r['combine_dest_gbps_per_sm']:>8.1f} "
                f"{r.get('combine_moved_gbps_per_sm', float('nan')):>8.1f} {r['combine_copy_fraction']:>8.1%} "
                f"{r.get('held_bytes_per_rank', float('nan')) / 2**30:>8.3f}")
        if nodes > 1:
            line += (f" {r['rdma_rows']:>10} {r['dispatch_rdma_gbps_per_sm']:>12.2f} "
                     f"{r['combine_rdma_gbps_per_sm']:>12.2f}")
        lines.append(line)
    for r in doc["runs"]:
        if "kernels_ms" in r:  # older emulated.json files have none
            lines.append(f"W={r['world_size']}, {r['sms_per_rank']} SMs/rank, kernels: {kernel_summary(r)}")
    for p in doc["index_select_index_add"]:
        lines.append(f"index_select/index_add_ on one GPU, W={p['world_size']}: dispatch {p['dispatch_ms']:.3f} ms, "
                     f"combine {p['combine_ms']:.3f} ms")
    for name, h in doc["host_time"].items():
        per_rank = h.get("median_us_per_rank", h["median_us"] / h["ranks"])
        lines.append(f"host time per dispatch+combine pair, static size, {name} ({h['ranks']} rank(s) per launch): "
                     f"{h['median_us']:.1f} us, {per_rank:.1f} us per rank (target <= {HOST_TARGET_US} us)")
    lines.append("GB/s/SM: rows received x row bytes / time / all SMs of the launch; of copy: bytes the kernels "
                 "read + write / time, against the device-to-device copy; held GiB: what each rank's buffer holds "
                 "for its life (memory_plan())")
    if nodes > 1:
        lines.append("RDMA rows: rows all forwarders received by RDMA (equal to the traffic model's count, checked); "
                     "RDMA/SM: those rows' bytes / time / all SMs of the launch, GB/s")
    return "\n".join(lines)


def _plot(doc: dict, path: str) -> None:
    from ..figures import matplotlib_part, new_figure, save_png

    ticker = matplotlib_part("ticker")
    fig = new_figure(figsize=(11, 4.2))
    ax1, ax2 = fig.subplots(1, 2)
    colors = {"dispatch": "tab:blue", "combine": "tab:orange"}
    styles = ["-", "--", ":", "-."]
    for i, W in enumerate(doc["metadata"]["config"]["world_sizes"]):
        runs = [r for r in doc["runs"] if r["world_size"] == W]
        if not runs:
            continue
        for op in ("dispatch", "combine"):
            kw = dict(color=colors[op], ls=styles[i % len(styles)], marker="o", label=f"{op}, W={W}")
            ax1.plot([r["sms_per_rank"] for r in runs], [r[f"{op}_dest_gbps_per_sm"] for r in runs], **kw)
            ax2.plot([r["total_sms"] for r in runs], [100 * r[f"{op}_copy_fraction"] for r in runs], **kw)
    quarter = doc.get("device_sms", 132) / 4
    ax2.axvline(quarter, color="grey", lw=0.8, ls=":")
    ax2.text(quarter, ax2.get_ylim()[1], " 1/4 of the SMs", color="grey", fontsize=8, va="top")
    ax1.set(xlabel="SMs per rank", ylabel="destination GB/s per SM", title="per-SM throughput")
    ax2.set(xlabel="SMs of the launch (all virtual ranks)", ylabel="% of device copy bandwidth",
            title="bytes read + written, against a device copy")
    for ax, key in ((ax1, "sms_per_rank"), (ax2, "total_sms")):
        ax.set_xscale("log", base=2)
        ticks = sorted({r[key] for r in doc["runs"]})
        if ticks:
            ax.xaxis.set_major_locator(ticker.FixedLocator(ticks))
        ax.xaxis.set_minor_locator(ticker.NullLocator())
        ax.xaxis.set_major_formatter(ticker.ScalarFormatter())
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"hybrid-ep cuda kernels in single-GPU emulation on {doc['metadata']['device']} "
                 f"({doc['metadata']['date']})")
    fig.tight_layout()
    save_png(fig, path, 110)
