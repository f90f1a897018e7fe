"""`hybrid-ep-launch` / `python scripts/launch_slurm.py`: recipe -> checked sbatch script.

    hybrid-ep-launch RECIPE [--set key=value ...] [--nodes N] [--dry-run | --submit | --local]

RECIPE is the name of a recipe shipped with the package (deepseek_v3, ...: the checkout's
recipes/), or a folder holding a recipe.yaml (or the file). The recipe is loaded, overridden,
validated (every failure names the field and the rule; exit status 2) and, for pretraining,
its memory per GPU is estimated (a warning when it exceeds the GPU's memory). Then:

--dry-run (default)  print the sbatch script
--submit             write it (to a temporary folder, or --script PATH), create the Slurm
                     log's folder and call `sbatch` from the current folder
--local              run it on this machine without Slurm (local.py; tiny_moe on CPU)

Slurm opens the job's log before the script runs and creates no folders: the log goes to
the leading part of output.dir without variables (render.log_dir, e.g. results/<name>), which
--submit creates relative to the folder it runs in (or under cluster.workdir, the job's
--chdir) before it calls sbatch, wherever --script is written. The script creates the
per-job folder OUT_DIR itself.

--script applies only with --submit and --trainer only with --local: given without them, or a
--script that names a folder or a path under a file, they are errors (exit status 2) before
anything is loaded, written or submitted.

--nodes N rescales data parallelism: it sets cluster.nodes, so DP = N x GPUs / (TP x PP x CP)
with the global batch kept (it must still divide by micro batch x DP).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

from hybrid_ep.cli_parser import ArgumentParser
from hybrid_ep.paths import output_problem

from . import calibration, domain, memory, render, shape, site_fields, validate
from . import recipe as recipe_mod
from .local import TRAINERS, choose, run_local

PROG = "hybrid-ep-launch"


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[1], allow_abbrev=False,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", help="a shipped recipe's name (deepseek_v3, ...), a recipe folder or a recipe.yaml")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field by its dotted name (repeatable), e.g. --set parallelism.ep=32")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes; rescales data parallelism")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the sbatch script (the default)")
    mode.add_argument("--submit", action="store_true", help="write the script and submit it with sbatch")
    mode.add_argument("--local", action="store_true", help="run on this machine (one node, no Slurm)")
    p.add_argument("--script", default=None, help="with --submit: where to write the script")
    p.add_argument("--trainer", choices=TRAINERS, default=None,
                   help="with --local: megatron (pretrain_gpt.py), core (Megatron-Core CPU trainer) or auto "
                        "(the default)")
    return p


def check_flags(a) -> list[tuple[str, str]]:
    """Flags that apply only with another flag, and a --script path that cannot be written,
    as (flag, rule) pairs: refused before the recipe is loaded, so nothing is written or submitted."""
    problems = []
    if a.script is not None and not a.submit:
        problems.append(("--script", "only applies with --submit (it names the file the submitted script is "
                                     "written to); add --submit or leave --script out"))
    if a.trainer is not None and not a.local:
        problems.append(("--trainer", "only applies with --local; add --local or leave --trainer out"))
    if a.script is not None and a.submit:
        rule = _script_path_rule(a.script)
        if rule:
            problems.append(("--script", rule))
    return problems


def _script_path_rule(script: str) -> str | None:
    """None when `script` names a file that can be written (its folder may not exist yet)."""
    return output_problem(os.path.expanduser(script.strip()) if script.strip() else "", folder=False)


def _error(problems) -> int:
    for field, rule in problems:
        print(f"{PROG}: error: {field}: {rule}", file=sys.stderr)
    return 2


def load_checked(path: str, overrides: list[str], nodes: int | None = None):
    """Load + override + validate; raises RecipeError."""
    overrides = list(overrides)
    if nodes is not None:
        overrides.append(f"cluster.nodes={nodes}")
    recipe = recipe_mod.load(path, overrides)
    validate.validate(recipe)
    return recipe


def report(recipe, on_cpu: bool = False) -> None:
    """Layout and memory estimate on stderr (stdout carries the script). on_cpu: local mode
    runs the ranks as CPU processes, so there is no GPU to count or to compare memory with."""
    if recipe.kind != "pretrain":
        return
    print(f"{PROG}: {recipe.name}: {shape.shape_of(recipe).describe(on_cpu)}", file=sys.stderr)
    est = memory.estimate(recipe)
    domains = domain.describe(recipe, est.dispatcher.config.ranks_per_node if est.dispatcher else None)
    if domains:
        print(f"{PROG}: {recipe.name}: {domains}", file=sys.stderr)
    print(est.table(on_cpu), file=sys.stderr)
    measured = calibration.describe(recipe)
    if measured:
        print(f"{PROG}: {recipe.name}: {measured}", file=sys.stderr)
    if est.over and not on_cpu:
        print(f"{PROG}: warning: estimated {est.total_gb:.1f} GiB per GPU exceeds the {est.gpu_gb:g} GiB of "
              f"cluster.gpu_type {recipe['cluster.gpu_type']} (stage {est.stage}); more PP/EP, recomputation "
              "(train.recompute) or a larger GPU", file=sys.stderr)


def warn_megatron_lm_dir(recipe) -> None:
    """Say where the job will look for pretrain_gpt.py when the recipe does not name a checkout."""
    if recipe.kind != "pretrain" or render.megatron_lm_dir(recipe):
        return
    given = os.environ.get("MEGATRON_LM_DIR")
    if given:
        print(f"{PROG}: note: megatron_lm_dir is not set; the job uses MEGATRON_LM_DIR={given} from this shell "
              "(sbatch passes the environment)", file=sys.stderr)
        return
    placeholder = " (the docs' placeholder)" if recipe["megatron_lm_dir"] == render.PLACEHOLDER_LM_DIR else ""
    print(f"{PROG}: warning: megatron_lm_dir is {recipe['megatron_lm_dir'] or 'not set'}{placeholder} and "
          "MEGATRON_LM_DIR is not exported: the job needs Megatron-LM on the container's PYTHONPATH", file=sys.stderr)
    print(f"{PROG}:   or --set megatron_lm_dir=/your/Megatron-LM", file=sys.stderr)


def report_site(recipe) -> None:
    """Say which site fields are unset (what runs instead) and which still hold placeholders,
    and warn when a container may not see the job's working directory."""
    for line in site_fields.report_lines(recipe):
        print(f"{PROG}: {line}", file=sys.stderr)
    if recipe["container.image"] and not recipe["container.workdir"] and not recipe["container.mounts"]:
        print(f"{PROG}: warning: container.mounts is empty: the container starts in the job's working directory "
              "(srun --container-workdir), which it must mount", file=sys.stderr)


