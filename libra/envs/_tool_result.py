"""What a tool returns when it knows how its call went.

A tool may return a plain ``str`` (or anything JSON can encode): the model reads it, and
the scheduler's status is read back from the text (an error or a traceback reads as
``failure``). A tool that knows better, such as one that ran a program and saw its exit
status, returns a :class:`ToolResult` and says so; nothing is guessed then.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import get_args

from libra.envs._tools import ToolError, ToolTimeout
from libra.signals import ToolStatus

_STATUSES: tuple[ToolStatus, ...] = get_args(ToolStatus)


@dataclass(frozen=True, slots=True)
class ToolResult:
    """A tool's answer (``content``, what the model reads) and how the call went."""

    content: str
    status: ToolStatus = "success"

    def __post_init__(self) -> None:
        # Checked here, not where the scheduler meets it: a wrong status would become a
        # state of the prefix tree that no other call ever reaches.
        if not isinstance(self.content, str):
            raise TypeError(f"ToolResult.content must be a str, not {type(self.content).__name__}")
        if self.status not in _STATUSES:
            raise ValueError(f"ToolResult.status must be one of {_STATUSES}, not {self.status!r}")

    @classmethod
    def of_error(cls, error: ToolError) -> ToolResult:
        """What the model reads when a tool raised ``error``, and its status."""
        status: ToolStatus = "timeout" if isinstance(error, ToolTimeout) else "failure"
        return cls(f"Error: {error}", status)

    @classmethod
    def failure(cls, message: str) -> ToolResult:
        """A call that went wrong before or inside the tool: the model reads ``message``."""
        return cls(f"Error: {message}", "failure")
