"""From raw per-rank samples and traffic to the numbers reported (docs/benchmarks/README.md, Columns).

  time            median of the timed calls on that rank (ms)
  algbw           algorithm bytes / time: rows the rank received in dispatch (one per token
                  and destination rank, itself included) x row bytes (fp8: plus scales);
                  combine sends the same rows back, so the same count at the combine dtype
  NVLink busbw    bytes the rank sent over NVLink (hierarchical scheme) / time
  RDMA busbw      bytes the rank sent over RDMA (hierarchical scheme) / time
GB/s are 1e9 bytes per second.
"""

from __future__ import annotations

import statistics

OPS = ("dispatch", "combine")


def _gbps(num_bytes: int, ms: float) -> float:
    return num_bytes / (ms * 1e-3) / 1e9


def phase_metrics(samples_ms: list[float], traffic: dict) -> dict:
    median = statistics.median(samples_ms)
    return {
        "median_ms": median,
        "min_ms": min(samples_ms),
        "max_ms": max(samples_ms),
        "algbw_gbps": _gbps(traffic["algorithm_bytes"], median),
        "nvlink_gbps": _gbps(traffic["nvlink_bytes"], median),
        "rdma_gbps": _gbps(traffic["rdma_bytes"], median),
        "rows": traffic["rows"],
        "row_bytes": traffic["row_bytes"],
        "algorithm_bytes": traffic["algorithm_bytes"],
        "nvlink_bytes": traffic["nvlink_bytes"],
        "rdma_bytes": traffic["rdma_bytes"],
        "flat_nvlink_bytes": traffic["flat_nvlink_bytes"],
        "flat_rdma_bytes": traffic["flat_rdma_bytes"],
        "samples_ms": list(samples_ms),
    }


def summarize(ranks: list[dict]) -> dict:
    """Per op: the slowest rank's median time, and bandwidths averaged over ranks."""
    out = {}
    for op in OPS:
        rows = [r[op] for r in ranks]
        out[op] = {
            "max_ms": max(r["median_ms"] for r in rows),
            "mean_algbw_gbps": statistics.fmean(r["algbw_gbps"] for r in rows),
            "mean_nvlink_gbps": statistics.fmean(r["nvlink_gbps"] for r in rows),
            "mean_rdma_gbps": statistics.fmean(r["rdma_gbps"] for r in rows),
        }
    return out


def build_run(backend: str, num_sms: int | None, sms_note: str, raw_per_rank: list[dict],
              ranks_per_node: int, probes: list[dict]) -> dict:
    """One (backend, SM count) run: per-rank metrics in rank order and their summary."""
    ranks = []
    for raw in sorted(raw_per_rank, key=lambda r: r["rank"]):
        r = raw["rank"]
        ranks.append({
            "rank": r,
            "node": r // ranks_per_node,
            "local_index": r % ranks_per_node,
            "host": probes[r]["host"],
            "device": probes[r]["device"],
            **{op: phase_metrics(raw[op]["samples_ms"], raw[op]["traffic"]) for op in OPS},
        })
    return {
        "backend": backend,
        "num_sms": num_sms,
        "sms_note": sms_note,
        "timing": raw_per_rank[0]["timing"],
        "ranks": ranks,
        "summary": summarize(ranks),
    }
