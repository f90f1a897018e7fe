"""Output paths of the command-line tools, checked before the work that fills them.

A run that writes its results at the end must not find out then that it cannot: every tool
asks `output_problem` first and reports the answer as a usage error naming its flag.
"""

from __future__ import annotations

import os
import tempfile


def output_problem(path: str, *, folder: bool) -> str | None:
    """Why `path` cannot take an output file (folder=False) or folder (folder=True); None when
    it can. Missing folders on the way are made when the output is written, so the nearest
    existing ancestor must be a folder this process can create entries in. Permission bits
    are not enough (root passes os.access everywhere, and /proc or a read-only mount refuses
    anyway): the check creates and removes an entry there, or opens an existing file to append."""
    if not path:
        return f"the path is empty; give a {'folder' if folder else 'file'} name"
    full = os.path.abspath(path)
    if os.path.lexists(full):
        if folder and not os.path.isdir(full):
            return f"{path} is a file, not a folder"
        if not folder and (os.path.isdir(full) or path.endswith(("/", os.sep))):
            return f"{path} is a folder; give a file name"
        return _cannot_write_in(full, path) if folder else _cannot_append(full, path)
    if not folder and path.endswith(("/", os.sep)):
        return f"{path} names a folder; give a file name"
    existing = os.path.dirname(full)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"cannot write {path}: {existing} is a file, not a folder"
    return _cannot_write_in(existing, path)


def refuse_output(parser, flag: str, path: str, *, folder: bool) -> None:
    """parser.error("<flag>: <why>") (exit 2) where `path` cannot take the output (output_problem)."""
    problem = output_problem(path, folder=folder)
    if problem:
        parser.error(f"{flag}: {problem}")


def _cannot_write_in(folder: str, path: str) -> str | None:
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".hybrid-ep-check-", dir=folder))
    except OSError as err:
        return f"cannot write {path}: cannot create anything in {folder} ({err.strerror})"
    return None


def _cannot_append(file: str, path: str) -> str | None:
    try:
        with open(file, "ab"):
            pass
    except OSError as err:
        return f"cannot write {path}: {err.strerror}"
    return None