def note_log_dir(recipe) -> None:
    """Say where the Slurm log goes, and that its folder must exist when the job starts."""
    folder = render.log_dir_to_create(recipe)
    where = f"{PROG}: note: the Slurm log goes to {_log_path(recipe)} (%j: the job id)"
    if folder == ".":
        print(f"{where}, in the folder sbatch runs in", file=sys.stderr)
    else:
        print(f"{where}; Slurm creates no folders: --submit creates {folder} before sbatch", file=sys.stderr)
        print(f"{PROG}:   (to run sbatch by hand: mkdir -p {folder} first)", file=sys.stderr)


def _log_path(recipe) -> str:
    """The Slurm log from the folder sbatch runs in."""
    folder, name = render.log_dir_to_create(recipe), os.path.basename(render.log_file(recipe))
    return name if folder == "." else os.path.join(folder, name)


def submit(recipe, text: str, script: str | None) -> int:
    if script is None:
        folder = tempfile.mkdtemp(prefix=f"hybrid_ep_{recipe.name}_")
        script = os.path.join(folder, f"{recipe.name}.sbatch")
    script = os.path.expanduser(script)
    try:
        os.makedirs(os.path.dirname(os.path.abspath(script)), exist_ok=True)
        with open(script, "w") as f:
            f.write(text)
    except OSError as err:
        return _error([("--script", f"cannot write {script}: {err.strerror or err}")])
    # Relative to this folder, where sbatch runs: the job's working directory, or what a
    # relative cluster.workdir (its --chdir) starts from.
    log_folder = render.log_dir_to_create(recipe)
    try:
        os.makedirs(log_folder, exist_ok=True)
    except OSError as err:
        return _error([("output.dir", f"cannot create {log_folder}, the folder of the Slurm log (Slurm opens it "
                                      f"before the job starts and creates no folders): {err.strerror or err}")])
    try:
        proc = subprocess.run(["sbatch", script], capture_output=True, text=True)
    except FileNotFoundError:
        print(f"{PROG}: error: sbatch not found on PATH (script written to {script})", file=sys.stderr)
        return 127
    sys.stdout.write(proc.stdout)
    sys.stderr.write(proc.stderr)
    print(f"{PROG}: script {script}", file=sys.stderr)
    print(f"{PROG}: Slurm log {_log_path(recipe)} (%j: the job id)", file=sys.stderr)
    return proc.returncode


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        a = parser.parse_args(argv)
    except SystemExit as exit_:
        return exit_.code if isinstance(exit_.code, int) else 2
    problems = check_flags(a)
    if problems:
        return _error(problems)
    try:
        recipe = load_checked(a.recipe, a.overrides, a.nodes)
        if a.local:
            path = choose(recipe, a.trainer or "auto")
            report(recipe, on_cpu=not path.on_gpus)
            return run_local(recipe, path=path)
        report(recipe)
        warn_megatron_lm_dir(recipe)
        report_site(recipe)
        text = render.render(recipe)
    except recipe_mod.RecipeError as err:
        return _error(err.problems)
    if a.submit:
        placeholders = site_fields.placeholder_problems(recipe)
        if placeholders:  # the job would wait in the queue, then fail
            return _error(placeholders)
        return submit(recipe, text, a.script)
    note_log_dir(recipe)
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
