"""Lines a process logs once: a choice or a fallback that every call or layer would repeat."""

from __future__ import annotations

import logging

_said: set = set()  # the keys this process has logged


def log_once(log: logging.Logger, level: int, line: str, key=None) -> None:
    """Log `line` at `level` the first time this process meets `key` (default: the line itself;
    a key of its own where lines differ in a detail logged only the first time)."""
    key = line if key is None else key
    if key not in _said:
        _said.add(key)
        log.log(level, "%s", line)
