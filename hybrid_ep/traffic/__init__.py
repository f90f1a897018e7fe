"""Traffic model of the hierarchical scheme; `python -m hybrid_ep.traffic` prints it."""

from .model import (
    RowCounts,
    Traffic,
    combine_row_bytes,
    count_tables,
    dispatch_row_bytes,
    rank_traffic,
    routing_row_counts,
    row_counts,
)

__all__ = [
    "RowCounts",
    "Traffic",
    "combine_row_bytes",
    "count_tables",
    "dispatch_row_bytes",
    "rank_traffic",
    "routing_row_counts",
    "row_counts",
]
