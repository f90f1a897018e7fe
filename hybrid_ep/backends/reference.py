"""The ground truth: torch.distributed collectives only (gloo on CPU, NCCL on GPU).

It follows the hierarchical scheme's data flow where it matters for semantics: one row per
(token, destination rank) travels, and the destination expands it to its local experts.
Everything moves as raw bytes, so bf16, fp32 and fp8 rows take the same path.

Collectives, as few as Megatron's alltoall dispatcher makes: a dispatch with a new routing
exchanges its counts once (the agreement header rides with them, reference_agreement) and
reads them on the host once, then its rows; a dispatch with a handle, a combine and the
probs backward exchange their rows only, with the header in front. With a static output
size (num_out_tokens) every rank's block has max_tokens_per_rank rows, so the counts ride
with the rows and nothing is read on the host (reference_tables, reference_exchange).

Legend: T tokens, K routes per token, H hidden, L local experts, W ranks, N nodes,
S rows sent, V rows received, R output rows, P rows of a message (blocks with headers).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from ..config import KernelConfig
from ..dtypes import combine_dtype_for
from ..handle import DispatchHandle
from ..limits import check_group
from ..memory import BufferSpec, MemoryPlan
from ..refusals import InputRefused, code_of, refused_here
from ..routing import Routing, max_output_rows
from ..rows import as_byte_rows as _as_bytes
from ..rows import from_byte_rows as _from_bytes
from . import reference_agreement as agreement
from .base import Backend
from .reference_exchange import ReferenceExchange
from .reference_message import Messages, block_starts, message_rows
from .reference_tables import (
    ReferenceSendTable,
    assert_routing_on_device,
    padded_row_count,
    receive_table,
    routes_per_row,
    send_table,
)

_HW = agreement.HEADER_WORDS


class ReferenceBackend(Backend):
    name = "reference"

    def __init__(self, config, group, rank, owner):
        super().__init__(config, group, rank, owner)
        check_group(config.world_size, config.ranks_per_node, config.num_experts)  # every backend's limits
        transport = str(dist.get_backend(group)).lower()
        if "nccl" in transport and torch.cuda.is_available():
            self._device = torch.device("cuda", torch.cuda.current_device())
            ReferenceExchange.bound_group(group)
        else:
            self._device = torch.device("cpu")
        # With a static size nothing is read on the host, the routing checks included (on a GPU).
        self.checks_routing_on_device = self._device.type == "cuda"
        self._exchange = ReferenceExchange(group, rank, config.world_size, self._device, _longest_message(config))
        self._num_dispatches = 0  # dispatches of a new routing so far: the serial number of their handles
        self._msg = Messages(self._device)
        self._refusing = 0  # while this rank makes a call it refused: the argument's code (refusals.py)
        # the last dispatch's x dtype and scales (dtype, columns): a refused call's rows are as wide
        self._last_format: tuple = (torch.bfloat16, None)
        self._last_combine_dtype: torch.dtype | None = None  # of the last combine's expert_out, the same

    @property
    def device(self) -> torch.device:
        return self._device

    @staticmethod
    def _memo(table, key, make):
        """An index tensor derived from a handle's table, made once per call kind (a handle
        serves a dispatch, a combine and the backward: the same indices every time)."""
        found = table.memo.get(key)
        if found is None:
            found = table.memo[key] = make()
        return found

    def _check(self, table_WH: torch.Tensor, call: int, fields: dict) -> None:
        if self.config.world_size > 1:
            self._exchange.check_headers(table_WH[:, :_HW], lambda t: agreement.check(call, fields, t))

    def _message(self, call: int, fields: dict, handle: DispatchHandle | None, extra=()) -> torch.Tensor:
        """The header words (then extra words) this rank sends every peer; a handle's are made once."""
        def make():
            serial, checksum = (handle.serial, handle.checksum) if handle is not None else (0, 0)
            words = agreement.header(call, self.config.ranks_per_node, fields, serial, checksum, self._refusing)
            return torch.cat([self._msg.ints(words), *extra]) if extra else self._msg.ints(words)

        if handle is None or self._refusing:
            return make()
        return self._memo(handle.dest, ("words", call, *fields.items()), make)

    def _put_headers(self, message: torch.Tensor, call: int, fields: dict, handle: DispatchHandle,
                     starts: list[int], header_rows: int) -> None:
        """The header of a call with a handle in front of every block (its words made once per
        handle and call kind)."""
        self._msg.put_headers(message, self._message(call, fields, handle), starts, header_rows)

    # -- dispatch ----------------------------------------------------------------------------

    def refuse_dispatch(self, error, num_out_tokens, handle, kernel_config: KernelConfig):
        """The call its peers make, with no rows of its own and the refusal in its header: every
        rank raises the same refusals.InputRefused at the header check (for a static size on a
        GPU, at the next call that reads, as every header check there). The rows are as wide as
        the last dispatch's (the peers' message blocks have that size); a handle of this buffer
        sets the blocks, else num_out_tokens the kind of size."""
        if self.config.world_size == 1:
            return error  # no peer waits
        mine = refused_here(self.rank, "dispatch", error)
        static = num_out_tokens if isinstance(num_out_tokens, int) and num_out_tokens >= 0 else None
        ours = isinstance(handle, DispatchHandle) and handle.owner == self.owner
        tokens = handle.routing.topk_idx_TK.shape[0] if ours else 0
        dtype, scales_format = self._last_format
        x = torch.zeros(tokens, self.config.hidden_dim, dtype=dtype, device=self._device)
        scales = (torch.zeros(tokens, scales_format[1], dtype=scales_format[0], device=self._device)
                  if scales_format is not None else None)
        routing = None if ours else Routing(torch.empty(0, 1, dtype=torch.int64, device=self._device))
        return self._refused_call(mine, lambda: self.dispatch(x, scales, routing, handle if ours else None, static,
                                                              kernel_config))

    def refuse_combine(self, error, handle, apply_probs, kernel_config: KernelConfig):
        """The combine its peers make, with zero rows and the refusal in its header (refuse_dispatch)."""
        if self.config.world_size == 1:
            return error  # no peer waits
        mine = refused_here(self.rank, "combine", error)
        if not (isinstance(handle, DispatchHandle) and handle.owner == self.owner):
            return mine  # without this buffer's handle the exchange's blocks are unknown: peers wait (bounded)
        dtype = self._last_combine_dtype or combine_dtype_for(self._last_format[0])  # as wide as the peers' rows
        rows = torch.zeros(handle.num_rows, self.config.hidden_dim, dtype=dtype, device=self._device)
        return self._refused_call(mine, lambda: self.combine(rows, handle, False, kernel_config))

    def _refused_call(self, mine, call):
        """Makes `call` with this rank's refusal in its headers; returns `mine`, the error to raise."""
        self._refusing = code_of(mine.argument)
        try:
            call()
        except InputRefused:
            pass  # what every rank read: this rank's refusal, or a lower rank's
        except (RuntimeError, ValueError) as telling_failed:
            mine.add_note(f"telling the peers failed: {telling_failed}")
        finally:
            self._refusing = 0
        return mine

    def dispatch(self, x_TH, scales_TB, routing: Routing | None, handle: DispatchHandle | None,
                 num_out_tokens, kernel_config: KernelConfig):
        cfg = self.config
        self._exchange.start_call()
        if not self._refusing:
            self._last_format = (x_TH.dtype, None if scales_TB is None else (scales_TB.dtype, scales_TB.shape[1]))
        payload = [_as_bytes(x_TH)] + ([_as_bytes(scales_TB)] if scales_TB is not None else [])
        static = (num_out_tokens if handle is None else handle.num_out_tokens) is not None
        fields = {"x dtype": x_TH.dtype, "x row bytes": payload[0].shape[1],
                  "scales row bytes": sum(p.shape[1] for p in payload[1:]), "num_experts": cfg.num_experts,
                  "a static output size (num_out_tokens)": static}
        if static:
            self._exchange.run_deferred_checks()
        if handle is not None:
            return self._dispatch_with_handle(x_TH, payload, handle, fields)
        if static:
            return self._dispatch_static(x_TH, payload, routing, num_out_tokens, fields)
        return self._dispatch_counted(x_TH, payload, routing, fields)

    @staticmethod
    def _tokens_at(table: ReferenceSendTable, row_of_pos: torch.Tensor | None) -> torch.Tensor:
        """Message row -> its token (row_of_pos: message row -> send row; None: the same row).
        Rows of no token read token 0 (T - 1 at most): they are headers or never read."""
        gathered = table.token_of_row if row_of_pos is None else table.token_of_row[row_of_pos]
        return gathered.clamp(max=max(table.num_tokens - 1, 0))

    def _pack(self, payload, table: ReferenceSendTable, token_of_pos: torch.Tensor, routes_of_pos=None):
        """Message rows: row p carries the payload of token token_of_pos[p], then, for a new
        routing, routes_of_pos = (routes_per_row, row_of_pos or None for the same order): each
        row's local-expert weights and marks. Whole-row gathers straight into the message's
        columns (index_select), the fast copy of byte rows."""
        widths = [p.shape[1] for p in payload]
        meta = 0 if routes_of_pos is None else 5 * self.config.experts_per_rank
        message = self._exchange.message(token_of_pos.shape[0], sum(widths) + meta)
        col = 0
        for part, width in zip(payload, widths):
            if table.num_tokens:
                torch.index_select(part, 0, token_of_pos, out=message[:, col:col + width])
            col += width
        if routes_of_pos is not None:
            (probs_SL, mask_SL), row_of_pos = routes_of_pos
            routes = torch.cat([probs_SL.view(torch.uint8), mask_SL], dim=1)
            if row_of_pos is None:
                message[:, col:] = routes
            else:
                torch.index_select(routes, 0, row_of_pos, out=message[:, col:])
        return message

    def _dispatch_counted(self, x_TH, payload, routing, fields):
        """A new routing, exact sizes: one count exchange (with the agreement header) and one host
        read, overlapped with packing the rows, then the rows."""
        cfg, rank = self.config, self.rank
        W, N, L = cfg.world_size, cfg.num_nodes, cfg.experts_per_rank
        table = send_table(routing, cfg)
        node_counts = torch.zeros(W, dtype=torch.int64, device=self._device)
        node_counts[:N] = table.node_counts_N
        words = self._message(agreement.NEW_ROUTING, fields, None,
                              (table.send_counts_W, node_counts, table.expert_counts_E))
        M = words.numel()
        recv, starts = self._exchange.all_to_all(words.view(torch.uint8).view(1, M, 8).expand(W, M, 8).reshape(-1, 8),
                                                 [M] * W, [M] * W, _HW, "dispatch (counts)")
        copy = self._exchange.start_host_copy(self._msg.read_headers(recv, starts, M))
        message = self._pack(payload, table, self._tokens_at(table, None), (routes_per_row(table, L), None))
        host_words = self._exchange.finish_host_copy(copy, "dispatch (counts)")
        rows = host_words.tolist()  # the routing's one host read (on the CPU a list of the table)
        if W > 1:
            agreement.check(agreement.NEW_ROUTING, fields, [r[:_HW] for r in rows])
        self._num_dispatches += 1  # numbered once every rank has agreed, so the ranks count alike
        count_WW, node_WN = host_words[:, _HW:_HW + W], host_words[:, _HW + W:_HW + W + N]
        first = _HW + 2 * W + rank * L
        num_rows = sum(padded_row_count(sum(r[first + j] for r in rows), cfg.pad_multiple, cfg.min_rows_per_expert)
                       for j in range(L))
        send_W, recv_W = rows[rank][_HW:_HW + W], [r[_HW + rank] for r in rows]
        table = _with_blocks(table, send_W)
        recv, starts = self._exchange.all_to_all(message, send_W, recv_W, 0, "dispatch")
        return self._unpack_new(x_TH, payload, routing, table, recv, starts, recv_W, 0, num_rows, None,
                                count_WW, node_WN, agreement.checksum(count_WW))

    def _dispatch_static(self, x_TH, payload, routing, num_out_tokens, fields):
        """A new routing, static sizes: blocks of max_tokens_per_rank rows per rank, the agreement
        header and the counts in front of each; no host read."""
        cfg = self.config
        W, N, per_rank = cfg.world_size, cfg.num_nodes, cfg.max_tokens_per_rank
        if self.checks_routing_on_device:
            assert_routing_on_device(routing, cfg.num_experts)
        table = _with_blocks(send_table(routing, cfg, per_rank), [per_rank] * W)
        node_counts = torch.zeros(W, dtype=torch.int64, device=self._device)
        node_counts[:N] = table.node_counts_N
        words = self._message(agreement.NEW_ROUTING, fields, None, (table.send_counts_W, node_counts))
        B = sum(p.shape[1] for p in payload) + 5 * cfg.experts_per_rank
        header_rows = -(-words.numel() * 8 // B)
        _, starts, row_of_pos = self._msg.blocks(list(table.block_rows_W), header_rows, table.num_rows_max)
        message = self._pack(payload, table, self._tokens_at(table, row_of_pos),
                             (routes_per_row(table, cfg.experts_per_rank), row_of_pos))
        self._msg.put_headers(message, words, starts, header_rows)
        blocks = [header_rows + per_rank] * W
        recv, starts = self._exchange.all_to_all(message, blocks, blocks, header_rows, "dispatch")
        headers = self._msg.read_headers(recv, starts, words.numel())
        self._check(headers, agreement.NEW_ROUTING, fields)
        self._num_dispatches += 1
        count_WW, node_WN = headers[:, _HW:_HW + W], headers[:, _HW + W:_HW + W + N]
        checksum = agreement.checksum(count_WW) if self._device.type == "cpu" else 0
        return self._unpack_new(x_TH, payload, routing, table, recv, starts, [per_rank] * W, header_rows,
                                num_out_tokens, num_out_tokens, count_WW, node_WN, checksum)

    def _unpack_new(self, x_TH, payload, routing, table, recv, starts, recv_W, header_rows, num_rows,
                    num_out_tokens, count_WW, node_WN, checksum):
        """Rows of a new routing: the table from the received marks, then the expert-major rows."""
        cfg, L = self.config, self.config.experts_per_rank
        V = sum(recv_W)
        rows_of = self._msg.row_map(starts, recv_W, header_rows, V, recv.shape[0] - 1)
        col = sum(p.shape[1] for p in payload)
        meta = recv[:, col:].index_select(0, rows_of[:V])
        probs_VL = _from_bytes(meta[:, :4 * L], torch.float32)
        dest = receive_table(meta[:, 4 * L:], num_rows, cfg.pad_multiple, cfg.min_rows_per_expert, tuple(recv_W))
        probs_R = torch.cat([probs_VL, probs_VL.new_zeros(1, L)])[dest.src_of_row_R, dest.expert_of_row_R]
        recv_counts = count_WW[:, self.rank] if count_WW.device == self._device else self._msg.ints(recv_W)
        handle = DispatchHandle(
            owner=self.owner, config=cfg, rank=self.rank, routing=routing, source=table, dest=dest,
            recv_counts_W=recv_counts, num_recv_rows=V, count_matrix_WW=count_WW, node_counts_WN=node_WN,
            probs_R=probs_R, num_out_tokens=num_out_tokens, serial=self._num_dispatches, checksum=checksum,
        )
        return (*self._expand(recv, rows_of[dest.src_of_row_R], payload, x_TH.dtype), handle)

    def _expand(self, recv, picked, payload, dtype):
        """Output rows [R, H] (and scales): row r is receive row picked[r] (the zero row for padding)."""
        parts, col = [], 0
        for part in payload:
            width = part.shape[1]
            parts.append(recv[:, col:col + width].index_select(0, picked))
            col += width
        rows_RH = parts[0].view(dtype)
        return rows_RH, (parts[1].view(torch.float32) if len(parts) > 1 else None)

    def _dispatch_with_handle(self, x_TH, payload, handle: DispatchHandle, fields):
        source, dest = handle.source, handle.dest
        B = sum(p.shape[1] for p in payload)
        header_rows = -(-_HW * 8 // B)
        send_W, recv_W = list(source.block_rows_W), list(dest.block_rows_W)
        _, starts, row_of_pos = self._msg.blocks(send_W, header_rows, source.num_rows_max)
        tokens = self._memo(source, ("tokens at", header_rows), lambda: self._tokens_at(source, row_of_pos))
        message = self._pack(payload, source, tokens)
        self._put_headers(message, agreement.WITH_HANDLE, fields, handle, starts, header_rows)
        recv, starts = self._exchange.all_to_all(message, [header_rows + c for c in send_W],
                                                 [header_rows + c for c in recv_W], header_rows, "dispatch")
        self._check(self._msg.read_headers(recv, starts, _HW), agreement.WITH_HANDLE, fields)
        rows_of = self._msg.row_map(starts, recv_W, header_rows, dest.num_recv_rows, recv.shape[0] - 1)
        picked = self._memo(dest, ("picked", tuple(starts), header_rows), lambda: rows_of[dest.src_of_row_R])
        return (*self._expand(recv, picked, payload, x_TH.dtype), handle)

    # -- the way back: combine and the probs backward ----------------------------------------

    def combine(self, rows_RH, handle: DispatchHandle, apply_probs: bool, kernel_config: KernelConfig):
        if not self._refusing:
            self._last_combine_dtype = rows_RH.dtype
        return self._send_back(handle, rows_RH, None, apply_probs, kernel_config.wire_dtype_for(rows_RH.dtype))[0]

    def return_row_values(self, values_R, handle: DispatchHandle):
        return self._send_back(handle, None, values_R, False, torch.float32)[1]

    def combine_and_return_row_values(self, rows_RH, values_R, handle: DispatchHandle, kernel_config: KernelConfig):
        return self._send_back(handle, rows_RH, values_R, False, kernel_config.wire_dtype_for(rows_RH.dtype))

    def _send_back(self, handle: DispatchHandle, rows_RH, values_R, apply_probs: bool, wire: torch.dtype):
        """The way back in one exchange: combine (rows_RH: [T, H] sums) and / or the probs
        backward (values_R: one fp32 value per output row back to its route, [T, K]).

        Combine reduces a token's local experts first: one fp32 partial row per received row,
        sent back in the wire dtype (rounded on this hop), summed in fp32 at the source after the
        node sums of remote nodes are rounded once more (the forwarders' hop).

        A message row is one partial row (wire dtype: whole fp32 words); each peer's
        block holds its header rows, its partial rows, then its rows' local-expert values
        packed densely in as many more rows as they take (the values alone: rows of L fp32).
        So the partials are dense rows on both sides: the sums are row adds, no strided copy."""
        dest, source, L = handle.dest, handle.source, self.config.experts_per_rank
        self._exchange.start_call()
        if handle.num_out_tokens is not None:
            self._exchange.run_deferred_checks()
        width = 0 if rows_RH is None else rows_RH.shape[1] * wire.itemsize
        B = width or 4 * L  # width: a multiple of 4 bytes (hidden_dim is a multiple of 4)
        F = B // 4  # fp32 words per row
        header_rows = -(-_HW * 8 // B)
        send_W, recv_W = _back_blocks(dest.block_rows_W, width, values_R, B, L), \
            _back_blocks(source.block_rows_W, width, values_R, B, L)
        P = message_rows(send_W, header_rows)
        starts = block_starts(send_W, header_rows)
        at = self._memo(dest, ("at", header_rows, tuple(send_W)), lambda: self._msg.row_map(
            starts, list(dest.block_rows_W), header_rows, dest.num_recv_rows, P - 1)[dest.src_of_row_R])
        # Rows past the last block: the dummy row (P - 1), where padding rows land, and room for
        # their L values.
        message = self._exchange.message(P - 1 + max(1, -(-L // F)), B)
        if rows_RH is not None:
            vals_RH = rows_RH.detach().float()
            if apply_probs:
                vals_RH = vals_RH * handle.probs_R.detach()[:, None]
            if wire == torch.float32:  # the message's rows are the partial rows: summed in place
                partial = message.view(torch.float32)
                partial.zero_()
                partial.index_add_(0, at, vals_RH)
            else:
                partial = torch.zeros(message.shape[0], rows_RH.shape[1], dtype=torch.float32, device=self._device)
                message[:] = _as_bytes(partial.index_add_(0, at, vals_RH).to(wire))  # zero where no row adds
        else:
            message.zero_()
        if values_R is not None:
            before = list(dest.block_rows_W) if width else [0] * len(send_W)
            slots = self._memo(dest, ("value slots", header_rows, F, tuple(send_W)), lambda: self._msg.value_slots(
                starts, list(dest.block_rows_W), header_rows, before, F, L, (P - 1) * F,
            )[dest.src_of_row_R] + dest.expert_of_row_R)
            message.view(-1).view(torch.float32)[slots] = values_R.detach().float()
        if rows_RH is None:
            call, fields = agreement.PROBS_BACKWARD, {}
        else:
            call, fields = agreement.COMBINE, {"expert_out dtype": rows_RH.dtype, "wire dtype": wire,
                                               "hidden": rows_RH.shape[1],
                                               "routing-weight gradients sent back": values_R is not None}
        self._put_headers(message, call, fields, handle, starts, header_rows)
        recv, starts = self._exchange.all_to_all(message, [header_rows + c for c in send_W],
                                                 [header_rows + c for c in recv_W], header_rows, agreement.PHASES[call])
        self._check(self._msg.read_headers(recv, starts, _HW), call, fields)
        y_TH = out_TK = None
        if rows_RH is not None:
            recv_SH = recv.view(wire)[:, :rows_RH.shape[1]]
            y_TH = self._sum_partials(recv_SH, starts, header_rows, source, wire).to(rows_RH.dtype)
        if values_R is not None:
            S = sum(source.block_rows_W)
            before = list(source.block_rows_W) if width else [0] * len(recv_W)
            none = (recv.shape[0] - 1) * F  # the receive's zero row: the value of a slot not routed
            at_slot = self._memo(source, ("value slots", tuple(starts), header_rows, F, tuple(recv_W), none),
                                 lambda: self._msg.value_slots(starts, list(source.block_rows_W), header_rows, before,
                                                               F, L, none)[source.route_row_TK.clamp(max=S)]
                                 + source.route_local_TK)
            out_TK = recv.view(-1).view(torch.float32)[at_slot]
        return y_TH, out_TK

    def _sum_partials(self, recv_SH: torch.Tensor, starts: list[int], header_rows: int, source: ReferenceSendTable,
                      wire: torch.dtype) -> torch.Tensor:
        """The source's fp32 sum of the partials, with the hierarchical path's roundings: the
        partials of a remote node are summed (fp32) and rounded to the wire once more, as that
        node's forwarder does, before the final sum. The rows travelled flat; the arithmetic
        is the hops'. Each rank's block of the receive rows (recv_SH, wire dtype) is added where
        it lies, with no gather; row T collects the rows of no token (static blocks' padding)."""
        cfg = self.config
        G, T, H = cfg.ranks_per_node, source.num_tokens, recv_SH.shape[1]
        blocks = source.block_rows_W
        y: torch.Tensor | None = None
        tokens_W = self._memo(source, ("tokens of blocks",), lambda: _tokens_of_blocks(source))
        for n in range(cfg.num_nodes):
            part = torch.zeros(T + 1, H, device=self._device)
            for d in range(n * G, (n + 1) * G):
                if blocks[d]:
                    lo = starts[d] + header_rows
                    rows = recv_SH[lo:lo + blocks[d]]
                    part.index_add_(0, tokens_W[d], rows if rows.dtype == torch.float32 else rows.float())
            if n != cfg.node_of(self.rank) and wire != torch.float32:  # rounding to fp32 changes nothing
                part = part.to(wire).float()
            y = part if y is None else y.add_(part)
        assert y is not None  # num_nodes >= 1
        return y[:T]

    def memory_plan(self, dtype: torch.dtype = torch.bfloat16) -> MemoryPlan:
        return memory_plan(self.config, self._device.type)  # sized for fp32 rows, whatever dtype


def _tokens_of_blocks(source: ReferenceSendTable) -> list[torch.Tensor]:
    """The token of each row of each rank's block of a send table (its rows in packed order)."""
    out, first = [], 0
    for rows in source.block_rows_W:
        out.append(source.token_of_row[first:first + rows])
        first += rows
    return out


def _back_blocks(block_rows_W, width: int, values_R, row_bytes: int, num_local: int) -> list[int]:
    """Rows of each peer's block on the way back, headers aside: its partial rows (if any),
    then the rows its local-expert values take (if any)."""
    return [(c if width else 0) + (-(-c * 4 * num_local // row_bytes) if values_R is not None else 0)
            for c in block_rows_W]


def _with_blocks(table: ReferenceSendTable, block_rows_W: list[int]) -> ReferenceSendTable:
    return dataclasses.replace(table, block_rows_W=tuple(block_rows_W))


def memory_plan(config, device_type: str = "cuda") -> MemoryPlan:
    """What a reference buffer of `config` holds on a device of `device_type`, known without
    one: its messages and outputs come from PyTorch's allocator per call (NCCL), except on the
    CPU (gloo), where the send and receive messages live in two buffers kept across calls (fresh
    memory would cost page faults on every call, reference_exchange.py), each at most one
    peer's longest message per rank: held for the buffer's life."""
    T, W, H, L = config.max_tokens_per_rank, config.world_size, config.hidden_dim, config.experts_per_rank
    row = H * 4 + 5 * L  # widest row (fp32) plus per-row expert mask and weights
    max_rows = max_output_rows(config, L)
    kept = device_type == "cpu" and W > 1
    return MemoryPlan(
        backend=ReferenceBackend.name,
        buffers=(
            BufferSpec("send_rows", T * W * row, False, "dispatch rows packed per destination rank"),
            BufferSpec("recv_rows", W * T * row, False, "dispatch rows received, one per (token, rank)"),
            BufferSpec("expert_rows", max_rows * H * 4, False, "expert-major output rows"),
            BufferSpec("combine_partials", W * T * H * 4, False, "fp32 per-rank partial sums"),
            BufferSpec("gloo_messages", 2 * W * _longest_message(config) if kept else 0, True,
                       "on the CPU: the send and receive messages, kept across calls, up to one peer's "
                       "longest message per rank each"),
        ),
    )


def _longest_message(cfg) -> int:
    """Bytes of the longest message one rank can send another in any call of this buffer: the
    agreement header with the counts, then either a dispatch block of max_tokens_per_rank rows
    (fp32 x, the widest; fp8 x with its scales is narrower; weights and marks of the local
    experts) or the count message of a routing. A receive posted at this size takes any call."""
    W, T, H, L, E = cfg.world_size, cfg.max_tokens_per_rank, cfg.hidden_dim, cfg.experts_per_rank, cfg.num_experts
    widest = 4 * H + 5 * L
    # One more widest row: combine's values take their own rows after the partial rows.
    return (_HW + 2 * W) * 8 + 2 * widest + max(T * widest, (2 * W + E) * 8)
