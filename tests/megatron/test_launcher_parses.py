"""Inside the launcher's context every parse of Megatron-LM's arguments that megatron.training
makes (the installed one's own modules) accepts hybrid_ep and the --hybrid-ep-* flags: the
in-process restart wrapper's and the fault-tolerance set-up's (no provider, unknown arguments
ignored), parse_args, and parse_and_validate_args with a script's own provider. A Megatron
release that builds its parser somewhere else fails these by name."""

from __future__ import annotations

import pytest

from harness.megatron.moe_layer import TINY_GPT_ARGS

pytestmark = pytest.mark.megatron

arguments = pytest.importorskip("megatron.training.arguments")

COMMAND_LINE = ["pretrain_gpt.py", *TINY_GPT_ARGS, "--moe-token-dispatcher-type", "hybrid_ep",
                "--hybrid-ep-pad-multiple", "8", "--hybrid-ep-backend", "reference"]


@pytest.fixture
def command_line(monkeypatch):
    """pretrain_gpt.py's command line with hybrid_ep's choice and flags; Megatron's global
    arguments unset after (options_for reads them)."""
    from megatron.training import global_vars

    monkeypatch.setattr("sys.argv", list(COMMAND_LINE))
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    yield
    global_vars.unset_global_variables()


@pytest.fixture
def parses(monkeypatch) -> list:
    """What each call of megatron.training.arguments.parse_args returns, in order."""
    seen = []
    original = arguments.parse_args

    def recording_parse_args(*args, **kwargs):
        seen.append(original(*args, **kwargs))
        return seen[-1]

    monkeypatch.setattr(arguments, "parse_args", recording_parse_args)
    return seen


def hybrid_ep_values(args) -> tuple:
    return args.moe_token_dispatcher_type, args.hybrid_ep_pad_multiple, args.hybrid_ep_backend


def test_without_the_launcher_megatron_refuses_the_choice(command_line, capsys):
    with pytest.raises(SystemExit):
        arguments.parse_args(ignore_unknown_args=True)
    assert "invalid choice: 'hybrid_ep'" in capsys.readouterr().err


def test_inprocess_restart_wrapper_parses_hybrid_ep(command_line, parses):
    from megatron.training import inprocess_restart

    from megatron_patches.pretrain_gpt import hybrid_ep_arguments

    def pretrain():
        return None

    with hybrid_ep_arguments():
        wrapped, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)
    assert (wrapped, store) == (pretrain, None)
    assert [hybrid_ep_values(args) for args in parses] == [("hybrid_ep", 8, "reference")]


def test_fault_tolerance_setup_parses_hybrid_ep(command_line, parses):
    from megatron.training import ft_integration

    from megatron_patches.pretrain_gpt import hybrid_ep_arguments

    with hybrid_ep_arguments():
        assert ft_integration.setup() is None  # --enable-ft-package not given: parses, then returns
    assert [hybrid_ep_values(args) for args in parses] == [("hybrid_ep", 8, "reference")]


def test_parse_args_ignoring_unknown_arguments_parses_hybrid_ep(command_line):
    from megatron_patches.pretrain_gpt import hybrid_ep_arguments

    with hybrid_ep_arguments():
        args = arguments.parse_args(ignore_unknown_args=True)
        strict = arguments.parse_args()
    assert hybrid_ep_values(args) == hybrid_ep_values(strict) == ("hybrid_ep", 8, "reference")


def test_parse_and_validate_args_with_the_scripts_provider(command_line, monkeypatch):
    import megatron_patches
    from megatron_patches.pretrain_gpt import hybrid_ep_arguments

    def own(parser):
        parser.add_argument("--own-flag", type=int, default=0)
        return parser

    monkeypatch.setattr("sys.argv", [*COMMAND_LINE, "--own-flag", "3"])
    with hybrid_ep_arguments():
        args = arguments.parse_and_validate_args(extra_args_provider=own,
                                                 args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    assert hybrid_ep_values(args) + (args.own_flag,) == ("hybrid_ep", 8, "reference", 3)
    assert megatron_patches.options.from_args(args).pad_multiple == 8


def test_a_script_passing_hybrid_eps_provider_itself_parses_the_same(command_line):
    """Scripts of their own that already pass megatron_patches.extra_args_provider keep working."""
    import megatron_patches
    from megatron_patches.pretrain_gpt import hybrid_ep_arguments

    with hybrid_ep_arguments():
        twice = arguments.parse_args(megatron_patches.extra_args_provider)
    once = arguments.parse_args(megatron_patches.extra_args_provider)
    assert vars(twice) == vars(once)


def test_the_context_restores_megatrons_parser(command_line):
    from megatron_patches.pretrain_gpt import hybrid_ep_arguments

    before = arguments.add_megatron_arguments
    with pytest.raises(RuntimeError, match="inside"):
        with hybrid_ep_arguments():
            assert arguments.add_megatron_arguments is not before
            raise RuntimeError("inside")
    assert arguments.add_megatron_arguments is before
