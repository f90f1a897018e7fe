"""Slurm pretraining recipes: load a recipe, check its parallel shape, estimate memory, render sbatch.

    python scripts/launch_slurm.py recipes/deepseek_v3 --dry-run      (or: hybrid-ep-launch ...)

Modules, one job each: `schema` (which fields a recipe has and their types), `recipe`
(YAML + `--set` overrides), `shape` (derived parallel sizes and the pipeline split),
`validate` (the rules, each failure naming its field), `domain` (which GPUs share an NVLink
domain: #SBATCH --segment, the groups' fit), `memory` (bytes per GPU),
`megatron_args` (recipe -> Megatron-LM argument list), `render` (sbatch text), `local`
(run on this machine without Slurm; when Megatron-LM's pretrain_gpt.py or a GPU is missing
it runs the Megatron-Core trainer megatron_patches.local.cpu_train), `cli`. Docs: docs/slurm.md.
"""
