"""The calibration step of a pretraining recipe: the measurement `auto` follows, made before training.

`dispatcher.calibrate` null (the default) calibrates wherever it applies, false skips it, true
where it cannot apply is an error (validate.py, domain.py). It applies to the hybrid_ep
dispatcher with backend auto, where one EP x ETP group fits on hosts of its own: that group's
ranks run `hybrid-ep-bench --calibrate --reuse` at the dispatcher's shape
(dispatcher_memory.buffer_config: hidden size, tokens per rank, experts; the recipe's top-k;
bf16 rows, fp8 under precision fp8) within `dispatcher.calibrate_time_limit_s` seconds, before
the training step, whose buffers' auto reads the same evidence file ($HYBRID_EP_AUTO_EVIDENCE).

The evidence is kept per recipe beside the job folders, as the checkpoints are
(results/<name>/auto-evidence.json for output.dir results/<name>/${SLURM_JOB_ID}): a later job
on the same device with the same versions, topology and shape reuses the entry and starts
training at once; a change of any of them measures again. The step cannot end the job
(render.calibration): whatever its exit status the script goes on to train, and a failure (a
rank's error, the bound, a crash) is in the evidence, where auto reads it and keeps reference,
naming the failure in its log line.
"""

from __future__ import annotations

import math

from hybrid_ep.backends.evidence import describe_shape
from hybrid_ep.wording import plural

from . import domain
from .megatron_args import beside_job_folders

EVIDENCE_NAME = "auto-evidence.json"
# Minutes Slurm gives the step beyond the bound: its tasks' start (container, imports) and the
# SIGTERM-to-SIGKILL wait; the calibration's own bound ends it first.
STEP_MARGIN_MIN = 3


def skipped(recipe) -> str | None:
    """Why the recipe runs no calibration step, or None where it runs one."""
    if recipe.kind != "pretrain":
        return "a benchmark recipe"
    if recipe["dispatcher.calibrate"] is False:
        return "dispatcher.calibrate is false"
    if recipe["dispatcher.type"] != "hybrid_ep":
        return f"dispatcher.type is {recipe['dispatcher.type']}"
    if recipe["dispatcher.backend"] != "auto":
        return f"dispatcher.backend is {recipe['dispatcher.backend']}, not auto"
    if domain.calibration_misfit(recipe):
        return domain.calibration_misfit(recipe)
    return None


def evidence_file(recipe) -> str:
    """The recipe's evidence file, from the job's working directory (may hold shell variables, as
    output.dir may)."""
    return beside_job_folders(recipe, EVIDENCE_NAME)


def shape(recipe) -> dict:
    """What the step measures: the dispatcher's buffer, as hybrid-ep-bench's flags name it."""
    from .dispatcher_memory import buffer_config

    config = buffer_config(recipe)
    return {"hidden": config.hidden_dim, "tokens_per_rank": config.max_tokens_per_rank,
            "topk": recipe["model.moe_router_topk"], "experts": config.num_experts,
            "dtype": "fp8" if recipe["precision"].startswith("fp8") else "bf16",
            "ranks": config.world_size, "ranks_per_node": config.ranks_per_node}


def bench_args(recipe, device: str = "cuda") -> list[str]:
    """hybrid-ep-bench's arguments for the step (the evidence file comes from $HYBRID_EP_AUTO_EVIDENCE)."""
    s = shape(recipe)
    return ["--calibrate", "--reuse", "--hidden", str(s["hidden"]), "--tokens", str(s["tokens_per_rank"]),
            "--experts", str(s["experts"]), "--topk", str(s["topk"]), "--dtype", s["dtype"],
            "--ranks-per-node", str(s["ranks_per_node"]), "--device", device,
            "--time-limit", str(recipe["dispatcher.calibrate_time_limit_s"])]


def step_minutes(recipe) -> int:
    """Slurm's limit on the step (srun --time, whole minutes): the bound and STEP_MARGIN_MIN."""
    return math.ceil(recipe["dispatcher.calibrate_time_limit_s"] / 60) + STEP_MARGIN_MIN


def describe(recipe) -> str | None:
    """What the job measures before training, in one line (None for a recipe without a dispatcher to calibrate)."""
    why = skipped(recipe)
    if why is not None:
        if recipe.kind != "pretrain" or recipe["dispatcher.type"] != "hybrid_ep":
            return None
        return f"no calibration ({why}): auto follows {evidence_file(recipe)} where it holds an entry, else its rule"
    s = shape(recipe)
    hosts, tasks = domain.group_hosts(recipe)
    return (f"calibration before training: one EP group of {plural(s['ranks'], 'rank')} ({plural(hosts, 'host')} x "
            f"{tasks}) times reference against cuda at {describe_shape(s)}, {s['experts']} experts, within "
            f"{recipe['dispatcher.calibrate_time_limit_s']} s; evidence {evidence_file(recipe)}, reused while "
            "device, versions, topology and shape match (dispatcher.calibrate=false skips it)")
