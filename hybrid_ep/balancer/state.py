"""What lives in an expert slot: parameters, their master copies, optimizer state, grads.

A slot's contents must move with its expert, and must be found without knowing the expert
module's class: `slot_parameters` reads the parameter names of an experts module
(Megatron's SequentialMLP: `local_experts.<j>.*`; TEGroupedMLP and the torch grouped
linear: `*.weight<j>` / `*.bias<j>`) and groups them by slot. Optimizers differ in where
master weights and moments live; an `OptimizerView` answers that per parameter:

- `TorchOptimizerView`: any torch.optim optimizer (Adam, AdamW, SGD, ...): the parameter
  is its own master, the state is `optimizer.state[param]`.
- `MegatronOptimizerView`: Megatron-Core's FP32Optimizer, mixed-precision
  Float16OptimizerWithFloat16Params and DistributedOptimizer (also inside a
  ChainedOptimizer). The first two keep fp32 master copies and the inner optimizer's state
  keyed by them. The distributed optimizer keeps, per bucket of its flat parameter buffer,
  one contiguous shard on each data-parallel member: a parameter's flat range is cut at the
  members' shard boundaries, and each member holds the master weights and Adam moments of
  its piece only. For such a parameter `sharded_slice` answers this member's piece of every
  tensor that moves (the weights' piece in the parameter buffer, master weights, moments)
  and where each member's piece lies, so a migration moves pieces between the members that
  own them and nothing is gathered.
"""

from __future__ import annotations

import dataclasses
import re

import torch

_SEQUENTIAL = re.compile(r"(?:^|\.)local_experts\.(\d+)\.")
_GROUPED = re.compile(r"(?:^|\.)(?:weight|bias)(\d+)$")


def slot_parameters(experts: torch.nn.Module, num_slots: int) -> list[list[torch.nn.Parameter]]:
    """[slot][k] parameters of each local slot, in the same order for every slot."""
    by_slot: list[list[tuple[str, torch.nn.Parameter]]] = [[] for _ in range(num_slots)]
    for name, param in experts.named_parameters():
        m = _SEQUENTIAL.search(name)
        if m:
            key = name[m.end():]
        else:
            m = _GROUPED.search(name)
            key = name[: m.start(1)] if m else None
        if m is None:
            raise ValueError(
                f"expert parameter {name!r} belongs to no single expert: the expert balancer needs "
                "per-expert parameters (Megatron's SequentialMLP or TEGroupedMLP)"
            )
        j = int(m.group(1))
        if j >= num_slots:
            raise ValueError(f"expert parameter {name!r} names slot {j}, but the module has {num_slots} slots")
        by_slot[j].append((key, param))
    layout = None
    for j, items in enumerate(by_slot):
        items.sort(key=lambda kv: kv[0])
        this = [(k, tuple(p.shape), p.dtype) for k, p in items]
        if layout is None:
            layout = this
        elif this != layout:
            raise ValueError(f"expert slot {j} has parameters {this}, slot 0 has {layout}: slots must match")
    if not layout:
        raise ValueError("the experts module has no parameters")
    return [[p for _, p in items] for items in by_slot]


@dataclasses.dataclass(frozen=True)
class ShardedSlice:
    """This data-parallel member's piece of one parameter under a sharding optimizer.

    tensors: 1-D views of this member's piece of every tensor that moves with the
    parameter (weights in the parameter buffer, fp32 master weights, optimizer moments),
    all covering ranges[member]; ranges: (start, end) in the parameter's flat index for
    every member of the sharding group (start == end: no piece), the same on every EP rank.
    """

    tensors: tuple[torch.Tensor, ...]
    ranges: tuple[tuple[int, int], ...]
    member: int


