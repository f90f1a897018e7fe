"""Derived parallel sizes and the pipeline split of a pretraining recipe.

Megatron's two decompositions of the same world (W GPUs):

    dense (attention, embeddings, dense MLPs):  W = TP x CP x DP x PP
    experts (MoE MLPs):                         W = ETP x EP x EDP x PP

so EP x ETP must divide TP x CP x DP = W / PP, and the expert data-parallel size is
EDP = W / (PP x EP x ETP). The pipeline split puts `first_stage_layers` and
`last_stage_layers` (when set) on the first and last stage and the rest evenly on the
others; with `account_for_embedding` / `account_for_loss` the embedding and the loss
count as one layer each (Megatron's --account-for-*-in-pipeline-split).
"""

from __future__ import annotations

import dataclasses

from hybrid_ep.wording import plural


@dataclasses.dataclass(frozen=True)
class ParallelShape:
    world: int
    tp: int
    pp: int
    vpp: int
    cp: int
    dp: int
    ep: int
    etp: int
    edp: int

    def describe(self, on_cpu: bool = False) -> str:
        """One line; on_cpu counts CPU processes (local mode without GPUs) instead of GPUs."""
        ranks = (f"{self.world} CPU {'process' if self.world == 1 else 'processes'}" if on_cpu
                 else plural(self.world, "GPU"))
        return (f"{ranks} = TP {self.tp} x PP {self.pp} x CP {self.cp} x DP {self.dp}; "
                f"experts: EP {self.ep} x ETP {self.etp} x EDP {self.edp} per stage"
                + (f"; VPP {self.vpp}" if self.vpp > 1 else ""))


def shape_of(recipe) -> ParallelShape:
    """Sizes from the recipe; DP and EDP are rounded down (validate() checks they divide)."""
    p = recipe["parallelism"]
    world = recipe["cluster.nodes"] * recipe["cluster.gpus_per_node"]
    tp, pp, cp, ep, etp = (max(1, p[k]) for k in ("tp", "pp", "cp", "ep", "etp"))
    return ParallelShape(world=world, tp=tp, pp=pp, vpp=p["vpp"] or 1, cp=cp, dp=world // (tp * pp * cp),
                  ep=ep, etp=etp, edp=world // (pp * ep * etp))


def stage_layers(recipe) -> list[int]:
    """Transformer layers on each pipeline stage (embedding / loss slots removed).

    Raises ValueError when the layers do not split (validate() reports it with the field).
    """
    p, layers = recipe["parallelism"], recipe["model.num_layers"]
    pp = max(1, p["pp"])
    vpp = p["vpp"] or 1
    if pp == 1:
        return [layers]
    first, last = p["first_stage_layers"], p["last_stage_layers"]
    slots = layers + int(p["account_for_embedding"]) + int(p["account_for_loss"])
    middle_stages = pp - (first is not None) - (last is not None)
    rest = slots - (first or 0) - (last or 0)
    if middle_stages <= 0 or rest < 0 or rest % (middle_stages * vpp):
        raise ValueError(f"{plural(rest, 'layer')} cannot be split evenly over {plural(middle_stages, 'stage')} "
                         f"x VPP {vpp}")
    per = rest // middle_stages
    stages = [per] * pp
    if first is not None:
        stages[0] = first
    if last is not None:
        stages[-1] = last
    if p["account_for_embedding"]:
        stages[0] -= 1
    if p["account_for_loss"]:
        stages[-1] -= 1
    if min(stages) < 0:
        raise ValueError("a stage would hold a negative number of layers")
    return stages
