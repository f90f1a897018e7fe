"""The ground truth: torch.distributed collectives only (gloo on CPU, NCCL on GPU).

It follows the hierarchical scheme's data flow where it matters for semantics: one row per
(token, destination rank) travels, and the destination expands it to its local experts.
Everything moves as raw bytes, so bf16, fp32 and fp8 rows take the same path.

Legend: T tokens, K routes per token, H hidden, L local experts, W ranks, N nodes,
S rows sent, V rows received, R output rows, M kept (row, expert) entries.
"""

from __future__ import annotations

import datetime
import time
import zlib

import torch
import torch.distributed as dist

from ..config import KernelConfig, timeout_seconds
from ..handle import DispatchHandle
from ..memory import BufferSpec, MemoryPlan
from ..routing import Routing, SourceLayout, dest_layout, max_output_rows, source_layout
from ..rows import as_byte_rows as _as_bytes
from ..rows import from_byte_rows as _from_bytes
from .base import Backend


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self, config, group, rank, owner):
        super().__init__(config, group, rank, owner)
        transport = str(dist.get_backend(group)).lower()
        if "nccl" in transport and torch.cuda.is_available():
            self._device = torch.device("cuda", torch.cuda.current_device())
        else:
            self._device = torch.device("cpu")
        self._num_dispatches = 0  # dispatches of a new routing so far: the serial number of their handles

    @property
    def device(self) -> torch.device:
        return self._device

    # -- collectives, each wait bounded by HYBRID_EP_TIMEOUT_S -------------------------

    def _wait(self, work, phase: str) -> None:
        limit = timeout_seconds()
        start = time.monotonic()
        try:
            work.wait(timeout=datetime.timedelta(seconds=limit))
        except RuntimeError as err:
            elapsed = time.monotonic() - start
            if elapsed < limit:  # the transport failed first: a peer process exited or its link broke
                cause = (f"failed after {elapsed:.1f} s in {phase}: the connection to a peer rank broke "
                         f"(did a peer process exit or crash? check its log)")
            else:
                cause = (f"waited more than {limit:g} s (HYBRID_EP_TIMEOUT_S) in {phase}: a peer rank did "
                         f"not make the same call")
            raise RuntimeError(
                f"hybrid_ep: rank {self.rank} of the EP group {cause}. The process group is unusable after "
                f"this error. ({err})"
            ) from err

    def _agree(self, call: int, fields: dict, device, handle: DispatchHandle | None = None,
               source: SourceLayout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One all_gather before every collective call, so that ranks about to make different
        calls, with different handles or with another row format all raise the same ValueError
        instead of exchanging wrong rows (rows are raw bytes, counts are each rank's own).

        The message's length depends only on W: gloo aborts the process when the lengths
        differ. It holds a header (the call, ranks_per_node, the handle's serial number and
        count checksum, the row format padded to _FORMAT slots), then W send counts and the
        N <= W node counts padded to W, zero unless the call sends a new routing (source).
        Returns every rank's counts: [W, W] rows sent and [W, N] tokens per node.
        """
        cfg = self.config
        W, N = cfg.world_size, cfg.num_nodes
        serial, checksum = (handle.serial, _checksum(handle.count_matrix_WW)) if handle is not None else (0, 0)
        head = [call, cfg.ranks_per_node, serial, checksum] + _encode(fields) + [0] * (_FORMAT - len(fields))
        counts = torch.zeros(2 * W, dtype=torch.int64, device=device)
        if source is not None:
            counts[:W], counts[W:W + N] = source.send_counts_W, source.node_counts_N
        mine = torch.cat([torch.tensor(head, dtype=torch.int64, device=device), counts])
        if W == 1:
            table = mine[None]
        else:
            flat = torch.empty(W * mine.numel(), dtype=torch.int64, device=device)
            work = dist.all_gather_into_tensor(flat, mine, group=self.group, async_op=True)
            self._wait(work, f"{_PHASES[call]} (agreement)")
            table = flat.view(W, -1)
            _check_agreement(call, fields, table[:, :_HEAD + _FORMAT].tolist())
        counts_WX = table[:, _HEAD + _FORMAT:]
        return counts_WX[:, :W], counts_WX[:, W:W + N]

    def _all_to_all_rows(self, send, send_counts: list[int], recv_counts: list[int], phase: str):
        """Variable-size all-to-all of byte rows; rows for rank d are contiguous, in rank order."""
        row_bytes = send.shape[1]
        if self.config.world_size == 1:
            return send.clone()
        recv = torch.empty(sum(recv_counts) * row_bytes, dtype=torch.uint8, device=send.device)
        work = dist.all_to_all_single(
            recv,
            send.reshape(-1),
            [c * row_bytes for c in recv_counts],
            [c * row_bytes for c in send_counts],
            group=self.group,
            async_op=True,
        )
        self._wait(work, phase)
        return recv.view(-1, row_bytes)

    # -- data movement -------------------------------------------------------------------

    def dispatch(self, x_TH, scales_TB, routing: Routing | None, handle: DispatchHandle | None,
                 num_out_tokens, kernel: KernelConfig):
        cfg, L = self.config, self.config.experts_per_rank
        payload = [_as_bytes(x_TH)]
        if scales_TB is not None:
            payload.append(_as_bytes(scales_TB))
        widths = [p.shape[1] for p in payload]
        fields = {"x dtype": x_TH.dtype, "x row bytes": widths[0], "scales row bytes": sum(widths[1:]),
                  "num_experts": cfg.num_experts}

        if handle is None:
            source = source_layout(routing, cfg)
            count_WW, node_counts_WN = self._agree(_NEW_ROUTING, fields, x_TH.device, source=source)
            self._num_dispatches += 1  # numbered once every rank has agreed, so the ranks count alike
            recv_counts_W = count_WW[:, self.rank].contiguous()
            # The first dispatch of a routing carries each row's local experts and weights.
            meta = [_as_bytes(source.row_probs_SL), source.row_expert_mask_SL.to(torch.uint8)]
        else:
            source, recv_counts_W, meta = handle.source, handle.recv_counts_W, []
            self._agree(_WITH_HANDLE, fields, x_TH.device, handle)

        send = torch.cat([p[source.send_token_idx_S] for p in payload] + meta, dim=1)
        recv = self._all_to_all_rows(send, source.send_counts_W.tolist(), recv_counts_W.tolist(), "dispatch")
        parts = list(torch.split(recv, widths + [4 * L, L][: len(meta)], dim=1))

        if handle is None:
            recv_probs_VL = _from_bytes(parts[len(payload)], torch.float32)
            recv_mask_VL = parts[len(payload) + 1].bool()
            dest = dest_layout(recv_mask_VL, cfg.pad_multiple, num_out_tokens, cfg.min_rows_per_expert)
            probs_R = torch.zeros(dest.num_rows, dtype=torch.float32, device=x_TH.device)
            probs_R[dest.out_pos_M] = recv_probs_VL[dest.out_src_M, dest.out_expert_M]
            handle = DispatchHandle(
                owner=self.owner, config=cfg, rank=self.rank, routing=routing, source=source, dest=dest,
                recv_counts_W=recv_counts_W, num_recv_rows=recv.shape[0], count_matrix_WW=count_WW,
                node_counts_WN=node_counts_WN, probs_R=probs_R, num_out_tokens=num_out_tokens,
                serial=self._num_dispatches,
            )
        dest = handle.dest

        def expand(part_VB: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
            out = torch.zeros(dest.num_rows, part_VB.shape[1], dtype=torch.uint8, device=part_VB.device)
            out[dest.out_pos_M] = part_VB[dest.out_src_M]
            return out.view(dtype)

        rows_RH = expand(parts[0], x_TH.dtype)
        scales_RB = expand(parts[1], torch.float32) if scales_TB is not None else None
        return rows_RH, scales_RB, handle

    def combine(self, rows_RH, handle: DispatchHandle, apply_probs: bool, kernel: KernelConfig):
        dest, source = handle.dest, handle.source
        H = rows_RH.shape[1]
        vals_MH = rows_RH.detach()[dest.out_pos_M].float()
        if apply_probs:
            vals_MH = vals_MH * handle.probs_R.detach()[dest.out_pos_M, None]
        # Reduce a token's local experts first: one fp32 partial row per received row, sent
        # back in the wire dtype (rounded on this hop), summed in fp32 at the source after the
        # node sums of remote nodes are rounded once more (the forwarders' hop).
        partial_VH = torch.zeros(handle.num_recv_rows, H, dtype=torch.float32, device=rows_RH.device)
        partial_VH.index_add_(0, dest.out_src_M, vals_MH)
        wire = kernel.wire_dtype_for(rows_RH.dtype)
        self._agree(_COMBINE, {"expert_out dtype": rows_RH.dtype, "wire dtype": wire, "hidden": H}, rows_RH.device,
                    handle)
        back = self._all_to_all_rows(
            _as_bytes(partial_VH.to(wire)), handle.recv_counts_W.tolist(), source.send_counts_W.tolist(), "combine"
        )
        return self._sum_partials(_from_bytes(back, wire).float(), source, handle.num_tokens, wire).to(rows_RH.dtype)

    def _sum_partials(self, back_SH: torch.Tensor, source, num_tokens: int, wire: torch.dtype) -> torch.Tensor:
        """The source's fp32 sum of the partials, with the hierarchical path's roundings: the
        partials of a remote node are summed (fp32) and rounded to the wire once more, as that
        node's forwarder does, before the final sum. The rows travelled flat; the arithmetic
        is the hops'."""
        cfg = self.config
        N, G, H = cfg.num_nodes, cfg.ranks_per_node, back_SH.shape[1]
        dest_node_S = torch.repeat_interleave(torch.arange(cfg.world_size, device=back_SH.device) // G,
                                              source.send_counts_W.to(back_SH.device))
        by_node = torch.zeros(num_tokens * N, H, dtype=torch.float32, device=back_SH.device)
        by_node.index_add_(0, source.send_token_idx_S * N + dest_node_S, back_SH)
        by_node = by_node.view(num_tokens, N, H)
        remote = torch.arange(N, device=back_SH.device) != cfg.node_of(self.rank)
        by_node[:, remote] = by_node[:, remote].to(wire).float()
        return by_node.sum(dim=1)

    def return_row_values(self, values_R, handle: DispatchHandle):
        dest, source, L = handle.dest, handle.source, self.config.experts_per_rank
        self._agree(_PROBS_BACKWARD, {}, values_R.device, handle)
        vals_VL = torch.zeros(handle.num_recv_rows, L, dtype=torch.float32, device=values_R.device)
        vals_VL[dest.out_src_M, dest.out_expert_M] = values_R.detach()[dest.out_pos_M].float()
        back = self._all_to_all_rows(
            _as_bytes(vals_VL), handle.recv_counts_W.tolist(), source.send_counts_W.tolist(), "probs backward"
        )
        back_SL = _from_bytes(back, torch.float32)
        slot_row = source.slot_send_row_TK
        valid = slot_row >= 0
        out_TK = torch.zeros(slot_row.shape, dtype=torch.float32, device=values_R.device)
        out_TK[valid] = back_SL[slot_row[valid], source.slot_local_expert_TK[valid]]
        return out_TK

    def memory_plan(self) -> MemoryPlan:
        cfg = self.config
        T, W, H, L = cfg.max_tokens_per_rank, cfg.world_size, cfg.hidden_dim, cfg.experts_per_rank
        row = H * 4 + 5 * L  # widest row (fp32) plus per-row expert mask and weights
        max_rows = max_output_rows(cfg, L)
        return MemoryPlan(
            backend=self.name,
            buffers=(
                BufferSpec("send_rows", T * W * row, False, "dispatch rows packed per destination rank"),
                BufferSpec("recv_rows", W * T * row, False, "dispatch rows received, one per (token, rank)"),
                BufferSpec("expert_rows", max_rows * H * 4, False, "expert-major output rows"),
                BufferSpec("combine_partials", W * T * H * 4, False, "fp32 per-rank partial sums"),
            ),
        )


# The collective calls, as the agreement message numbers them and the errors name them.
_NEW_ROUTING, _WITH_HANDLE, _COMBINE, _PROBS_BACKWARD = range(4)
_CALLS = ("dispatch with a routing", "dispatch with a handle", "combine", "probs backward")
_PHASES = ("dispatch", "dispatch", "combine", "probs backward")
_HEAD = 4  # call, ranks_per_node, handle serial, handle count checksum
_FORMAT = 4  # row-format slots: the most fields of any call (dispatch's)

_DTYPES = [v for v in vars(torch).values() if isinstance(v, torch.dtype)]


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())  # the same in every process (hash() is salted)


def _encode(fields: dict) -> list[int]:
    return [_dtype_code(v) if isinstance(v, torch.dtype) else int(v) for v in fields.values()]


def _checksum(count_WW: torch.Tensor) -> int:
    """The handle's [W, W] count matrix came from one all_gather, so it is the same on every
    rank: two ranks whose handles' checksums differ hold handles of different dispatches."""
    return zlib.crc32(count_WW.cpu().contiguous().numpy().tobytes())


def _check_agreement(call: int, fields: dict, table: list[list[int]]) -> None:
    """Raise the same ValueError on every rank when the ranks' headers differ: the call first
    (in another call the other slots mean something else), then ranks_per_node, the handle
    and the row format fields."""

    def differ(what: str, shown: list, rule: str, prefix: str = f"hybrid_ep {_PHASES[call]}") -> None:
        if len(set(shown)) > 1:
            per_rank = ", ".join(f"rank {r}: {v}" for r, v in enumerate(shown))
            raise ValueError(f"{prefix}: the EP ranks disagree on {what} ({per_rank}); {rule}")

    column = [list(c) for c in zip(*table)]
    differ("the call", [_CALLS[c] for c in column[0]], "every rank must make the same calls in the same order",
           prefix="hybrid_ep")  # the same text on every rank, whatever its own call
    differ("ranks_per_node", column[1], "every rank must build its buffer with the same ranks_per_node")
    serials, sums = column[2], column[3]
    same_serial = len(set(serials)) == 1
    differ("the handle", [f"dispatch #{s}" + (f" with count checksum {c:08x}" if same_serial else "")
                          for s, c in zip(serials, sums)],
           "every rank must pass the handle of the same dispatch (a buffer numbers its dispatches "
           "with a routing in call order)")
    names = {_dtype_code(d): str(d) for d in _DTYPES}
    for j, (name, value) in enumerate(fields.items()):
        col = column[_HEAD + j]
        differ(name, [names.get(c, c) for c in col] if isinstance(value, torch.dtype) else col,
               "every rank must make the same call with the same row format")
