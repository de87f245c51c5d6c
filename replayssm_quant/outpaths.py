"""Checks of output paths that the command-line tools run before any work (a clear error
naming the flag and the path, instead of an ``OSError`` traceback after the work is done)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["output_file_problem"]


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
    p = Path(path)
    if p.is_dir():
        return f"{flag} {str(path)!r} is a directory; give a file name"
    for parent in p.absolute().parents:  # the nearest existing ancestor
        if parent.exists():
            if not parent.is_dir():
                return (f"{flag} {str(path)!r} cannot be written: {str(parent)!r} is not a "
                        "directory")
            if not os.access(parent, os.W_OK | os.X_OK):
                return f"{flag} {str(path)!r} cannot be written: {str(parent)!r} is not writable"
            return None
    return None
