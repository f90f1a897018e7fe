"""Output paths of the command-line tools, checked before the work that fills them.

A run that writes its results at the end must not find out then that it cannot: every tool
asks `output_problem` first and reports the answer as a usage error naming its flag.
"""

from __future__ import annotations

import os


def output_problem(path: str, *, folder: bool) -> str | None:
    """Why `path` cannot take an output file (folder=False) or folder (folder=True); None when
    it can. Missing folders on the way are made when the output is written, so the nearest
    existing ancestor must be a folder this process may write in."""
    if not path:
        return f"the path is empty; give a {'folder' if folder else 'file'} name"
    full = os.path.abspath(path)
    if os.path.lexists(full):
        if folder and not os.path.isdir(full):
            return f"{path} is a file, not a folder"
        if not folder and (os.path.isdir(full) or path.endswith(("/", os.sep))):
            return f"{path} is a folder; give a file name"
        return None if os.access(full, os.W_OK) else f"cannot write {path}: permission denied"
    if not folder and path.endswith(("/", os.sep)):
        return f"{path} names a folder; give a file name"
    existing = os.path.dirname(full)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"cannot write {path}: {existing} is a file, not a folder"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"cannot write {path}: cannot write in {existing} (permission denied)"
    return None
