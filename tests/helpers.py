"""What several test files share: where the checkout is, and the environment of a child Python
that must import this checkout's packages (a test may start it from another folder)."""

from __future__ import annotations

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_env(**extra: str) -> dict[str, str]:
    """os.environ with this checkout first on PYTHONPATH, and `extra` on top."""
    path = os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    return dict(os.environ, PYTHONPATH=path, **extra)
