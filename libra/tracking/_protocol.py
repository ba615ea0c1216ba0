"""What a tracker is handed: the run's start, each step's figures, each checkpoint."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Sample:
    """One trajectory shown as text: who played it, how it ended, its conversation."""

    id: str
    env: str
    status: str
    reward: float | None
    turns: int
    tokens: int
    text: str  # the conversation, one "role: content" paragraph a message

    def markdown(self) -> str:
        return (
            f"**{self.id}** ({self.env}): {self.status}, reward {self.reward}, "
            f"{self.turns} turns, {self.tokens} tokens\n\n{self.text}"
        )


@dataclass(frozen=True, slots=True)
class StepLog:
    """What one step (or one evaluation, its scalars under ``eval/``) logs at ``step``."""

    step: int
    scalars: dict[str, float]
    histograms: dict[str, list[float]] = field(default_factory=dict)
    samples: list[Sample] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class RunStart:
    """The tracked run: its names, its resolved config, and the step a resume goes on
    from (None: a new run; the tracker drops or skips what the killed run logged at
    that step and after)."""

    name: str
    project: str
    group: str
    tags: list[str]
    config: dict[str, Any]
    config_toml: str
    dir: Path
    resume_step: int | None = None

    def saved_id(self, backend: str) -> str | None:
        """The id of the tracked run a resume continues, as ``backend`` saved it."""
        path = self.dir / f"{backend}-run.json"
        return str(json.loads(path.read_text())["id"]) if path.exists() else None

    def save_id(self, backend: str, run_id: str, **more: str) -> None:
        """Keep the tracked run's id (and ``more``) for a resume to continue it."""
        (self.dir / f"{backend}-run.json").write_text(json.dumps({"id": run_id, **more}))


class Tracker(Protocol):
    """One backend: opened with :class:`RunStart`, then handed the run's figures."""

    name: str

    def log(self, entry: StepLog) -> None: ...

    def log_checkpoint(self, step: int, path: Path) -> None: ...

    def close(self) -> None: ...
