"""A call's input refused on one rank, told to every rank: the error they all raise, and the
codes that name the refused argument where it travels between ranks.

A rank whose own arguments fail the checks (inputs.py) cannot simply raise: its peers are
already in the call's exchange and would wait for it until HYBRID_EP_TIMEOUT_S. So it makes
the call anyway, with no tokens and a refusal in the words that exchange carries (the cuda
backend's count rows, csrc/kernels/count.cuh; the reference backend's message headers,
backends/reference_agreement.py), and every rank raises InputRefused naming the rank and the
argument, at once; the refusing rank's own message also says what was wrong. The exchange
completed, so the buffer stays usable for the next call.
"""

from __future__ import annotations

import re

# The arguments a refusal names, by code (0: no refusal, 1: an input of no name below).
ARGUMENTS = ("input", "x", "scales", "topk_idx", "topk_weights", "routing_map", "probs", "handle", "num_out_tokens",
             "num_sms", "expert_out", "apply_probs")
_WORD = re.compile(r"\b(" + "|".join(ARGUMENTS[1:]) + r")\b")


class InputRefused(ValueError):
    """A rank of the EP group refused its input of a call; raised alike on every rank.

    rank: the rank that refused; argument: the argument it named (ARGUMENTS)."""

    def __init__(self, message: str, rank: int, argument: str):
        super().__init__(message)
        self.rank, self.argument = rank, argument


class InputTypeRefused(InputRefused, TypeError):
    """InputRefused on the refusing rank where its check raised a TypeError (an argument of the
    wrong type or dtype): still a TypeError there, as the checks promise."""


def argument_of(error: BaseException) -> str:
    """The argument a check's error names: the first argument name its message holds ("scales
    must have shape ..." -> scales), else "input"."""
    found = _WORD.search(str(error))
    return found.group(1) if found else "input"


def code_of(argument: str) -> int:
    return ARGUMENTS.index(argument) + 1 if argument in ARGUMENTS else 1


def argument_of_code(code: int) -> str:
    return ARGUMENTS[code - 1] if 1 <= code <= len(ARGUMENTS) else f"argument code {code}"


def refused_here(rank: int, call: str, error: BaseException) -> InputRefused:
    """The refusing rank's error: its own check's words, with the rank and the argument."""
    argument = argument_of(error)
    kind = InputTypeRefused if isinstance(error, TypeError) else InputRefused
    refused = kind(f"{error} (hybrid_ep {call}: rank {rank} refused its input ({argument}); every rank raises this "
                   f"refusal, and the buffer stays usable)", rank, argument)
    refused.__cause__ = error
    return refused


def refused_by_peer(rank: int, call: str, code: int) -> InputRefused:
    """A peer's error for a refusal that reached it through the call's exchange."""
    argument = argument_of_code(code)
    return InputRefused(f"hybrid_ep {call}: rank {rank} refused its input ({argument}); that rank's error says what "
                        f"was wrong. The buffer stays usable", rank, argument)