class OptimizerView:
    sharded = False  # True: slots move as ShardedSlice pieces over (EP group, shard_group)
    shard_group = None  # the group the optimizer shards expert parameters over

    def main_param(self, param: torch.Tensor) -> torch.Tensor | None:
        """The master copy the optimizer updates, when it is not `param` itself."""
        return None

    def state(self, param: torch.Tensor) -> dict:
        """Optimizer state tensors of `param` (keyed by name; may be empty before a step)."""
        return {}

    def mark_duplicate(self, param: torch.Tensor, duplicate: bool) -> None:
        """Exclude a replica's copy from the optimizer's gradient norm and zero count."""

    def start_migration(self) -> None:
        """Called on every rank before slots move (the distributed optimizer finishes any
        parameter all-gather in flight, which would otherwise write old pieces over moved ones)."""

    def sharded_slice(self, param: torch.Tensor) -> ShardedSlice:
        raise NotImplementedError("this optimizer does not shard parameters")

    def grad_piece(self, param: torch.Tensor):
        """(1-D gradient this rank's optimizer reads, its offset in the parameter, numel)."""
        g = summed_grad(param)
        return None if g is None else (g, 0, param.numel())

    def finish_migration(self) -> None:
        """Called on every rank after slots moved (the distributed optimizer re-gathers weights)."""


REPLICA_ATTR = "hybrid_ep_replica"


def mark_replica(param: torch.Tensor, duplicate: bool) -> None:
    """Mark a model parameter as a replica's copy: statistics over the model's parameters
    (Megatron-LM's params norm) leave it out, so each expert counts once."""
    setattr(param, REPLICA_ATTR, duplicate)


def is_replica(param: torch.Tensor) -> bool:
    return getattr(param, REPLICA_ATTR, False)


def _set_shared(tensor, duplicate: bool) -> None:
    """Megatron's `shared` mark, read by its optimizers' gradient norm and zero count. Only
    on the tensors those read: Megatron-LM's params norm asserts that no expert parameter of
    the model carries it."""
    if duplicate:
        tensor.shared = True
    elif getattr(tensor, "shared", False):
        tensor.shared = False


class TorchOptimizerView(OptimizerView):
    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state(self, param):
        return self.optimizer.state.get(param, {})


