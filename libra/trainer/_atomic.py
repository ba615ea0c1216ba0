"""Folders a server may read written whole or not at all: filled under a temporary name in
the same parent, then renamed into place."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def write_folder_atomically(target: Path, write: Callable[[Path], object]) -> None:
    """``write(staging)`` fills a temporary folder, renamed to ``target`` once it is done;
    a version is never overwritten."""
    if target.exists():
        raise FileExistsError(f"{target} exists: weight versions are never overwritten")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        write(staging)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
