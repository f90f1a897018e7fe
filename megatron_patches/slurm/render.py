"""A recipe as an sbatch script (text).

One task per GPU (`srun --ntasks-per-node G`); each task exports the torch.distributed
variables Megatron reads (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) from Slurm's and runs the command. Pretraining runs
`python -m megatron_patches.pretrain_gpt <Megatron arguments>`; the benchmark recipe runs
`python -m hybrid_ep.bench` once per node count in one allocation. Every value from the
recipe is shell-quoted; `bash -n` accepts every rendered script (tested). Where the job's NVLink
domain spans hosts (cluster.nvlink_domain, domain.py) the header asks for `#SBATCH --segment`,
and every task of a run whose hybrid_ep domain spans hosts first runs FABRIC_CHECK (an IMEX
channel and pynvml).

Where the files land. Slurm opens the job's log before the script runs and creates no
folders, and `#SBATCH` lines expand no shell variables. So the log goes to `log_dir`, the
longest leading part of output.dir without variables (results/<name> for
results/<name>/${SLURM_JOB_ID}), which `hybrid-ep-launch --submit` creates before it calls
sbatch; the per-job folder OUT_DIR is created by the script. Both resolve from the job's
working directory: cluster.workdir as `#SBATCH --chdir` (validation refuses one with
variables), else the folder sbatch runs in.
"""

from __future__ import annotations

import os
import re
import shlex

from . import calibration as calibration_mod
from . import domain, site_fields
from . import recipe as recipe_mod
from .megatron_args import CHECKPOINT_PATH_FLAGS, megatron_args

_RANK_ENV = (
    'export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID" '
    'LOCAL_WORLD_SIZE="$SLURM_NTASKS_PER_NODE"'
)


def _q(value) -> str:
    return shlex.quote(str(value))


# A path component that depends on the job: shell expansion (OUT_DIR is a double-quoted shell
# string) or one of Slurm's filename patterns (%j, %x, ... in --output).
_JOB_DEPENDENT = re.compile(r"[$`%\\]")


def log_dir(recipe) -> str:
    """The folder of the Slurm log, from the job's working directory: the longest leading part
    of output.dir whose components have no variables ("results/x" for "results/x/${SLURM_JOB_ID}",
    output.dir itself when it has none), "." when its first component has one."""
    out = recipe["output.dir"]
    static = []
    for part in out.split("/"):
        if _JOB_DEPENDENT.search(part):
            break
        if part not in ("", "."):
            static.append(part)
    if not static:
        return "."
    return ("/" if out.startswith("/") else "") + "/".join(static)


def log_dir_to_create(recipe) -> str:
    """log_dir as a path from the folder sbatch runs in (cluster.workdir, the job's --chdir,
    joined when set): what `hybrid-ep-launch --submit` creates before it calls sbatch."""
    workdir = recipe["cluster.workdir"]
    return os.path.normpath(os.path.join(workdir, log_dir(recipe))) if workdir else log_dir(recipe)


def log_file(recipe) -> str:
    """The `#SBATCH --output` path (%j: Slurm's job id)."""
    folder = log_dir(recipe)
    return "slurm-%j.out" if folder == "." else f"{folder}/slurm-%j.out"


def _sbatch_path(path: str) -> str:
    """A path as an #SBATCH value: sbatch splits unquoted values at whitespace, and honours
    double quotes (validation refuses paths with a double quote)."""
    return f'"{path}"' if any(ch.isspace() for ch in path) else path


def _where_comments(recipe) -> list[str]:
    workdir, folder = recipe["cluster.workdir"], log_dir(recipe)
    base = f"cluster.workdir {workdir} (#SBATCH --chdir)" if workdir else "the folder sbatch is run in"
    lines = [f"# Slurm log: {log_file(recipe).replace('%j', '<job id>')}"
             + ("" if folder.startswith("/") else f", from {base}") + "."]
    if folder != "." or workdir:
        lines += ["#   Slurm opens it before this script runs and creates no folders: hybrid-ep-launch --submit",
                  f"#   creates {log_dir_to_create(recipe)} first; before sbatch by hand, mkdir -p it."]
    lines.append(f"# Results: OUT_DIR={recipe['output.dir']} (created by this script).")
    return lines


