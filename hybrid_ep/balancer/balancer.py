"""ExpertBalancer: statistics -> placement -> migration, driven from the training loop.

    balancer = ExpertBalancer(layers, num_experts=E, slots_per_rank=P, ep_group=..., interval=K)
    balancer.setup()                   # install the initial placement (copies replicas' weights)
    ... per MoE forward:  balancer.record(i, routed_per_expert_E)   (device add, no sync)
    ... before optimizer.step():  balancer.before_optimizer_step()  (sum replicas' grads)
    ... after optimizer.step():   balancer.after_optimizer_step(iteration)  (every K: plan, migrate)

The placement is the truth kept in each layer's SlotTable (device), so checkpoints that
hold the tables' `slot_to_expert` rows restore it (see `state_dict`). Rebalancing never
changes what the model computes: a token reaches a slot that holds exactly the weights and
optimizer state its expert has everywhere else.

Legend: L MoE layers of this pipeline stage, E experts, S slots, W EP ranks, P = S / W.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from ..checks import is_int
from .knobs import check_knobs
from .migration import migrate_shards_, migrate_slots_, plan_transfers, replica_placement, sum_replica_grads_
from .slots import SlotTable
from .state import OptimizerView, grad_tensors, mark_replica, movable_tensors
from .stats import LoadStatistics

log = logging.getLogger(__name__)


@dataclasses.dataclass
class BalancedLayer:
    """One MoE layer as the balancer sees it: its slot table and its P local slots' params."""

    table: SlotTable
    slot_params: list[list[torch.nn.Parameter]]  # [P][k]
    # Checkpointed statistics (kept current by the balancer at each reduction and before a
    # save): [window + 2, E] (LoadStatistics.pack), float64 or its bits in an int64 tensor
    # (stats_values), and int64 [4] (reductions held, average set, balancer steps, 1 once written).
    saved_stats: torch.Tensor | None = None
    saved_meta: torch.Tensor | None = None


def stats_values(buffer: torch.Tensor) -> torch.Tensor:
    """The float64 statistics a checkpointed buffer holds. A model's buffer keeps them as the
    bits of an int64 tensor: Megatron's Float16Module casts every floating-point buffer to
    bf16 / fp16 (counts rounded, above 65504 inf), integer ones it leaves alone."""
    if buffer.dtype == torch.int64:
        return buffer.view(torch.float64)
    if buffer.dtype != torch.float64:
        raise ValueError(f"statistics buffer is {buffer.dtype}: it must stay float64 or hold float64 bits as "
                         "int64 (a cast to low precision rounds the token counts)")
    return buffer


def native_placement(num_layers: int, num_experts: int, num_slots: int, num_ranks: int) -> torch.Tensor:
    """[L, S] what freshly built experts hold: rank r's first E/W slots hold experts r*E/W + j;
    spare slots hold nothing yet (-1)."""
    P, per_rank = num_slots // num_ranks, num_experts // num_ranks
    row = torch.full((num_slots,), -1, dtype=torch.int64)
    for r in range(num_ranks):
        row[r * P : r * P + per_rank] = torch.arange(r * per_rank, (r + 1) * per_rank)
    return row.expand(num_layers, num_slots).clone()


