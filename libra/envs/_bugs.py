"""Bugs in env code, shown to the env's author once each.

A tool or hook that raises something other than ``ToolError`` is a bug in the env, not
the model's doing: the model reads a one-line error, the record says an exception was
raised, and the traceback goes to stderr, where the author can fix it. The first
occurrence per place (a tool, or the env's hooks) and exception type is shown; a bug hit
by every one of 10,000 trajectories would otherwise bury the terminal.
"""

from __future__ import annotations

import sys
import traceback
from typing import TextIO


class EnvBugs:
    """The bugs shown so far, by place and exception type."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._seen: set[tuple[str, type[BaseException]]] = set()
        self._stream = stream

    def report(self, where: str, error: BaseException) -> None:
        """Show ``error``'s traceback, unless one of its type was shown for ``where``."""
        key = (where, type(error))
        if key in self._seen:
            return
        self._seen.add(key)
        stream = self._stream or sys.stderr
        header = (
            f"libra: a bug in {where}: {type(error).__name__} (its traceback is shown once; "
            "later ones are in the records)\n"
        )
        stream.write(header + "".join(traceback.format_exception(error)))
        stream.flush()
