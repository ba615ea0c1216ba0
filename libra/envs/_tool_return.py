"""What a tool call produced, as the engine records it and feeds it to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from libra.signals import SizeClass, ToolSignal, ToolStatus, size_class


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
