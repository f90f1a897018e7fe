"""Launcher: Megatron-LM's own pretrain_gpt.py with the hybrid_ep patches applied.

    python -m megatron_patches.pretrain_gpt [--megatron-lm-dir DIR] <pretrain_gpt.py arguments>

Users keep their scripts and add `--moe-token-dispatcher-type hybrid_ep` (plus any
--hybrid-ep-* knob). The script is found, in this order, at:

1. `--megatron-lm-dir DIR` (taken off the argument list) or $MEGATRON_LM_DIR: DIR/pretrain_gpt.py;
2. a `pretrain_gpt` module importable from sys.path (a Megatron-LM checkout on PYTHONPATH,
   next to the installed megatron.training it uses).

The script's folder goes first on sys.path before anything imports megatron, so a Megatron-LM
checkout's own megatron package (modified or not) is the one that runs, not an installed
megatron-core; one line on rank 0 names the script and the Megatron-Core it runs (version and
folder). Then megatron_patches.apply(), and the script runs as `__main__` with sys.argv set to
the remaining arguments, exactly as `python pretrain_gpt.py ...` would, except that every
parse of Megatron-LM's arguments in the process includes hybrid_ep's: while it runs, the
function that builds Megatron-LM's parser (`add_megatron_arguments`, which `parse_args` calls
for every caller: `parse_and_validate_args` with the script's own provider, and the in-process
restart and fault-tolerance set-ups, which parse with no provider) also applies
`megatron_patches.extra_args_provider` (`hybrid_ep_arguments`; megatron_patches/patches.py
lists it with the other patches).
torchrun works the same way: `torchrun ... -m megatron_patches.pretrain_gpt ...`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import runpy
import sys

SCRIPT = "pretrain_gpt.py"


class LauncherError(RuntimeError):
    pass


def split_launcher_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take --megatron-lm-dir DIR (or --megatron-lm-dir=DIR) off argv; the rest is Megatron's."""
    rest, lm_dir, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--megatron-lm-dir":
            if i + 1 >= len(argv):
                raise LauncherError("--megatron-lm-dir needs a folder")
            lm_dir, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--megatron-lm-dir="):
            lm_dir = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return lm_dir, rest


def find_pretrain_script(lm_dir: str | None = None) -> str:
    """Path of Megatron-LM's pretrain_gpt.py (see the module docstring for the order)."""
    lm_dir = lm_dir or os.environ.get("MEGATRON_LM_DIR")
    if lm_dir:
        path = os.path.join(os.path.abspath(os.path.expanduser(lm_dir)), SCRIPT)
        if not os.path.isfile(path):
            raise LauncherError(f"{path} does not exist (from --megatron-lm-dir / MEGATRON_LM_DIR)")
        return path
    spec = importlib.util.find_spec("pretrain_gpt")
    if spec is not None and spec.origin and os.path.isfile(spec.origin):
        return spec.origin
    raise LauncherError(
        "cannot find Megatron-LM's pretrain_gpt.py: set MEGATRON_LM_DIR (or pass "
        "--megatron-lm-dir) to a Megatron-LM checkout, or put one on PYTHONPATH"
    )


def checkout_megatron_check(checkout: str, imported_folder: str) -> None:
    """Refuse a run whose megatron.core is not the checkout's own when the checkout has one
    (something imported megatron before the launcher could put the checkout first)."""
    own = os.path.join(checkout, "megatron", "core")
    if os.path.isdir(own) and os.path.realpath(imported_folder) != os.path.realpath(own):
        raise LauncherError(
            f"megatron.core was imported from {imported_folder}, not from the Megatron-LM checkout's {own}: "
            "something imported megatron before the launcher (a sitecustomize or a .pth file?)"
        )


@contextlib.contextmanager
def hybrid_ep_arguments():
    """Inside: every parser of Megatron-LM's arguments (built by megatron.training.arguments'
    add_megatron_arguments, whoever parses and whatever provider it passes) also has hybrid_ep's
    choice and flags; a provider of the caller's runs after, on that parser. Restored after."""
    from megatron.training import arguments

    from .options import extra_args_provider

    original = arguments.add_megatron_arguments

    @functools.wraps(original)
    def add_megatron_arguments(parser, *args, **kwargs):
        return extra_args_provider(original(parser, *args, **kwargs))

    arguments.add_megatron_arguments = add_megatron_arguments
    try:
        yield
    finally:
        arguments.add_megatron_arguments = original


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        lm_dir, megatron_args = split_launcher_args(argv)
        script = find_pretrain_script(lm_dir)
        checkout = os.path.dirname(script)
        sys.path.insert(0, checkout)  # before anything imports megatron, as `python pretrain_gpt.py` has it
        from .versions import imported_megatron_core

        version, folder = imported_megatron_core()
        checkout_megatron_check(checkout, folder)
    except LauncherError as err:
        print(f"megatron_patches.pretrain_gpt: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    if os.environ.get("RANK", "0") == "0":
        print(f"megatron_patches.pretrain_gpt: running {script} with Megatron-Core {version} from {folder}",
              flush=True)

    import megatron_patches

    megatron_patches.apply()
    sys.argv = [script] + megatron_args
    with hybrid_ep_arguments():
        runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
