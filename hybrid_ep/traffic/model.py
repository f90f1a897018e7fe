"""Bytes each rank sends over NVLink and RDMA, hierarchical scheme versus flat all-to-all.

The model needs only two count tables, which every backend's dispatch already exchanges:
  count_WW[s, d]     rows rank s sends to rank d (one per token routed to any expert of d)
  node_counts_WN[s, n]  tokens of rank s routed to any expert on node n
Hierarchical dispatch: a token crosses RDMA once per remote destination node, landing on
the rank with the sender's local index (same rail); that rank forwards it over NVLink to
the other destination ranks of its node. Combine retraces the same edges backwards, so a
rank sends in combine exactly the rows it received in dispatch, on the same link.
Local copies (a rank to itself) are on neither link.
Bytes count the token payload only (row plus fp8 scales); per-row routing metadata
(a few bytes of expert ids and weights) is left out.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import BufferConfig
from ..routing import normalize_routing, send_table


@dataclasses.dataclass(frozen=True)
class RowCounts:
    """Rows per rank [W] for each link, scheme and operation."""

    received: torch.Tensor  # dispatch rows arriving at each rank (= combine rows it sends back)
    dispatch_nvlink: torch.Tensor
    dispatch_rdma: torch.Tensor
    combine_nvlink: torch.Tensor
    combine_rdma: torch.Tensor
    flat_dispatch_nvlink: torch.Tensor
    flat_dispatch_rdma: torch.Tensor
    flat_combine_nvlink: torch.Tensor
    flat_combine_rdma: torch.Tensor


def row_counts(count_WW: torch.Tensor, node_counts_WN: torch.Tensor, ranks_per_node: int) -> RowCounts:
    C = count_WW.to(torch.int64).cpu()
    Nn = node_counts_WN.to(torch.int64).cpu()
    W = C.shape[0]
    G = ranks_per_node
    ranks = torch.arange(W)
    node, rail = ranks // G, ranks % G
    s_node, d_node = node[:, None], node[None, :]
    same_node = s_node == d_node
    not_self = ranks[:, None] != ranks[None, :]
    intra = same_node & not_self
    remote = ~same_node

    # Hierarchical: remote rows go to the forwarder f = (node of d, rail of s).
    forwarder_sd = d_node * G + rail[:, None]
    forwarded = remote & (forwarder_sd != ranks[None, :])
    nvlink_forward_sent = torch.zeros(W, dtype=torch.int64).index_add_(0, forwarder_sd[forwarded], C[forwarded])
    direct_sent = (C * intra).sum(dim=1)
    dispatch_nvlink = direct_sent + nvlink_forward_sent
    own_node_mask = node[:, None] == torch.arange(Nn.shape[1])[None, :]
    dispatch_rdma = (Nn * ~own_node_mask).sum(dim=1)

    nvlink_received = (C * intra).sum(dim=0) + (C * forwarded).sum(dim=0)
    # RDMA rows land on the rank of the sender's rail in each remote destination node.
    rdma_to_r = remote & (rail[:, None] == rail[None, :])  # [s, r]
    rdma_received = (Nn[:, node] * rdma_to_r).sum(dim=0)

    return RowCounts(
        received=C.sum(dim=0),
        dispatch_nvlink=dispatch_nvlink,
        dispatch_rdma=dispatch_rdma,
        combine_nvlink=nvlink_received,
        combine_rdma=rdma_received,
        flat_dispatch_nvlink=direct_sent,
        flat_dispatch_rdma=(C * remote).sum(dim=1),
        flat_combine_nvlink=(C * intra).sum(dim=0),
        flat_combine_rdma=(C * remote).sum(dim=0),
    )


@dataclasses.dataclass(frozen=True)
class Traffic:
    """Bytes one rank moved in one call (what `buf.last_traffic` holds)."""

    op: str  # "dispatch" or "combine"
    rank: int
    row_bytes: int  # payload bytes of one row (fp8: row plus its scales)
    rows: int  # rows this rank received in dispatch (combine sends the same rows back)
    nvlink_bytes: int
    rdma_bytes: int
    flat_nvlink_bytes: int
    flat_rdma_bytes: int

    @property
    def algorithm_bytes(self) -> int:
        """DeepEP's convention: one row per token and destination rank, self included."""
        return self.rows * self.row_bytes


def rank_traffic(op: str, rank: int, counts: RowCounts, row_bytes: int) -> Traffic:
    if op not in ("dispatch", "combine"):
        raise ValueError(f"op must be 'dispatch' or 'combine', got {op!r}")
    pick = lambda t: int(t[rank]) * row_bytes  # noqa: E731
    return Traffic(
        op=op,
        rank=rank,
        row_bytes=row_bytes,
        rows=int(counts.received[rank]),
        nvlink_bytes=pick(getattr(counts, f"{op}_nvlink")),
        rdma_bytes=pick(getattr(counts, f"{op}_rdma")),
        flat_nvlink_bytes=pick(getattr(counts, f"flat_{op}_nvlink")),
        flat_rdma_bytes=pick(getattr(counts, f"flat_{op}_rdma")),
    )


def dispatch_rows_written(path: str, recv_rows: int, out_rows: int, rdma_rows: int = 0) -> int:
    """Rows a dispatch's SMs write, all ranks: on the direct path one per route (out_rows), on
    the receive path one per token and destination rank into the receive ring first (recv_rows);
    across nodes each row crossing them once more, into the RDMA staging ring. Every one passes
    its SM's store path, whose rate the microbenchmarks measure alone (C_store): that rate times
    recv_rows / these rows bounds the dispatch's destination GB/s per SM (write_ceiling_gbps_per_sm)."""
    return out_rows + rdma_rows + (recv_rows if path != "direct" else 0)


def write_ceiling_gbps_per_sm(store_gbps_per_sm: float, recv_rows: int, written_rows: int) -> float:
    """The most destination GB/s per SM (the bench's unit, algorithm bytes) a dispatch that writes `written_rows`
    rows can reach when its SMs store at `store_gbps_per_sm` and do nothing else: a routing that
    puts several of a token's experts on one rank is credited fewer rows than the direct path
    writes, and no schedule of the kernel's warps passes this."""
    return store_gbps_per_sm * recv_rows / written_rows


def dispatch_row_bytes(hidden_dim: int, dtype: torch.dtype) -> int:
    from ..fp8 import is_fp8, num_scale_blocks

    size = hidden_dim * dtype.itemsize
    if is_fp8(dtype):
        size += num_scale_blocks(hidden_dim) * 4
    return size


def combine_row_bytes(hidden_dim: int, dtype: torch.dtype) -> int:
    return hidden_dim * dtype.itemsize


def count_tables(topk_idx_per_rank: list[torch.Tensor], config: BufferConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """count_WW and node_counts_WN for the routings of all ranks, as a dispatch exchanges them."""
    if len(topk_idx_per_rank) != config.world_size:
        raise ValueError(
            f"topk_idx_per_rank has {len(topk_idx_per_rank)} entries, expected world_size={config.world_size}"
        )
    rows, nodes = [], []
    for idx in topk_idx_per_rank:
        routing = normalize_routing(idx.shape[0], config.num_experts, idx.device, topk_idx=idx)
        table = send_table(routing, config)
        rows.append(table.send_counts_W)
        nodes.append(table.node_counts_N)
    return torch.stack(rows), torch.stack(nodes)


def routing_row_counts(topk_idx_per_rank: list[torch.Tensor], config: BufferConfig) -> RowCounts:
    count_WW, node_counts_WN = count_tables(topk_idx_per_rank, config)
    return row_counts(count_WW, node_counts_WN, config.ranks_per_node)
