"""Checks of output paths that the command-line tools run before any work (a clear error
naming the flag and the path, instead of an ``OSError`` traceback after the work is done)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["output_file_problem", "output_dir_problem", "nearest_existing", "ancestor_problem",
           "check_distinct_dirs"]


def nearest_existing(path) -> tuple[Path | None, list[Path]]:
    """The nearest existing one of ``path`` (made absolute) and its ancestors, and the missing
    ones below it, deepest first."""
    missing: list[Path] = []
    for d in (p := Path(path).absolute(), *p.parents):
        if d.exists():
            return d, missing
        missing.append(d)
    return None, missing


def ancestor_problem(parent: Path | None) -> str | None:
    """Why nothing can be made under the existing ``parent`` ("not a directory", "not
    writable"), or None."""
    if parent is None:
        return None
    if not parent.is_dir():
        return "not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return "not writable"
    return None


def check_distinct_dirs(paths, noun: str = "run directory", nouns: str = "run directories",
                        nested: bool = False) -> None:
    """Refuse a directory given twice, however spelled (and, with ``nested``, one inside
    another given one), which a tool would otherwise read twice.

    Raises:
        ValueError: naming the directories (``noun`` / ``nouns``: what the tool calls them).
    """
    seen: dict = {}
    for d in paths:
        key = Path(d).resolve()
        if key in seen:
            if str(seen[key]) == str(d):
                raise ValueError(f"{noun} {str(d)!r} is given twice; give each {noun} once")
            raise ValueError(f"{nouns} {str(seen[key])!r} and {str(d)!r} are the same directory "
                             f"({key}): given twice; give each {noun} once")
        if nested:
            for qkey, q in seen.items():
                if qkey in key.parents or key in qkey.parents:
                    inner, outer = (d, q) if qkey in key.parents else (q, d)
                    raise ValueError(f"{str(inner)!r} lies inside {str(outer)!r}: its files would "
                                     f"be read twice; give each {noun} once")
        seen[key] = d


def output_file_problem(path, flag: str = "--output") -> str | None:
    """Why the file ``path`` could not be written, or None if it can.

    Creates nothing. A missing parent directory is fine where it can be created (the tools make
    it, as ``replayssm-report`` does); it cannot be where the nearest existing ancestor is a
    file or not writable.

    Args:
        path: the output file the tool will write (str or Path).
        flag: the option that named it, for the message.

    Returns:
        None, or a message naming ``flag`` and the path: the path is a directory, the nearest
        existing ancestor is not a directory, or it is not writable.
    """
    if Path(path).is_dir():
        return f"{flag} {str(path)!r} is a directory; give a file name"
    parent, _ = nearest_existing(Path(path).absolute().parent)
    reason = ancestor_problem(parent)
    return f"{flag} {str(path)!r} cannot be written: {str(parent)!r} is {reason}" if reason else None


def output_dir_problem(path, flag: str = "--output") -> str | None:
    """Why the directory ``path`` could not be written into, or None if it can.

    Creates nothing: an existing directory must be writable; a missing one must be creatable
    (its nearest existing ancestor a writable directory); an existing file is refused.

    Returns:
        None, or a message naming ``flag``, the path and the reason.
    """
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            return f"{flag} {str(path)!r} exists and is not a directory"
        if not os.access(p, os.W_OK | os.X_OK):
            return f"{flag} {str(path)!r} is not writable"
        return None
    parent, _ = nearest_existing(p)
    reason = ancestor_problem(parent)
    return f"{flag} {str(path)!r} cannot be created: {str(parent)!r} is {reason}" if reason \
        else None