class MegatronOptimizerView(OptimizerView):
    def __init__(self, optimizer):
        self.optimizer = optimizer
        self._main = {}
        self._inner_of = {}
        self._dist = {}  # id(param) -> DistributedOptimizer holding it
        self._dist_opts = []
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            if getattr(opt, "is_stub_optimizer", False) or getattr(opt, "optimizer", 0) is None:
                continue  # nothing trainable on its side (e.g. frozen dense parameters)
            if hasattr(opt, "gbuf_ranges"):
                self._dist_opts.append(opt)
                for buffer in opt.buffers:
                    for p in buffer.param_index_map:
                        self._dist[id(p)] = (opt, buffer)
                continue
            inner = opt.optimizer
            if hasattr(opt, "float16_groups"):
                for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
                    for p, main in zip(model_group, main_group):
                        self._main[id(p)] = main
                        self._inner_of[id(main)] = inner
                for group in getattr(opt, "fp32_from_fp32_groups", []):
                    for p in group:
                        self._inner_of[id(p)] = inner
            else:
                for group in inner.param_groups:
                    for p in group["params"]:
                        self._inner_of[id(p)] = inner

    def use_for(self, params) -> "MegatronOptimizerView":
        """Settle `sharded` and `shard_group` for the expert parameters the balancer moves."""
        frozen = sum(not p.requires_grad for p in params)
        if frozen and any(id(p) in self._dist for p in params):
            raise ValueError(
                f"{frozen} expert slot parameters have requires_grad=False: the distributed optimizer "
                "leaves them out of its buffers, so the expert balancer cannot move their shards; "
                "train every expert parameter, or turn the balancer off (balancer.interval: 0)")
        kinds = {id(p) in self._dist for p in params}
        if len(kinds) > 1:
            raise ValueError("expert slot parameters are split between the distributed optimizer and another one")
        self.sharded = kinds == {True}
        if self.sharded:
            groups = {id(self._dist[id(p)][1].data_parallel_group) for p in params}
            if len(groups) != 1:
                raise ValueError("expert slot parameters are sharded over more than one data-parallel group")
            self.shard_group = self._dist[id(params[0])][1].data_parallel_group
        return self

    def main_param(self, param):
        return self._main.get(id(param))

    def state(self, param):
        main = self._main.get(id(param), param)
        inner = self._inner_of.get(id(main))
        return {} if inner is None else inner.state.get(main, {})

    def _shard_main(self, param):
        """(main param shard, its optimizer state) of param on this member, or None."""
        opt, _ = self._dist[id(param)]
        where = opt.model_param_group_index_map.get(param)
        if where is None:
            return None
        main = opt.optimizer.param_groups[where[0]]["params"][where[1]]
        return main, opt.optimizer.state.get(main, {})

    def _ranges(self, param):
        _, buffer = self._dist[id(param)]
        start, end, bucket_id = buffer.param_index_map[param]
        bucket = buffer.buckets[bucket_id]
        members = buffer.data_parallel_group.size()
        shard = bucket.grad_data.numel() // members
        out = []
        for d in range(members):
            lo = max(start, bucket.offset + d * shard)
            hi = min(end, bucket.offset + (d + 1) * shard)
            out.append((lo - start, hi - start) if hi > lo else (0, 0))
        return tuple(out), buffer.data_parallel_group.rank()

    def sharded_slice(self, param):
        if id(param) not in self._dist:
            return super().sharded_slice(param)
        ranges, member = self._ranges(param)
        lo, hi = ranges[member]
        flat = param.detach().view(-1)
        tensors = [flat[lo:hi]]
        owned = self._shard_main(param)
        if owned is not None:
            main, state = owned
            if main.data_ptr() != tensors[0].data_ptr() or main.dtype != tensors[0].dtype:
                tensors.append(main.detach().view(-1))  # fp32 master of a 16-bit parameter
            for key in sorted(state):
                t = state[key]
                if key != "step" and torch.is_tensor(t) and t.numel() == hi - lo and t.dim() >= 1:
                    tensors.append(t.view(-1))
        return ShardedSlice(tuple(tensors), ranges, member)

    def grad_piece(self, param):
        if id(param) not in self._dist:
            return super().grad_piece(param)
        g = getattr(param, "main_grad", None)
        if g is None:
            return None
        ranges, member = self._ranges(param)
        lo, hi = ranges[member]
        return g.view(-1)[lo:hi], lo, param.numel()

    def _expert_bucket_groups(self) -> list:
        """Each expert bucket group of the distributed optimizers' model chunks, once (a
        ChainedOptimizer's dense and expert parts hold the same chunks)."""
        groups, seen = [], set()
        for opt in self._dist_opts:
            for chunk in opt.model_chunks:
                for group in getattr(chunk, "expert_parallel_bucket_groups", []):
                    if id(group) not in seen:
                        seen.add(id(group))
                        groups.append(group)
        return groups

    def start_migration(self):
        for group in self._expert_bucket_groups():
            if group.param_gather_handle is not None:
                group.start_param_sync(force_sync=True)  # with a handle: waits for it, gathers nothing

    def finish_migration(self):
        """Re-gather the expert parameter buffers from their (moved) shards: synchronously, so the
        weights are whole before the next forward, with or without overlapped param gather
        (start_migration already finished any gather in flight)."""
        for group in self._expert_bucket_groups():
            group.start_param_sync(force_sync=True)

    def mark_duplicate(self, param, duplicate):
        if id(param) in self._dist:  # the optimizer reads its own shard of the fp32 master
            owned = self._shard_main(param)
            if owned is not None:
                _set_shared(owned[0], duplicate)
            return
        _set_shared(self._main.get(id(param), param), duplicate)  # the master copy, or param itself


def movable_tensors(param: torch.Tensor, view: OptimizerView) -> list[torch.Tensor]:
    """What must follow `param` to another slot: weights, master weights, optimizer state."""
    out = [param.data]
    main = view.main_param(param)
    if main is not None:
        out.append(main.data)
    state = view.state(main if main is not None else param)
    out.extend(state[k] for k in sorted(state) if torch.is_tensor(state[k]))
    return out


def grad_tensors(param: torch.Tensor, view: OptimizerView) -> list[torch.Tensor]:
    """Gradient storage of `param` (Megatron's main_grad, .grad, the master's .grad)."""
    out = []
    for g in (getattr(param, "main_grad", None), param.grad):
        if g is not None:
            out.append(g)
    main = view.main_param(param)
    if main is not None and main.grad is not None:
        out.append(main.grad)
    return out


def summed_grad(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer step will read (main_grad under Megatron's DDP)."""
    g = getattr(param, "main_grad", None)
    return g if g is not None else param.grad
