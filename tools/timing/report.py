"""predicted.json and its table, and the comparison of predictions with a measured run.

A predicted time is never printed or stored beside a measured one as if it were one: the
table's first line and every unit say "predicted", and `compare` puts the two side by side
only as predicted / measured, per point, the worst last.
"""

from __future__ import annotations

import math

RECEIVE = "receive"  # the data path of a row that names none: the only one before the direct path

UNITS = {"world_size": "ranks", "nodes": "nodes", "sms_per_rank": "SMs", "total_sms": "SMs (all ranks of the launch)",
         "dispatch_ms": "ms, predicted by the timing model (count + dispatch kernels; no host time)",
         "combine_ms": "ms, predicted by the timing model (combine kernel)",
         "recv_rows": "rows all ranks receive in the dispatch (one per token and destination rank), counted",
         "out_rows": "rows all ranks hand to their experts (one per token and routed expert), counted",
         "kernels_ms": "ms per call, predicted by the timing model: each kernel of a call ({call: {kernel: ms}}, "
                       "named as the bench's kernels_ms names them), the count kernel apart from the dispatch kernel",
         "dispatch_dest_gbps_per_sm": "GB/s per SM (destination bytes / predicted time)",
         "combine_dest_gbps_per_sm": "GB/s per SM (destination bytes / predicted time)",
         "dispatch_written_gbps_per_sm": "GB/s per SM (rows the dispatch writes x row bytes / predicted time), "
                                         "the bench's field of the same name",
         "dispatch_write_ceiling_gbps_per_sm": "GB/s per SM in dispatch_dest_gbps_per_sm's unit: the table's "
                                               "engine_store_bytes_per_ns x rows received / rows the dispatch "
                                               "writes, the most any schedule of these writes reaches",
         "data_path": "the kernels' data path: direct (rows straight to their final row) or receive",
         "model_tokens": "tokens per rank the CPU model ran at (the prediction is on the line through them)",
         "constants": "the timing table the prediction used: value, unit, source per constant",
         "readings": "per reading of the store cost (tools/timing/readings.py: its values in place of the "
                     "table's), the same fields predicted from the same runs of the model",
         "count_tokens": "tokens per rank of the count kernel's own run (--count-run)",
         "elapsed_s": "s (wall time of the prediction)", "cpu_s": "s (CPU time of the predicting process)",
         "peak_rss_mb": "MB (its peak resident memory)"}


def units() -> dict:
    """predicted.json's units: UNITS and, for the rows crossing nodes, the bench's own entries
    (predicted_row writes those fields with the bench's rdma_fields)."""
    from hybrid_ep.bench.emulated import UNITS as BENCH

    return UNITS | {key: BENCH[key] for key in ("rdma_rows", "dispatch_rdma_gbps_per_sm", "combine_rdma_gbps_per_sm")}


def predicted_row(W: int, nodes: int, sms: int, dispatch_ms: float, combine_ms: float, recv_rows: int,
                  out_rows: int, row_bytes: int, comb_bytes: int, rdma_rows: int | None = None, *,
                  path: str = RECEIVE, store_bytes_per_ns: float | None = None) -> dict:
    """A predicted point as the bench's row has it; with several nodes the rows crossing them
    (`rdma_rows`, the traffic model's) and their GB/s per SM, the bench's RDMA measure; with the
    table's store rate, the ceiling the rows the dispatch writes on `path` put on it."""
    from hybrid_ep.bench.emulated import rdma_fields
    from hybrid_ep.traffic.model import dispatch_rows_written, write_ceiling_gbps_per_sm

    row = {"world_size": W, "nodes": nodes, "sms_per_rank": sms, "total_sms": W * sms, "dispatch_ms": dispatch_ms,
           "combine_ms": combine_ms, "recv_rows": recv_rows, "out_rows": out_rows}
    for op, ms, dest in (("dispatch", dispatch_ms, recv_rows * row_bytes), ("combine", combine_ms,
                                                                               recv_rows * comb_bytes)):
        row[f"{op}_dest_gbps_per_sm"] = dest / (ms * 1e-3) / (W * sms) / 1e9
    written = dispatch_rows_written(path, recv_rows, out_rows, rdma_rows or 0)
    row["dispatch_written_gbps_per_sm"] = written * row_bytes / (dispatch_ms * 1e-3) / (W * sms) / 1e9
    if store_bytes_per_ns is not None:  # bytes/ns: GB/s
        row["dispatch_write_ceiling_gbps_per_sm"] = write_ceiling_gbps_per_sm(store_bytes_per_ns, recv_rows, written)
    if nodes > 1 and rdma_rows is not None:
        row["rdma_rows"] = rdma_rows
        row.update(rdma_fields(W, sms, dispatch_ms, combine_ms, rdma_rows, row_bytes, comb_bytes))
    return row


