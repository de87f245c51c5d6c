"""The commit a benchmark measured, for its JSON (no side effects on import: the benchmark
scripts share it, and ``replay_kernels`` sets the backend when imported)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def git_commit(short: bool = False) -> str:
    """The checkout's HEAD commit ("" where git or the history is missing, as on the device
    copy: record the local HEAD as ``code_commit`` there)."""
    try:
        args = ["git", "rev-parse"] + (["--short"] if short else []) + ["HEAD"]
        return subprocess.run(args, capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def code_commit(short: bool = False) -> str:
    """``CODE_COMMIT`` where set (the device copy has no git history: pass the local HEAD),
    else :func:`git_commit`."""
    return os.environ.get("CODE_COMMIT") or git_commit(short)