def _data_comments(recipe) -> list[str]:
    """What the job trains on: mock data is said, since it reads no dataset."""
    if recipe.kind != "pretrain":
        return []
    d = recipe["data"]
    if d["mock"]:
        return ["# Data: MOCK (data.mock true): synthetic tokens, no dataset is read."]
    if d["blend"]:
        return [f"# Data: a blend of {len(d['blend'])} datasets (data.blend), tokenizer {d['tokenizer_type']}."]
    return [f"# Data: {d['path']} (data.path), tokenizer {d['tokenizer_type']}."]


def _source(recipe) -> str:
    """The recipe as the header names it: a shipped one by name (the same text from a clone and
    from an installed wheel), any other by its path."""
    name = recipe_mod.shipped_name(recipe.path)
    return f"the recipe {name} shipped with hybrid-ep" if name else recipe.path


def _header(recipe, nodes: int, job_name: str) -> list[str]:
    c = recipe["cluster"]
    lines = [
        "#!/bin/bash",
        f"# Rendered by hybrid-ep-launch from {_source(recipe)}",
        f"# overrides: {' '.join(recipe.overrides) if recipe.overrides else 'none'}",
        "# Edit the recipe (or pass --set key=value), not this file.",
        *_where_comments(recipe),
        *_data_comments(recipe),
        *domain.comment_lines(recipe),
        *site_fields.header_lines(recipe),
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={c['gpus_per_node']}",
        f"#SBATCH --gpus-per-node={c['gpus_per_node']}",
        *_segment(recipe),
        f"#SBATCH --time={c['time']}",
    ]
    if c["workdir"]:
        lines.append(f"#SBATCH --chdir={_sbatch_path(c['workdir'])}")
    lines.append(f"#SBATCH --output={_sbatch_path(log_file(recipe))}")
    if c["partition"]:
        lines.append(f"#SBATCH --partition={c['partition']}")
    if c["account"]:
        lines.append(f"#SBATCH --account={c['account']}")
    if c["qos"]:
        lines.append(f"#SBATCH --qos={c['qos']}")
    if c["exclusive"]:
        lines.append("#SBATCH --exclusive")
    lines += [f"#SBATCH {extra}" for extra in c["sbatch_extra"]]
    lines += ["", "set -euo pipefail", ""]
    return lines


def _segment(recipe) -> list[str]:
    """Slurm's block topology keeps each set of `segment` hosts inside one NVLink domain, where
    the job's domains span hosts (domain.py); the node count is a multiple of it (validated)."""
    job = domain.job_domain(recipe)
    return [f"#SBATCH --segment={job.segment}"] if job.spans_hosts else []


def _task(module: str, fabric: bool) -> str:
    """The bash -c program of every task: the rank variables, FABRIC_CHECK where the run's
    hybrid_ep domains span hosts (`fabric`, _fabric_check), then `python -m module "$@"`."""
    check = 'eval "$FABRIC_CHECK"; ' if fabric else ""
    return f"'{_RANK_ENV}; {check}exec \"$0\" -m {module} \"$@\"'"


def _fabric_check(recipe) -> list[str]:
    """FABRIC_CHECK, exported to every task (srun passes the environment, pyxis into the
    container), where hybrid_ep's domains span hosts: one definition, read once, beside the
    short srun lines that run it."""
    if not domain.needs_fabric(recipe):
        return []
    return ["# NVLink domains across hosts: each task first checks for an IMEX channel and pynvml",
            "# (docs/slurm.md#nvlink-domains-across-hosts-gb200-nvl72)",
            f"export FABRIC_CHECK={_q(domain.fabric_check())}", ""]


def _environment(recipe) -> list[str]:
    lines = ["# Communication and runtime environment (recipe field env)"]
    for key, value in recipe["env"].items():
        lines.append(f"export {key}={_q(value)}")
    nics = site_fields.network_env(recipe)
    if nics:
        lines += ["", "# NICs (recipe section network)"]
        lines += [f"export {key}={_q(value)}" for key, value in nics.items()]
    lines += [
        "",
        "# Rendezvous: the first node of the allocation",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'export MASTER_PORT="${MASTER_PORT:-29500}"',
    ]
    out = recipe["output.dir"]  # from the job's working directory, as the log (#SBATCH --chdir)
    lines += [f'OUT_DIR="{out}"', 'mkdir -p "$OUT_DIR"', ""]
    return lines + _fabric_check(recipe)


