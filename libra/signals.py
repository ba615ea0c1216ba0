"""The tool-return signal: the causal state a tool return is reduced to.

Every layer speaks it: envs emit it, the scheduler feeds on it (C-MLFQ's prefix tree is
keyed by it), the engine and the benchmark replay reduce tool results to it, and the
OpenAI gateway reduces ``role: "tool"`` messages to it. So it lives here, in a leaf that
imports nothing of Libra.

The reduction follows the paper's reference: size class by payload length (small up to
500 characters, medium up to 5,000, large beyond); status ``failure`` when the tool
raised or its output reads like an error, ``timeout`` when it ran out of time, else
``success``. A tool that knows its status says so (``libra.envs.ToolResult``); reading it
back from the text is only the fallback for plain strings.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

SizeClass = Literal["small", "medium", "large"]
ToolStatus = Literal["success", "failure", "timeout"]

SMALL_MAX_CHARS = 500
MEDIUM_MAX_CHARS = 5000

_ERROR_TEXT = re.compile(
    r"^\s*(error|exception)\b|traceback \(most recent call last\)|\bstatus:\s*(error|failed)\b",
    re.IGNORECASE | re.MULTILINE,
)


@dataclass(frozen=True, slots=True)
class ToolSignal:
    """The causal state a tool return is reduced to: ``(tool, size class, status)``."""

    tool: str
    size_class: SizeClass
    status: ToolStatus


def size_class(chars: int) -> SizeClass:
    if chars <= SMALL_MAX_CHARS:
        return "small"
    return "medium" if chars <= MEDIUM_MAX_CHARS else "large"


def status_of_output(text: str) -> ToolStatus:
    """``failure`` when a tool's normal output still reads like an error report."""
    return "failure" if _ERROR_TEXT.search(text) else "success"


def signal_of(tool: str, content: str, status: ToolStatus | None = None) -> ToolSignal:
    """The signal of a tool return: its status as reported, else read from its text."""
    if status is None:
        status = status_of_output(content)
    return ToolSignal(tool, size_class(len(content)), status)
