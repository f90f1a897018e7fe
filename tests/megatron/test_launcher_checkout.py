"""`python -m megatron_patches.pretrain_gpt` runs the Megatron-LM checkout's own megatron package,
not the installed megatron-core, and its first line names the one it runs."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.megatron

REPO = pathlib.Path(__file__).resolve().parents[2]
STAND_IN_VERSION = "0.99.0+checkout"

# The checkout's megatron/core: the installed package's modules, with its own package_info
# (another version) and a mark, so which of the two Python imported shows.
CORE_INIT = textwrap.dedent('''
    import os
    INSTALLED = {installed!r}
    __path__.append(INSTALLED)  # modules the stand-in lacks come from the installed copy
    exec(compile(open(os.path.join(INSTALLED, "__init__.py")).read(), __file__, "exec"))
    FROM_CHECKOUT = True
''')

SCRIPT = textwrap.dedent('''
    import json
    import megatron.core
    from megatron.core import package_info
    from megatron.core.transformer.moe.moe_layer import MoELayer
    print("RESULT " + json.dumps({
        "core_file": megatron.core.__file__,
        "from_checkout": getattr(megatron.core, "FROM_CHECKOUT", False),
        "version": package_info.__version__,
        "patched": getattr(MoELayer.__init__, "_hybrid_ep_patched", False),
    }))
''')


def _installed_core() -> str:
    spec = __import__("importlib").util.find_spec("megatron.core")
    return os.path.dirname(spec.origin)


def _stand_in_checkout(root: pathlib.Path) -> pathlib.Path:
    core = root / "megatron" / "core"
    core.mkdir(parents=True)
    (core / "__init__.py").write_text(CORE_INIT.format(installed=_installed_core()))
    (core / "package_info.py").write_text(
        (pathlib.Path(_installed_core()) / "package_info.py").read_text()
        + f"\n__version__ = {STAND_IN_VERSION!r}\n")
    (root / "pretrain_gpt.py").write_text(SCRIPT)
    return root


def _launch(*args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("MEGATRON_LM_DIR", "RANK")}
    env["PYTHONWARNINGS"] = "ignore"
    return subprocess.run([sys.executable, "-m", "megatron_patches.pretrain_gpt", *args], capture_output=True,
                          text=True, timeout=300, env=env, cwd=cwd)


def test_the_checkouts_megatron_runs_and_the_first_line_names_it(tmp_path):
    pytest.importorskip("megatron.core")
    checkout = _stand_in_checkout(tmp_path / "Megatron-LM")
    proc = _launch("--megatron-lm-dir", str(checkout), cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == (f"megatron_patches.pretrain_gpt: running {checkout / 'pretrain_gpt.py'} with "
                        f"Megatron-Core {STAND_IN_VERSION} from {checkout / 'megatron' / 'core'}")
    got = json.loads(next(line for line in lines if line.startswith("RESULT "))[len("RESULT "):])
    assert got == {"core_file": str(checkout / "megatron" / "core" / "__init__.py"), "from_checkout": True,
                   "version": STAND_IN_VERSION, "patched": True}


@pytest.mark.slow  # the full tier (scripts/test.sh --full): a second Megatron run
def test_a_checkout_without_megatron_runs_the_installed_one_and_says_so(tmp_path):
    pytest.importorskip("megatron.core")
    from megatron.core import package_info

    (tmp_path / "pretrain_gpt.py").write_text(SCRIPT)
    proc = _launch("--megatron-lm-dir", str(tmp_path), cwd=str(REPO))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines()[0] == (f"megatron_patches.pretrain_gpt: running {tmp_path / 'pretrain_gpt.py'} "
                                           f"with Megatron-Core {package_info.__version__} from {_installed_core()}")


def test_megatron_imported_before_the_launcher_is_refused(tmp_path):
    pytest.importorskip("megatron.core")
    from megatron_patches.pretrain_gpt import LauncherError, checkout_megatron_check

    checkout = _stand_in_checkout(tmp_path / "Megatron-LM")
    checkout_megatron_check(str(checkout), str(checkout / "megatron" / "core"))
    with pytest.raises(LauncherError, match="megatron.core was imported from .* not from the Megatron-LM checkout"):
        checkout_megatron_check(str(checkout), _installed_core())
