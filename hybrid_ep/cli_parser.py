"""The argument parser of the project's command lines: argparse's, naming the closest flag.

Python 3.12's argparse answers a mistyped flag with "unrecognized arguments: --node 2" alone
(`suggest_on_error` comes with 3.14). This parser adds the closest flag of the parser that
read it (the subcommand's, when one ran): "unrecognized arguments: --node 2 (did you mean
--nodes?)". Everything else is argparse's: the exit status stays 2, and a mistyped choice
already lists the choices. It imports no more than argparse and difflib, so a command line
refuses a bad argument before it loads torch. `positive_int` and `positive_number` are
argparse types whose errors argparse prefixes with the flag ("argument --steps: must be ...").
"""

from __future__ import annotations

import argparse
import difflib
import math

CUTOFF = 0.6  # difflib's similarity ratio a suggestion needs


class ArgumentParser(argparse.ArgumentParser):
    """argparse.ArgumentParser whose "unrecognized arguments" error names the closest flags."""

    def parse_args(self, args=None, namespace=None):
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unrecognized_message(self, extras, args))
        return namespace


def option_strings(parser: argparse.ArgumentParser, argv: list[str] | None) -> list[str]:
    """The flags of `parser` and of the subcommands named in argv (recursively)."""
    flags, subcommands = [], []
    for action in parser._actions:
        flags += [s for s in action.option_strings if s.startswith("--")]
        if isinstance(action, argparse._SubParsersAction):
            subcommands.append(action)
    for action in subcommands:
        chosen = next((a for a in (argv or []) if a in action.choices), None)
        if chosen is not None:
            flags += option_strings(action.choices[chosen], argv[argv.index(chosen) + 1:])
    return flags


def suggestion(flag: str, flags: list[str]) -> str | None:
    """The flag closest to `flag` (its part before '='), or None when none is close."""
    close = difflib.get_close_matches(flag.split("=", 1)[0], flags, n=1, cutoff=CUTOFF)
    return close[0] if close else None


def unrecognized_message(parser: argparse.ArgumentParser, extras: list[str], argv: list[str] | None) -> str:
    """argparse's message for arguments no action took, with the closest flag of each mistyped one."""
    import sys

    known = option_strings(parser, list(sys.argv[1:] if argv is None else argv))
    hints = []
    for extra in extras:
        if extra.startswith("--"):
            close = suggestion(extra, known)
            if close is not None:
                hints.append((extra.split("=", 1)[0], close))
    message = f"unrecognized arguments: {' '.join(extras)}"
    if len(hints) == 1:
        return f"{message} (did you mean {hints[0][1]}?)"
    if hints:
        return f"{message} (did you mean {', '.join(f'{close} for {given}' for given, close in hints)}?)"
    return message


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {value}")
    return value


def positive_number(text: str) -> float:
    """argparse type: a finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value
