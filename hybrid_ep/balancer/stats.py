"""Tokens routed to each expert, per MoE layer: counted on the device, reduced every K steps.

`record` adds one layer's counts into a device tensor with an in-place add: no host read,
no collective, so a training step gains no synchronisation. `reduce` (called every K
steps) sums the counts over the given process groups (EP, then expert data-parallel: together
every rank that runs these layers), moves them to the host once, and folds them into the
planning load: the sum of the last `window` reductions, or an exponential moving average
with `decay` when that is set. The per-reduction counts are kept as history for reports.

Checkpoints: `flush` (a collective, run on every rank before a save) reduces the counts
of the steps since the last reduction into `carry`, the same on every rank, which the next
reduction adds in; `pack` / `unpack` turn the window, the average and the carry into one
[window + 2, E] array per layer, so each MoE layer saves its own statistics beside its
placement and a resumed run plans exactly as the saved one would have.

Legend: L MoE layers of this pipeline stage, E experts.
"""

from __future__ import annotations

import collections

import numpy as np
import torch
import torch.distributed as dist


class LoadStatistics:
    def __init__(self, num_layers: int, num_experts: int, *, window: int = 1, decay: float | None = None,
                 device=None, history_limit: int = 1000):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if decay is not None and not 0.0 < decay < 1.0:
            raise ValueError(f"decay must be in (0, 1) or None, got {decay}")
        self.num_layers = num_layers
        self.num_experts = num_experts
        self.window = window
        self.decay = decay
        self.counts_LE = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
        self._recent = collections.deque(maxlen=window)
        self._ema_LE: np.ndarray | None = None
        self.history: collections.deque = collections.deque(maxlen=history_limit)  # [L, E] per reduction
        self.history_steps: collections.deque = collections.deque(maxlen=history_limit)
        self.carry_LE = np.zeros((num_layers, num_experts))  # flushed counts not yet in a reduction

    def record(self, layer: int, tokens_per_expert_E: torch.Tensor) -> None:
        """Add one forward pass's routed tokens per expert [E] of `layer` (device, no sync)."""
        self.counts_LE[layer].add_(tokens_per_expert_E.detach().to(self.counts_LE.dtype))

    def _reduced_counts(self, groups) -> np.ndarray:
        counts = self.counts_LE.clone()
        self.counts_LE.zero_()
        for group in groups:
            if group is not None and dist.get_world_size(group) > 1:
                dist.all_reduce(counts, group=group)
        return counts.cpu().numpy().astype(np.float64)

    def flush(self, groups=()) -> None:
        """Reduce the counts since the last reduction into `carry` (collective; before a save)."""
        self.carry_LE = self.carry_LE + self._reduced_counts(groups)

    def reduce(self, groups=(), step: int | None = None) -> np.ndarray:
        """Sum the counts since the last reduction over `groups`, reset them, return the load [L, E]."""
        interval_LE = self._reduced_counts(groups) + self.carry_LE
        self.carry_LE = np.zeros_like(self.carry_LE)
        self.history.append(interval_LE)
        self.history_steps.append(-1 if step is None else int(step))
        self._recent.append(interval_LE)
        if self.decay is None:
            return self.load()
        if self._ema_LE is None:
            self._ema_LE = interval_LE.copy()
        else:
            self._ema_LE = self.decay * self._ema_LE + (1.0 - self.decay) * interval_LE
        return self.load()

    def load(self) -> np.ndarray:
        """The planning load [L, E] (zeros before the first reduction)."""
        if self.decay is not None and self._ema_LE is not None:
            return self._ema_LE.copy()
        if not self._recent:
            return np.zeros((self.num_layers, self.num_experts))
        return np.sum(np.stack(self._recent), axis=0)

    def history_array(self) -> np.ndarray:
        """[reductions, L, E] tokens per expert of each reduction interval."""
        if not self.history:
            return np.zeros((0, self.num_layers, self.num_experts))
        return np.stack(self.history)

    def state_dict(self) -> dict:
        return {
            "recent": [a.copy() for a in self._recent],
            "ema": None if self._ema_LE is None else self._ema_LE.copy(),
            "counts": self.counts_LE.cpu().clone(),
            "carry": self.carry_LE.copy(),
        }

    def load_state_dict(self, state: dict) -> None:
        self._recent.clear()
        self._recent.extend(np.asarray(a) for a in state["recent"])
        self._ema_LE = None if state["ema"] is None else np.asarray(state["ema"])
        self.counts_LE.copy_(state["counts"].to(self.counts_LE.device))
        self.carry_LE = np.asarray(state.get("carry", np.zeros_like(self.carry_LE)), dtype=np.float64)

    def pack(self, layer: int) -> tuple[np.ndarray, int, bool]:
        """(array [window + 2, E]: the window's reductions oldest first, zero rows after them,
        then the average, then the carry; reductions held; whether the average is set)."""
        out = np.zeros((self.window + 2, self.num_experts))
        for i, a in enumerate(self._recent):
            out[i] = a[layer]
        if self._ema_LE is not None:
            out[self.window] = self._ema_LE[layer]
        out[self.window + 1] = self.carry_LE[layer]
        return out, len(self._recent), self._ema_LE is not None

    def unpack(self, arrays: list[np.ndarray], held: int, has_ema: bool) -> None:
        """Inverse of `pack` over all layers (one array per layer). A window saved with
        another length keeps its newest reductions (at most `window`)."""
        if len(arrays) != self.num_layers:
            raise ValueError(f"statistics of {len(arrays)} layers given, this stage has {self.num_layers}")
        arrays = [np.asarray(a, dtype=np.float64) for a in arrays]
        saved_window = arrays[0].shape[0] - 2
        if held > saved_window or any(a.shape != (saved_window + 2, self.num_experts) for a in arrays):
            raise ValueError(f"saved statistics have shape {arrays[0].shape} with {held} reductions; "
                             f"expected [window + 2, {self.num_experts}]")
        stacked = np.stack(arrays)  # [L, window' + 2, E]
        self._recent.clear()
        self._recent.extend(stacked[:, i] for i in range(max(0, held - self.window), held))
        self._ema_LE = stacked[:, saved_window].copy() if has_ema else None
        self.carry_LE = stacked[:, saved_window + 1].copy()
        self.counts_LE.zero_()
