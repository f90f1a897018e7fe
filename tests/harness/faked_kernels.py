"""The cuda backend of one rank per process on the CPU, its kernels faked: what runs in a gloo
process where no GPU is at hand and the CPU model cannot run a launch across processes.

Everything the cuda backend does on the host is the real code: its peer memory between the
processes (memfd chunks mapped at each process's own addresses, descriptors over the Unix
socket: peer_memory.py), the agreement on every call's path (agreement.py), the engine's
path choice, its blocks in peer memory and its handles (engine.py). Only `ext.HostPath`, the
launcher of the kernels, is replaced by `GlooKernels`, which computes what the kernels would:

- the count kernel: every rank's routing and agreement words are all-gathered over the group
  (the numbers the count exchange hands every rank) and the call's info (rows per expert,
  counts, the agreement rows) is written into the workspace where the engine reads it;
- the dispatch kernel: on the direct path every source writes each route's row and weight
  straight into its destination's output, through its own mapping of that rank's peer memory
  (the addresses differ per process; the outputs' offsets are all-gathered as the kernels
  publish them); on the receive path the rows come over gloo;
- the combine kernel: on the direct path every source reads each route's expert_out row (and
  weight) from its expert's rank through the same mappings; on the receive path over gloo.

So a direct call proves that every rank mapped the memory its peers write into. fp8 rows and
several nodes are not faked (CudaBackend's GPU tests and the CPU model's emulation cover them).
`installed()` makes backend="cuda" build this backend in the calling process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import torch
import torch.distributed as dist

from hybrid_ep.backends.base import Backend
from hybrid_ep.backends.cuda.arena import memory_tensor
from hybrid_ep.backends.cuda.backend import CudaBackend
from hybrid_ep.backends.cuda.layout import AGREE_WORDS, BAD_ROUTE_WORDS

_CPU = torch.device("cpu")


def _view(ptr: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    """`count` elements of `dtype` at address `ptr` (an empty tensor for none)."""
    if count == 0:
        return torch.empty(0, dtype=dtype)
    return memory_tensor(ptr, count * dtype.itemsize, _CPU).view(dtype)


@dataclasses.dataclass
class _Call:
    """What the count kernel of one call computed, for its dispatch and combine (keyed by workspace)."""

    idx: list[torch.Tensor]  # every rank's topk_idx
    weights: list[torch.Tensor]  # every rank's routing weights
    xs: list[torch.Tensor]  # every rank's rows
    row_of: list[torch.Tensor]  # every rank's [T, K] output row of each route at its expert's rank, -1 none
    rows: list[int]  # every rank's output rows


class GlooKernels:
    """ext.HostPath of one rank per process, computing the kernels' results over gloo and
    through the peer memory's mappings (module docstring)."""

    def __init__(self, engine, group):
        self.engine, self.group = engine, group
        self.config = engine.config
        self.rank = engine.ranks[0]
        self.codes = {code: name for name, code in engine.ext.DTYPE_CODES.items()}
        self.agree = [0] * AGREE_WORDS
        self.calls: dict[int, _Call] = {}
        self.launched = {"count": 0, "dispatch_direct": 0, "dispatch_receive": 0, "combine_direct": 0,
                         "combine_receive": 0}

    def _dtype(self, args) -> torch.dtype:
        return getattr(torch, self.codes[args.dtype])

    def _gather(self, value) -> list:
        out = [None] * self.config.world_size
        dist.all_gather_object(out, value, group=self.group)
        return out

    def _bases(self) -> list[int]:
        """Where this process sees every rank's peer memory (0: not mapped here)."""
        return [int(b) for b in self.engine.bases_tables[0].tolist()]

    def set_agree(self, i: int, words) -> None:
        self.agree = [int(w) for w in words]

    def set_absent(self, absent: int, after_count: int) -> None:
        if absent or after_count:
            raise NotImplementedError("faked kernels have no absent ranks")

    # -- the count kernel ------------------------------------------------------------------

    def dispatch_count(self, args, stream, ptr, layout, static_rows, inputs, read):
        self._layout(args, ptr, layout, static_rows, inputs)

    def _layout(self, args, ptr: int, layout, static_rows: int, inp) -> None:
        self.launched["count"] += 1
        c, H = self.config, self.config.hidden_dim
        W, L, N = c.world_size, c.experts_per_rank, c.num_nodes
        if inp.x_scales:
            raise NotImplementedError("faked kernels move no fp8 rows")
        T, K = inp.num_tokens, inp.topk
        mine = (_view(inp.topk_idx, T * K, torch.int64).view(T, K).clone(),
                _view(inp.topk_weights, T * K, torch.float32).view(T, K).clone(),
                _view(inp.x, T * H, self._dtype(args)).view(T, H).clone(), list(self.agree))
        idx, weights, xs, words = zip(*self._gather(mine))
        # Every rank's expert-major layout, as the count kernels of all ranks compute it.
        starts, needed, rows = [], [], []
        for d in range(W):
            per_expert = [sum(int((i == d * L + j).any(1).sum()) for i in idx) for j in range(L)]
            padded = [-(-max(n, c.min_rows_per_expert) // c.pad_multiple) * c.pad_multiple for n in per_expert]
            starts.append([sum(padded[:j]) for j in range(L)])
            needed.append((per_expert, padded))
            rows.append(static_rows if static_rows >= 0 else sum(padded))
        row_of = [torch.full((int(i.shape[0]), int(i.shape[1])), -1, dtype=torch.int64) for i in idx]
        for d in range(W):
            for j in range(L):
                at = starts[d][j]
                for s in range(W):
                    for t in (idx[s] == d * L + j).any(1).nonzero()[:, 0].tolist():
                        k = int((idx[s][t] == d * L + j).nonzero()[0, 0])
                        if at < rows[d]:
                            row_of[s][t, k] = at
                        at += 1
        r = self.rank
        info = _view(ptr + layout.info, self.engine.info.total, torch.int64)
        il = self.engine.info
        per_expert, padded = needed[r]
        for j in range(L):
            info[il.expert_rows + j] = per_expert[j]
            info[il.tokens_per_expert + j] = padded[j]
            info[il.expert_start + j] = starts[r][j]
            run = 0
            for s in range(W):
                info[il.src_prefix + s * L + j] = run
                run += int((idx[s] == r * L + j).any(1).sum())
        reach = [[int(((i // L) == d).any(1).sum()) for d in range(W)] for i in idx]  # tokens of s to d
        for s in range(W):
            info[il.recv_count + s] = reach[s][r]
            info[il.src_tokens + s] = int(idx[s].shape[0])
            info[il.send_count + s] = reach[r][s]
            for d in range(W):
                info[il.count_matrix + s * W + d] = reach[s][d]
            for n in range(N):
                G = c.ranks_per_node
                info[il.node_counts + s * N + n] = int((((idx[s] // L) // G) == n).any(1).sum())
        info[il.recv_offset:il.recv_offset + W] = torch.tensor([sum(reach[s][r] for s in range(q)) for q in range(W)])
        info[il.num_recv] = sum(reach[s][r] for s in range(W))
        info[il.needed] = sum(padded)
        info[il.bad_route:il.bad_route + BAD_ROUTE_WORDS] = -1
        info[il.dropped] = sum(int(((row_of[s] < 0) & ((idx[s] // L) == r)).sum()) for s in range(W))
        width = 1 + AGREE_WORDS
        for d in range(W):
            info[il.agreement + d * width] = sum(int(((i // L) == d).sum()) for i in idx)  # routes into d
            info[il.agreement + d * width + 1:il.agreement + (d + 1) * width] = torch.tensor(words[d])
        if layout.route_rows >= 0:
            _view(ptr + layout.route_rows, T * K, torch.int32).view(T, K).copy_(row_of[r])
        self.calls[ptr] = _Call(list(idx), list(weights), list(xs), row_of, rows)

    # -- the dispatch kernel ----------------------------------------------------------------

    def dispatch_rows(self, args, direct, stream, ptr, layout, outputs):
        """outputs: the rank's ext.DispatchOutputs, as the extension's HostPath.dispatch_rows."""
        self._rows(args, direct, ptr, outputs)

    def dispatch_rows_into(self, args, stream, ptr, layout, taken):
        """The arena block an ext.ArenaTaken holds; its ext.OutputTensors come back, as the
        extension's HostPath.dispatch_rows_into."""
        return self._rows_into(args, ptr, taken)

    def dispatch(self, args, direct, stream, ptr, layout, static_rows, inputs, outputs):
        self._layout(args, ptr, layout, static_rows, inputs)
        self._rows(args, direct, ptr, outputs)

    def dispatch_into(self, args, stream, ptr, layout, static_rows, inputs, taken):
        """A direct call into the blocks `taken` holds (arena.arena_take): both kernels, then the
        blocks' tensors, as the extension's HostPath.dispatch_into."""
        self._layout(args, ptr, layout, static_rows, inputs)
        return self._rows_into(args, ptr, taken)

    def _rows_into(self, args, ptr: int, taken):
        ext = self.engine.ext
        rows_at, scales_at, probs_at = taken.addresses()[0]
        self._rows(args, True, ptr, ext.DispatchOutputs(num_rows=self.calls[ptr].rows[self.rank], rows=rows_at,
                                                        scales=scales_at, probs=probs_at))
        rows, scales, probs = taken.tensors()[0]
        return ext.OutputTensors(rows=rows, scales=scales, probs=probs)

    def _rows(self, args, direct: bool, ptr: int, out) -> None:
        self.launched["dispatch_direct" if direct else "dispatch_receive"] += 1
        call, H, r = self.calls[ptr], self.config.hidden_dim, self.rank
        dtype = self._dtype(args)
        R = out.num_rows
        rows_here = _view(out.rows, R * H, dtype).view(R, H)
        probs_here = _view(out.probs, R, torch.float32)
        rows_here.zero_()
        probs_here.zero_()
        if direct:  # the rows go straight into each destination's output, through this process's mapping
            own = self._bases()[r]
            offsets = self._gather((out.rows - own, out.probs - own, R))
            dist.barrier(group=self.group)  # every destination zeroed its padding first
            bases = self._bases()
            L = self.config.experts_per_rank
            for (t, k), p in zip(call.row_of[r].ge(0).nonzero().tolist(),
                                 call.row_of[r][call.row_of[r] >= 0].tolist()):
                d = int(call.idx[r][t, k]) // L
                rows_at, probs_at, R_d = offsets[d]
                if not bases[d]:
                    raise RuntimeError(f"rank {r} has not mapped rank {d}'s peer memory on a direct call")
                _view(bases[d] + rows_at + p * H * dtype.itemsize, H, dtype).copy_(call.xs[r][t])
                _view(bases[d] + probs_at + p * 4, 1, torch.float32).fill_(float(call.weights[r][t, k]))
            dist.barrier(group=self.group)  # every source's rows landed (the kernels' done count)
            return
        L = self.config.experts_per_rank
        for s in range(self.config.world_size):
            for (t, k) in call.row_of[s].ge(0).nonzero().tolist():
                if int(call.idx[s][t, k]) // L == r:
                    p = int(call.row_of[s][t, k])
                    rows_here[p] = call.xs[s][t]
                    probs_here[p] = call.weights[s][t, k]

    # -- the combine kernel -----------------------------------------------------------------

    def combine(self, args, direct, stream, inputs):
        self.launched["combine_direct" if direct else "combine_receive"] += 1
        inp, r = inputs, self.rank
        call = self.calls[inp.part]
        dtype, C, L = self._dtype(args), args.row_elems, self.config.experts_per_rank
        if direct:  # every route's expert_out row from its expert's rank, through this process's mapping
            own = self._bases()[r]
            offsets = self._gather((inp.expert_out - own, inp.probs - own))
            bases = self._bases()

            def row(d, p):
                return _view(bases[d] + offsets[d][0] + p * C * dtype.itemsize, C, dtype)

            def prob(d, p):
                return float(_view(bases[d] + offsets[d][1] + p * 4, 1, torch.float32))
        else:
            got = self._gather((_view(inp.expert_out, inp.num_rows * C, dtype).view(inp.num_rows, C).clone(),
                                _view(inp.probs, inp.num_rows, torch.float32).clone()))

            def row(d, p):
                return got[d][0][p]

            def prob(d, p):
                return float(got[d][1][p])
        T = inp.num_tokens
        y = torch.zeros(T, C, dtype=torch.float32)
        for (t, k) in call.row_of[r].ge(0).nonzero().tolist():
            d, p = int(call.idx[r][t, k]) // L, int(call.row_of[r][t, k])
            y[t] += row(d, p).float() * (prob(d, p) if args.apply_probs else 1.0)
        _view(inp.y, T * C, dtype).view(T, C).copy_(y.to(dtype))
        if direct:
            dist.barrier(group=self.group)  # no source reads an expert_out its rank moved on from


def faked_backend(config, group, rank: int, owner: int, kernels=GlooKernels):
    """CudaBackend for this process's rank on the CPU: the real peer memory and agreement
    (process_agreement over `group`) and engine, the kernels faked by `kernels` (GlooKernels)."""
    from hybrid_ep.backends.cuda import load_extension
    from hybrid_ep.backends.cuda.engine import Engine
    from hybrid_ep.backends.cuda.peer_setup import process_agreement

    self = CudaBackend.__new__(CudaBackend)
    Backend.__init__(self, config, group, rank, owner)
    ext = load_extension("cpu")
    self._device, self._buffers, self._rdma = _CPU, None, None
    self._peer = process_agreement(ext, config, group, rank, _CPU)
    tables = [torch.zeros(config.world_size, dtype=torch.int64)]  # no registered buffers: no kernel reads them
    self._engine = Engine(ext, config, [rank], tables, _CPU, None, peer=self._peer)
    self._engine.host = self._engine.model.host = kernels(self._engine, group)
    return self


@contextlib.contextmanager
def installed(kernels=GlooKernels):
    """While open, backend="cuda" builds faked_backend with `kernels` in this process (a buffer
    made inside keeps its faked kernels after), and the CPU model launches nothing (no launch
    tensors are declared for kernels that never run)."""
    import hybrid_ep.backends as backends
    from hybrid_ep.backends.cuda import backend as cuda_backend
    from hybrid_ep.backends.cuda import load_extension

    ext = load_extension("cpu")
    saved = backends.cuda_unavailable_reason, cuda_backend.CudaBackend, ext.launches_enabled()
    backends.cuda_unavailable_reason = lambda group, explicit=False: None
    cuda_backend.CudaBackend = functools.partial(faked_backend, kernels=kernels)
    ext.set_launches_enabled(False)
    try:
        yield
    finally:
        backends.cuda_unavailable_reason, cuda_backend.CudaBackend = saved[:2]
        ext.set_launches_enabled(saved[2])
