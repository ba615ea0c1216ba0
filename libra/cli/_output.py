"""Output paths, checked before a command starts anything (servers, containers, vLLM)."""

from __future__ import annotations

import os
from pathlib import Path

from libra.config import UsageError


def check_output_file(path: Path, flag: str) -> None:
    """Refuse, before anything runs, an output file the command could not write at the
    end: a folder, a path under a file, or one in a folder it may not write to. Missing
    folders are fine: the command creates them when it writes."""
    if path.is_dir():
        raise UsageError(f"{flag} {path} is a folder; give a file in it, e.g. {path / 'out'}")
    if path.exists():
        if not os.access(path, os.W_OK):
            raise UsageError(f"{flag} {path}: no permission to overwrite it")
        return
    folder = path.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"{flag} {path}: {folder} is a file, not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: no permission to write in {folder}")
