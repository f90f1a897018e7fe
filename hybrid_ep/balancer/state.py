"""What lives in an expert slot: parameters, their master copies, optimizer state, grads.

A slot's contents must move with its expert, and must be found without knowing the expert
module's class: `slot_parameters` reads the parameter names of an experts module
(Megatron's SequentialMLP: `local_experts.<j>.*`; TEGroupedMLP and the torch grouped
linear: `*.weight<j>` / `*.bias<j>`) and groups them by slot. Optimizers differ in where
master weights and moments live; an `OptimizerView` answers that per parameter:

- `TorchOptimizerView`: any torch.optim optimizer (Adam, AdamW, SGD, ...): the parameter
  is its own master, the state is `optimizer.state[param]`.
- `MegatronOptimizerView`: Megatron-Core's FP32Optimizer and mixed-precision
  Float16OptimizerWithFloat16Params (also inside a ChainedOptimizer): fp32 master
  copies and the inner optimizer's state keyed by them. The distributed optimizer shards
  master weights and state over data-parallel ranks in flat buffers; it is refused.
"""

from __future__ import annotations

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


class OptimizerView:
    def main_param(self, param: torch.Tensor) -> torch.Tensor | None:
        """The master copy the optimizer updates, when it is not `param` itself."""
        return None

    def state(self, param: torch.Tensor) -> dict:
        """Optimizer state tensors of `param` (keyed by name; may be empty before a step)."""
        return {}

    def mark_duplicate(self, param: torch.Tensor, duplicate: bool) -> None:
        """Exclude a replica's copy from gradient-norm and similar global statistics."""


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
        for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
            kind = type(opt).__name__
            if "Distributed" in kind or hasattr(opt, "gbuf_ranges"):
                raise NotImplementedError(
                    "the expert balancer does not support Megatron's distributed optimizer yet "
                    "(--use-distributed-optimizer): it shards master weights and Adam state over "
                    "data-parallel ranks; run without it or without --hybrid-ep-balancer-interval"
                )
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

    def main_param(self, param):
        return self._main.get(id(param))

    def state(self, param):
        main = self._main.get(id(param), param)
        inner = self._inner_of.get(id(main))
        return {} if inner is None else inner.state.get(main, {})

    def mark_duplicate(self, param, duplicate):
        for p in (param, self._main.get(id(param))):
            if p is None:
                continue
            if duplicate:
                p.shared = True
            elif getattr(p, "shared", False):
                p.shared = False


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