class ExpertBalancer:
    def __init__(self, layers: list[BalancedLayer], *, num_experts: int, slots_per_rank: int, ep_group=None,
                 stats_groups=None, num_nodes: int = 1, interval: int = 100, window: int = 1,
                 decay: float | None = None, min_gain: float = 0.0, tolerance: float | None = None,
                 move_budget: float | None = None, rdma_weight: float | None = None,
                 optimizer_view: OptimizerView | None = None,
                 report_dir: str | None = None, is_reporter: bool | None = None, writers=(),
                 layer_numbers: list[int] | None = None):
        self.layers = list(layers)
        if not self.layers:
            raise ValueError("layers: the expert balancer needs at least one MoE layer")
        self.ep_group = ep_group
        self.num_ranks = dist.get_world_size(ep_group) if dist.is_initialized() else 1
        self.rank = dist.get_rank(ep_group) if dist.is_initialized() else 0
        self.num_experts = num_experts
        self.slots_per_rank = slots_per_rank
        self.num_slots = slots_per_rank * self.num_ranks
        if num_experts % self.num_ranks:
            raise ValueError(f"num_experts ({num_experts}) must be a multiple of the EP size ({self.num_ranks})")
        if self.num_slots < num_experts:
            raise ValueError(
                f"slots_per_rank ({slots_per_rank}) x EP size ({self.num_ranks}) = {self.num_slots} slots, "
                f"fewer than the {num_experts} experts"
            )
        if not is_int(num_nodes, 1):
            raise ValueError(f"num_nodes must be an integer >= 1, got {num_nodes!r}")
        if self.num_ranks % num_nodes:
            raise ValueError(f"num_nodes ({num_nodes}) must divide the EP size ({self.num_ranks})")
        for i, layer in enumerate(self.layers):
            if layer.table.num_slots != self.num_slots or len(layer.slot_params) != slots_per_rank:
                raise ValueError(
                    f"layer {i}: {layer.table.num_slots} slots / {len(layer.slot_params)} local, "
                    f"expected {self.num_slots} / {slots_per_rank}"
                )
        if not is_int(interval, 1):
            raise ValueError(f"interval must be an integer >= 1, got {interval!r}")
        if not math.isfinite(min_gain):
            raise ValueError(f"min_gain must be a finite number, got {min_gain!r}")
        check_knobs(tolerance=tolerance, move_budget=move_budget, rdma_weight=rdma_weight)
        self.num_nodes = num_nodes
        # plan_placement's: None the node-agnostic plan (routes spread over all copies), a number
        # the node-aware plan, whose routes take the copies on their own node (slots.py)
        self.rdma_weight = None if rdma_weight is None else float(rdma_weight)
        # nodes the replica choice spreads by locality over (1: the spreading rule)
        self.routing_nodes = num_nodes if self.rdma_weight is not None else 1
        for layer in self.layers:
            layer.table.set_shape(self.num_ranks, self.routing_nodes)
        self.interval = interval
        self.min_gain = min_gain
        # plan_placement's; None: its default (the planner loads at the first rebalance)
        self.tolerance = None if tolerance is None else float(tolerance)
        # most slots per layer one rebalance migrates, as a fraction (None: no cap)
        self.move_budget = None if move_budget is None else float(move_budget)
        self.view = optimizer_view or OptimizerView()
        self.stats_groups = [ep_group] if stats_groups is None else list(stats_groups)
        device = self.layers[0].table.slot_to_expert_S.device
        self.stats = LoadStatistics(len(self.layers), num_experts, window=window, decay=decay, device=device)
        self.report_dir = report_dir
        self.is_reporter = (self.rank == 0 and (not dist.is_initialized() or dist.get_rank() == 0)) \
            if is_reporter is None else is_reporter
        self.writers = list(writers)
        # the model's layer numbers (Megatron counts from 1), for the report's tables and plots
        numbers = range(1, len(self.layers) + 1) if layer_numbers is None else layer_numbers
        self.layer_numbers = [int(n) for n in numbers]
        if len(self.layer_numbers) != len(self.layers):
            raise ValueError(f"layer_numbers has {len(self.layer_numbers)} entries for {len(self.layers)} MoE layers")
        self.steps = 0
        self._rows_LS = None  # host mirror of the tables: reading them per step would sync
        self._replicas = None  # which replicas each gradient sum covers, for the placement in _rows_LS
        self.refresh_from_tables()
        self.last_summary: dict | None = None
        self.events: list[dict] = []
        self._reported_step = -(2 ** 62)  # reductions after this step go into the next report
        self._earlier = None  # (history, steps) of the run this one resumed, from its report dir

    # -- placement ---------------------------------------------------------------------------

    def placement_rows(self) -> torch.Tensor:
        """[L, S] the placement now in effect (host copy of the device tables)."""
        return self._rows_LS.clone()

    def refresh_from_tables(self) -> None:
        """Re-read the device tables (after something other than the balancer wrote them,
        e.g. a checkpoint load); one host read."""
        self._rows_LS = torch.stack([layer.table.slot_to_expert_S.detach().cpu() for layer in self.layers])
        self._replicas = None
        if bool((self._rows_LS >= 0).all()):
            for i, layer in enumerate(self.layers):
                layer.table.load_(self._rows_LS[i])
            self._mark_duplicates(self._rows_LS)

    def _placement(self, rows=None):
        from .placement import Placement

        rows = self.placement_rows() if rows is None else rows
        return Placement(slot_to_expert=rows, num_ranks=self.num_ranks, num_nodes=self.num_nodes,
                         num_experts=self.num_experts)

    def _slot_tensors(self, layer: int, local: int) -> list[torch.Tensor]:
        return [t for p in self.layers[layer].slot_params[local] for t in movable_tensors(p, self.view)]

    def _slot_slices(self, layer: int, local: int):
        return [self.view.sharded_slice(p) for p in self.layers[layer].slot_params[local]]

    def _slot_grads(self, layer: int, local: int) -> list:
        """One gradient piece per parameter of a replicated slot, in order: the replica sum
        lines pieces up by position, so a missing one would shift the rest."""
        out = []
        for p in self.layers[layer].slot_params[local]:
            piece = self.view.grad_piece(p)
            if piece is None and not self.view.sharded:
                # a replica its rank's forward did not use: its gradient is zero, and it takes
                # the sum like every other replica (left without one, the optimizer would skip
                # it while the other replicas step, and the copies would drift apart)
                p.grad = torch.zeros_like(p)
                piece = self.view.grad_piece(p)
            if piece is None:
                raise RuntimeError(f"layer {layer}, local slot {local}: a replicated expert's parameter has no "
                                   "gradient storage for the replica sum (main_grad)")
            out.append(piece)
        return out

    def apply_placement(self, new_LS: torch.Tensor, old_LS: torch.Tensor | None = None) -> dict:
        """Migrate slot contents from `old` (default: the tables) to `new`; update the tables."""
        new_LS = torch.as_tensor(new_LS, dtype=torch.int64).cpu()
        old_LS = self.placement_rows() if old_LS is None else torch.as_tensor(old_LS, dtype=torch.int64).cpu()
        if tuple(new_LS.shape) != (len(self.layers), self.num_slots):
            raise ValueError(f"placement has shape {tuple(new_LS.shape)}, this balancer needs "
                             f"({len(self.layers)}, {self.num_slots}) (layers, slots)")
        for i, layer in enumerate(self.layers):  # before any slot moves: a bad row must not half-migrate
            try:
                layer.table.tables_for(new_LS[i], layer.table.num_experts, layer.table.max_replicas)
            except ValueError as exc:
                raise ValueError(f"placement layer {i}: {exc}") from None
        transfers = plan_transfers(old_LS, new_LS, self.num_ranks)
        self.view.start_migration()
        if self.view.sharded:
            moved = migrate_shards_(self._slot_slices, transfers, rank=self.rank, num_ranks=self.num_ranks,
                                    slots_per_rank=self.slots_per_rank, group=self.ep_group,
                                    shard_group=self.view.shard_group)
        else:
            moved = migrate_slots_(self._slot_tensors, transfers, rank=self.rank, num_ranks=self.num_ranks,
                                   slots_per_rank=self.slots_per_rank, group=self.ep_group)
        self.view.finish_migration()
        P = self.slots_per_rank
        for t in transfers:
            if t.dst_slot // P == self.rank:
                for p in self.layers[t.layer].slot_params[t.dst_slot % P]:
                    for g in grad_tensors(p, self.view):
                        g.zero_()
        for i, layer in enumerate(self.layers):
            layer.table.load_(new_LS[i])
        self._rows_LS = new_LS.clone()
        self._replicas = None
        self._mark_duplicates(new_LS)
        moved["slots_changed"] = len(transfers)
        return moved

    def _mark_duplicates(self, rows_LS: torch.Tensor) -> None:
        """Only the first slot of each expert counts in gradient-norm and params-norm statistics."""
        P = self.slots_per_rank
        for i, layer in enumerate(self.layers):
            row = rows_LS[i].tolist()
            first = {}
            for s, e in enumerate(row):
                first.setdefault(e, s)
            for j in range(P):
                s = self.rank * P + j
                for p in layer.slot_params[j]:
                    self.view.mark_duplicate(p, first[row[s]] != s)
                    mark_replica(p, first[row[s]] != s)

    def setup(self, initial_LS: torch.Tensor | None = None) -> dict:
        """Install the first placement over freshly built experts (collective over EP).

        initial_LS: [L, S] (default: Placement.identity: the usual placement, spare slots
        holding replicas).
        """
        from .placement import Placement

        if initial_LS is None:
            initial_LS = Placement.identity(len(self.layers), self.num_experts, self.num_slots,
                                            self.num_ranks, self.num_nodes).slot_to_expert
        native = native_placement(len(self.layers), self.num_experts, self.num_slots, self.num_ranks)
        return self.apply_placement(initial_LS, old_LS=native)

    # -- per step ----------------------------------------------------------------------------

    def record(self, layer: int, routed_per_expert_E: torch.Tensor) -> None:
        self.stats.record(layer, routed_per_expert_E)

    def before_optimizer_step(self) -> int:
        """Sum replicas' gradients over their holders (one all_reduce per dtype, replicated experts only)."""
        if self.num_slots == self.num_experts:
            return 0
        if self._replicas is None:
            self._replicas = replica_placement(self._rows_LS, rank=self.rank, num_ranks=self.num_ranks)
        return sum_replica_grads_(None, self._slot_grads, rank=self.rank, num_ranks=self.num_ranks,
                                  group=self.ep_group, replicas=self._replicas,
                                  shard_group=self.view.shard_group if self.view.sharded else None)

    def after_optimizer_step(self, iteration: int | None = None) -> dict | None:
        """Count a step; every `interval` steps reduce the statistics and maybe migrate."""
        self.steps += 1
        if self.steps % self.interval:
            return None
        return self.rebalance(iteration if iteration is not None else self.steps)

    def rebalance(self, iteration: int) -> dict:
        """Reduce the statistics (collective), plan, migrate when the gain is worth it."""
        t0 = time.perf_counter()
        load_LE = self.stats.reduce(self.stats_groups, step=iteration)
        event = self._plan_and_apply(load_LE, iteration, t0)
        self._write_saved()
        return event

    def replan(self, iteration: int | None = None) -> dict:
        """Plan from the statistics held now (no reduction) and migrate: after a checkpoint
        saved with another EP size is loaded, the placement follows the saved load. Saved
        before the first reduction, the counts since then (the carry) are all there is."""
        load_LE = self.stats.load()
        if not load_LE.any():
            load_LE = self.stats.carry_LE.copy()
        return self._plan_and_apply(load_LE, self.steps if iteration is None else iteration, time.perf_counter())

    def _plan_and_apply(self, load_LE, iteration: int, t0: float) -> dict:
        from .metrics import imbalance_ratio, rank_loads, scalars, summarize
        from .planner import plan_placement

        before = self._placement()
        tolerance = {} if self.tolerance is None else {"tolerance": self.tolerance}
        planned = plan_placement(load_LE, self.num_slots, self.num_nodes, self.num_ranks, previous=before,
                                 move_budget=self.move_budget, rdma_weight=self.rdma_weight, **tolerance)
        nodes = self.routing_nodes
        old_imb = imbalance_ratio(rank_loads(load_LE, before.slot_to_expert, self.num_ranks, nodes=nodes)).mean()
        new_imb = imbalance_ratio(rank_loads(load_LE, planned.slot_to_expert, self.num_ranks, nodes=nodes)).mean()
        applied = bool(load_LE.sum() > 0 and float(old_imb) - float(new_imb) > self.min_gain)
        plan_s = time.perf_counter() - t0
        moved = self.apply_placement(planned.slot_to_expert) if applied else {"slots_changed": 0}
        summary = summarize(load_LE, before, planned if applied else before, nodes=nodes)
        event = {
            "iteration": int(iteration), "applied": applied, "plan_seconds": plan_s,
            "migrate_seconds": time.perf_counter() - t0 - plan_s,
            "imbalance_rank_before": float(old_imb), "imbalance_rank_after": float(new_imb if applied else old_imb),
            **{k: int(v) for k, v in moved.items()},
            "moved_bytes": int(moved["slots_changed"]) * self.bytes_per_slot(),
        }
        self.events.append(event)
        self.last_summary = summary
        # every rank that was given writers writes (every rank holds the same summary):
        # Megatron-LM creates its TensorBoard and wandb writers on its last rank only
        if self.writers:
            values = scalars(summary, layer_numbers=self.layer_numbers)
            values.update({"balancer/applied": float(applied), "balancer/slots_changed": float(moved["slots_changed"]),
                           "balancer/moved_bytes": float(event["moved_bytes"])})
            for write in self.writers:
                write(values, int(iteration))
        if self.is_reporter:
            if self.report_dir:
                self.write_report(iteration)
            log.info("hybrid_ep balancer at iteration %d: rank imbalance %.3f -> %.3f, %s, %d slots changed "
                     "(%.3g GiB of weights and optimizer state per EP group)", iteration, old_imb,
                     event["imbalance_rank_after"], "applied" if applied else "kept", moved["slots_changed"],
                     event["moved_bytes"] / 2 ** 30)
        return event

    def write_report(self, iteration: int) -> dict:
        """JSON summary, heatmap PNGs and the statistics of the reductions since the last report
        under report_dir/iter_<N>/; the whole kept history in report_dir/statistics.npz, replaced
        each time (a full copy per rebalance grew the folder with the square of the run's length)."""
        from .report import save_statistics, write_report

        out = os.path.join(self.report_dir, f"iter_{int(iteration):07d}")
        os.makedirs(out, exist_ok=True)
        history = self.stats.history_array()
        steps = np.asarray(self.stats.history_steps, dtype=np.int64)
        new = steps > self._reported_step
        common = dict(ep_size=self.num_ranks, layer_numbers=np.asarray(self.layer_numbers))
        save_statistics(os.path.join(out, "statistics.npz"), self.stats.load(), history=history[new],
                        steps=steps[new], **common)
        whole = os.path.join(self.report_dir, "statistics.npz")
        earlier = self._earlier
        if earlier is None:
            # before this process's first reduction (a re-plan at a resume into another EP
            # size) the earlier run's file is kept up to this step, and looked at again later
            first = int(steps.min()) if len(steps) else int(iteration) + 1
            earlier = self._earlier_history(whole, history.shape[1:], first)
            if len(steps):
                self._earlier = earlier
        kept = self.stats.history.maxlen
        whole_history = np.concatenate([earlier[0], history])[-kept:]
        whole_steps = np.concatenate([earlier[1], steps])[-kept:]
        save_statistics(whole + ".tmp", self.stats.load(), history=whole_history, steps=whole_steps, **common)
        os.replace(whole + ".tmp", whole)  # a reader never sees half a file
        self._reported_step = int(iteration)
        return write_report({**self.last_summary, "layer_numbers": list(self.layer_numbers)}, out,
                            history=self._rank_history(history), step=int(iteration),
                            layer_names=[f"layer {n}" for n in self.layer_numbers],
                            bytes_per_slot=self.bytes_per_slot())

    def _earlier_history(self, path: str, shape, first_step: int) -> tuple[np.ndarray, np.ndarray]:
        """The reductions a resumed run's report dir already holds from before this process's
        first one: the checkpoint carries the statistics window, not the history, so without
        them the whole-run file would restart at the resume. Only a file of these layers and
        experts counts, and only its reductions before `first_step` (a new run from step 0
        into an old report dir keeps none)."""
        from .report import load_statistics

        none = (np.zeros((0, *shape)), np.zeros(0, dtype=np.int64))
        if not os.path.exists(path):
            return none
        try:
            old = load_statistics(path)
        except (OSError, ValueError):
            log.warning("hybrid_ep balancer: %s is not a statistics file; the whole-run history restarts", path)
            return none
        same = ("history" in old and "steps" in old and old["history"].shape[1:] == tuple(shape)
                and list(old.get("layer_numbers", [])) == list(self.layer_numbers))
        if not same:
            return none
        before = old["steps"] < first_step
        return old["history"][before], old["steps"][before]

    def bytes_per_slot(self) -> int:
        """Bytes a moved slot carries: the tensors a migration moves for it (weights, master
        copy, optimizer state; only the weights before the optimizer's first step), the most
        over this rank's slots of the first layer. Under the distributed optimizer from this
        member's pieces: their bytes per element times the slot's elements."""
        best = 0
        for params in self.layers[0].slot_params:
            if self.view.sharded:
                pieces = [self.view.sharded_slice(p) for p in params]
                per_element = max((sum(t.element_size() for t in sl.tensors) for sl in pieces
                                   if sl.tensors[0].numel()), default=params[0].element_size())
                total = sum(p.numel() for p in params) * per_element
            else:
                total = sum(t.numel() * t.element_size() for p in params for t in movable_tensors(p, self.view))
            best = max(best, total)
        return best

    def _rank_history(self, history_TLE: np.ndarray) -> np.ndarray:
        """[T, L, W] tokens per rank of each interval under the current placement."""
        from .metrics import rank_loads

        rows = self.placement_rows()
        if history_TLE.shape[0] == 0:
            return np.zeros((0, len(self.layers), self.num_ranks))
        return np.stack([np.asarray(rank_loads(h, rows, self.num_ranks, nodes=self.routing_nodes))
                         for h in history_TLE])

    # -- checkpoint --------------------------------------------------------------------------

    def prepare_checkpoint(self) -> None:
        """Before a save, on every rank (collective over the statistics groups): fold the
        counts since the last reduction into the statistics and write them, with the step
        count, into each layer's checkpointed buffers."""
        self.stats.flush(self.stats_groups)
        self._write_saved()

    def _write_saved(self) -> None:
        for i, layer in enumerate(self.layers):
            if layer.saved_stats is None:
                continue
            packed, held, has_ema = self.stats.pack(i)
            if tuple(layer.saved_stats.shape) != packed.shape:
                raise ValueError(f"layer {i}: statistics buffer {tuple(layer.saved_stats.shape)}, "
                                 f"the statistics need {packed.shape}")
            stats_values(layer.saved_stats).copy_(torch.from_numpy(packed))
            layer.saved_meta.copy_(torch.tensor([held, int(has_ema), self.steps, 1]))

    def restore_saved(self) -> bool:
        """Statistics and step count from the layers' checkpointed buffers, when a checkpoint
        filled them (one host read); returns whether it did."""
        if any(layer.saved_meta is None for layer in self.layers):
            return False
        metas = [layer.saved_meta.cpu().tolist() for layer in self.layers]
        if not all(m[3] == 1 for m in metas):
            return False
        held, has_ema, steps = metas[0][:3]
        self.stats.unpack([stats_values(layer.saved_stats).cpu().numpy() for layer in self.layers], held,
                          bool(has_ema))
        self.steps = int(steps)
        return True

    def state_dict(self) -> dict:
        return {"placement": self.placement_rows(), "num_ranks": self.num_ranks, "num_slots": self.num_slots,
                "num_experts": self.num_experts, "steps": self.steps, "stats": self.stats.state_dict()}

    def load_state_dict(self, state: dict, *, migrate: bool = False) -> None:
        """Restore placement, step count and statistics.

        migrate=False: the slot contents were restored with the placement (same checkpoint),
        only the tables are set. migrate=True: the slots hold the placement now in effect and
        are moved to the saved one.
        """
        mine_by_key = (("num_experts", self.num_experts), ("num_slots", self.num_slots), ("num_ranks", self.num_ranks))
        for key, mine in mine_by_key:
            if int(state[key]) != mine:
                raise ValueError(
                    f"checkpoint's expert placement has {key}={state[key]}, this run has {mine}: a placement "
                    "only loads into the same experts, slots and EP size"
                )
        rows = torch.as_tensor(state["placement"], dtype=torch.int64)
        if rows.dim() != 2 or rows.shape[0] != len(self.layers):
            raise ValueError(
                f"checkpoint's expert placement has shape {tuple(rows.shape)}, this run has {len(self.layers)} "
                f"balanced MoE layers of {self.num_slots} slots"
            )
        if migrate:
            self.apply_placement(rows)
        else:
            for i, layer in enumerate(self.layers):
                layer.table.load_(rows[i])
            self.refresh_from_tables()
        self.steps = int(state["steps"])
        self.stats.load_state_dict(state["stats"])
