"""What a tool call produced, as the engine records it and feeds it to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from libra.signals import SizeClass, ToolSignal, ToolStatus, signal_of, size_class


@dataclass(frozen=True, slots=True)
class ToolReturn:
    """The result of one tool call, as recorded and as fed to the scheduler.

    ``status`` is final: as the tool reported it (a ``ToolResult``, a ``ToolError``, the
    engine's timeout), or read from the text of a plain result.
    """

    call_id: str
    tool: str
    content: str
    status: ToolStatus
    latency_s: float
    #: The type of an exception the tool raised that is not a ``ToolError``: a bug in
    #: the env, not the model's doing (None when it returned or raised ``ToolError``).
    exception: str | None = None

    @property
    def size_class(self) -> SizeClass:
        return size_class(len(self.content))

    def signal(self) -> ToolSignal:
        return signal_of(self.tool, self.content, self.status)