def _srun_prefix(recipe, nodes: int, tasks_per_node: int | None = None, minutes: int | None = None) -> str:
    # --relative=0: a step on fewer nodes than the allocation starts at its first node, the
    # MASTER_ADDR of the script. minutes: the step's own time limit (srun --time).
    tasks = tasks_per_node or recipe["cluster.gpus_per_node"]
    parts = ["srun", f"--nodes={nodes}", f"--ntasks-per-node={tasks}",
             "--relative=0", "--kill-on-bad-exit=1", *([f"--time={minutes}"] if minutes else [])]
    image, mounts = recipe["container.image"], recipe["container.mounts"]
    if not image:
        return " ".join(parts)
    pyxis = [f"--container-image={_q(image)}"]
    if mounts:
        pyxis.append(f"--container-mounts={_q(','.join(mounts))}")
    # Relative paths (OUT_DIR, checkpoints) resolve in the container as on the host: it starts in
    # the job's working directory (which container.mounts must hold), not in the image's WORKDIR.
    workdir = recipe["container.workdir"]
    pyxis.append(f"--container-workdir={_q(workdir)}" if workdir else '--container-workdir="$PWD"')
    return " ".join(parts) + " \\\n  " + " ".join(pyxis)


def python_of(recipe) -> str:
    """The interpreter the tasks run: cluster.python, or `python` from the job's PATH when unset."""
    return recipe["cluster.python"] or "python"


def _array(name: str, items: list[str]) -> list[str]:
    """A bash array, one flag and all of its values per line (`--recompute-modules a b c`)."""
    lines = [f"{name}=("]
    for item in map(str, items):
        if item.startswith("--") or len(lines) == 1:
            lines.append(f"  {_q(item)}")
        else:
            lines[-1] += f" {_q(item)}"
    return lines + [")"]


PLACEHOLDER_LM_DIR = "/path/to/Megatron-LM"  # what the docs write for "your checkout"


def megatron_lm_dir(recipe) -> str | None:
    """The recipe's Megatron-LM checkout, None when unset or still the docs' placeholder."""
    value = recipe["megatron_lm_dir"]
    return None if value in (None, "", PLACEHOLDER_LM_DIR) else value


REPORT_DIR_FLAG = "--hybrid-ep-balancer-report-dir"


def _job_paths(args: list[str]) -> tuple[list[str], list[str]]:
    """(args without --save and --load, those flags with their paths double-quoted): the paths
    may hold shell variables, as output.dir does (validation refuses a double quote in them)."""
    kept, paths, i = [], [], 0
    while i < len(args):
        if args[i] in CHECKPOINT_PATH_FLAGS:
            paths.append(f'{args[i]} "{args[i + 1]}"')
            i += 2
        else:
            kept.append(args[i])
            i += 1
    return kept, paths


def _job_report_dir(args: list[str]) -> tuple[list[str], str | None]:
    """(args without a relative balancer report folder, that folder): a relative folder goes
    under the job's OUT_DIR, beside its tensorboard folder, not into the submit folder, which
    every job shares; an absolute one stays in args as given."""
    if REPORT_DIR_FLAG not in args:
        return args, None
    i = args.index(REPORT_DIR_FLAG)
    if os.path.isabs(args[i + 1]):
        return args, None
    return args[:i] + args[i + 2:], args[i + 1]


def calibration(recipe) -> list[str]:
    """With the hybrid_ep dispatcher and backend auto: the recipe's evidence file, which the
    training step's auto reads (HYBRID_EP_AUTO_EVIDENCE), then the calibration step where the
    recipe runs one (calibration.py): one EP group's ranks on hosts of their own, bounded by the
    calibration itself and by Slurm (srun --time), and never the end of the job: `|| echo` takes
    its exit status, so `set -e` goes on to training."""
    if recipe["dispatcher.type"] != "hybrid_ep" or recipe["dispatcher.backend"] != "auto":
        return []
    export = f'export HYBRID_EP_AUTO_EVIDENCE="{calibration_mod.evidence_file(recipe)}"'
    why = calibration_mod.skipped(recipe)
    if why is not None:
        return [f"# No calibration ({why}): auto follows the recipe's evidence where an earlier job left an entry.",
                export, ""]
    hosts, tasks = domain.group_hosts(recipe)
    limit = recipe["dispatcher.calibrate_time_limit_s"]
    srun = _srun_prefix(recipe, hosts, tasks, minutes=calibration_mod.step_minutes(recipe))
    return [
        "# auto's evidence (dispatcher.calibrate; docs/slurm.md#calibration): one EP group's ranks time reference",
        f"# against cuda at the dispatcher's shape, within {limit} s (Slurm ends the step "
        f"{calibration_mod.STEP_MARGIN_MIN} min later at the most).",
        "# An entry of this device, versions, topology and shape already in the file is reused. A failure never",
        "# ends the job: it is recorded in the file, and the training step's auto takes reference there.",
        export,
        f"{srun} bash -c \\",
        f"  {_task('hybrid_ep.bench', domain.needs_fabric(recipe))} \\",
        f"  {_q(python_of(recipe))} {' '.join(_q(v) for v in calibration_mod.bench_args(recipe))} \\",
        '  || echo "hybrid-ep: the calibration step ended with status $?; training starts, auto following '
        '$HYBRID_EP_AUTO_EVIDENCE where it holds an entry (a failure keeps reference), else its rule"',
        "",
    ]