def kernels_ms(ns: dict, sms: int, table: int = 0) -> dict:
    """{call: {kernel: predicted ms}} of a point from predict's per-kernel times (of the
    `table`-th cost table), with the GPU's kernel names (the model's launch name + "_kernel",
    as the bench's kernels_ms has them)."""
    out: dict[str, dict[str, float]] = {}
    for key, values in ns.items():
        if len(key) == 3 and key[0] == sms:
            out.setdefault(key[1], {})[f"{key[2]}_kernel"] = values[table] / 1e6
    return {call: dict(sorted(kernels.items())) for call, kernels in sorted(out.items())}


def format_predicted(doc: dict) -> str:
    c = doc["metadata"]["config"]
    nodes = c["nodes"]
    where = "" if nodes == 1 else (f" as {nodes} nodes (puts posted as a cluster's NIC: nic_* constants)"
                                   if c.get("posted_puts") else f" as {nodes} nodes (loopback transport between them)")
    model_tokens = c["model_tokens"]  # a list, or the rule by world size when none was given
    if not isinstance(model_tokens, str):
        model_tokens = "/".join(map(str, model_tokens))
    lines = [f"PREDICTED by the timing model (CPU model at T = {model_tokens} per rank, "
             f"constants {c['constants_file']}), not measured: cuda kernels, W = "
             f"{', '.join(map(str, c['world_sizes']))} virtual ranks{where} on one {c['device_modelled']} | "
             f"H={c['hidden']} T={c['tokens_per_rank']} K={c['topk']} E={c['experts']} {c['dtype']} {c['routing']}"
             f" | {c.get('data_path', RECEIVE)} path"
             + ("" if c.get("store_groups") is None else f" | HYBRID_EP_STORE_GROUPS={c['store_groups']}"),
             f"{'W':>3} {'SMs/rank':>8} {'SMs':>5} {'disp ms':>9} {'count ms':>9} {'GB/s/SM':>8} {'ceiling':>8} "
             f"{'comb ms':>9} {'GB/s/SM':>8}" + ("" if nodes == 1 else f" {'RDMA GB/s/SM disp / comb':>25}")]
    for r in doc["runs"]:
        count = r.get("kernels_ms", {}).get("dispatch", {}).get("count_kernel")
        ceiling = r.get("dispatch_write_ceiling_gbps_per_sm")  # predictions made before it was kept: none
        rdma = ("" if "dispatch_rdma_gbps_per_sm" not in r else
                f" {r['dispatch_rdma_gbps_per_sm']:>15.1f} / {r['combine_rdma_gbps_per_sm']:>6.1f}")
        lines.append(f"{r['world_size']:>3} {r['sms_per_rank']:>8} {r['total_sms']:>5} {r['dispatch_ms']:>9.3f} "
                     + (f"{count:>9.3f} " if count is not None else f"{'-':>9} ")
                     + f"{r['dispatch_dest_gbps_per_sm']:>8.1f} "
                     + (f"{ceiling:>8.1f} " if ceiling is not None else f"{'-':>8} ")
                     + f"{r['combine_ms']:>9.3f} {r['combine_dest_gbps_per_sm']:>8.1f}" + rdma)
        for name, alt in r.get("readings", {}).items():  # the same runs under a reading of the store cost
            lines.append(f"{'':>3} {'':>8} {'':>5} {alt['dispatch_ms']:>9.3f} {'':>9} "
                         f"{alt['dispatch_dest_gbps_per_sm']:>8.1f} {'':>8} {alt['combine_ms']:>9.3f} "
                         f"{alt['combine_dest_gbps_per_sm']:>8.1f}  reading {name}")
    lines.append("predicted ms: kernel time only (dispatch: the count and dispatch kernels, without the host's read "
                 "of the row count between them; count ms: its count kernel's part); GB/s/SM: rows received x "
                 "row bytes / predicted time / all SMs; ceiling: the most GB/s/SM the rows the dispatch writes "
                 "allow at the table's store rate (engine_store_bytes_per_ns), whatever the kernel's schedule")
    return "\n".join(lines)


