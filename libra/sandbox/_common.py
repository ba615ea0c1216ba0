"""Pieces shared by the sandbox providers: capped output and process identity."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["CappedOutput", "process_start_time"]


@dataclass(slots=True)
class CappedOutput:
    """stdout and stderr, each kept up to ``limit`` bytes; the rest is read and dropped.
    ``stdout_extra`` more bytes of stdout are kept for a marker the sandbox prints first."""

    limit: int
    stdout_extra: int = 0
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    truncated: bool = False

    def add(self, stream: int, data: bytes) -> None:
        """Append ``data`` to stream 1 (stdout) or 2 (stderr)."""
        buffer = self.stderr if stream == 2 else self.stdout
        limit = self.limit if stream == 2 else self.limit + self.stdout_extra
        room = limit - len(buffer)
        if len(data) > room:
            self.truncated = True
            data = data[: max(room, 0)]
        buffer += data


def process_start_time(pid: int) -> str | None:
    """When ``pid`` started, in clock ticks since boot; None if no such process exists.

    A pid and its start time name a process for good, where a pid alone may be reused.
    """
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return ""  # exists but unreadable: alive, start time unknown
    # Field 22; the command name (field 2) may hold spaces and parentheses, so split after it.
    return stat.rsplit(")", 1)[1].split()[19]
