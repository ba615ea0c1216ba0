"""Where Libra keeps what it builds and runs: models, images, logs, run state."""

from __future__ import annotations

import os
from pathlib import Path


def libra_home() -> Path:
    """Libra's cache folder: ``$LIBRA_HOME``, or ``~/.cache/libra``."""
    configured = os.environ.get("LIBRA_HOME")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "libra"