SHAPE_KEYS = ("hidden", "tokens_per_rank", "topk", "experts", "dtype", "routing", "seed")
def shape_differences(predicted: dict, measured: dict) -> list[str]:
    """The settings in which the two runs differ (a measured file without a seed ran the
    bench's default, 0), and the kernel variants (a file that names none ran the default one):
    a prediction of one variant does not score a run of another."""
    from hybrid_ep.backends.cuda import launch

    p, m = predicted["metadata"]["config"], measured["metadata"]["config"]
    differ = [f"{k} {p.get(k)} against {m.get(k, 0 if k == 'seed' else None)}" for k in SHAPE_KEYS
              if p.get(k) != m.get(k, 0 if k == "seed" else None)]
    for k, default in (("reducer_wait", launch.REDUCER_WAIT_DEFAULT), ("reducer_warps", launch.REDUCER_WARPS_NARROW),
                       ("combine_stage", launch.COMBINE_STAGE_DEFAULT), ("store_runs", 0)):
        a, b = p.get(k) or default, m.get(k) or default
        if a != b:
            differ.append(f"{k} {a} against {b}")
    return differ



def compare(predicted: dict, measured: dict) -> list[dict]:
    """Per point both files have (world size, nodes, SMs per rank and data path): predicted and
    measured ms and their ratio, per call (dispatch, combine) and per kernel where both files
    time each kernel (kernels_ms: the dispatch kernel alone, the count kernel alone)."""
    nodes_p = predicted["metadata"]["config"]["nodes"]
    nodes_m = measured["metadata"]["config"].get("nodes", 1)
    want = {(r["world_size"], r.get("nodes", nodes_m), r["sms_per_rank"], r.get("data_path", RECEIVE)): r
            for r in measured["runs"]}
    out = []
    for r in predicted["runs"]:
        m = want.get((r["world_size"], r.get("nodes", nodes_p), r["sms_per_rank"], r.get("data_path", RECEIVE)))
        if m is None:
            continue
        pairs = [(call, r[f"{call}_ms"], m[f"{call}_ms"]) for call in ("dispatch", "combine") if f"{call}_ms" in r]
        # each kernel alone, where both say it (a measured row: the bench's torch.profiler times)
        for call, kernels in r.get("kernels_ms", {}).items():
            measured_kernels = (m.get("kernels_ms") or {}).get(call) or {}
            pairs += [(kernel, ms, measured_kernels[kernel]) for kernel, ms in kernels.items()
                      if measured_kernels.get(kernel)]
        for kernel, p_ms, m_ms in pairs:
            out.append({"world_size": r["world_size"], "nodes": r["nodes"], "sms_per_rank": r["sms_per_rank"],
                        "data_path": r.get("data_path", RECEIVE), "kernel": kernel, "predicted_ms": p_ms,
                        "measured_ms": m_ms, "ratio": p_ms / m_ms})
    return out


def worst(rows: list[dict]) -> dict:
    """The point whose prediction is furthest off, either way."""
    return max(rows, key=lambda r: abs(math.log(r["ratio"])))


def format_comparison(rows: list[dict], predicted_path: str, measured_path: str) -> str:
    lines = [f"predicted ({predicted_path}) against measured ({measured_path}); ratio = predicted / measured",
             f"{'W':>3} {'nodes':>5} {'SMs/rank':>8} {'path':>7} {'kernel':>22} {'predicted ms':>13} "
             f"{'measured ms':>12} {'ratio':>6}"]
    for r in rows:
        lines.append(f"{r['world_size']:>3} {r['nodes']:>5} {r['sms_per_rank']:>8} {r['data_path']:>7} "
                     f"{r['kernel']:>22} {r['predicted_ms']:>13.3f} {r['measured_ms']:>12.3f} {r['ratio']:>6.2f}")
    w = worst(rows)
    lines.append(f"worst: {w['kernel']} at W={w['world_size']}, {w['nodes']} node(s), {w['sms_per_rank']} SMs/rank, "
                 f"{w['data_path']} path: "
                 f"predicted / measured {w['ratio']:.2f}")
    return "\n".join(lines)
