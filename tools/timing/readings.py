"""The two readings of the direct dispatch's store cost that both fit the 2026-11-26 H100 run
(docs/dev/request_path.md, "What the counts leave unexplained"), as the values they put in
place of a table's. A prediction under each (`predict --readings`) says what a design of the
store path gains if that reading holds; the GPU run's request counts decide between them.
"""

from __future__ import annotations

READINGS: dict[str, dict[str, float]] = {
    # a fixed cost per bulk store beyond its bytes: the rows at 45 bytes/ns, about 150 ns a store
    "per_store": {"engine_store_bytes_per_ns": 45.0, "store_copy_ns": 150.0},
    # a lower store rate and costly scale stores: the rows at 32.2 bytes/ns, 1.65 ns a scale store
    "store_rate": {"engine_store_bytes_per_ns": 32.2, "request_ns": 1.65},
}
