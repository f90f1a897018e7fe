"""Every command line of the project names the closest flag of a near-miss (hybrid_ep.cli_parser,
argparse's suggestion for Python 3.12): exit status 2, argparse's own message, then the flag."""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys

import pytest

from helpers import REPO, checkout_env
from hybrid_ep import cli_parser

pytestmark = pytest.mark.unit

TINY = os.path.join(REPO, "recipes", "tiny_moe")

# (module whose main() parses, argv with a near miss, argparse's words, the suggestion)
CASES = [
    ("megatron_patches.slurm.cli", [TINY, "--node", "2"], "--node 2", "--nodes"),
    ("hybrid_ep.bench.cli", ["--device", "cpu", "--hid", "128"], "--hid 128", "--hidden"),
    ("hybrid_ep.traffic.cli", ["--node", "2"], "--node 2", "--nodes"),
    ("hybrid_ep.balancer.cli", ["plan", "--stats", "x.npz", "--out", "p.yaml", "--ep-siz", "4"], "--ep-siz 4",
     "--ep-size"),
    ("tools.timing.cli", ["predict", "--emulate", "2", "8", "--out", "x", "--hiden", "8"], "--hiden 8", "--hidden"),
    ("tools.microbench.__main__", ["lines.txt", "--out", "x", "--comand", "a"], "--comand a", "--command"),
    ("hybrid_ep.bench.host", ["--itres", "3"], "--itres 3", "--iters"),
    ("tools.balancer_study.quality", ["--expert", "3"], "--expert 3", "--experts"),
    ("megatron_patches.layer_bench", ["--repeat", "3"], "--repeat 3", "--repeats"),
    ("megatron_patches.local.demo", ["--step", "3"], "--step 3", "--steps"),
]


@pytest.mark.parametrize("module, argv, words, close", CASES, ids=[c[0] for c in CASES])
def test_every_cli_names_the_closest_flag(module, argv, words, close, capsys):
    main = importlib.import_module(module).main
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    assert code == 2
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.endswith(f"error: unrecognized arguments: {words} (did you mean {close}?)"), last
    assert len(last) < 200


def _parser(subcommand: bool = False):
    p = cli_parser.ArgumentParser(prog="tool", allow_abbrev=False)
    p.add_argument("--nodes", type=int)
    p.add_argument("--hidden", type=int)
    if subcommand:
        plan = p.add_subparsers(dest="command").add_parser("plan", allow_abbrev=False)
        plan.add_argument("--num-slots", type=int)
    return p


def _error(argv, capsys, subcommand: bool = False) -> str:
    with pytest.raises(SystemExit) as exit_:
        _parser(subcommand).parse_args(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_suggestions(capsys):
    assert _error(["--node", "2"], capsys) == "tool: error: unrecognized arguments: --node 2 (did you mean --nodes?)"
    assert _error(["--node=2", "--hiden", "3"], capsys) == (
        "tool: error: unrecognized arguments: --node=2 --hiden 3 (did you mean --nodes for --node, --hidden for "
        "--hiden?)")
    # far from every flag, or not a flag: argparse's message as it was
    assert _error(["--color", "red"], capsys) == "tool: error: unrecognized arguments: --color red"
    assert _error(["stray"], capsys) == "tool: error: unrecognized arguments: stray"
    # a subcommand's own flags
    assert _error(["plan", "--num-slot", "4"], capsys, subcommand=True) == (
        "tool: error: unrecognized arguments: --num-slot 4 (did you mean --num-slots?)")
    assert _parser(True).parse_args(["--nodes", "2", "plan", "--num-slots", "4"]) == argparse.Namespace(
        nodes=2, hidden=None, command="plan", num_slots=4)


def test_the_parser_loads_no_torch():
    """A command line refuses a bad argument before torch is loaded (the demo's --steps in a second)."""
    code = "import sys, hybrid_ep.cli_parser, megatron_patches.local.demo; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=checkout_env(),
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stderr


@pytest.mark.parametrize("kind, text, message", [
    (cli_parser.positive_int, "0", "must be an integer >= 1, got 0"),
    (cli_parser.positive_int, "-3", "must be an integer >= 1, got -3"),
    (cli_parser.positive_int, "2.5", "must be an integer >= 1, got '2.5'"),
    (cli_parser.positive_number, "0", "must be a finite number > 0, got '0'"),
    (cli_parser.positive_number, "nan", "must be a finite number > 0, got 'nan'"),
    (cli_parser.positive_number, "inf", "must be a finite number > 0, got 'inf'"),
    (cli_parser.positive_number, "x", "must be a finite number > 0, got 'x'"),
])
def test_positive_types_name_the_rule(kind, text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("(", r"\(")):
        kind(text)


def test_positive_types_take_good_values():
    assert cli_parser.positive_int("7") == 7 and cli_parser.positive_number("3e-3") == 0.003