def render_pretrain(recipe) -> str:
    c = recipe["cluster"]
    lines = _header(recipe, c["nodes"], c["job_name"] or f"hybrid-ep-{recipe.name}")
    lines += _environment(recipe)
    lm_dir = megatron_lm_dir(recipe)
    if lm_dir:
        lines.append(f"export MEGATRON_LM_DIR={_q(lm_dir)}")
    else:
        lines += ["# megatron_lm_dir is not set: pretrain_gpt.py comes from MEGATRON_LM_DIR exported when the job",
                  "# was submitted (sbatch passes the environment) or from PYTHONPATH in the container."]
    lines.append("")
    lines.append(f"# Megatron-LM pretrain_gpt.py arguments ({recipe['dispatcher.type']} dispatcher)")
    args, report_dir = _job_report_dir(megatron_args(recipe))
    args, checkpoint_paths = _job_paths(args)
    lines += _array("ARGS", args)
    lines += ['ARGS+=(--tensorboard-dir "$OUT_DIR/tensorboard")']
    if checkpoint_paths:
        lines.append(f"ARGS+=({' '.join(checkpoint_paths)})  # checkpoint (recipe section checkpoint)")
    if report_dir is not None:
        lines.append(f'ARGS+=(--hybrid-ep-balancer-report-dir "$OUT_DIR"/{_q(report_dir)})')
    lines.append("")
    lines += calibration(recipe)
    py = _q(python_of(recipe))
    lines += [
        f"{_srun_prefix(recipe, c['nodes'])} bash -c \\",
        f"  {_task('megatron_patches.pretrain_gpt', domain.needs_fabric(recipe))} \\",
        f"  {py} \"${{ARGS[@]}}\"",
        "",
    ]
    return "\n".join(lines)


def render_benchmark(recipe) -> str:
    c, b = recipe["cluster"], recipe["bench"]
    nodes = max(b["node_counts"])
    lines = _header(recipe, nodes, c["job_name"] or f"hybrid-ep-{recipe.name}")
    lines += _environment(recipe)
    per_run = {n: domain.bench_ranks_per_node(recipe, n) for n in b["node_counts"]}
    same = len(set(per_run.values())) == 1  # one --ranks-per-node for every run, else each run's own
    common = ["--hidden", b["hidden"], "--tokens", b["tokens"], "--experts", b["experts"], "--topk", b["topk"],
              "--dtype", b["dtype"], "--routing", b["routing"], "--warmup", b["warmup"], "--iters", b["iters"],
              *(["--ranks-per-node", per_run[nodes]] if same else []), "--device", "cuda"]
    if b["backends"]:
        common += ["--backends", ",".join(b["backends"])]
    if b["sms"]:
        common += ["--sms", ",".join(str(n) for n in b["sms"])]
    lines += _array("BENCH_ARGS", [str(v) for v in common])
    lines += ["", "# One run per node count in this allocation; each writes results.json and PNG plots."]
    py = _q(python_of(recipe))
    for n in b["node_counts"]:
        own = "" if same else f" --ranks-per-node {per_run[n]}"
        lines += [
            f"{_srun_prefix(recipe, n)} bash -c \\",
            f"  {_task('hybrid_ep.bench', per_run[n] > c['gpus_per_node'])} \\",
            f"  {py} \"${{BENCH_ARGS[@]}}\"{own} --out \"$OUT_DIR/nodes{n}\"",
        ]
    lines += ['echo "results: $OUT_DIR/nodes*/results.json"', ""]
    return "\n".join(lines)


def render(recipe) -> str:
    return render_benchmark(recipe) if recipe.kind == "benchmark" else render_pretrain(recipe)
