"""`python -m megatron_patches.pretrain_gpt`: argument handling, finding pretrain_gpt.py, and
running it as __main__ with the patches applied (a stand-in pretrain_gpt.py that parses the
full argument list with Megatron-LM's parse_and_validate_args and an extra_args_provider of
its own, to which the launcher adds hybrid_ep's, and builds the TransformerConfig)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from harness.megatron.moe_layer import TINY_GPT_ARGS
from helpers import REPO
from megatron_patches.pretrain_gpt import LauncherError, find_pretrain_script, split_launcher_args

pytestmark = pytest.mark.megatron

# Stands in for Megatron-LM's pretrain_gpt.py (Megatron-Core 0.19's): it parses the arguments
# with parse_and_validate_args and an extra_args_provider of its own, as the real one passes
# ModelOpt's; what it sees is what the real one would see.
STAND_IN = textwrap.dedent('''
    import json, os, sys
    import helper_next_to_script  # importable because the script's folder is on sys.path
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.training.arguments import core_transformer_config_from_args, parse_and_validate_args

    def own_arguments(parser):
        parser.add_argument("--stand-in-flag", type=int, default=0)
        return parser

    args = parse_and_validate_args(extra_args_provider=own_arguments,
                                   args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    config = core_transformer_config_from_args(args)
    print("RESULT " + json.dumps({
        "name": __name__,
        "argv0": os.path.basename(sys.argv[0]),
        "dispatcher_type": config.moe_token_dispatcher_type,
        "pad_multiple": args.hybrid_ep_pad_multiple,
        "static_size_factor": args.hybrid_ep_static_size_factor,
        "own_flag": args.stand_in_flag,
        "patched": getattr(MoELayer.__init__, "_hybrid_ep_patched", False),
        "helper": helper_next_to_script.VALUE,
    }))
''')


def test_split_launcher_args():
    assert split_launcher_args(["--megatron-lm-dir", "/x", "--lr", "1"]) == ("/x", ["--lr", "1"])
    assert split_launcher_args(["--lr", "1", "--megatron-lm-dir=/y"]) == ("/y", ["--lr", "1"])
    assert split_launcher_args(["--lr", "1"]) == (None, ["--lr", "1"])
    with pytest.raises(LauncherError, match="needs a folder"):
        split_launcher_args(["--megatron-lm-dir"])


def test_find_pretrain_script(tmp_path, monkeypatch):
    (tmp_path / "pretrain_gpt.py").write_text("")
    assert find_pretrain_script(str(tmp_path)) == str(tmp_path / "pretrain_gpt.py")
    monkeypatch.setenv("MEGATRON_LM_DIR", str(tmp_path))
    assert find_pretrain_script() == str(tmp_path / "pretrain_gpt.py")
    monkeypatch.setenv("MEGATRON_LM_DIR", str(tmp_path / "missing"))
    with pytest.raises(LauncherError, match="does not exist"):
        find_pretrain_script()
    monkeypatch.delenv("MEGATRON_LM_DIR")
    path = [p for p in sys.path if not os.path.isfile(os.path.join(p or ".", "pretrain_gpt.py"))]
    monkeypatch.setattr(sys, "path", path)
    with pytest.raises(LauncherError, match="MEGATRON_LM_DIR"):
        find_pretrain_script()


def run_launcher(args, env_extra=None, cwd=None):
    env = {k: v for k, v in os.environ.items() if k != "MEGATRON_LM_DIR"}
    env.update(env_extra or {}, PYTHONWARNINGS="ignore")
    return subprocess.run([sys.executable, "-m", "megatron_patches.pretrain_gpt", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=cwd)


def result_of(proc) -> dict:
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_launcher_runs_megatron_script_with_patches(tmp_path):
    pytest.importorskip("megatron.training.arguments")
    (tmp_path / "pretrain_gpt.py").write_text(STAND_IN)
    (tmp_path / "helper_next_to_script.py").write_text("VALUE = 42\n")
    proc = run_launcher(
        ["--megatron-lm-dir", str(tmp_path), *TINY_GPT_ARGS, "--moe-token-dispatcher-type", "hybrid_ep",
         "--hybrid-ep-pad-multiple", "8", "--hybrid-ep-static-size-factor", "1.25", "--stand-in-flag", "3"],
        cwd=REPO,
    )
    got = result_of(proc)
    assert got == {"name": "__main__", "argv0": "pretrain_gpt.py", "dispatcher_type": "hybrid_ep",
                   "pad_multiple": 8, "static_size_factor": 1.25, "own_flag": 3, "patched": True, "helper": 42}


def test_launcher_without_script_explains(tmp_path):
    proc = run_launcher(["--lr", "1"], cwd=str(tmp_path))
    assert proc.returncode == 2
    assert "MEGATRON_LM_DIR" in proc.stderr
