"""What a tool call produced, and the causal signal it is reduced to.

The reduction follows the paper's reference: size class by payload length (small up to
500 characters, medium up to 5,000, large beyond) and status ``failure`` when the tool
raised or its output reads like an error, ``timeout`` when it ran out of time, else
``success``. An env may override :meth:`Env.signal` to emit a signal of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from libra.sched import SizeClass, ToolSignal, ToolStatus

SMALL_MAX_CHARS = 500
MEDIUM_MAX_CHARS = 5000

_ERROR_TEXT = re.compile(
    r"^\s*(error|exception)\b|traceback \(most recent call last\)|\bstatus:\s*(error|failed)\b",
    re.IGNORECASE | re.MULTILINE,
)


@dataclass(frozen=True, slots=True)
class ToolReturn:
    """The result of one tool call, as recorded and as fed to the scheduler."""

    call_id: str
    tool: str
    content: str
    status: ToolStatus
    latency_s: float

    @property
    def size_class(self) -> SizeClass:
        return size_class(len(self.content))

    def signal(self) -> ToolSignal:
        return ToolSignal(self.tool, self.size_class, self.status)


def size_class(chars: int) -> SizeClass:
    if chars <= SMALL_MAX_CHARS:
        return "small"
    return "medium" if chars <= MEDIUM_MAX_CHARS else "large"


def status_of_output(text: str) -> ToolStatus:
    """``failure`` when a tool's normal output still reads like an error report."""
    return "failure" if _ERROR_TEXT.search(text) else "success"
