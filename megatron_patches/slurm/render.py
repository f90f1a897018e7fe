"""A recipe as an sbatch script (text).

One task per GPU (`srun --ntasks-per-node G`); each task exports the torch.distributed
variables Megatron reads (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) from Slurm's and runs the command. Pretraining runs
`python -m megatron_patches.pretrain_gpt <Megatron arguments>`; the benchmark recipe runs
`python -m hybrid_ep.bench` once per node count in one allocation. Every value from the
recipe is shell-quoted; `bash -n` accepts every rendered script (tested).
"""

from __future__ import annotations

import shlex

from .megatron_args import megatron_args

_RANK_ENV = (
    'export RANK="$SLURM_PROCID" WORLD_SIZE="$SLURM_NTASKS" LOCAL_RANK="$SLURM_LOCALID" '
    'LOCAL_WORLD_SIZE="$SLURM_NTASKS_PER_NODE"'
)


def _q(value) -> str:
    return shlex.quote(str(value))


def _header(recipe, nodes: int, job_name: str) -> list[str]:
    c = recipe["cluster"]
    out = recipe["output.dir"]
    lines = [
        "#!/bin/bash",
        f"# Rendered by hybrid-ep-launch from {recipe.path}",
        f"# overrides: {' '.join(recipe.overrides) if recipe.overrides else 'none'}",
        "# Edit the recipe (or pass --set key=value), not this file.",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes}",
        f"#SBATCH --ntasks-per-node={c['gpus_per_node']}",
        f"#SBATCH --gpus-per-node={c['gpus_per_node']}",
        f"#SBATCH --time={c['time']}",
        f"#SBATCH --output={out.replace('${SLURM_JOB_ID}', '%j')}/slurm-%j.out",
    ]
    if c["partition"]:
        lines.append(f"#SBATCH --partition={c['partition']}")
    if c["account"]:
        lines.append(f"#SBATCH --account={c['account']}")
    if c["exclusive"]:
        lines.append("#SBATCH --exclusive")
    lines += [f"#SBATCH {extra}" for extra in c["sbatch_extra"]]
    lines += ["", "set -euo pipefail", ""]
    return lines


def _environment(recipe) -> list[str]:
    lines = ["# Communication and runtime environment (recipe field env)"]
    for key, value in recipe["env"].items():
        lines.append(f"export {key}={_q(value)}")
    lines += [
        "",
        "# Rendezvous: the first node of the allocation",
        'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
        'export MASTER_PORT="${MASTER_PORT:-29500}"',
    ]
    workdir = recipe["cluster.workdir"]
    if workdir:
        lines.append(f"cd {_q(workdir)}")
    out = recipe["output.dir"]
    lines += [f'OUT_DIR="{out}"', 'mkdir -p "$OUT_DIR"', ""]
    return lines


def _srun_prefix(recipe, nodes: int) -> str:
    # --relative=0: a step on fewer nodes than the allocation starts at its first node, the
    # MASTER_ADDR of the script.
    parts = ["srun", f"--nodes={nodes}", f"--ntasks-per-node={recipe['cluster.gpus_per_node']}",
             "--relative=0", "--kill-on-bad-exit=1"]
    image, mounts = recipe["container.image"], recipe["container.mounts"]
    if image:
        parts.append(f"--container-image={_q(image)}")
        if mounts:
            parts.append(f"--container-mounts={_q(','.join(mounts))}")
    return " ".join(parts)


def _array(name: str, items: list[str]) -> list[str]:
    """A bash array, one flag (and its value, when it has one) per line."""
    lines, i = [f"{name}=("], 0
    while i < len(items):
        if i + 1 < len(items) and not str(items[i + 1]).startswith("--"):
            lines.append(f"  {_q(items[i])} {_q(items[i + 1])}")
            i += 2
        else:
            lines.append(f"  {_q(items[i])}")
            i += 1
    return lines + [")"]


PLACEHOLDER_LM_DIR = "/path/to/Megatron-LM"  # what the docs write for "your checkout"


def megatron_lm_dir(recipe) -> str | None:
    """The recipe's Megatron-LM checkout, None when unset or still the docs' placeholder."""
    value = recipe["megatron_lm_dir"]
    return None if value in (None, "", PLACEHOLDER_LM_DIR) else value


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
    lines += _array("ARGS", megatron_args(recipe))
    lines += ['ARGS+=(--tensorboard-dir "$OUT_DIR/tensorboard")', ""]
    py = _q(c["python"])
    lines += [
        f"{_srun_prefix(recipe, c['nodes'])} bash -c \\",
        f"  '{_RANK_ENV}; exec \"$0\" -m megatron_patches.pretrain_gpt \"$@\"' \\",
        f"  {py} \"${{ARGS[@]}}\"",
        "",
    ]
    return "\n".join(lines)


def render_benchmark(recipe) -> str:
    c, b = recipe["cluster"], recipe["bench"]
    nodes = max(b["node_counts"])
    lines = _header(recipe, nodes, c["job_name"] or f"hybrid-ep-{recipe.name}")
    lines += _environment(recipe)
    common = ["--hidden", b["hidden"], "--tokens", b["tokens"], "--experts", b["experts"], "--topk", b["topk"],
              "--dtype", b["dtype"], "--routing", b["routing"], "--warmup", b["warmup"], "--iters", b["iters"],
              "--ranks-per-node", c["gpus_per_node"], "--device", "cuda"]
    if b["backends"]:
        common += ["--backends", ",".join(b["backends"])]
    if b["sms"]:
        common += ["--sms", ",".join(str(n) for n in b["sms"])]
    lines += _array("BENCH_ARGS", [str(v) for v in common])
    lines += ["", "# One run per node count in this allocation; each writes results.json and PNG plots."]
    py = _q(c["python"])
    for n in b["node_counts"]:
        lines += [
            f"{_srun_prefix(recipe, n)} bash -c \\",
            f"  '{_RANK_ENV}; exec \"$0\" -m hybrid_ep.bench \"$@\"' \\",
            f"  {py} \"${{BENCH_ARGS[@]}}\" --out \"$OUT_DIR/nodes{n}\"",
        ]
    lines += ['echo "results: $OUT_DIR/nodes*/results.json"', ""]
    return "\n".join(lines)


def render(recipe) -> str:
    return render_benchmark(recipe) if recipe.kind == "benchmark" else render_pretrain(recipe)
