"""Traffic of one routing as plain numbers: the traffic model's counts, per rank and per token.

`summarize` turns every rank's routing into what the CLI prints and writes (cli.py) and what
a placement's traffic reports (placement.py): bytes each rank sends per link and scheme,
bytes per token, the RDMA saving, destinations per token.
Legend: W ranks, T tokens, K routes per token.
"""

from __future__ import annotations

import torch

from ..config import BufferConfig
from .model import combine_row_bytes, count_tables, dispatch_row_bytes, rank_traffic, row_counts

# Columns of the table: (scheme, link) -> key in the report.
COLUMNS = ("hierarchical_nvlink", "hierarchical_rdma", "flat_nvlink", "flat_rdma")


def _max_distinct(group_TK: torch.Tensor) -> int:
    """Most distinct non-negative values in a row of [T, K] (-1 = not routed); 0 when T = 0."""
    if group_TK.shape[0] == 0:
        return 0
    srt = group_TK.sort(dim=1).values
    new = torch.ones_like(srt, dtype=torch.bool)
    new[:, 1:] = srt[:, 1:] != srt[:, :-1]
    return int((new & (srt >= 0)).sum(dim=1).max())


def _bytes_per_token(sent_W: list[int], tokens_W: torch.Tensor) -> dict:
    """Mean (total bytes / total tokens, = mean over ranks when T is equal) and max over ranks."""
    sent = torch.tensor(sent_W, dtype=torch.float64)
    has = tokens_W > 0
    total = int(tokens_W.sum())
    return {
        "mean": float(sent.sum() / total) if total else 0.0,
        "max": float((sent[has] / tokens_W[has]).max()) if bool(has.any()) else 0.0,
    }


def summarize(topk_idx_per_rank: list[torch.Tensor], config: BufferConfig,
              dispatch_dtype: torch.dtype, combine_dtype: torch.dtype, tables=None) -> dict:
    """Traffic of one routing (all ranks), as plain Python numbers.

    per_rank[op][column]: bytes each rank sends; bytes_per_token[op][column]: mean and max;
    rdma_saving_percent[op]: 100 * (1 - hierarchical / flat) over all ranks (None without RDMA).
    tables: (count_WW, node_counts_WN) of this routing where the caller has them (model.py).
    """
    count_WW, node_counts_WN = count_tables(topk_idx_per_rank, config) if tables is None else tables
    counts = row_counts(count_WW, node_counts_WN, config.ranks_per_node)
    row_bytes = {"dispatch": dispatch_row_bytes(config.hidden_dim, dispatch_dtype),
                 "combine": combine_row_bytes(config.hidden_dim, combine_dtype)}
    tokens_W = torch.tensor([idx.shape[0] for idx in topk_idx_per_rank], dtype=torch.int64)
    total_tokens = int(tokens_W.sum())

    per_rank, per_token, saving = {}, {}, {}
    for op in ("dispatch", "combine"):
        traffic = [rank_traffic(op, r, counts, row_bytes[op]) for r in range(config.world_size)]
        per_rank[op] = {
            "hierarchical_nvlink": [t.nvlink_bytes for t in traffic],
            "hierarchical_rdma": [t.rdma_bytes for t in traffic],
            "flat_nvlink": [t.flat_nvlink_bytes for t in traffic],
            "flat_rdma": [t.flat_rdma_bytes for t in traffic],
        }
        per_token[op] = {col: _bytes_per_token(per_rank[op][col], tokens_W) for col in COLUMNS}
        flat_rdma = sum(per_rank[op]["flat_rdma"])
        saving[op] = 100.0 * (1 - sum(per_rank[op]["hierarchical_rdma"]) / flat_rdma) if flat_rdma else None

    # Means from the model's count tables; maxima need the per-token routing.
    idx_all = torch.cat([idx.to(torch.int64) for idx in topk_idx_per_rank])  # [sum of T, K]
    dest = torch.where(idx_all >= 0, idx_all // config.experts_per_rank, -1)  # destination rank
    destinations = {
        "ranks": {"mean": int(count_WW.sum()) / max(total_tokens, 1), "max": _max_distinct(dest)},
        "nodes": {"mean": int(node_counts_WN.sum()) / max(total_tokens, 1),
                  "max": _max_distinct(torch.where(dest >= 0, dest // config.ranks_per_node, -1))},
    }
    return {
        "world_size": config.world_size,
        "num_nodes": config.num_nodes,
        "ranks_per_node": config.ranks_per_node,
        "hidden": config.hidden_dim,
        "row_bytes": row_bytes,
        "tokens_per_rank": tokens_W.tolist(),
        "received_rows": counts.received.tolist(),
        "per_rank": per_rank,
        "bytes_per_token": per_token,  # bytes sent per token of the sending rank
        "rdma_saving_percent": saving,
        "destinations_per_token": destinations,
    }
